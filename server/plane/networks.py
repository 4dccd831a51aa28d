"""The table of loaded networks, which the request path reads and model control writes.

It sits below both so that neither reaches into the other for it: the data plane
(``dataplane.py``) looks a request's network up here, model control (``model_control.py``)
puts networks in and takes them out, and the protocols' converters read a
:class:`LoadedNetwork` without importing either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import (
    CompiledNetwork,
    InvalidInput,
    NotFound,
    PlugserveError,
    TensorSpec,
    check_element_type,
    check_input_shape,
    listing,
)
from plugserve.plugins.streams import StreamsExecutor
from plugserve.server.plane.metrics import Recorder
from plugserve.server.plane.sequences import SequenceBatcher
from plugserve.server.plane.tenant_queue import TenantQueue

if TYPE_CHECKING:
    from plugserve.server.apps.pipelines.ensemble import SequenceRelay
    from plugserve.server.plane.queue_policy import PolicyQueue

__all__ = [
    "SMALL_RUN_BYTES",
    "LoadFailed",
    "LoadedNetwork",
    "ModelLoading",
    "NetworkTable",
    "NotReady",
    "small_inputs",
]

#: a request whose inputs hold at most this many bytes is small: its runs are what
#: ``LoadedNetwork.small_run_seconds`` measures, and only such a request may run on the REST
#: event loop (a 64 KiB JSON body makes at most ~128 KiB of FP32 values)
SMALL_RUN_BYTES = 256 << 10

# Messages begin with Triton's own words for the condition (triton-inference-server/core:
# model_repository_manager.cc, model_lifecycle.cc), which Triton's example clients and users'
# scripts match on ("Request for unknown model"); what is loaded follows them.


class NotReady(PlugserveError):
    """A version that is loading: Triton's UNAVAILABLE "is not at ready state"."""

    code = "UNAVAILABLE"


class LoadFailed(PlugserveError):
    """An on-demand load's error, as each request that waited on it is answered: a fresh
    exception per request (one instance raised on many threads would share its traceback),
    with the load's own status."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ModelLoading(NotReady):
    """A model loading on demand (``server/control/on_demand.py``), looked up on an event
    loop's thread, which must not wait for it: ``future`` is done once the load is (its
    outcome: None or the load's error); the REST faces await :meth:`loaded` off the loop,
    then look again. Anyone else who sees it answers UNAVAILABLE (503 with Retry-After)."""

    def __init__(self, message: str, future: Future, wait: float, late: Callable[[], str]) -> None:
        """``late()``: what a request that waited :attr:`wait` seconds in vain is told."""
        super().__init__(message)
        self.future = future
        self.wait = wait
        self.late = late

    async def loaded(self) -> None:
        """Wait for the load without holding the loop, at most :attr:`wait` seconds: past
        them UNAVAILABLE; the load's own error when it failed."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.future)), self.wait)
        except (asyncio.TimeoutError, TimeoutError):
            raise NotReady(self.late()) from None
        except PlugserveError as exc:
            raise LoadFailed(str(exc), exc.code) from None


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
    #: its waiting requests by tenant: their share of the queue and their fair places
    waiting: TenantQueue = dataclasses.field(init=False)
    #: What a request that names no outputs gets, and what it may name.
    output_names: list[str] = dataclasses.field(init=False)
    perf_enabled: bool = dataclasses.field(init=False)
    #: Admitted requests not yet finished, and whether a reload replaced it (then it closes
    #: once they are done, and a request reaching it late goes to its replacement).
    inflight: int = dataclasses.field(init=False, default=0)
    #: the same by tenant (what --model-load-on-demand asks: whose requests hold a model)
    inflight_tenants: dict[str, int] = dataclasses.field(init=False, default_factory=dict)
    #: what must live as long as it does (a load override's folder, ``OverrideFolder``)
    keeps: Any = dataclasses.field(init=False, default=None)
    retired: bool = dataclasses.field(init=False, default=False)
    #: per output, the class labels a classified answer names (Triton's label_filename)
    labels: dict[str, tuple[str, ...]] = dataclasses.field(init=False, default_factory=dict)
    #: per input, config.pbtxt's image format, for ModelConfig
    formats: dict[str, int] = dataclasses.field(init=False, default_factory=dict)
    #: per input, config.pbtxt's dims (no batch dimension), for a raw binary request's shape
    dims: dict[str, tuple[int, ...]] = dataclasses.field(init=False, default_factory=dict)
    #: Triton's sequence batcher, for a model whose config.pbtxt has sequence_batching; for
    #: an ensemble of a sequence model, what passes its sequence requests on to its steps
    sequences: SequenceBatcher | SequenceRelay | None = dataclasses.field(init=False, default=None)
    #: Triton's queue policies from its config (``queue_policy.py``), which admit its requests;
    #: None: none (set by model control before the network serves)
    queue: PolicyQueue | None = dataclasses.field(init=False, default=None)
    #: what a client sends and gets (metadata, model config): the network's inputs and
    #: outputs but those a sequence batcher feeds and keeps
    inputs: list[TensorSpec] = dataclasses.field(init=False)
    outputs: list[TensorSpec] = dataclasses.field(init=False)
    #: what a protocol prepared for this network's requests on first use, by protocol (its
    #: fast path for the common request: see ``kserve/convert.py``'s ``PlainLane``)
    lanes: dict[str, Any] = dataclasses.field(init=False, default_factory=dict)
    #: how long this network's runs take, in seconds: a moving average over the last few,
    #: which tells whether a run inline on a gRPC handler thread should give that thread's
    #: turn away while it runs (``DataPlane._admit``)
    run_seconds: float = dataclasses.field(init=False, default=0.0)
    #: the same for the runs of small requests only (inputs of at most ``SMALL_RUN_BYTES``;
    #: None: none has run yet): whether REST runs a small request on its event loop
    #: (``kserve/rest.py``'s ``_fast``). A large request's run does not count: one add of
    #: two 50M-element inputs (a second) moved the all-time mean over that bar for the next
    #: thousand small requests, each of which then paid two thread hand-offs
    small_run_seconds: float | None = dataclasses.field(init=False, default=None)
    #: when a request last came (``time.monotonic``; its load until then): which loaded
    #: model on-demand loading unloads first, and when one is idle (``control/on_demand.py``)
    last_used: float = dataclasses.field(init=False, default_factory=time.monotonic)
    #: how many times the heap had been frozen when its network began to be made
    #: (``control/allocator.py``; None: not known): its unload thaws the heap only if frozen
    #: again since
    made_after_freezes: int | None = dataclasses.field(init=False, default=None)
    #: when it was loaded (``time.monotonic``): on-demand loading keeps it at least
    #: --model-min-loaded-seconds before it may leave to make room (``control/on_demand.py``)
    loaded_at: float = dataclasses.field(init=False, default_factory=time.monotonic)

    def __post_init__(self, queue_size: int) -> None:
        self.executor = self.network.executor
        self.queue_limit = queue_size or max(64, 16 * self.executor.streams)
        self.waiting = TenantQueue(self.name, self.queue_limit)
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


