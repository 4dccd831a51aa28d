"""The data plane: everything the gRPC services do, independent of protocol.

The servicers (plugserve.v1 and KServe v2) translate messages and call this; it owns the loaded
networks, the model repository and the counters. A request runs on its network's own streams
executor (:attr:`CompiledNetwork.executor`, one infer request per stream); the data plane adds
what a server needs on top of it and no scheduler of its own: admission into a bounded queue
(``--queue-size``; a full queue is ``ResourceExhausted`` at once), the deadline checked when a
stream picks the request up, metrics, and completion through a future so the RPC layer never
waits on a queue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from plugserve.plugins import cancel
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
    TensorSpec,
    check_element_type,
    check_input_shape,
    check_inputs,
    listing,
    refuse_non_tensors,
)
from plugserve.plugins.streams import Finished, StreamsExecutor
from plugserve.server.allocator import give_back_freed_memory
from plugserve.server.budget import Charge, MemoryBudget
from plugserve.server.core import Core
from plugserve.server.deadlines import DeadlineWatch
from plugserve.server.devices import parse_device
from plugserve.server.metrics import Metrics, Recorder
from plugserve.server.repository import ModelEntry, Repository, check_name, is_version
from plugserve.server.security import refuse_server_keys
from plugserve.server.sequences import SequenceBatcher, Sequences, SequenceSettings, Step
from plugserve.server.shm import SharedMemory
from plugserve.server.triton_config import (
    EVERY_VERSION,
    ModelSettings,
    VersionPolicy,
    write_overrides,
)
from plugserve.server.versions import check_version, next_version

__all__ = [
    "ControlDisabled",
    "DataPlane",
    "LoadedNetwork",
    "NotReady",
    "ShuttingDown",
    "failed_to_load",
]

log = logging.getLogger(__name__)

_Item = TypeVar("_Item")
_Outcome = TypeVar("_Outcome")


# Messages begin with Triton's own words for the condition (triton-inference-server/core:
# model_repository_manager.cc, model_lifecycle.cc, server.cc), which Triton's example clients
# and users' scripts match on ("Request for unknown model", "failed to load"); plugserve's
# explanation and what to do follow them.


class ControlDisabled(PlugserveError):
    """A load or unload request under --model-control-mode none or poll (as Triton)."""

    code = "UNAVAILABLE"

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"explicit model load / unload is not allowed if polling is enabled: {detail}"
        )


class ShuttingDown(PlugserveError):
    """The server is draining for shutdown: new work is refused; the caller may retry elsewhere."""

    code = "UNAVAILABLE"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Server not ready: {detail}")


class NotReady(PlugserveError):
    """A version that is loading: Triton's UNAVAILABLE "is not at ready state"."""

    code = "UNAVAILABLE"


def failed_to_load(name: str, exc: PlugserveError) -> PlugserveError:
    """``exc`` (same type, so the same status) with Triton's ``failed to load 'NAME'`` first."""
    if str(exc).startswith("failed to load"):
        return exc
    return type(exc)(f"failed to load {name!r}: {exc}")


