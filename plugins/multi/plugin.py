"""The MULTI and AUTO devices.

``MULTI:A,B`` loads the network on every listed device and sends each request to a device with
a free request: the first in priority order with room, round robin when all are busy. A device
that fails to load is dropped with a warning (all failing is an error naming each reason). A
request that fails on a device fails, unless ``RUNTIME_FALLBACK=YES``: then it runs again on the
next device in priority order. A device that fails UNAVAILABLE is set aside for a while
(``UNAVAILABLE_BACKOFF_S``, see :mod:`.compiled`).

``AUTO`` (``AUTO:A,B``, ``AUTO:-X``) picks one device for the model among those of
``DEVICE_PRIORITIES`` (default OPENVINO, ORT, NUMPY) that are available, not excluded
(``EXCLUDED_DEVICES``), whose QueryNetwork covers every node, and that compile it: it times
them (and the precisions each may run in) and keeps the fastest whose answer is right (see
:mod:`.measure`); with ``MEASURE_SECONDS=0`` the first in priority order. Both report the
devices they use through the compiled network's ``EXECUTION_DEVICES`` metric.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from typing import Any

from plugserve.plugins.api import (
    CompiledNetwork,
    InvalidArgument,
    Model,
    NotFound,
    PlugserveError,
    device_refusals,
)
from plugserve.plugins.ir import load_model, read_model
from plugserve.plugins.multi.compiled import (
    AutoCompiledNetwork,
    MultiCompiledNetwork,
    close_quietly,
)
from plugserve.plugins.multi.config import (
    DEFAULT_AUTO_PRIORITIES,
    AutoConfiguration,
    MultiConfiguration,
)
from plugserve.plugins.multi.measure import (
    MAX_CANDIDATES,
    REFERENCE_DEVICES,
    Candidate,
    choose,
    reference,
    table,
)
from plugserve.plugins.outputcheck import made_up_inputs
from plugserve.plugins.virtual import VirtualPlugin, device_list

__all__ = ["AutoPlugin", "MultiPlugin"]

log = logging.getLogger(__name__)


class _Virtual(VirtualPlugin):
    """What MULTI and AUTO share beyond the virtual base: their refusals and names."""

    def _child_names(self, config: Mapping[str, Any]) -> list[str]:
        listed = config.get("DEVICE_PRIORITIES") or self._config.get("DEVICE_PRIORITIES")
        return device_list(listed or self._default_devices())

    def _default_devices(self) -> str:
        return ""

    def device_name(self) -> str:
        return self.full_name

    full_name = ""

    def _refusals(
        self, model: Model, devices: list[str], cfg: AutoConfiguration | MultiConfiguration
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the nodes each of ``devices`` does not support."""
        proto, _ = read_model(model)
        nodes = [n.name for n in load_model(proto).nodes]
        found: list[tuple[str, str, str]] = []
        for device in devices:
            child = cfg.child_strings(device)  # parsed by the device, whose errors say why
            found += device_refusals(self._devices(), proto, device, child, nodes)
        return found

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        raise NotImplementedError


