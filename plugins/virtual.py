"""What the virtual devices (HETERO, MULTI, AUTO, BATCH) share: they reach other devices
through the Core, take the config keys their devices know and hand those down, and name their
device list in ``DEVICE_PRIORITIES`` (parsed by :func:`device_list`, the one parser)."""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from plugserve.plugins.base import CallConfig, CompiledNetwork, Devices, Model, Plugin
from plugserve.plugins.configuration import Configuration
from plugserve.plugins.errors import FailedPrecondition, InvalidArgument, PlugserveError
from plugserve.plugins.inputs import TensorSpec

__all__ = [
    "OneNetwork",
    "VirtualConfiguration",
    "VirtualPlugin",
    "check_device_list",
    "device_list",
    "device_refusals",
    "refusal_reasons",
]


#: the most devices a virtual device's list may name: each is asked for the whole model, so a
#: QueryNetwork naming 20,000 device ids (an ``infer`` call) ran for --max-read-seconds
MAX_DEVICES = 64


def check_device_list(value: str) -> str:
    """DEVICE_PRIORITIES as its config key stores it: ``"A,B"``, each device once, at most
    MAX_DEVICES."""
    text = str(value).strip()
    if not text:
        return ""
    items = [p.strip() for p in text.split(",", MAX_DEVICES)]
    if len(items) > MAX_DEVICES:
        raise ValueError(f"more than {MAX_DEVICES} devices")
    if any(not p for p in items):
        raise ValueError("expected a comma-separated device list, e.g. ORT,NUMPY")
    if len(set(items)) != len(items):
        raise ValueError("a device is listed twice")
    return ",".join(items)


def device_list(text: Any) -> list[str]:
    """``"A, B(2),C"`` -> ``["A", "B(2)", "C"]``: DEVICE_PRIORITIES as a list, blanks dropped."""
    return [d.strip() for d in str(text or "").split(",") if d.strip()]


def refusal_reasons(
    devices: Devices, model: Model, device: str, config: Mapping[str, Any], nodes: Iterable[str]
) -> dict[str, str]:
    """``{node: why device did not take it}`` for ``nodes``, in the device's own words (its
    ``unsupported_nodes``, which a plugin offers beside ``query_network``), for the virtual
    devices' ``refusals``. A device that cannot read the model at all says so for each."""
    try:
        reasons = dict(devices.plugin(device).unsupported_nodes(model, config))
    except PlugserveError as exc:
        return dict.fromkeys(nodes, f"{device} cannot read the model: {exc}")
    return {n: reasons.get(n, f"not in {device}'s QueryNetwork answer") for n in nodes}


def device_refusals(
    devices: Devices, model: Model, device: str, config: Mapping[str, Any], nodes: Iterable[str]
) -> list[tuple[str, str, str]]:
    """``(node, device, why)`` for each of ``nodes`` that ``device``'s QueryNetwork leaves
    out (all of them when it cannot read the model)."""
    try:
        supported = devices.query_network(model, device, config)
    except PlugserveError:
        supported = {}
    missing = [n for n in nodes if n not in supported]
    why = refusal_reasons(devices, model, device, config, missing)
    return [(n, device, why[n]) for n in missing]


class VirtualConfiguration(Configuration):
    """A virtual device's configuration: its own keys, the call's config it was made from
    (``overrides``: the per-call keys its devices know travel in it), and its devices'
    configurations, each made from those once, on first use, and shared by everything the
    load does on that device (its QueryNetwork, its load, the streams it sizes).

    ``devices`` and ``overrides`` are set by the plugin that makes it
    (:meth:`VirtualPlugin.merged_config`).
    """

    #: this device's own keys, never handed to a child
    OWN_KEYS: ClassVar[frozenset[str]] = frozenset({"DEVICE_PRIORITIES", "CACHE_DIR"})

    #: the Core, to reach the devices
    devices: Devices | None = None
    #: the call's config this configuration was made from
    overrides: Mapping[str, Any] = MappingProxyType({})
    #: the devices' configurations made so far, by device and strings
    _made: dict[tuple[str, tuple[tuple[str, str], ...]], Configuration] | None = None

    def child_settings(self) -> dict[str, str]:
        """Common keys set here away from their defaults (PERF_COUNT, hints, streams), for
        the children; never DEVICE_ID or CACHE_DIR."""
        strings = self.to_strings()
        return {
            k.name: strings[k.name]
            for k in Configuration.KEYS
            if k.name not in ("DEVICE_ID", "CACHE_DIR") and self.get(k.name) != k.default
        }

    def child_strings(self, device: str) -> dict[str, str]:
        """The settings ``device`` understands, as strings: the common keys set here and the
        per-call keys it knows; never this device's own keys."""
        known = set(self._devices().plugin(device).config_class.keys())
        child = {k: v for k, v in self.child_settings().items() if k in known}
        child.update(
            {k: str(v) for k, v in self.overrides.items() if k in known and k not in self.OWN_KEYS}
        )
        return child

    def child(self, device: str) -> Configuration:
        """``device``'s configuration for this load, parsed once (:meth:`child_strings`)."""
        return self.device_config(device, self.child_strings(device))

    def device_config(self, device: str, strings: Mapping[str, str]) -> Configuration:
        """``device``'s configuration with ``strings`` over its own, parsed by the Core the
        first time this configuration asks for it and shared after (a reference check's, a
        candidate precision's)."""
        if self._made is None:
            self._made = {}
        key = (device, tuple(sorted(strings.items())))
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._devices().parse_config(device, strings)
        return made

    def _devices(self) -> Devices:
        if self.devices is None:
            raise FailedPrecondition("a virtual device's configuration needs the Core")
        return self.devices