@dataclasses.dataclass(eq=False)
class LoadedNetwork:
    """A compiled network as the server holds it: name, version, device, and what its
    requests use, decided once at load (its executor, queue bound, outputs, recorder)."""

    name: str
    version: int
    device: str
    network: CompiledNetwork
    persisted: bool
    max_batch_size: int
    recorder: Recorder
    queue_size: dataclasses.InitVar[int] = 0
    #: The network's own streams, each with its infer request; started at load.
    executor: StreamsExecutor = dataclasses.field(init=False)
    #: How many requests may wait for a stream (--queue-size, else 16 per stream and at
    #: least 64: one tritonclient stream's burst of 64 fits a one-stream device).
    queue_limit: int = dataclasses.field(init=False)
    #: What a request that names no outputs gets, and what it may name.
    output_names: list[str] = dataclasses.field(init=False)
    perf_enabled: bool = dataclasses.field(init=False)
    #: Admitted requests not yet finished, and whether a reload replaced it (then it closes
    #: once they are done, and a request reaching it late goes to its replacement).
    inflight: int = dataclasses.field(init=False, default=0)
    retired: bool = dataclasses.field(init=False, default=False)
    #: per output, the class labels a classified answer names (Triton's label_filename)
    labels: dict[str, tuple[str, ...]] = dataclasses.field(init=False, default_factory=dict)
    #: per input, config.pbtxt's image format, for ModelConfig
    formats: dict[str, int] = dataclasses.field(init=False, default_factory=dict)
    #: Triton's sequence batcher, for a model whose config.pbtxt has sequence_batching
    sequences: SequenceBatcher | None = dataclasses.field(init=False, default=None)
    #: what a client sends and gets (metadata, model config): the network's inputs and
    #: outputs but those a sequence batcher feeds and keeps
    inputs: list[TensorSpec] = dataclasses.field(init=False)
    outputs: list[TensorSpec] = dataclasses.field(init=False)
    #: what a protocol prepared for this network's requests on first use, by protocol (its
    #: fast path for the common request: see ``kserve_convert.PlainLane``)
    lanes: dict[str, Any] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self, queue_size: int) -> None:
        self.executor = self.network.executor
        self.queue_limit = queue_size or max(64, 16 * self.executor.streams)
        self.output_names = [o.name for o in self.network.outputs]
        self.inputs, self.outputs = list(self.network.inputs), list(self.network.outputs)
        self._known_outputs = frozenset(self.output_names)
        self._inputs = {spec.name: spec for spec in self.network.inputs}
        self.perf_enabled = bool(_safe_config(self.network, "PERF_COUNT"))

    def expect(self, name: str, dtype: np.dtype, shape: list[int] | None = None) -> None:
        """Before a protocol decodes input ``name``'s data: its element type (and the shape
        it declares, where the format gives it first) must be the network's (an unknown name
        is left to the one full check that follows)."""
        spec = self._inputs.get(name)
        if spec is not None:
            try:
                check_element_type(self.name, spec, dtype)
                if shape is not None:
                    check_input_shape(self.name, spec, shape)
            except InvalidInput:
                self.recorder.refused("invalid")  # counted as the full check would count it
                raise


def check_batch(name: str, max_batch_size: int, arrays: list[Any]) -> None:
    """As Triton: a model with max_batch_size > 0 takes at most that many rows per request."""
    for array in arrays:
        rows = array.shape[0] if getattr(array, "ndim", 0) else 0
        if rows > max_batch_size:
            raise InvalidInput(
                f"network {name!r}: a batch of {rows} rows is over its max_batch_size "
                f"{max_batch_size}; split the request"
            )


#: The longest a replaced network waits for its admitted requests before it closes anyway.
RETIRE_TIMEOUT = 300.0

_STATUS = {DeadlineExceeded: "deadline", Cancelled: "cancelled", InvalidInput: "invalid"}


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


def _safe_config(network: CompiledNetwork, key: str) -> Any:
    try:
        return network.get_config(key)
    except PlugserveError:
        return None


