"""BATCH's compiled network: the device's network plus the batcher in front of it.

Callers hand their inputs to :meth:`BatchCompiledNetwork.submit` and get a future. Requests are
queued by their shape beyond the first dimension (and element type), so only requests that can
be concatenated ever share a batch. A queue is sent as one batch when it holds ``BATCH_SIZE``
rows or ``BATCH_TIMEOUT_MS`` after its oldest request arrived, whichever comes first; a request
with more rows than ``BATCH_SIZE`` runs alone. As Triton's dynamic batcher, a batch is formed
only when the device has a stream free for it (its executor's ``streams``), and then from the
waiting requests of the highest priority first (their queue policy's ``place``), in arrival order
within one: a request of a higher priority that arrives while the device is busy runs before the
lower ones that waited longer (with batches formed as soon as they were full and queued on the
device, 32 of 256 pairs of a low request and a high one sent after it ran low first). Batches run
on the device network's own executor, each stream with its own infer request of it; the outputs
are split back along the first dimension. This network's own executor holds its callers while
their batch fills (``BatchConfiguration.streams``: how many may wait here at once). A batch of
several requests that fails runs each again alone (:meth:`BatchCompiledNetwork._alone`): one
client's bad input must not fail the others, nor show them its values.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Cancelled,
    CompiledNetwork,
    FailedPrecondition,
    InferenceError,
    PerfCount,
    PlugserveError,
    TensorSpec,
)
from plugserve.plugins.batch.config import BatchConfiguration
from plugserve.plugins.batch.request import BatchInferRequest
from plugserve.plugins.run_context import RunContext, for_batch
from plugserve.plugins.streams import RequestFuture
from plugserve.plugins.threads import start_daemon
from plugserve.plugins.virtual import OneNetwork

if TYPE_CHECKING:
    from plugserve.plugins.batch.plugin import BatchPlugin

__all__ = ["BatchCompiledNetwork", "row_coupling", "unbatchable"]

log = logging.getLogger(__name__)


# Ops whose every output row depends on every input row: one quantization scale computed over
# the whole tensor. Batched, a request's result would change with the requests beside it.
ROW_COUPLING_OPS = {
    ("", "DynamicQuantizeLinear"): "computes one scale over the whole tensor",
    ("com.microsoft", "DynamicQuantizeMatMul"): "quantizes its input with one scale",
    ("com.microsoft", "DynamicQuantizeLSTM"): "quantizes its input with one scale",
}


def row_coupling(graph: onnx.GraphProto) -> str:
    """Why rows of a batch would change each other's results in this graph ('' if they
    cannot), subgraphs included."""
    for node in graph.node:
        why = ROW_COUPLING_OPS.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
        if why:
            return f"node {node.name or node.op_type!r} ({node.op_type}) {why}"
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                if why := row_coupling(sub):
                    return why
    return ""


def unbatchable(specs: list[TensorSpec], kind: str) -> str:
    """Why these inputs or outputs cannot be batched ('' if they can)."""
    for spec in specs:
        if spec.shape is None:
            return f"{kind} {spec.name!r} has no known shape"
        if not spec.shape:
            return f"{kind} {spec.name!r} is a scalar"
        first = spec.shape[0]
        if isinstance(first, int) and first >= 0:
            return f"{kind} {spec.name!r} has a static first dimension ({spec.describe()})"
    return ""


class _Item:
    """One request in the batcher. Its token is its caller's: cancelled while queued, the item
    is dropped; cancelled while its batch runs, its caller stops waiting at once, and the
    batch itself is stopped once every request in it is cancelled (the others still want it)."""

    __slots__ = ("arrays", "arrived", "future", "rows", "run", "token")

    def __init__(
        self,
        arrays: list[np.ndarray],
        rows: int,
        token: cancel.Token | None,
        run: RunContext | None = None,
    ) -> None:
        self.arrays = arrays
        self.rows = rows
        self.arrived = time.monotonic()
        self.token = token
        #: what its caller was told of the request (None: nothing)
        self.run = run
        self.future: Future = RequestFuture(token)

    def abandon(self) -> None:
        """The caller's token was cancelled: out of the queue, or let go of its batch."""
        if not self.future.cancel() and self.token is not None:
            with contextlib.suppress(InvalidStateError):
                self.future.set_exception(self.token.failure())

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """The batch's outcome, unless the caller already let go."""
        with contextlib.suppress(InvalidStateError):
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)


