"""The data plane: everything the gRPC services do, independent of protocol.

The servicers (plugserve.v1 and KServe v2) translate messages and call this; it owns the loaded
networks, the per-device stream executors, the model repository and the counters. Requests are
admitted into a device's bounded queue (a full queue is ``ResourceExhausted`` at once), checked
against their deadline when a stream picks them up, and completed through a future so the RPC
layer never waits on a queue.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    Cancelled,
    CompiledNetwork,
    DeadlineExceeded,
    FailedPrecondition,
    InferenceError,
    InferRequest,
    InvalidArgument,
    InvalidInput,
    NotFound,
    PlugserveError,
    ResourceExhausted,
    check_inputs,
    listing,
    refuse_non_tensors,
)
from plugserve.plugins.streams import StreamsExecutor
from plugserve.server.core import Core
from plugserve.server.devices import parse_device
from plugserve.server.metrics import Metrics
from plugserve.server.repository import Repository, check_name, is_version
from plugserve.server.versions import check_version, next_version

__all__ = ["DataPlane", "LoadedNetwork", "ShuttingDown"]

log = logging.getLogger(__name__)


class ShuttingDown(PlugserveError):
    """The server is draining for shutdown: new work is refused; the caller may retry elsewhere."""

    code = "UNAVAILABLE"


@dataclasses.dataclass
class Stats:
    """Per-network counters for KServe's statistics extension (nanoseconds, as Triton)."""

    success: int = 0
    failure: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    last_inference_ms: int = 0
    execution_count: int = 0


class LoadedNetwork:
    """A compiled network as the server holds it: name, version, device, and stream requests."""

    def __init__(
        self,
        name: str,
        version: int,
        device: str,
        network: CompiledNetwork,
        persisted: bool,
        max_batch_size: int,
        streams: int,
    ) -> None:
        self.name = name
        self.version = version
        self.device = device
        self.network = network
        self.persisted = persisted
        self.max_batch_size = max_batch_size
        self.stats = Stats()
        #: The streams this network's requests run on (set by the data plane when it loads it).
        self.executor: StreamsExecutor | None = None
        #: Records a successful request in its metrics series (set with the executor).
        self.record_success: Callable[[float, float], None] = _unrecorded
        self._requests: list[InferRequest | None] = [None] * streams
        self.perf_enabled = bool(_safe_config(network, "PERF_COUNT"))
        self.perf_totals: dict[str, list[Any]] = {}
        self._perf_lock = threading.Lock()

    def request_for(self, stream: int) -> InferRequest:
        """Each stream keeps its own infer request (its own backend state) per network."""
        request = self._requests[stream]
        if request is None:
            request = self._requests[stream] = self.network.create_infer_request()
        return request

    def record_perf(self, request: InferRequest) -> list[Any]:
        counts = request.get_performance_counts()
        with self._perf_lock:
            for c in counts:
                entry = self.perf_totals.setdefault(c.node_name, [c, 0.0, 0])
                entry[0] = c
                entry[1] += c.real_time_s
                entry[2] += 1
        return counts


def batch_device(device: str, max_batch_size: int) -> str:
    """``BATCH:<device>(<max_batch_size>)`` for a plain device when ``max_batch_size`` > 0."""
    if max_batch_size <= 0:
        return device
    parsed = parse_device(device)
    if parsed.is_virtual:
        if parsed.kind != "BATCH":
            log.info("device %s is virtual: no dynamic batching for it", device)
        return device
    return f"BATCH:{parsed}({max_batch_size})"


def _unrecorded(queue_wait: float, compute: float) -> None:
    """A network not attached to a data plane records nothing."""


def _safe_config(network: CompiledNetwork, key: str) -> Any:
    try:
        return network.get_config(key)
    except PlugserveError:
        return None