def small_inputs(arrays: Iterable[Any]) -> bool:
    """Whether ``arrays`` (a request's inputs) hold at most :data:`SMALL_RUN_BYTES`."""
    total = 0
    for array in arrays:
        total += getattr(array, "nbytes", 0)
    return total <= SMALL_RUN_BYTES


def _safe_config(network: CompiledNetwork, key: str) -> Any:
    try:
        return network.get_config(key)
    except PlugserveError:
        return None


class NetworkTable:
    """Every loaded network version by name and version, and the versions being loaded.

    ``lock`` (re-entrant) guards both: a reader takes it for one lookup, model control holds
    it across a check and the change it decides (a load's reservation, a reload's swap)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: name -> version -> the loaded network
        self.by_name: dict[str, dict[int, LoadedNetwork]] = {}
        #: (name, version) of the loads under way
        self.loading: set[tuple[str, int]] = set()
        #: (name, version) -> why it did not load: a repository model the server was asked to
        #: serve (at startup, by a poll, by a repository load request) that failed, until a
        #: version of it loads or it is unloaded; version 0: the model as a whole (a config
        #: that cannot be read). While any is here the server is not ready (Triton's strict
        #: readiness: model_control.ModelControl.unready)
        self.failed: dict[tuple[str, int], str] = {}

    def all(self) -> list[LoadedNetwork]:
        with self.lock:
            return [n for versions in self.by_name.values() for n in versions.values()]

    def missing(self, name: str, version: int) -> PlugserveError:
        """Why ``name`` (``version``; 0: its latest) cannot serve, in Triton's words, then what
        is loaded (call with the lock held)."""
        head = f"Request for unknown model: {name!r}"
        versions = listing(sorted(self.by_name.get(name, {})), plain=True)
        loading = listing(sorted(v for n, v in self.loading if n == name), plain=True)
        if version and (name, version) in self.loading:
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
        loaded = listing(sorted(self.by_name), plain=True) or "none"
        failed = [why for (n, v), why in sorted(self.failed.items()) if n == name]
        because = f"; it failed to load: {failed[-1]}" if failed else ""
        return NotFound(f"{head} is not found; loaded networks: {loaded}{because}")