class MultiPlugin(_Virtual):
    name = "MULTI"
    config_class = MultiConfiguration
    CAPABILITIES = ("EXPORT_IMPORT",)
    full_name = "MULTI: one network on several devices, requests spread over them"

    def _priorities(self, cfg: MultiConfiguration) -> list[str]:
        priorities = cfg.priorities()
        if not priorities:
            raise InvalidArgument(
                "MULTI needs a device list: use MULTI:A,B or set DEVICE_PRIORITIES"
            )
        devices = self._devices()
        for device in priorities:
            plugin = devices.plugin(device)  # NotFound names an unknown or unavailable device
            if plugin.name in ("MULTI", "AUTO", "HETERO", "BATCH"):
                raise InvalidArgument(f"MULTI: device {device!r} is virtual; list real devices")
        return priorities

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> MultiCompiledNetwork:
        cfg = self.merged_config(config)
        priorities = self._priorities(cfg)
        proto, _ = read_model(model)  # read once, hand the same model to each device
        loaded: list[tuple[str, CompiledNetwork]] = []
        failures: list[tuple[str, PlugserveError]] = []
        for device in priorities:
            try:
                child = cfg.child(device)
                loaded.append((device, self._devices().load_network(proto, device, child)))
            except PlugserveError as exc:
                log.warning("MULTI: device %s could not load the network, dropped: %s", device, exc)
                failures.append((device, exc))
        if not loaded:
            first = failures[0][1]
            reasons = "; ".join(f"{d}: {e}" for d, e in failures)
            raise type(first)(f"MULTI: no device could load the network ({reasons})") from first
        return MultiCompiledNetwork(self, cfg, loaded)

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """A node is supported if every listed device supports it (MULTI runs it on all)."""
        cfg = self.merged_config(config, strict=False)
        result: dict[str, str] | None = None
        for device in self._priorities(cfg):
            supported = self._devices().query_network(model, device, cfg.child(device))
            result = (
                dict.fromkeys(supported, self.name)
                if result is None
                else {k: v for k, v in result.items() if k in supported}
            )
        return result or {}

    def refusals(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for each listed device and node it cannot run (MULTI then
        runs the network without that device)."""
        cfg = self.merged_config(config, strict=False)
        return self._refusals(model, self._priorities(cfg), cfg)

    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> MultiCompiledNetwork:
        header, payload, cfg = self._unpack(data, config)
        try:
            blobs = json.loads(payload)
        except ValueError:
            raise InvalidArgument("exported MULTI network is corrupt (payload)") from None
        loaded: list[tuple[str, CompiledNetwork]] = []
        try:
            for device in header.get("devices", []):
                network = self._devices().import_network(
                    base64.b64decode(blobs[device]), device, cfg.child_strings(device)
                )
                loaded.append((device, network))
        except (KeyError, ValueError):
            for _, network in loaded:
                close_quietly(network)
            raise InvalidArgument("exported MULTI network is corrupt (device blobs)") from None
        except PlugserveError:
            for _, network in loaded:
                close_quietly(network)
            raise
        if not loaded:
            raise InvalidArgument("exported MULTI network names no device")
        network = MultiCompiledNetwork(self, cfg, loaded)
        network.name = header.get("network_name") or network.name
        return network


class AutoPlugin(_Virtual):
    name = "AUTO"
    config_class = AutoConfiguration
    full_name = "AUTO: the best available device for each model"

    def _default_devices(self) -> str:
        return DEFAULT_AUTO_PRIORITIES

    def _known(self) -> set[str]:
        """Every device the Core knows, available or not (to tell a typo from a missing one)."""
        devices = self._devices()
        return set(devices.available_devices) | {info.name for info in devices.devices()}

    def candidates(self, cfg: AutoConfiguration) -> tuple[list[str], list[str]]:
        """The devices to try in order, and why each other one was skipped."""
        devices = self._devices()
        known = self._known()
        explicit = bool(cfg.priorities())
        skipped: list[str] = []
        chosen: list[str] = []
        for device in cfg.candidates():
            kind = device.partition(".")[0].upper()
            if kind in ("MULTI", "AUTO", "HETERO", "BATCH"):
                raise InvalidArgument(f"AUTO: device {device!r} is virtual; list real devices")
            if explicit and kind not in known:
                devices.plugin(device)  # raises NotFound naming the unknown device
            try:
                devices.plugin(device)
            except NotFound as exc:
                skipped.append(f"{device}: {exc}")
                continue
            chosen.append(device)
        excluded = cfg.excluded()
        if excluded:
            skipped.extend(f"{d}: excluded" for d in excluded)
        return chosen, skipped

    def _covers(self, graph: Any, proto: Any, device: str, cfg: AutoConfiguration) -> str:
        """Empty if ``device`` supports every node, else why not (a configuration the
        device refuses included)."""
        try:
            supported = self._devices().query_network(proto, device, cfg.child(device))
        except PlugserveError as exc:
            return f"QueryNetwork failed: {exc}"
        missing = [n.name for n in graph.nodes if n.name not in supported]
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            return f"does not support node(s) {shown}{more}"
        return ""

    def select(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> tuple[list[str], list[str]]:
        """The devices that can run ``model``, best first, and the reasons for the others."""
        cfg = self.merged_config(config, strict=False)
        proto, _ = read_model(model)
        graph = load_model(proto)
        candidates, reasons = self.candidates(cfg)
        usable = []
        for device in candidates:
            why = self._covers(graph, proto, device, cfg)
            if why:
                reasons.append(f"{device}: {why}")
            else:
                usable.append(device)
        return usable, reasons

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> AutoCompiledNetwork:
        cfg = self.merged_config(config)
        proto, _ = read_model(model)
        usable, reasons = self.select(proto, cfg)
        candidates = self._candidates(usable, cfg)
        budget = float(cfg.get("MEASURE_SECONDS"))
        # no input to measure on (strings, unknown ranks): nothing to compile the rest for
        feeds = made_up_inputs(proto) if budget > 0 and len(candidates) > 1 else None
        if feeds is None:
            for candidate in candidates:  # the first in priority order that compiles
                if self._compile(proto, candidate, reasons, cfg):
                    return self._chosen(cfg, candidate, [])
        else:
            for candidate in candidates:
                self._compile(proto, candidate, reasons, cfg)
            checker = reference(candidates)
            beside = None if checker else self._reference_beside(proto, cfg)
            try:
                chosen = choose(candidates, checker or beside, feeds, budget)
            except BaseException:
                for candidate in candidates:
                    close_quietly(candidate.network)
                raise
            finally:
                if beside is not None:
                    close_quietly(beside.network)
            shown = [*candidates, *([beside] if beside is not None else [])]
            loaded = [c for c in candidates if c.network is not None]
            chosen = chosen or (loaded[0] if loaded else None)
            if chosen is not None:
                log.info(
                    "AUTO measured network %s on a made-up input:\n%s",
                    chosen.network.name,  # type: ignore[union-attr]
                    table(shown, chosen),
                )
                for candidate in loaded:
                    if candidate is not chosen:
                        close_quietly(candidate.network)
                return self._chosen(cfg, chosen, [c.row() for c in shown])
        raise InvalidArgument(
            "AUTO: no device can run this network"
            + (f" ({'; '.join(reasons)})" if reasons else " (no candidate device)")
        )

    def _candidates(self, usable: list[str], cfg: AutoConfiguration) -> list[Candidate]:
        """Each usable device in each precision its config allows it (OPENVINO's default
        reduced precision and f32, unless a hint or ACCURACY settles it), in priority order."""
        found = []
        for device in usable:
            child = cfg.child_strings(device)
            plugin = self._devices().plugin(device)
            for change in plugin.precision_choices(cfg.child(device)):
                found.append(Candidate(device, {**child, **change}))
        return found[:MAX_CANDIDATES]

    def _reference_beside(self, proto: Any, cfg: AutoConfiguration) -> Candidate | None:
        """A network of :data:`REFERENCE_DEVICES` to check candidates none of which is one
        (a third-party device's answer is not trusted on its own)."""
        available = set(self._devices().available_devices)
        for device in REFERENCE_DEVICES:
            if device not in available:
                continue
            child = cfg.child_strings(device)
            candidate = Candidate(device, {**child, "EXECUTION_MODE_HINT": "ACCURACY"})
            if self._compile(proto, candidate, [], cfg):
                candidate.verdict = "reference only"
                return candidate
        return None

    def _compile(
        self, proto: Any, candidate: Candidate, reasons: list[str], cfg: AutoConfiguration
    ) -> bool:
        """Compile ``candidate`` with its configuration, parsed once for this load (the
        one :meth:`select` queried with, when the candidate changes nothing)."""
        try:
            typed = cfg.device_config(candidate.device, candidate.config)
            candidate.network = self._devices().load_network(proto, candidate.device, typed)
        except PlugserveError as exc:
            log.warning("AUTO: %s could not compile the network (%s)", candidate.device, exc)
            reasons.append(f"{candidate.device}: {type(exc).__name__}: {exc}")
            candidate.verdict = f"could not compile it: {exc}"
            return False
        return True

    def _chosen(
        self, cfg: AutoConfiguration, chosen: Candidate, measured: list[dict[str, Any]]
    ) -> AutoCompiledNetwork:
        network = chosen.network
        assert network is not None
        log.info("AUTO chose %s (%s) for network %s", chosen.device, chosen.precision, network.name)
        return AutoCompiledNetwork(self, cfg, chosen.device, network, measured)

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """The nodes of the device AUTO would choose (all of them, or none)."""
        cfg = self.merged_config(config, strict=False)
        usable, _ = self.select(model, cfg)
        if not usable:
            return {}
        device = usable[0]
        return dict(self._devices().query_network(model, device, cfg.child(device)))

    def refusals(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the devices tried before the one AUTO chose (all of
        them when none runs every node)."""
        cfg = self.merged_config(config, strict=False)
        usable, _ = self.select(model, cfg)
        candidates, _ = self.candidates(cfg)
        before = candidates[: candidates.index(usable[0])] if usable else candidates
        return self._refusals(model, before, cfg)

    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> AutoCompiledNetwork:
        header, payload, cfg = self._unpack(data, config)
        device = header.get("device")
        if not device:
            raise InvalidArgument("exported AUTO network names no device")
        network = self._devices().import_network(payload, device, cfg.child_strings(device))
        return AutoCompiledNetwork(self, cfg, device, network, header.get("measured") or [])