def _place(item: _Item) -> int:
    """Where ``item`` waits among the others: its queue policy's place (Triton's priority
    level, ``cancel.Token.place``), 0 without one."""
    return item.token.place if item.token is not None else 0


def _oldest(queue: list[_Item]) -> float:
    """When the longest waiting request of ``queue`` arrived (the queue is in priority order,
    not arrival order, once a batch was taken from it)."""
    return min(i.arrived for i in queue)


class BatchCompiledNetwork(OneNetwork, CompiledNetwork):
    plugin: BatchPlugin
    config: BatchConfiguration
    gathers = True  # a request waits in the batcher until its batch starts

    def __init__(
        self,
        plugin: BatchPlugin,
        config: BatchConfiguration,
        device: str,
        network: CompiledNetwork,
    ) -> None:
        super().__init__(plugin, network.name, config)
        self.child_device = device
        self.network = network
        self.batch_size = int(config.get("BATCH_SIZE"))
        self.timeout_s = float(config.get("BATCH_TIMEOUT_MS")) / 1000.0
        self.input_names = [s.name for s in network.inputs]
        self.output_names = [s.name for s in network.outputs]
        self._cond = threading.Condition()
        self._queues: dict[tuple, list[_Item]] = {}
        #: batches handed to the device and not finished, and how many it runs at once: a
        #: batch is formed only when one of them is free
        self._running = 0
        self._slots = max(1, int(getattr(network.executor, "streams", 1)))
        self._closed = False
        self._collector: threading.Thread | None = None
        self._stats: dict[int, list[int]] = {}  # rows -> [batches, ns]
        self._batches = itertools.count(1)
        self.last_counts: list[PerfCount] = []

    # --- the batcher

    def submit(
        self,
        arrays: list[np.ndarray],
        key: tuple,
        rows: int,
        token: cancel.Token | None = None,
        run: RunContext | None = None,
    ) -> Future:
        """Queue one request's checked inputs; the future holds its own outputs. ``token``:
        the caller's run's (see :class:`_Item`); ``run``: its request, which the batch's run
        is told together with the others' (``run_context.for_batch``)."""
        item = _Item(arrays, rows, token, run)
        with self._cond:
            if self._closed:
                raise FailedPrecondition(f"network {self.name}: BATCH network is closed")
            if self._collector is None:
                self._collector = start_daemon(
                    f"BATCH/{self.name}-collector", _collect, weakref.ref(self)
                )
            self._queues.setdefault(key, []).append(item)
            self._cond.notify()
        if token is not None:
            token.on_cancel(item.abandon)
        return item.future

    def _ready(self, now: float) -> tuple | None:
        for key, queue in self._queues.items():
            if (
                sum(i.rows for i in queue) >= self.batch_size
                or now >= _oldest(queue) + self.timeout_s
            ):
                return key
        return None

    def _next_batch(self, idle: float) -> list[_Item] | None:
        """The next batch to run; ``[]`` if none is ready after ``idle`` s, None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    pending = [i for q in self._queues.values() for i in q]
                    self._queues.clear()
                    for item in pending:
                        item.settle(
                            error=Cancelled(f"network {self.name}: closed before the batch ran")
                        )
                    return None
                if self._running >= self._slots:  # the device is busy: gather, form later
                    self._cond.wait(idle if not self._queues else None)
                    if not self._queues and not self._closed:
                        return []
                    continue
                now = time.monotonic()
                key = self._ready(now)
                if key is not None:
                    break
                wake = min(
                    (_oldest(q) + self.timeout_s for q in self._queues.values()), default=None
                )
                if wake is None:
                    self._cond.wait(idle)
                    if not self._queues:
                        return []
                else:
                    self._cond.wait(max(0.0, wake - now))
            queue = self._queues[key]
            queue.sort(key=_place)  # the highest priority first (stable: arrival order within)
            batch = [queue.pop(0)]
            rows = batch[0].rows
            while queue and rows + queue[0].rows <= self.batch_size:
                rows += queue[0].rows
                batch.append(queue.pop(0))
            if not queue:
                del self._queues[key]
            self._running += 1
            return batch

    def _finished(self) -> None:
        """A batch handed to the device is done (or never ran): its stream is free."""
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def _dispatch(self, batch: list[_Item]) -> None:
        try:
            # a weak reference: a stream keeps its last task until the next one arrives
            ref = weakref.ref(self)
            # batches waiting for the device's streams: the highest priority in them first
            self.network.executor.submit(
                lambda request, b=batch: _run_batch(ref, request, b),
                place=min(_place(i) for i in batch),
            )
        except PlugserveError as exc:
            self._finished()
            for item in batch:
                item.settle(error=exc)

    def _run(self, request: Any, batch: list[_Item]) -> None:
        number = next(self._batches)
        rows = sum(i.rows for i in batch)
        what = (
            f"network {self.name}: batch #{number} ({len(batch)} request(s), {rows} rows) "
            f"on {self.child_device}"
        )
        live = [i for i in batch if i.future.set_running_or_notify_cancel()]
        if not live:
            return
        for item in live:
            cancel.started(item.token)
        if len(live) != len(batch):
            batch, rows = live, sum(i.rows for i in live)
        token, forget = cancel.every(
            [i.token for i in batch],
            lambda: Cancelled(f"{what}: every request in it was cancelled"),
        )
        start = time.perf_counter()
        try:
            if len(batch) == 1:
                feeds = dict(zip(self.input_names, batch[0].arrays))
            else:
                feeds = {
                    name: np.concatenate([i.arrays[k] for i in batch], axis=0)
                    for k, name in enumerate(self.input_names)
                }
            told = for_batch(
                [i.run or RunContext(token=i.token or cancel.Token()) for i in batch],
                token or cancel.Token(),
            )
            outputs = request.infer(feeds, told)
            parts = self._split(outputs, batch, rows)
        except BaseException as exc:
            if len(batch) == 1 or (token is not None and token.cancelled):
                for item in batch:
                    item.settle(error=_failed(what, exc))
                return
            failed = exc
        else:
            failed = None
        finally:
            forget()  # the requests' tokens no longer reach this run
        if failed is not None:
            self._alone(request, batch, failed)
            return
        elapsed = int((time.perf_counter() - start) * 1e9)
        if self.config.get("PERF_COUNT"):
            with contextlib.suppress(PlugserveError):
                self.last_counts = list(request.get_performance_counts())
        self._record(rows, elapsed)
        for item, part in zip(batch, parts):
            item.settle(part)

    def _record(self, rows: int, elapsed: int) -> None:
        """One batch of ``rows`` rows ran in ``elapsed`` ns (BATCH_SIZE_COUNTS)."""
        with self._cond:
            entry = self._stats.setdefault(rows, [0, 0])
            entry[0] += 1
            entry[1] += elapsed

    def _alone(self, request: Any, batch: list[_Item], failed: BaseException) -> None:
        """A batch of several requests failed: each is run again on its own, and gets its own
        answer or error. The batch's error was one for all of them: one client's bad input
        (an index past an embedding's rows) failed every other request gathered with it, and
        each error showed that input's values and how many requests shared the batch, to
        other clients (other tenants, with tokens). A batch fails thus at most once for each
        of its requests' one run more."""
        log.debug("network %s: a batch of %d failed (%s): run one by one", self.name, len(batch),
                  type(failed).__name__)  # fmt: skip
        what = f"network {self.name}: a run on {self.child_device}"
        for item in batch:
            if item.future.done() or (item.token is not None and item.token.cancelled):
                item.settle(error=item.token.failure() if item.token else failed)
                continue
            run = item.run or RunContext(token=item.token or cancel.Token())
            try:
                feeds = dict(zip(self.input_names, item.arrays))
                start = time.perf_counter()
                outputs = request.infer(feeds, for_batch([run], item.token or cancel.Token()))
                part = dict(outputs)
            except BaseException as exc:
                item.settle(error=_failed(what, exc))
                continue
            elapsed = int((time.perf_counter() - start) * 1e9)
            self._record(item.rows, elapsed)
            item.settle(part)

    def _split(
        self, outputs: dict[str, Any], batch: list[_Item], rows: int
    ) -> list[dict[str, np.ndarray]]:
        if len(batch) == 1:
            return [dict(outputs)]
        offsets = list(itertools.accumulate(i.rows for i in batch))[:-1]
        parts: list[dict[str, np.ndarray]] = [{} for _ in batch]
        for name, value in outputs.items():
            array = np.asarray(value)
            if array.ndim == 0 or array.shape[0] != rows:
                raise InferenceError(
                    f"output {name!r} has shape {list(array.shape)}, its first dimension is "
                    f"not the batch's {rows} rows: the model does not batch along it"
                )
            for part, piece in zip(parts, np.split(array, offsets, axis=0)):
                part[name] = piece
        return parts

    def batch_statistics(self) -> dict[int, tuple[int, int]]:
        """``{rows: (batches run, nanoseconds)}`` for every batch size executed so far."""
        with self._cond:
            return {rows: (v[0], v[1]) for rows, v in sorted(self._stats.items())}

    def batching(self) -> tuple[int, float]:
        return self.batch_size, float(self.config.get("BATCH_TIMEOUT_MS"))

    # --- the CompiledNetwork API

    def create_infer_request(self) -> BatchInferRequest:
        return BatchInferRequest(self)

    def export(self) -> bytes:
        """The device's own export: batching is how a network is served, not what it is, so
        the blob imports on the device itself or, batched again, on ``BATCH:<device>(n)``."""
        return self.network.export()

    def each_stream(self, fn: Any) -> list[Any]:
        """The device network's streams: batches run on them, each with its own request of it
        (this network's own streams only hold callers while their batch fills)."""
        return self.network.each_stream(fn)

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "EXECUTION_DEVICES", "BATCH_SIZE_COUNTS"]

    def _metric(self, name: str) -> Any:
        if name == "EXECUTION_DEVICES":
            return [self.child_device]
        if name == "BATCH_SIZE_COUNTS":
            return {rows: count for rows, (count, _) in self.batch_statistics().items()}
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.config.streams()
        return super()._metric(name)

    def __del__(self) -> None:
        # unlike other networks, all of close(): the collector and the device's network exist
        # only for this one
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        super().close()
        self.network.close()


def _failed(what: str, exc: BaseException) -> BaseException:
    """The error a request of a failed run gets: a typed refusal keeps its status (an output
    over the answer's bound is RESOURCE_EXHAUSTED, not the device's failure)."""
    cause = f"{type(exc).__name__}: {exc}"
    kind = type(exc) if isinstance(exc, PlugserveError) else InferenceError
    try:
        error = kind(f"{what} failed: {cause}")
    except TypeError:  # an error type made otherwise
        error = InferenceError(f"{what} failed: {cause}")
    error.__cause__ = exc
    return error


def _collect(ref: weakref.ref) -> None:
    """The collector thread: holds its network only while handling a batch, so a network
    dropped without close() is still collected (and its __del__ closes it)."""
    while True:
        network = ref()
        if network is None:
            return
        batch = network._next_batch(idle=0.5)
        if batch is None:
            return
        if batch:
            network._dispatch(batch)
        del network, batch


def _run_batch(ref: weakref.ref, request: Any, batch: list[_Item]) -> None:
    network = ref()
    if network is None:
        for item in batch:
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(Cancelled("the BATCH network was dropped"))
        return
    try:
        network._run(request, batch)
    finally:
        network._finished()