class DataPlane:
    def __init__(
        self,
        core: Core,
        metrics: Metrics,
        repository: Repository | None,
        default_device: str = "NUMPY",
        queue_size: int = 0,
        max_networks: int = 0,
        max_model_bytes: int = 0,
        max_request_seconds: float = 0.0,
        max_inflight_bytes: int = 0,
        load_threads: int = 1,
        max_sequences: int = 0,
    ) -> None:
        """``max_networks`` / ``max_model_bytes`` / ``max_request_seconds`` /
        ``max_sequences``: --max-networks, --max-model-bytes, --max-request-seconds and
        --max-sequences (0: no limit); ``load_threads``: --model-load-threads, made concrete."""
        self.load_threads = max(1, load_threads)
        self.max_request_seconds = max_request_seconds
        #: --max-inflight-bytes: what the protocols charge their requests against
        self.budget = MemoryBudget(max_inflight_bytes)
        #: Triton's system shared memory regions (the server sets its own, with its flags)
        self.shm = SharedMemory(budget=self.budget)
        #: cancels requests past their client's deadline or --max-request-seconds
        self.deadlines = DeadlineWatch()
        #: every sequence model's bounds and idle reaper (--max-sequences)
        self.sequences = Sequences(max_sequences, self.budget)
        self.max_networks = max_networks
        self.max_model_bytes = max_model_bytes
        self.core = core
        self.metrics = metrics
        self.repository = repository
        self.default_device = default_device
        self.queue_size = queue_size
        self._networks: dict[str, dict[int, LoadedNetwork]] = {}
        self._lock = threading.RLock()
        self._loading: set[tuple[str, int]] = set()
        self.ready = False
        self.draining = False  # set by drain(): new requests and loads are UNAVAILABLE
        #: --model-control-mode; and what each repository version was loaded from (poll)
        self.control_mode = ""
        #: the ports the server listens on (-1: off), for clients that ask (GetMetric
        #: SERVER_PORTS): grpc, http, metrics, health
        self.ports: dict[str, int] = {}
        self._stamps: dict[tuple[str, int], tuple] = {}
        self._inflight = 0  # admitted requests not yet finished (queued or running)
        self._inflight_lock = threading.Lock()
        metrics.watch_executors(self._executor_gauges)
        metrics.watch_sequences(self._sequence_gauges)

    # --- executors

    def _executor_gauges(self) -> list[tuple[str, int, int, int, int]]:
        with self._lock:
            per_device: dict[str, list[StreamsExecutor]] = {}
            for versions in self._networks.values():
                for net in versions.values():
                    per_device.setdefault(net.device, []).append(net.executor)
        return [
            (
                kind,
                sum(ex.pending for ex in group),
                sum(ex.busy for ex in group),
                sum(ex.streams for ex in group),
                len(group),
            )
            for kind, group in sorted(per_device.items())
        ]

    def _sequence_gauges(self) -> list[tuple[str, str, str, int, int]]:
        return [
            (n.device, n.name, str(n.version), n.sequences.active, n.sequences.state_bytes)
            for n in self.networks()
            if n.sequences is not None
        ]

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
        dynamic_batching: bool = True,
        batch_size: int = 0,
        sequence: SequenceSettings | None = None,
    ) -> tuple[LoadedNetwork, bool]:
        """Compile and register a network; returns it and whether it came from the cache.

        Dynamic batching: a network with ``max_batch_size`` > 0 (a repository model's
        ``config.json``) is loaded as ``BATCH:<device>(<max_batch_size>)``, so concurrent
        requests are gathered into batches of up to that many rows, unless its device already
        is a BATCH device (which then decides the batch size). BATCH wraps one plain device:
        a HETERO, MULTI or AUTO device is loaded as it is, without dynamic batching.
        ``dynamic_batching=False`` (a Triton config.pbtxt without dynamic_batching): no BATCH.
        ``batch_size``: the rows BATCH gathers, when not ``max_batch_size`` (Triton's preferred
        size). ``max_batch_size`` always bounds each request's rows.
        """
        check_name(name)
        check_version(version)
        if self.draining:
            raise ShuttingDown(f"network {name!r}: the server is shutting down; not loading it")
        self._check_model_size(model, "LoadNetwork")
        device = device or self.default_device
        if dynamic_batching:
            device = batch_device(device, batch_size or max_batch_size)
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
        try:
            network = self._compile(name, model, device, config)
            network.name = name
            if persist:
                self.repository.persist(name, version, model, device, config, max_batch_size)
            entry = self._entry(name, version, device, network, persist, max_batch_size)
            self._sequenced(entry, sequence)
            with self._lock:
                self._networks.setdefault(name, {})[version] = entry
        finally:
            with self._lock:
                self._loading.discard((name, version))
        log.info(
            "network %s version %d ready on %s in %s%s",
            name,
            version,
            entry.device,
            network.precision,
            " (from cache)" if network.loaded_from_cache else "",
        )
        return entry, network.loaded_from_cache

    def _entry(
        self,
        name: str,
        version: int,
        device: str,
        network: CompiledNetwork,
        persisted: bool,
        max_batch_size: int,
    ) -> LoadedNetwork:
        kind = str(parse_device(device))
        recorder = self.metrics.recorder(kind, name, version, network.precision)
        return LoadedNetwork(
            name, version, kind, network, persisted, max_batch_size, recorder, self.queue_size
        )

    def _sequenced(self, entry: LoadedNetwork, settings: SequenceSettings | None) -> None:
        """Give ``entry`` its sequence batcher (Triton's sequence_batching); its state outputs
        are then the server's, not an answer's."""
        if settings is None:
            return
        try:
            entry.sequences = SequenceBatcher(
                entry.name,
                settings,
                entry.max_batch_size,
                entry.network.inputs,
                entry.output_names,
                functools.partial(self._admit, entry),
                self.sequences,
                entry.recorder.joined,
            )
        except PlugserveError:
            self._close(entry)
            raise
        batcher = entry.sequences
        entry.output_names = [n for n in entry.output_names if n not in batcher.hidden_outputs]
        entry.inputs = [s for s in entry.inputs if s.name not in batcher.hidden_inputs]
        entry.outputs = [s for s in entry.outputs if s.name not in batcher.hidden_outputs]

    def unload(self, name: str, version: int = 0, remove: bool = False) -> list[LoadedNetwork]:
        """Unload a version (every version when 0); ``remove`` also deletes it from the
        repository. Files are never deleted implicitly: an operator's models stay on disk."""
        with self._lock:
            versions = self._networks.get(name)
            if not versions or (version and version not in versions):
                raise self._missing(name, version)
            targets = [versions.pop(version)] if version else list(versions.values())
            if version == 0 or not versions:
                versions.clear()
                del self._networks[name]
        for entry in targets:
            if remove and entry.persisted and self.repository is not None:
                self.repository.remove(name, entry.version)
            self.metrics.forget(entry.device, name, entry.version)
            self._close(entry)
        return targets

    @staticmethod
    def _end_sequences(entry: LoadedNetwork) -> None:
        """Its sequences end with it (unload, reload, shutdown): their clients start again."""
        ended = entry.sequences.close() if entry.sequences is not None else 0
        if ended:
            log.info(
                "network %s version %d: %d active sequence(s) ended with it",
                entry.name,
                entry.version,
                ended,
            )

    @classmethod
    def _close(cls, entry: LoadedNetwork) -> None:
        cls._end_sequences(entry)
        try:
            entry.network.close()
        except Exception as exc:  # a failed device must not keep a network loaded
            log.warning(
                "network %s version %d: closing it on %s failed (%s: %s); it is unloaded",
                entry.name,
                entry.version,
                entry.device,
                type(exc).__name__,
                exc,
            )

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
            raise self._missing(name, version)

    def _missing(self, name: str, version: int) -> PlugserveError:
        """Why ``name`` (``version``; 0: its latest) cannot serve, in Triton's words, then what
        is loaded (call with the lock held)."""
        head = f"Request for unknown model: {name!r}"
        versions = listing(sorted(self._networks.get(name, {})), plain=True)
        loading = listing(sorted(v for n, v in self._loading if n == name), plain=True)
        if version and (name, version) in self._loading:
            return NotReady(
                f"{head} version {version} is not at ready state: it is loading; retry when "
                f"/v2/models/{name}/versions/{version}/ready says it is"
            )
        if not versions and loading:
            return NotReady(
                f"{head} has no available versions: version {loading} is loading; "
                f"retry when /v2/models/{name}/ready says it is"
            )
        if version and versions:
            return NotFound(
                f"{head} version {version} is not found; its loaded versions: {versions}"
            )
        loaded = listing(sorted(self._networks), plain=True) or "none"
        return NotFound(f"{head} is not found; loaded networks: {loaded}")

    # --- inference

    def submit(
        self,
        entry: LoadedNetwork,
        inputs: Mapping[str, Any],
        outputs: list[str] | None = None,
        deadline: float | None = None,
        inline: bool = False,
        token: cancel.Token | None = None,
        holds: int = 0,
        after: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
        step: Step | None = None,
        checked: list[np.ndarray] | None = None,
    ) -> Future | Finished:
        """Admit one inference (see :meth:`_admit`); ``step``: the request's place in a
        sequence (its ``sequence_*`` parameters), which a network with Triton's sequence
        batching requires and others refuse."""
        if step is None and entry.sequences is None:
            return self._admit(
                entry, inputs, outputs, deadline, inline, token, holds, after, checked
            )
        if entry.sequences is None:
            entry.recorder.refused("invalid")
            raise InvalidInput(
                f"inference request to model '{entry.name}' names a sequence (sequence_id "
                f"{step.id!r}), but the model has no sequence batching (Triton's "
                "sequence_batching in its config.pbtxt); send it without the sequence_* "
                "parameters"
            )
        hidden = sorted(entry.sequences.hidden_outputs.intersection(outputs or ()))
        try:
            if hidden:
                raise InvalidInput(
                    f"network {entry.name!r}: {listing(hidden)} are state outputs, which the "
                    "server keeps for the sequence; ask for the model's other outputs"
                )
            wanted = self._outputs(entry, outputs)
            return entry.sequences.submit(
                step, inputs, wanted, deadline, token, holds, after, inline
            )
        except ResourceExhausted:
            entry.recorder.refused("overloaded")
            raise
        except PlugserveError:
            entry.recorder.refused("invalid")
            raise

    def _admit(
        self, entry, inputs, outputs, deadline, inline, token, holds, after=None, checked=None
    ):
        """(:meth:`submit`'s arguments but ``step``.) Queue one inference on ``entry`` (the
        caller's one :meth:`get`, which its response also names, so an unload or load meanwhile
        cannot relabel or lose a finished request); the future holds ``{output: array}`` or a
        typed error.

        ``inline``: the caller waits for the result anyway (a unary RPC), so when one of the
        network's streams is idle the inference runs on the caller's thread (see
        :meth:`StreamsExecutor.run_inline`) and its outcome is returned :class:`Finished`.

        ``token``: the request's cancellation token, which the caller cancels when its client
        goes away (a unary call hooks it to the call's end before the run may start inline);
        cancelling the returned future does the same. The request is also cancelled, queued
        or running, once ``deadline`` (``time.monotonic``) or --max-request-seconds passes.

        ``after``: applied to the outputs on the thread that ran the request, before it counts
        as done (outputs written into shared memory regions).

        ``holds``: the bytes the request holds until it is answered, charged to
        --max-inflight-bytes before it is admitted (a protocol that charged it already, as
        REST does when a body's headers arrive, passes 0).

        ``checked``: the inputs as arrays in the network's order, already known to pass
        :func:`check_inputs` against ``entry`` (a protocol's fast path decided that from the
        network's specs); ``inputs`` is then unused.
        """
        name = entry.name
        recorder = entry.recorder
        try:
            arrays = (
                checked if checked is not None else check_inputs(name, entry.network.inputs, inputs)
            )
            if entry.max_batch_size > 0:
                check_batch(name, entry.max_batch_size, arrays)
            wanted = self._outputs(entry, outputs)
        except PlugserveError:
            recorder.refused("invalid")
            raise
        executor = entry.executor
        admitted = time.perf_counter()
        token = token if token is not None else cancel.Token()

        def run(request: InferRequest) -> dict[str, np.ndarray]:
            started = time.perf_counter()
            if token.error is not None:
                raise token.failure()
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"network {name!r}: the deadline passed while queued "
                    f"({started - admitted:.3f} s in the queue)"
                )
            entered = cancel.enter(token)
            try:
                result = request.infer_checked(arrays)  # checked once, above
            except PlugserveError:
                raise
            except Exception as exc:  # the device's own failure: INTERNAL, naming it
                log.exception(
                    "network %s version %d on %s failed", name, entry.version, entry.device
                )
                raise InferenceError(
                    f"network {name!r} on {entry.device}: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                cancel.leave(entered)
            answer = {k: result[k] for k in wanted}
            if after is not None:
                answer = after(answer)
            finished = time.perf_counter()
            if entry.perf_enabled:
                recorder.layers(request.get_performance_counts())
            recorder.success(started - admitted, finished - started)
            return answer

        with self._inflight_lock:
            if self.draining:
                raise ShuttingDown(
                    f"network {name!r}: the server is shutting down; send the request elsewhere"
                )
            retired = entry.retired
            if not retired:
                self._inflight += 1
                entry.inflight += 1
        if retired:  # reloaded since the caller's lookup: its replacement answers
            if checked is not None:  # checked against this network; the replacement checks
                inputs = {spec.name: a for spec, a in zip(entry.network.inputs, checked)}
            return self._admit(
                self.get(name, entry.version),
                inputs,
                outputs,
                deadline,
                inline,
                token,
                holds,
                after,
            )
        try:
            charge = self.budget.charge(holds, f"a request to network {name!r}")
        except ResourceExhausted:
            with self._inflight_lock:
                self._inflight -= 1
                entry.inflight -= 1
            recorder.refused("overloaded")
            raise
        self._watch(name, token, deadline)
        try:
            future = (inline and executor.run_inline(run)) or executor.submit(
                run, entry.queue_limit, token=token
            )
        except BaseException as exc:
            self.deadlines.forget(token)
            charge.release()
            with self._inflight_lock:
                self._inflight -= 1
                entry.inflight -= 1
            recorder.refused("overloaded" if isinstance(exc, ResourceExhausted) else "")
            raise
        if type(future) is Finished:  # ran inline: its callback would run now anyway
            self._finished(entry, future, token, charge)
        else:
            future.add_done_callback(lambda f: self._finished(entry, f, token, charge))
        return future

    def _watch(self, name: str, token: cancel.Token, deadline: float | None) -> None:
        """Have the deadline watch cancel ``token`` at the client's deadline or the server's
        --max-request-seconds, whichever comes first."""
        now = time.monotonic()
        limit = self.max_request_seconds
        server_end = now + limit if limit else float("inf")
        if deadline is not None and deadline <= server_end:
            self.deadlines.watch(
                token,
                deadline,
                lambda: DeadlineExceeded(
                    f"network {name!r}: stopped, the request passed its deadline "
                    f"({time.monotonic() - now:.3f} s after it was admitted)"
                ),
            )
        else:
            self.deadlines.watch(
                token,
                server_end,
                lambda: DeadlineExceeded(
                    f"network {name!r}: stopped, the request ran past the server's limit "
                    f"of {limit:g} s (--max-request-seconds)"
                ),
            )

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

    def _finished(
        self, entry: LoadedNetwork, future: Future | Finished, token: cancel.Token, charge: Charge
    ) -> None:
        """Successes are recorded where they ran; here the admitted ones that failed."""
        self.deadlines.forget(token)
        token.finish()
        charge.release()
        with self._inflight_lock:
            self._inflight -= 1
            entry.inflight -= 1
        exc = future.exception()
        if exc is not None:
            entry.recorder.failure(_STATUS.get(type(exc), "error"))

    def cancel_all(self, why: str) -> int:
        """Cancel every admitted request, queued or running (a shutdown that stops waiting
        for them); returns how many there were."""
        return self.deadlines.cancel_all(lambda: Cancelled(why))

    def _outputs(self, entry: LoadedNetwork, outputs: list[str] | None) -> list[str]:
        if not outputs:
            return entry.output_names
        unknown = [o for o in outputs if o not in entry._known_outputs]
        if unknown:
            raise InvalidInput(
                f"network {entry.name!r}: unknown output(s) {listing(unknown)}; "
                f"its outputs are {listing(entry.output_names)}"
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
        entry = self.get(name, version)
        return self.submit(entry, inputs, outputs, deadline, inline=True).result()

    # --- the rest of the plugin API

    def subgraphs(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """The split a HETERO load would make (empty for devices that do not split)."""
        plugin, merged = self.core.resolve(device, config)
        try:
            return plugin.subgraphs(model, merged)
        except PlugserveError:  # some node has no device: the query itself says which
            return []

    def refusals(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the nodes a virtual device's devices did not take
        (empty for a real device: ``query`` gives its reasons)."""
        plugin, merged = self.core.resolve(device, config)
        return plugin.refusals(model, merged)

    def query(
        self, model: bytes | str | Path, device: str, config: Mapping[str, str] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        self._check_model_size(model, "QueryNetwork")
        supported = self.core.query_network(model, device, config)
        plugin = self.core.plugin(device)
        reasons = plugin.unsupported_nodes(model, config)
        return supported, {k: v for k, v in reasons.items() if k not in supported}

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
        network = self.core.import_network(blob, device, config)
        network.name = name
        with self._lock:
            version = next_version(max(self._networks.get(name, {}), default=0), name)
            self._check_network_count(name, version, len(self._loading))
            entry = self._entry(name, version, device, network, False, 0)
            self._networks.setdefault(name, {})[version] = entry
        return entry

    def repository_model(self, path: str) -> tuple[Path, str, dict[str, str], int]:
        """A model named by ``name`` or ``name/version`` in the repository, with its settings."""
        if self.repository is None:
            raise FailedPrecondition("this server has no model repository")
        name, _, version = path.partition("/")
        if version and not is_version(version):
            raise InvalidArgument(f"repository path {path!r}: expected NAME or NAME/VERSION")
        model, settings = self._stored(name, int(version or 0))
        return model, settings.device, settings.config, settings.max_batch_size

    def version_policy(self, name: str) -> VersionPolicy:
        """Which versions of ``name`` the repository loads (every one for a model loaded by an
        RPC, or kept by config.json; Triton's and OVMS's own policy for theirs)."""
        if self.repository is not None:
            with contextlib.suppress(PlugserveError, OSError):
                return self.repository.read_settings(name).policy
        return EVERY_VERSION

    def _stored(
        self, name: str, version: int = 0, repository: Repository | None = None
    ) -> tuple[Path, ModelSettings]:
        repository = repository or self.repository
        if repository is None:
            raise FailedPrecondition("this server has no model repository")
        model = repository.model_path(name, version)
        return model, repository.read_settings(name, int(model.parent.name))

    def versions(self, name: str, version: int = 0) -> list[LoadedNetwork]:
        """The loaded version asked for, or every loaded version of ``name`` (0); NotFound
        names what is loaded."""
        with self._lock:
            found = self._networks.get(name, {})
            if version in found or (not version and found):
                return [found[version]] if version else [found[v] for v in sorted(found)]
            raise self._missing(name, version)

    def check_control(self, what: str) -> None:
        """Load and unload requests are refused in Triton's none and poll modes."""
        if self.control_mode in ("none", "poll"):
            raise ControlDisabled(
                f"{what}: model load and unload requests are not allowed with "
                f"--model-control-mode {self.control_mode} (the repository decides what is "
                "loaded); start the server with --model-control-mode explicit to allow them"
            )

    def load_with_overrides(self, name: str, config: str | None, files: dict[str, bytes]) -> None:
        """Triton's RepositoryModelLoad with overrides: ``config`` (a ModelConfig as JSON)
        replaces the model's configuration, ``files`` (``<version>/<file name>`` -> bytes) its
        version folders (then ``config`` is required, as in Triton). They are written to a
        private folder, loaded from it (seamlessly, as :meth:`reload`), and removed; the
        repository on disk is left as it is."""
        check_name(name)
        if files and config is None:
            raise InvalidArgument(
                f"model {name!r}: file overrides need a 'config' override too (as in Triton)"
            )
        for data in files.values():
            self._check_model_size(data, "RepositoryModelLoad")
        with tempfile.TemporaryDirectory(prefix="plugserve-override-") as tmp:
            folder = Path(tmp) / name
            folder.mkdir()
            write_overrides(folder, name, config, files)
            if not files:  # the repository's versions, with the new configuration
                source = self._stored(name)[0].parent.parent
                for version in source.iterdir():
                    if is_version(version.name):
                        (folder / version.name).symlink_to(version.resolve())
            overridden = Repository(tmp)
            entries, problems = overridden.scan()
            if problems:
                raise InvalidArgument(f"model {name!r}: {'; '.join(problems)}")
            for entry in entries:
                settings = self._stored(name, entry.version, overridden)[1]
                refuse_server_keys(settings.config, f"model {name!r}: the load's 'config'")
            if not entries:
                raise InvalidArgument(f"model {name!r}: the overrides give no version to load")
            for entry in entries:
                self.reload(name, entry.version, overridden)

    def reload(
        self, name: str, version: int = 0, repository: Repository | None = None
    ) -> LoadedNetwork:
        """Load the repository's ``version`` of ``name`` (0: its latest), as Triton reloads:
        the new network is compiled while the loaded one (if any) still serves, then takes its
        place in one step; requests admitted by the old one finish there, and it closes after
        them. ``repository``: another than the server's (load overrides)."""
        if self.draining:
            raise ShuttingDown(f"model {name!r}: the server is shutting down; not loading it")
        model, settings = self._stored(name, version, repository)
        stamp = self.repository.stamp(name, model) if self.repository else ()
        version = int(model.parent.name)  # the repository layout is NAME/VERSION/model.onnx
        self._check_model_size(model, "RepositoryModelLoad")
        device, config, batch = settings.device, settings.config, settings.max_batch_size
        device = device or self.default_device
        if settings.dynamic_batching:
            device = batch_device(device, settings.batch_size or batch)
        with self._lock:
            old = self._networks.get(name, {}).get(version)
            if (name, version) in self._loading:
                raise InvalidArgument(f"model {name!r} version {version} is being loaded")
            if old is None:
                self._check_network_count(name, version, len(self._loading))
            self._loading.add((name, version))
        try:
            network = self._compile(name, model, device, dict(config))
            network.name = name
            entry = self._entry(name, version, device, network, True, batch)
            entry.labels = dict(settings.labels)
            entry.formats = dict(settings.formats)
            self._sequenced(entry, settings.sequence)
            with self._lock:
                self._networks.setdefault(name, {})[version] = entry
                self._stamps[(name, version)] = stamp
        finally:
            with self._lock:
                self._loading.discard((name, version))
        log.info("network %s version %d %s on %s", name, version,
                 "reloaded" if old else "ready", entry.device)  # fmt: skip
        if old is not None:
            self._retire(old, keep_series=old.device == entry.device)
        return entry

    def _retire(self, entry: LoadedNetwork, keep_series: bool) -> None:
        """Close a replaced network once the requests it admitted are done (its replacement
        takes any that reach it later; see :meth:`submit`)."""
        with self._inflight_lock:
            entry.retired = True

        def close_when_idle() -> None:
            end = time.monotonic() + RETIRE_TIMEOUT
            while entry.inflight and time.monotonic() < end:
                time.sleep(0.02)
            if not keep_series:
                self.metrics.forget(entry.device, entry.name, entry.version)
            self._close(entry)

        threading.Thread(target=close_when_idle, name=f"retire-{entry.name}", daemon=True).start()

    def index(self, ready_only: bool = False) -> list[tuple[str, int, bool]]:
        """``(name, version, loaded)`` for every loaded or stored network version, sorted."""
        loaded = {(n.name, n.version) for n in self.networks()}
        stored: set[tuple[str, int]] = set()
        if self.repository is not None:
            entries, _ = self.repository.scan()
            stored = {(e.name, e.version) for e in entries}
        rows = [(name, version, (name, version) in loaded) for name, version in loaded | stored]
        return sorted(row for row in rows if row[2] or not ready_only)

    def load_repository(
        self, names: Collection[str] | None = None
    ) -> tuple[list[LoadedNetwork], list[str]]:
        """Load every model of the repository (only ``names``, when given); one bad model does
        not stop the others."""
        if self.repository is None:
            return [], []
        self.repository.clean_staging()
        entries, problems = self.repository.scan()
        if names is not None:
            found = {e.name for e in entries}
            problems += [f"--load-model {n}: no such model in the repository" for n in
                         sorted(set(names) - found)]  # fmt: skip
            entries = [e for e in entries if e.name in names]
        ready: list[LoadedNetwork] = []
        for outcome in self._each(self._load_entry, entries):
            if isinstance(outcome, LoadedNetwork):
                ready.append(outcome)
            else:
                problems.append(outcome)
        return ready, problems

    def _load_entry(self, entry: ModelEntry) -> LoadedNetwork | str:
        """One repository version loaded, or what went wrong with it (its file first)."""
        try:
            loaded, _ = self.load(
                entry.name,
                entry.path,
                entry.device,
                entry.config,
                version=entry.version,
                max_batch_size=entry.max_batch_size,
                dynamic_batching=entry.settings.dynamic_batching,
                batch_size=entry.settings.batch_size,
                sequence=entry.settings.sequence,
            )
        except PlugserveError as exc:
            return f"{entry.path}: {exc}"
        loaded.persisted = True
        loaded.labels = dict(entry.settings.labels)
        loaded.formats = dict(entry.settings.formats)
        stamp = self.repository.stamp(entry.name, entry.path)
        with self._lock:
            self._stamps[(entry.name, entry.version)] = stamp
        return loaded

    def _each(self, load: Callable[[_Item], _Outcome], items: list[_Item]) -> list[_Outcome]:
        """``load`` of every item, ``load_threads`` at a time (Triton's model load threads), in
        the items' order. Each version loads on its own: one that fails or is slow holds up
        none of the others, and the caller sees every outcome once all are done. Then the
        loads' scratch memory goes back to the system (see give_back_freed_memory)."""
        if not items:
            return []
        if self.load_threads == 1 or len(items) == 1:
            outcomes = [load(item) for item in items]
        else:
            threads = min(self.load_threads, len(items))
            with ThreadPoolExecutor(threads, thread_name_prefix="model-load") as pool:
                outcomes = list(pool.map(load, items))
        give_back_freed_memory()
        return outcomes

    def poll_repository(self) -> list[str]:
        """One look at the repository (--model-control-mode poll): versions added are loaded,
        removed ones unloaded, changed ones (model or config file) reloaded seamlessly.
        Networks loaded by request without ``persist`` are not the repository's: left alone.
        Returns what went wrong, one line each."""
        if self.repository is None or self.draining:
            return []
        entries, problems = self.repository.scan()
        wanted = {(e.name, e.version): e for e in entries}
        ours = {(n.name, n.version) for n in self.networks() if n.persisted}
        for name, version in sorted(ours - wanted.keys()):
            with contextlib.suppress(NotFound):
                self.unload(name, version)
                self._stamps.pop((name, version), None)
                log.info("repository poll: %s version %d removed: unloaded", name, version)
        changed = [
            entry
            for (name, version), entry in sorted(wanted.items())
            if (name, version) not in ours
            or self._stamps.get((name, version)) != self.repository.stamp(name, entry.path)
        ]
        problems += [p for p in self._each(self._reload_entry, changed) if p]
        for problem in problems:
            log.error("repository poll: %s", problem)
        return problems

    def _reload_entry(self, entry: ModelEntry) -> str:
        """:meth:`reload` of a repository version; what went wrong, or "" when it loaded."""
        try:
            self.reload(entry.name, entry.version)
        except PlugserveError as exc:
            return f"{entry.path}: {exc}"
        return ""

    def close(self) -> None:
        """Stop every network's streams: what is queued still runs, nothing new is taken."""
        self.deadlines.close()
        self.sequences.close()
        for entry in self.networks():
            self._end_sequences(entry)
            entry.executor.shutdown(wait=False)