class VirtualPlugin(Plugin):
    """A device made of other devices (see the module's docstring)."""

    cancellation = "as the device running the request"
    config_class: ClassVar[type[VirtualConfiguration]] = VirtualConfiguration

    def __init__(self) -> None:
        super().__init__()
        self.architecture = f"{platform.machine() or 'unknown'}-{self.name.lower()}1"

    def _devices(self) -> Devices:
        if self.devices is None:
            raise FailedPrecondition(f"{self.name} needs a Core to reach other devices")
        return self.devices

    def _unpack(self, data: bytes, config: CallConfig | None) -> tuple[dict[str, Any], bytes, Any]:
        if isinstance(config, self.config_class):
            return super()._unpack(data, config)
        header, payload, cfg = super()._unpack(data, config)
        cfg.devices = self.devices  # its configuration sizes streams from the children
        cfg.overrides = dict(config or {})
        return header, payload, cfg

    def _child_names(self, config: Mapping[str, Any]) -> list[str]:
        """The devices whose keys a config may carry (by default the DEVICE_PRIORITIES set in
        ``config`` or on this device)."""
        return device_list(config.get("DEVICE_PRIORITIES") or self._config.get("DEVICE_PRIORITIES"))

    def merged_config(self, config: CallConfig | None, strict: bool = True) -> Any:
        """Keys of this device, plus keys one of its devices knows (handed to that device:
        the call's config is kept as the configuration's ``overrides``)."""
        if isinstance(config, self.config_class):
            return config
        overrides = config = dict(config or {})
        own = self.config_class.keys()
        foreign = [k for k in config if k not in own]
        if foreign:
            known: set[str] = set()
            for name in self._child_names(config):
                try:
                    known |= set(self._devices().plugin(name).config_class.keys())
                except PlugserveError:
                    continue
            unknown = [k for k in foreign if k not in known]
            if unknown and strict:
                raise InvalidArgument(
                    f"{self.name}: unsupported config key {unknown[0]!r}; neither {self.name} "
                    f"({', '.join(own)}) nor its devices know it"
                )
            config = {k: v for k, v in config.items() if k in own}
        cfg = super().merged_config(config, strict)
        cfg.devices = self.devices
        cfg.overrides = overrides
        return cfg


class OneNetwork:
    """Mixed into a virtual device's compiled network that serves one other network's inputs
    and outputs as its own (AUTO's chosen device, BATCH's device)."""

    network: CompiledNetwork

    @property
    def inputs(self) -> list[TensorSpec]:
        return self.network.inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self.network.outputs

    @property
    def open_ended(self) -> bool:
        return self.network.open_ended

    @property
    def platform(self) -> str:
        return self.network.platform

    @property
    def precision(self) -> str:
        return self.network.precision

    def ready(self) -> bool:
        return self.network.ready()

    def unready_reasons(self) -> list[str]:
        """The served network's (a GPU device that failed: plugins/torch/devmem.py)."""
        return self.network.unready_reasons()

    def graph_statistics(self) -> dict[str, int]:
        """The network's CUDA graph events (its requests are the ones that replay)."""
        return self.network.graph_statistics()

    def cuda_graphs(self) -> int | None:
        return self.network.cuda_graphs()