class DataPlane:
    # limits (0: none), set by the server from --max-networks and --max-model-bytes
    max_networks = 0
    max_model_bytes = 0

    def __init__(
        self,
        core: Core,
        metrics: Metrics,
        repository: Repository | None,
        default_device: str = "NUMPY",
        queue_size: int = 0,
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.repository = repository
        self.default_device = default_device
        self.queue_size = queue_size
        self._networks: dict[str, dict[int, LoadedNetwork]] = {}
        self._executors: dict[str, StreamsExecutor] = {}
        self._executor_users: dict[str, int] = {}  # networks and loads under way, per executor
        self._lock = threading.RLock()
        self._loading: set[tuple[str, int]] = set()
        self.ready = False
        self.draining = False  # set by drain(): new requests and loads are UNAVAILABLE
        self._inflight = 0  # admitted requests not yet finished (queued or running)
        self._inflight_lock = threading.Lock()
        metrics.watch_executors(self._executor_gauges)

    # --- executors

    def executor(self, device: str, config: Mapping[str, str] | None = None) -> StreamsExecutor:
        """Streams for a device, as many as its configuration asks, overridden by a network's
        own ``config`` (NUM_STREAMS, PERFORMANCE_HINT): networks of one device that ask for the
        same number share one executor, so a THROUGHPUT network is not run one at a time."""
        kind = str(parse_device(device))
        streams = self.core.device_config(kind, config).streams()
        key = f"{kind}/{streams}"
        with self._lock:
            executor = self._executors.get(key)
            if executor is None:
                queue = self.queue_size or 16 * streams
                executor = StreamsExecutor(kind, streams, queue, state_factory=lambda i: i)
                self._executors[key] = executor
            self._executor_users[key] = self._executor_users.get(key, 0) + 1
            return executor

    def _release(self, executor: StreamsExecutor) -> None:
        """One network (or failed load) less on ``executor``; the last one stops its threads,
        so loading and unloading with ever new NUM_STREAMS does not pile threads up."""
        with self._lock:
            key = next((k for k, e in self._executors.items() if e is executor), None)
            if key is None:
                return
            self._executor_users[key] -= 1
            if self._executor_users[key] > 0:
                return
            del self._executors[key], self._executor_users[key]
        executor.shutdown(wait=False)  # what is queued still runs

    def _executor_gauges(self) -> list[tuple[str, int, int, int, int]]:
        with self._lock:
            counts: dict[str, int] = {}
            for versions in self._networks.values():
                for net in versions.values():
                    counts[net.device] = counts.get(net.device, 0) + 1
            per_device: dict[str, list[StreamsExecutor]] = {}
            for ex in self._executors.values():
                per_device.setdefault(ex.name, []).append(ex)
            rows = []
            for kind in sorted(set(per_device) | set(counts)):
                group = per_device.get(kind, [])
                rows.append(
                    (
                        kind,
                        sum(ex.pending for ex in group),
                        sum(ex.busy for ex in group),
                        sum(ex.streams for ex in group),
                        counts.get(kind, 0),
                    )
                )
            return rows

    # --- networks

    def load(
        self,
        name: str,
        model: bytes | str | Path,
        device: str = "",
        config: Mapping[str, str] | None = None,
        persist: bool = False,
        version: int = 0,
        max_batch_size: int = 0,
    ) -> tuple[LoadedNetwork, bool]:
        """Compile and register a network; returns it and whether it came from the cache.

        Dynamic batching: a network with ``max_batch_size`` > 0 (a repository model's
        ``config.json``) is loaded as ``BATCH:<device>(<max_batch_size>)``, so concurrent
        requests are gathered into batches of up to that many rows, unless its device already
        is a BATCH device (which then decides the batch size). BATCH wraps one plain device:
        a HETERO, MULTI or AUTO device is loaded as it is, without dynamic batching.
        """
        check_name(name)
        check_version(version)
        if self.draining:
            raise ShuttingDown(f"network {name!r}: the server is shutting down; not loading it")
        self._check_model_size(model, "LoadNetwork")
        device = batch_device(device or self.default_device, max_batch_size)
        config = dict(config or {})
        if persist and self.repository is None:
            raise FailedPrecondition("persist needs a server started with --model-repository")
        if persist and not isinstance(model, bytes):
            raise InvalidArgument("persist needs the model as bytes")
        with self._lock:
            if not version:
                loaded = max(self._networks.get(name, {}), default=0)
                stored = (
                    self.repository.next_version(name) - 1 if (persist and self.repository) else 0
                )
                version = next_version(max(loaded, stored), name)
            if version in self._networks.get(name, {}) or (name, version) in self._loading:
                raise InvalidArgument(
                    f"network {name!r} version {version} is already loaded; unload it first "
                    "or load another version"
                )
            self._check_network_count(name, version, len(self._loading))
            self._loading.add((name, version))
        executor = None
        try:
            executor = self.executor(device, config)
            network = self._compile(name, model, device, config)
            if persist:
                self.repository.persist(name, version, model, device, config, max_batch_size)
            entry = LoadedNetwork(
                name,
                version,
                str(parse_device(device)),
                network,
                persist,
                max_batch_size,
                executor.streams,
            )
            self._attach(entry, executor)
            network.name = name
            with self._lock:
                self._networks.setdefault(name, {})[version] = entry
        except BaseException:
            if executor is not None:
                self._release(executor)
            raise
        finally:
            with self._lock:
                self._loading.discard((name, version))
        log.info(
            "network %s version %d ready on %s%s",
            name,
            version,
            entry.device,
            " (from cache)" if network.loaded_from_cache else "",
        )
        return entry, network.loaded_from_cache

    def _attach(self, entry: LoadedNetwork, executor: StreamsExecutor) -> None:
        """What a network's requests use, decided once when it is loaded: its streams and its
        success series in the metrics."""
        entry.executor = executor
        entry.record_success = self.metrics.success_recorder(
            entry.device, entry.name, entry.version
        )

    def unload(self, name: str, version: int = 0, remove: bool = False) -> list[LoadedNetwork]:
        """Unload a version (every version when 0); ``remove`` also deletes it from the
        repository. Files are never deleted implicitly: an operator's models stay on disk."""
        with self._lock:
            versions = self._networks.get(name)
            if not versions or (version and version not in versions):
                raise NotFound(self._missing(name, version))
            targets = [versions.pop(version)] if version else list(versions.values())
            if version == 0 or not versions:
                versions.clear()
                del self._networks[name]
        for entry in targets:
            if remove and entry.persisted and self.repository is not None:
                self.repository.remove(name, entry.version)
            self.metrics.forget(entry.device, name, entry.version)
            self._release(entry.executor)
            close = getattr(entry.network, "close", None)
            try:
                if close:
                    close()
            except Exception as exc:  # a failed device must not keep a network loaded
                log.warning(
                    "network %s version %d: closing it on %s failed (%s: %s); it is unloaded",
                    name,
                    entry.version,
                    entry.device,
                    type(exc).__name__,
                    exc,
                )
        return targets

    def _compile(
        self, name: str, model: bytes | str | Path, device: str, config: Mapping[str, str]
    ) -> CompiledNetwork:
        """Core.load_network, with a device's own exceptions as a typed INTERNAL error."""
        try:
            network = self.core.load_network(model, device, config)
        except PlugserveError:
            raise
        except Exception as exc:
            log.exception("network %s: loading on %s failed", name, device)
            raise InferenceError(
                f"network {name!r}: loading on {device} failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            refuse_non_tensors(network, f"network {name!r}")
        except PlugserveError:
            network.close()
            raise
        return network

    def _check_model_size(self, model: Any, what: str) -> None:
        """--max-model-bytes, before anything parses the model (a file path is the
        operator's repository and is not limited)."""
        limit = self.max_model_bytes
        if limit and isinstance(model, bytes | bytearray | memoryview) and len(model) > limit:
            raise InvalidArgument(
                f"{what}: the model is {len(model)} bytes, over this server's limit of "
                f"{limit} bytes (--max-model-bytes / PLUGSERVE_MAX_MODEL_BYTES)"
            )

    def _check_network_count(self, name: str, version: int, loading: int) -> None:
        """--max-networks: loaded plus loading network versions (call with the lock held)."""
        limit = self.max_networks
        loaded = sum(len(v) for v in self._networks.values()) + loading
        if limit and loaded >= limit:
            raise ResourceExhausted(
                f"cannot load network {name!r}"
                + (f" version {version}" if version else "")
                + f": {loaded} network version(s) are loaded or loading, the limit is {limit} "
                "(--max-networks / PLUGSERVE_MAX_NETWORKS); unload one first"
            )

    def networks(self) -> list[LoadedNetwork]:
        with self._lock:
            return [n for versions in self._networks.values() for n in versions.values()]

    def get(self, name: str, version: int = 0) -> LoadedNetwork:
        if not name:
            raise InvalidArgument(
                "the request names no network: set its name (plugserve.v1 'network' or "
                "'name', KServe 'model_name' or 'name')"
            )
        with self._lock:
            versions = self._networks.get(name)
            if versions and not version:
                return versions[max(versions)]
            if versions and version in versions:
                return versions[version]
        raise NotFound(self._missing(name, version))

    def _missing(self, name: str, version: int) -> str:
        loaded = sorted(self._networks)
        what = f"network {name!r}" + (f" version {version}" if version else "")
        return f"{what} is not loaded; loaded networks: {listing(loaded, plain=True) or 'none'}"

    # --- inference

    def submit(
        self,
        name: str,
        version: int,
        inputs: Mapping[str, Any],
        outputs: list[str] | None = None,
        deadline: float | None = None,
        inline: bool = False,
    ) -> Future:
        """Queue one inference; the future holds ``{output: array}`` or a typed error.

        ``inline``: the caller waits for the result anyway (a unary RPC), so when one of the
        network's streams is idle the inference runs on the caller's thread (see
        :meth:`StreamsExecutor.run_inline`); the future is then already done.
        """
        entry = self.get(name, version)
        try:
            arrays = check_inputs(name, entry.network.inputs, inputs)
            wanted = self._outputs(entry, outputs)
        except PlugserveError:
            entry.stats.failure += 1
            self.metrics.observe(entry.device, entry.name, entry.version, "invalid")
            raise
        executor = entry.executor
        record_success = entry.record_success
        admitted = time.perf_counter()
        feeds = {spec.name: a for spec, a in zip(entry.network.inputs, arrays)}

        def run(stream: int) -> dict[str, np.ndarray]:
            started = time.perf_counter()
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"network {name!r}: the deadline passed while queued "
                    f"({started - admitted:.3f} s in the queue)"
                )
            request = entry.request_for(stream)
            try:
                result = request.infer(feeds)
            except PlugserveError:
                raise
            except Exception as exc:  # the device's own failure: INTERNAL, naming it
                log.exception(
                    "network %s version %d on %s failed", name, entry.version, entry.device
                )
                raise InferenceError(
                    f"network {name!r} on {entry.device}: {type(exc).__name__}: {exc}"
                ) from exc
            finished = time.perf_counter()
            if entry.perf_enabled:
                self.metrics.observe_layers(
                    entry.device, entry.name, entry.version, entry.record_perf(request)
                )
            entry.stats.queue_ns += int((started - admitted) * 1e9)
            entry.stats.compute_ns += int((finished - started) * 1e9)
            record_success(started - admitted, finished - started)
            return {k: result[k] for k in wanted}

        with self._inflight_lock:
            if self.draining:
                raise ShuttingDown(
                    f"network {name!r}: the server is shutting down; send the request elsewhere"
                )
            self._inflight += 1
        try:
            future = (inline and executor.run_inline(run)) or executor.submit(run)
        except BaseException as exc:
            with self._inflight_lock:
                self._inflight -= 1
            entry.stats.failure += 1
            if isinstance(exc, ResourceExhausted):
                self.metrics.observe(entry.device, entry.name, entry.version, "overloaded")
            raise
        future.add_done_callback(lambda f: self._finished(entry, f))
        return future

    def drain(self) -> None:
        """Refuse new requests and loads (UNAVAILABLE); admitted ones still run."""
        with self._inflight_lock:
            self.draining = True

    def wait_idle(self, timeout: float, give_up: threading.Event | None = None) -> int:
        """Wait until every admitted request finished and no load is running, at most
        ``timeout`` seconds (or until ``give_up`` is set); returns how many are left."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                left = self._inflight + len(self._loading)
            if not left or time.monotonic() >= end or (give_up and give_up.is_set()):
                return left
            time.sleep(0.02)

    def _finished(self, entry: LoadedNetwork, future: Future) -> None:
        with self._inflight_lock:
            self._inflight -= 1
        entry.stats.last_inference_ms = int(time.time() * 1000)
        if future.cancelled():
            entry.stats.failure += 1
            self.metrics.observe(entry.device, entry.name, entry.version, "cancelled")
            return
        exc = future.exception()
        if exc is None:
            entry.stats.success += 1
            entry.stats.execution_count += 1
            return
        entry.stats.failure += 1
        status = {
            DeadlineExceeded: "deadline",
            Cancelled: "cancelled",
            InvalidInput: "invalid",
        }.get(type(exc), "error")
        self.metrics.observe(entry.device, entry.name, entry.version, status)

    def _outputs(self, entry: LoadedNetwork, outputs: list[str] | None) -> list[str]:
        names = [o.name for o in entry.network.outputs]
        if not outputs:
            return names
        unknown = [o for o in outputs if o not in names]
        if unknown:
            raise InvalidInput(
                f"network {entry.name!r}: unknown output(s) {listing(unknown)}; its outputs "
                f"are {listing(names)}"
            )
        return list(outputs)

    def infer(
        self,
        name: str,
        version: int,
        inputs: Mapping[str, Any],
        outputs: list[str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + timeout if timeout else None
        return self.submit(name, version, inputs, outputs, deadline, inline=True).result()

    # --- the rest of the plugin API

    def subgraphs(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """The split a HETERO load would make (empty for devices that do not split)."""
        plugin, merged = self.core.resolve(device, config)
        split = getattr(plugin, "subgraphs", None)
        if split is None:
            return []
        try:
            return split(model, merged)
        except PlugserveError:  # some node has no device: the query itself says which
            return []

    def refusals(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the nodes a virtual device's devices did not take
        (empty for a real device: ``query`` gives its reasons)."""
        plugin, merged = self.core.resolve(device, config)
        explain = getattr(plugin, "refusals", None)
        return explain(model, merged) if explain is not None else []

    def query(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        self._check_model_size(model, "QueryNetwork")
        supported = self.core.query_network(model, device, config)
        plugin = self.core.plugin(device)
        reasons: dict[str, str] = {}
        explain: Callable[..., dict[str, str]] | None = getattr(plugin, "unsupported_nodes", None)
        if explain is not None:
            reasons = {k: v for k, v in explain(model, config).items() if k not in supported}
        return supported, reasons

    def export(self, name: str, version: int = 0) -> bytes:
        return self.get(name, version).network.export()

    def import_network(
        self, name: str, blob: bytes, device: str, config: Mapping[str, str] | None = None
    ) -> LoadedNetwork:
        check_name(name)
        if self.draining:
            raise ShuttingDown(f"network {name!r}: the server is shutting down; not loading it")
        self._check_model_size(blob, "ImportNetwork")
        device = device or self.default_device
        with self._lock:
            self._check_network_count(name, 0, len(self._loading))
        executor = self.executor(device, config)
        try:
            network = self.core.import_network(blob, device, config)
            with self._lock:
                version = next_version(max(self._networks.get(name, {}), default=0), name)
                self._check_network_count(name, version, len(self._loading))
                entry = LoadedNetwork(
                    name,
                    version,
                    str(parse_device(device)),
                    network,
                    False,
                    0,
                    executor.streams,
                )
                self._attach(entry, executor)
                network.name = name
                self._networks.setdefault(name, {})[version] = entry
        except BaseException:
            self._release(executor)
            raise
        return entry

    def repository_model(self, path: str) -> tuple[Path, str, dict[str, str], int]:
        """A model named by ``name`` or ``name/version`` in the repository, with its settings."""
        if self.repository is None:
            raise FailedPrecondition("this server has no model repository")
        name, _, version = path.partition("/")
        if version and not is_version(version):
            raise InvalidArgument(f"repository path {path!r}: expected NAME or NAME/VERSION")
        model = self.repository.model_path(name, int(version or 0))
        settings = self.repository.read_settings(name, int(model.parent.name))
        return model, settings.device, settings.config, settings.max_batch_size

    def load_repository(self) -> tuple[list[LoadedNetwork], list[str]]:
        """Load every model of the repository; one bad model does not stop the others."""
        if self.repository is None:
            return [], []
        self.repository.clean_staging()
        entries, problems = self.repository.scan()
        ready = []
        for entry in entries:
            try:
                loaded, _ = self.load(
                    entry.name,
                    entry.path,
                    entry.device,
                    entry.config,
                    version=entry.version,
                    max_batch_size=entry.max_batch_size,
                )
                loaded.persisted = True
                ready.append(loaded)
            except PlugserveError as exc:
                problems.append(f"{entry.path}: {exc}")
        return ready, problems

    def close(self) -> None:
        with self._lock:
            executors = list(self._executors.values())
        for executor in executors:
            executor.shutdown(wait=False)
