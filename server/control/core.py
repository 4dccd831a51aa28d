"""The Core: finds device plugins, parses device names, and loads networks with a model cache.

Plugins are discovered from the entry-point group ``plugserve.plugins`` (so a third-party
package adds a device by declaring one entry point). A plugin whose constructor raises is kept as
*unavailable* with its reason, shown by :meth:`Core.devices`, instead of failing the process: the
seed's rule that a plugin checks its backend in its constructor, made visible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import onnx

from plugserve.plugins import blob, cancel
from plugserve.plugins.api import (
    STATE_PAIRS,
    CallConfig,
    CompiledNetwork,
    Configuration,
    InvalidArgument,
    Model,
    NotFound,
    Plugin,
    PlugserveError,
    Unsupported,
    parse_state_pairs,
)
from plugserve.plugins.version import plugserve_version
from plugserve.server.control.devices import DeviceName, parse_device
from plugserve.server.control.formats import format_of

__all__ = ["SERVER_KEYS", "ConfigLimits", "Core", "DeviceInfo", "refuse_server_keys"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "plugserve.plugins"


#: Config keys only the server's operator sets (its --plugins file, the repository's files on
#: disk): CACHE_DIR names a folder the server writes compiled networks into, and a remote
#: client that chose it (a load with {"CACHE_DIR": "/etc"} was accepted) would choose where
#: the server writes.
SERVER_KEYS = frozenset({"CACHE_DIR"})


def refuse_server_keys(config: Mapping[str, Any] | None, where: str) -> None:
    """A client's config (a load's, an import's, SetConfig's, a load override's) may not set
    :data:`SERVER_KEYS`: InvalidArgument saying where the operator sets them."""
    taken = sorted(SERVER_KEYS.intersection(config or ()))
    if taken:
        raise InvalidArgument(
            f"{where}: {', '.join(taken)} is the server's own setting, not a client's: the "
            "folder the server writes compiled networks into is set by its operator (the "
            "device config in the --plugins file), never by a request"
        )


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    name: str
    available: bool
    reason: str = ""
    full_name: str = ""


@dataclasses.dataclass(frozen=True)
class ConfigLimits:
    """Server-wide caps on config values that make threads and buffers (0: no cap).

    Checked on the merged configuration (the device's own, the name's, the call's) before a
    network is compiled or an executor made, and on SetConfig, so no source of config gets
    past them: ``NUM_STREAMS=100000`` would otherwise start 100,000 threads.
    """

    #: config key -> (cap, the flag and env variable that set it)
    caps: tuple[tuple[str, int, str], ...] = ()

    @classmethod
    def of(cls, num_streams: int, batch_size: int, inference_threads: int) -> ConfigLimits:
        return cls(
            (
                ("NUM_STREAMS", num_streams, "--max-num-streams / PLUGSERVE_MAX_NUM_STREAMS"),
                ("BATCH_SIZE", batch_size, "--max-batch-size / PLUGSERVE_MAX_BATCH_SIZE"),
                (
                    "INFERENCE_NUM_THREADS",
                    inference_threads,
                    "--max-inference-threads / PLUGSERVE_MAX_INFERENCE_THREADS",
                ),
            )
        )

    def check(self, config: Any, device: str) -> None:
        """Raise InvalidArgument naming the first key of ``config`` over its cap."""
        for key, cap, flag in self.caps:
            if not cap or key not in config:
                continue
            value = int(config.get(key) or 0)
            if value > cap:
                raise InvalidArgument(
                    f"device {device}: {key}={value} is over this server's limit of {cap} ({flag})"
                )


class Core:
    """Plugins by device name; the in-process entry point of plugserve.

    ``plugins`` maps extra device names to plugin classes (or factories), added after the
    discovered ones; ``discover=False`` skips entry points (embedding, tests of one plugin).
    """

    def __init__(
        self,
        plugins: Mapping[str, Callable[[], Plugin]] | None = None,
        discover: bool = True,
    ) -> None:
        self._plugins: dict[str, Plugin] = {}
        self._unavailable: dict[str, str] = {}
        self.limits = ConfigLimits()  # the server sets its caps here
        #: the server's defaults per folder format (``formats.py``), by the format's name: the
        #: generation engine's settings where a model's config sets none ("transformers": the
        #: --max-num-seqs ... flags)
        self.format_settings: dict[str, Any] = {}
        factories: dict[str, Callable[[], Plugin]] = {}
        if discover:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                factories.setdefault(ep.name.upper(), _lazy(ep))
        factories.update({k.upper(): v for k, v in (plugins or {}).items()})
        for name, factory in factories.items():
            self._construct(name, factory)

    def _construct(self, name: str, factory: Callable[[], Plugin]) -> None:
        try:
            plugin = factory()
        except Exception as exc:  # any failure means the device is not usable here
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._unavailable[name] = reason
            log.warning("device %s is unavailable: %s", name, reason)
            return
        plugin.devices = self
        self._plugins[name] = plugin
        # at DEBUG: the server logs each device it uses once, with its full name (app.py)
        log.debug("device %s loaded (%s)", name, type(plugin).__name__)

    # --- devices

    def disable(self, name: str) -> None:
        """Stop offering a device, and stop listing it (a ``--plugins`` file that does not
        list it, whether its plugin started or not)."""
        self._plugins.pop(name.upper(), None)
        self._unavailable.pop(name.upper(), None)

    @property
    def available_devices(self) -> list[str]:
        return sorted(self._plugins)

    def devices(self) -> list[DeviceInfo]:
        """Every known device, available or not, with the reason it is not."""
        infos = []
        for name in sorted(set(self._plugins) | set(self._unavailable)):
            plugin = self._plugins.get(name)
            if plugin is None:
                infos.append(DeviceInfo(name, False, self._unavailable[name]))
                continue
            try:
                full = str(plugin.get_metric("FULL_DEVICE_NAME"))
            except PlugserveError:
                full = name
            infos.append(DeviceInfo(name, True, "", full))
        return infos

    def plugin(self, device: str | DeviceName) -> Plugin:
        """The plugin serving a device name (the id is dropped); unknown names raise NotFound."""
        parsed = parse_device(device) if isinstance(device, str) else device
        if parsed.is_virtual and parsed.kind not in self._plugins:
            raise NotFound(
                f"device {str(parsed)!r}: the virtual device {parsed.kind} is not available "
                f"in this plugserve; devices: {', '.join(self.available_devices) or 'none'}"
            )
        plugin = self._plugins.get(parsed.kind)
        if plugin is None:
            if parsed.kind in self._unavailable:
                raise NotFound(
                    f"device {parsed.kind!r} is unavailable: {self._unavailable[parsed.kind]}"
                )
            raise NotFound(
                f"unknown device {parsed.kind!r}; available devices: "
                f"{', '.join(self.available_devices) or 'none'}"
            )
        return plugin

    def resolve(
        self, device: str, config: CallConfig | None
    ) -> tuple[Plugin, dict[str, Any] | Configuration]:
        """The device's plugin, and the call's config with the keys the device's name sets
        (``ORT.1``: DEVICE_ID; ``MULTI:A,B``: DEVICE_PRIORITIES...) unless the call sets them.
        A config already parsed (:meth:`device_config`, which a virtual device uses for its
        devices) has them already and is returned as it is."""
        parsed = parse_device(device)
        plugin = self.plugin(parsed)
        if isinstance(config, Configuration):
            return plugin, config
        merged = dict(config or {})
        for key, value in name_config(parsed).items():
            merged.setdefault(key, value)
        return plugin, merged

    def parse_config(self, device: str, config: CallConfig | None = None) -> Configuration:
        """The configuration a load on ``device`` would use (plugin's, name's, then ``config``),
        parsed once: a load, a query or an import given it uses it as it is (a virtual device
        makes its devices' configurations here). The load checks it against :attr:`limits`."""
        plugin, merged = self.resolve(device, config)
        return plugin.merged_config(merged)

    def device_config(self, device: str, config: CallConfig | None = None) -> Configuration:
        """:meth:`parse_config`, checked against :attr:`limits`."""
        full = self.parse_config(device, config)
        self.limits.check(full, device)
        return full

    # --- config and metrics

    def get_metric(self, device: str, name: str, options: Mapping[str, Any] | None = None) -> Any:
        plugin, _ = self.resolve(device, None)
        return plugin.get_metric(name, options)

    def set_config(self, config: Mapping[str, Any], device: str | None = None) -> None:
        """Set keys on one device, or on every available one when ``device`` is None."""
        targets = [self.resolve(device, None)[0]] if device else list(self._plugins.values())
        for plugin in targets:  # validate everywhere before changing anything
            self.limits.check(plugin.merged_config(config), plugin.name)
        for plugin in targets:
            plugin.set_config(config)

    def get_config(self, device: str, key: str) -> Any:
        plugin, _ = self.resolve(device, None)
        return plugin.get_config(key)

    def add_extension(self, extension: Any, device: str = "NUMPY") -> None:
        plugin, _ = self.resolve(device, None)
        plugin.add_extension(extension)

    # --- networks

    def query_network(
        self,
        model: Model,
        device: str,
        config: CallConfig | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> dict[str, str]:
        """``should_stop``: when it turns true the work stops with Cancelled (see cancel.py)."""
        plugin, merged = self.resolve(device, config)
        with _stopping(should_stop):
            return plugin.query_network(model, merged)

    def query_with_reasons(
        self, model: Model, device: str, config: CallConfig | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """:meth:`query_network` and why the other nodes are not supported, of one read
        (``Plugin.query_with_reasons``)."""
        plugin, merged = self.resolve(device, config)
        return plugin.query_with_reasons(model, merged)

    def load_network(
        self,
        model: Model,
        device: str,
        config: CallConfig | None = None,
        should_stop: Callable[[], bool] | None = None,
        *,
        trusted: bool = False,
    ) -> CompiledNetwork:
        """Compile ``model`` on ``device``; with ``CACHE_DIR`` set, reuse an earlier export.
        ``should_stop``: when it turns true the work stops with Cancelled (see cancel.py).
        ``trusted``: the model is the operator's (its repository on disk, or a program of the
        caller's own in-process), so a format that runs the code it carries (a PyTorch program,
        a Python model) may load (``Plugin.load_trusted``); otherwise such a model is refused
        with PermissionDenied. Model control sets it for repository loads only."""
        fmt = format_of(model)
        if fmt is not None:  # a folder an application serves (a Hugging Face model's)
            with _stopping(should_stop):
                return fmt.load(self, os.fspath(model), device, config)
        pairs: dict[str, str] = {}
        if (
            not isinstance(config, Configuration)
            and config
            and STATE_PAIRS in config
            and not self.resolve(device, None)[0].native_states
        ):
            config = dict(config)
            pairs = parse_state_pairs(config.pop(STATE_PAIRS))
        with _stopping(should_stop):
            network = self._load_network(model, device, config, trusted)
        if pairs:  # the Core's key, not the device's: every device's requests keep them
            try:
                network.keep_states(pairs)
            except PlugserveError:
                network.close()
                raise
        return network

    def _load_network(
        self, model: Model, device: str, config: Mapping[str, Any] | None, trusted: bool
    ) -> CompiledNetwork:
        plugin, merged = self.resolve(device, config)
        full = plugin.merged_config(merged)  # the one parse of this load's config
        self.limits.check(full, device)
        load = plugin.load_trusted if trusted else plugin.load_network
        cache_dir = str(full.get("CACHE_DIR")) if "CACHE_DIR" in full else ""
        if not cache_dir:
            return load(model, full)
        key = self._cache_key(model, plugin, full)
        path = Path(cache_dir) / f"{key}.blob"
        # Each entry starts with its own key, so a file copied or renamed into place (another
        # network's export under this name) is recompiled rather than served.
        stamp = f"plugserve-cache {key}\n".encode()
        if path.is_file():
            try:
                data = path.read_bytes()
                if not data.startswith(stamp):
                    raise InvalidArgument("the entry was not written for this model and config")
                # an entry holds what the load would (a program's archive too): as trusted
                entry = plugin.import_trusted if trusted else plugin.import_network
                network = entry(data[len(stamp) :], merged)
                network.loaded_from_cache = True
                return network
            except PlugserveError as exc:
                log.warning("cache entry %s is unusable (%s); recompiling", path, exc)
        network = load(model, full)
        try:
            _write_atomically(path, stamp + network.export())
        except OSError as exc:
            log.warning("could not write cache entry %s: %s", path, exc)
        except Unsupported as exc:  # a network that cannot be exported is compiled each time
            log.info("not cached: %s", exc)
        return network

    def import_network(
        self,
        data: bytes,
        device: str,
        config: CallConfig | None = None,
        *,
        trusted: bool = False,
    ) -> CompiledNetwork:
        """``trusted``: as :meth:`load_network`'s (an exported PyTorch program is its archive:
        importing one runs its code)."""
        plugin, merged = self.resolve(device, config)
        self.limits.check(plugin.merged_config(merged), device)
        saved = blob.saved_config(data)  # checked before any thread is made from it (a value
        numbers = {k: v for k, v in saved.items() if v.isascii() and v.isdigit()}  # not a
        self.limits.check(numbers, device)  # number: the plugin refuses it, naming the key)
        network = (plugin.import_trusted if trusted else plugin.import_network)(data, merged)
        try:  # a blob carries the config it was exported with
            self.limits.check(network.config, device)
        except InvalidArgument:
            network.close()
            raise
        return network

    def _cache_key(self, model: Model, plugin: Plugin, config: Any) -> str:
        digest = hashlib.sha256()
        digest.update(_model_bytes(model))
        settings = {k: v for k, v in config.to_strings().items() if k != "CACHE_DIR"}
        extensions = plugin.extension_names()
        digest.update(
            json.dumps(
                {
                    "device": plugin.name,
                    "config": settings,
                    "architecture": plugin.get_metric("DEVICE_ARCHITECTURE"),
                    "plugserve": plugserve_version(),
                    "format": blob.FORMAT_VERSION,
                    "extensions": extensions,
                },
                sort_keys=True,
            ).encode()
        )
        return digest.hexdigest()[:32]


def name_config(name: DeviceName) -> dict[str, str]:
    """Config keys a device name carries: ``ORT.1`` a device id, ``HETERO:A,B`` priorities,
    ``AUTO:-X`` exclusions, ``BATCH:D(8)`` the batch size."""
    config: dict[str, str] = {}
    if name.device_id:
        config["DEVICE_ID"] = name.device_id
    if name.children:
        config["DEVICE_PRIORITIES"] = ",".join(str(c) for c in name.children)
    if name.excluded:
        config["EXCLUDED_DEVICES"] = ",".join(name.excluded)
    if name.batch_size:
        config["BATCH_SIZE"] = str(name.batch_size)
    return config


def _stopping(should_stop: Callable[[], bool] | None) -> contextlib.AbstractContextManager:
    """cancel.stop_when for a caller that gave a check; otherwise the enclosing one stays (a
    HETERO or MULTI load compiling its children through the Core)."""
    return cancel.stop_when(should_stop) if should_stop is not None else contextlib.nullcontext()


def _lazy(ep: Any) -> Callable[[], Plugin]:
    def make() -> Plugin:
        return ep.load()()

    return make


def _model_bytes(model: Model) -> bytes:
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString(deterministic=True)
    if isinstance(model, bytes | bytearray | memoryview):
        return bytes(model)
    if isinstance(model, str | os.PathLike):
        path = Path(model)
        try:
            stat = path.stat()
            data = path.read_bytes() + f"{path.resolve()}:{stat.st_mtime_ns}".encode()
            weights = path.with_suffix(".bin")  # an OpenVINO IR's weights beside its .xml
            if path.suffix == ".xml" and weights.is_file():
                held = weights.stat()
                data += f"{weights.resolve()}:{held.st_size}:{held.st_mtime_ns}".encode()
            return data
        except OSError as exc:
            raise InvalidArgument(f"model file {str(path)!r} cannot be read: {exc}") from None
    raise InvalidArgument(
        f"a model is a path, bytes or onnx.ModelProto, not {type(model).__name__}"
    )


def _write_atomically(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename: a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
