"""The data plane: the request path every protocol shares, from lookup to completion.

The servicers (plugserve.v1, KServe v2 and REST) translate messages and call this for each
inference; what is loaded is model control's (``model_control.py``), which fills the table of
loaded networks (``networks.py``) this reads. Keeping the two apart keeps the path a request
pays for free of loading's concerns, and lets either change without the other. A request runs
on its network's own streams executor (:attr:`CompiledNetwork.executor`, one infer request per
stream); the data plane adds what a server needs on top of it and no scheduler of its own:
admission into a bounded queue (``--queue-size``; a full queue is ``ResourceExhausted`` at
once), the deadline checked when a stream picks the request up, metrics, and completion
through a future so the RPC layer never waits on a queue.

A model whose configuration has Triton's queue policies (``LoadedNetwork.queue``,
``queue_policy.py``) has its requests admitted through them: its levels' bounds, priorities
and waiting timeouts, with the request's ``timeout`` read as the policy says. Any other
model takes a request's ``timeout`` (``Request.timeout``) as its deadline, beside the call's
own; it pays one attribute test for the policies it does not have.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Cancelled,
    DeadlineExceeded,
    InferenceError,
    InferRequest,
    InvalidArgument,
    InvalidInput,
    NotFound,
    PlugserveError,
    ResourceExhausted,
    check_inputs,
    listing,
)
from plugserve.plugins.streams import Finished, StreamsExecutor
from plugserve.plugins.tracing import Span
from plugserve.server.plane.budget import Charge, MemoryBudget
from plugserve.server.plane.callpool import blocked
from plugserve.server.plane.deadlines import DeadlineWatch
from plugserve.server.plane.errors import Unloaded, forget_frames
from plugserve.server.plane.metrics import Metrics, failure_status
from plugserve.server.plane.networks import LoadedNetwork, NetworkTable, small_inputs
from plugserve.server.plane.queue_policy import QueueRejected, Ticket
from plugserve.server.plane.request import Request
from plugserve.server.plane.response_stream import ResponseStream
from plugserve.server.plane.shm import SharedMemory
from plugserve.server.plane.tracing import Stage, Tracing

__all__ = ["DataPlane", "ShuttingDown"]

log = logging.getLogger(__name__)

#: A run inline on a gRPC handler thread that is expected to take longer than this (its
#: network's runs average more) gives the thread's turn to another call while it runs
#: (``callpool.blocked``), so that call's decoding overlaps the run: devices compute without
#: the GIL, and the few handler threads that run calls at once would otherwise all sit in
#: runs while calls wait. A shorter run keeps its turn: giving it away and back costs a
#: thread more fighting for the GIL, which on a tiny request costs more than the run.
LONG_RUN = 250e-6


# Messages begin with Triton's own words for the condition (triton-inference-server/core:
# server.cc), which Triton's example clients and users' scripts match on ("Server not
# ready"); plugserve's explanation and what to do follow them (as in networks.py and
# model_control.py).


class ShuttingDown(PlugserveError):
    """The server is draining for shutdown: new work is refused; the caller may retry elsewhere."""

    code = "UNAVAILABLE"

    def __init__(self, detail: str) -> None:
        super().__init__(f"Server not ready: {detail}")


def _check_batch(name: str, max_batch_size: int, arrays: list[Any]) -> None:
    """As Triton: a model with max_batch_size > 0 takes at most that many rows per request."""
    for array in arrays:
        rows = array.shape[0] if getattr(array, "ndim", 0) else 0
        if rows > max_batch_size:
            raise InvalidInput(
                f"network {name!r}: a batch of {rows} rows is over its max_batch_size "
                f"{max_batch_size}; split the request"
            )


def _past_deadline(name: str, admitted: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"network {name!r}: stopped, the request passed its deadline "
        f"({time.monotonic() - admitted:.3f} s after it was admitted)"
    )


def _answer_too_large(name: str, outputs: dict[str, Any], most: int) -> ResourceExhausted:
    sizes = ", ".join(f"{k} {getattr(v, 'nbytes', 0):,}" for k, v in outputs.items())
    return ResourceExhausted(
        f"network {name!r}: its outputs take more bytes ({sizes}) than the largest answer this "
        f"server sends, {most:,} bytes (--max-message-bytes / PLUGSERVE_MAX_MESSAGE_BYTES); "
        "send smaller inputs, ask for fewer outputs, or have them written to shared memory"
    )


def _fail_from(stream: ResponseStream, future: Future) -> None:
    """End ``stream`` with what its run raised before it could send (queued past its
    deadline, cancelled while queued, its executor shut down)."""
    error = future.exception()
    if error is not None:
        stream.fail(error)


def _overload(exc: BaseException) -> bool:
    """A refusal for lack of room (counted "overloaded"), not for what the request holds."""
    return isinstance(exc, ResourceExhausted | QueueRejected)


def _follow(ticket: Ticket, future: Future | Finished, executor: StreamsExecutor) -> None:
    """``ticket`` follows its request: where it waits, and when it is done."""
    ticket.queued(future, executor)
    future.add_done_callback(ticket.ended)


def _answer(
    name: str,
    result: dict[str, Any],
    wanted: list[str],
    after: Callable[[dict[str, Any]], dict[str, Any]] | None,
    most: int,
) -> dict[str, Any]:
    """A run's answer: the outputs ``wanted``, in their order; written to shared memory by
    ``after``, else over ``most`` bytes in all refused (:func:`_answer_too_large`)."""
    try:
        answer = dict(zip(wanted, map(result.__getitem__, wanted)))
    except KeyError:  # left out by a model that may (RunContext.partial_outputs)
        answer = {name: result[name] for name in wanted if name in result}
    if after is not None:
        return after(answer)
    if most:
        total = 0
        for array in answer.values():
            total += getattr(array, "nbytes", 0)
        if total > most:
            raise _answer_too_large(name, answer, most)
    return answer


def _past_limit(name: str, limit: float) -> DeadlineExceeded:
    return DeadlineExceeded(
        f"network {name!r}: stopped, the request ran past the server's limit "
        f"of {limit:g} s (--max-request-seconds)"
    )


class DataPlane:
    """Admits, runs and completes the requests to the networks in :attr:`table`."""

    def __init__(
        self,
        metrics: Metrics,
        max_request_seconds: float = 0.0,
        max_inflight_bytes: int = 0,
        max_answer_bytes: int = 0,
    ) -> None:
        """``max_request_seconds`` / ``max_inflight_bytes`` / ``max_answer_bytes``:
        --max-request-seconds, --max-inflight-bytes and --max-message-bytes (0: no limit)."""
        self.max_request_seconds = max_request_seconds
        #: the most bytes of outputs an answer may carry (see :meth:`admit`)
        self.max_answer_bytes = max_answer_bytes
        #: --max-inflight-bytes: what the protocols charge their requests against
        self.budget = MemoryBudget(max_inflight_bytes)
        #: Triton's system shared memory regions (the server sets its own, with its flags)
        self.shm = SharedMemory(budget=self.budget)
        #: cancels requests past their client's deadline or --max-request-seconds
        self.deadlines = DeadlineWatch()
        #: acts on requests that waited past their model's queue policy's timeout
        self.queue_timeouts = DeadlineWatch("queue-timeouts")
        #: which requests are traced (off until the server configures it: --trace-config)
        self.tracing = Tracing(known=self.table_has)
        self.metrics = metrics
        #: the loaded networks requests are served from (model control fills it)
        self.table = NetworkTable()
        #: --model-load-on-demand: ``(name, version) -> network`` for a request to a model
        #: not loaded, which loads it or raises why not (``control/on_demand.py`` sets it)
        self.on_demand: Callable[[str, int], LoadedNetwork] | None = None
        self.ready = False
        self.draining = False  # set by drain(): new requests and loads are UNAVAILABLE
        #: the ports the server listens on (-1: off), for clients that ask (GetMetric
        #: SERVER_PORTS): grpc, http, metrics, health
        self.ports: dict[str, int] = {}
        self._inflight = 0  # admitted requests not yet finished (queued or running)
        self._inflight_lock = threading.Lock()
        metrics.watch_executors(self._executor_gauges)
        metrics.watch_sequences(self._sequence_gauges)
        metrics.watch_graphs(self._graph_counts)
        metrics.watch_budget(self.budget.snapshot)
        # (read through self.shm at scrape time: the server's app replaces it)
        metrics.watch_cuda_shm(lambda: self.shm.cuda.copies.snapshot())

    # --- executors

    def _executor_gauges(self) -> list[tuple[str, int, int, int, int]]:
        with self.table.lock:
            per_device: dict[str, list[StreamsExecutor]] = {}
            for versions in self.table.by_name.values():
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

    def _graph_counts(self) -> list[tuple[str, str, str, dict[str, int]]]:
        """The graph events of each network that replays shapes (``plugins/torch/graphs``)."""
        found = []
        for n in self.table.all():
            counts = n.network.graph_statistics()
            if counts:
                found.append((n.device, n.name, str(n.version), counts))
        return found

    def _sequence_gauges(self) -> list[tuple[str, str, str, int, int]]:
        return [
            (n.device, n.name, str(n.version), n.sequences.active, n.sequences.state_bytes)
            for n in self.table.all()
            if n.sequences is not None and not n.sequences.relay
        ]

    # --- networks

    def table_has(self, name: str) -> bool:
        """Whether a version of ``name`` is loaded."""
        return bool(self.table.by_name.get(name))

    def get(self, name: str, version: int = 0, load: bool = True) -> LoadedNetwork:
        """A request's one lookup: ``name``'s ``version`` (0: its latest). One not loaded is
        loaded, when ``load`` and on-demand loading is on (:attr:`on_demand`; a readiness
        probe or a listing passes ``load=False``: asking whether a model is there must not
        load it)."""
        if not name:
            raise InvalidArgument(
                "the request names no network: set its name (plugserve.v1 'network' or "
                "'name', KServe 'model_name' or 'name')"
            )
        # without the table's lock: each step is one under the GIL, and model control
        # replaces or drops a version only while holding it (a lookup that races one of
        # those takes the lock and looks again)
        versions = self.table.by_name.get(name)
        if versions:
            try:
                return versions[version or max(versions)]
            except (KeyError, ValueError):
                pass
        with self.table.lock:
            versions = self.table.by_name.get(name)
            if versions and not version:
                return versions[max(versions)]
            if versions and version in versions:
                return versions[version]
            if not (load and self.on_demand):
                raise self.table.missing(name, version)
        return self.on_demand(name, version)  # (not holding the lock while a load runs)

    # --- inference: one way in for a request answered once, one for a stream of responses

    def check(self, request: Request) -> None:
        """Check ``request``'s inputs now, on the caller's thread, so that admitting it does
        not: a protocol calls it on a worker for inputs whose checks cost (a 50 MB generate
        text's UTF-8 decode, on the REST loop, held its health 0.3 s); a refusal counts as
        invalid, as at admission."""
        request.checked = self._checked(request)[0]

    def infer(self, request: Request) -> Future | Finished:
        """Admit ``request`` (built by its adapter; see ``request.py``); the future holds
        ``{output: array}`` or a typed error. A request of a sequence goes through its
        network's sequence batcher, which admits each of its runs here in turn.

        ``request.inline``: the caller waits for the result anyway (a unary RPC), so when one
        of the network's streams is idle the inference runs on the caller's thread (see
        :meth:`StreamsExecutor.run_inline`) and its outcome is returned :class:`Finished`.

        The request is cancelled, queued or running, when its token is (its client gone) and
        once its deadline or --max-request-seconds passes.

        Outputs over :attr:`max_answer_bytes` in all (--max-message-bytes, the largest message
        the server sends) fail the request with ResourceExhausted once it has run, before any
        protocol encodes them: the encoding would copy them at least once more (a 180-byte
        request to ``ConstantOfShape`` made 8 GB of outputs, and the gRPC answer another 8 GB
        before grpcio refused to send it), and the answer could not leave anyway. One whose
        size the request's values decide is refused before it is computed (the run's context
        carries the bound: ``plugins/amplify.py``).
        """
        if request.decode is not None:
            return self._decoded(request, self.infer)
        if request.timeout and request.entry.queue is None:
            request.until(time.monotonic() + request.timeout)  # no queue policy reads it
        sequences = request.entry.sequences
        if request.step is None and (sequences is None or sequences.relay):
            return self._admit(request)
        return self._sequenced(request)

    def stream(
        self,
        request: Request,
        start: Callable[[ResponseStream, Span | None], object] | None = None,
    ) -> ResponseStream:
        """Admit ``request`` answered by a stream of responses (a decoupled network, a
        generative model) and return the :class:`ResponseStream` they come in.

        ``start(stream, span)`` begins producing into it, from any thread, for as long as the
        request lasts (the generation engine's loop; ``span``: the request's model span, which
        what the producer records opens under, None when it is not traced); without one, the
        request's inputs are checked and run on the network's executor with
        :meth:`InferRequest.infer_decoupled`
        (a network that is not decoupled answers one final response; the stream slot is held
        while ``infer_decoupled`` runs, and a model that goes on sending after it returns, a
        Python model's threads, holds none). An error ``start`` raises is the caller's (a
        refusal: nothing was admitted); one the producer sends later ends the stream. The
        request counts as done when its final response is sent, it fails, or it is cancelled.
        """
        if request.decode is not None:
            return self._decoded(request, lambda r: self.stream(r, start))
        if request.timeout and request.entry.queue is None:
            request.until(time.monotonic() + request.timeout)  # no queue policy reads it
        entry = request.entry
        decoupled = start is None  # the network's own decoupled run, on its streams
        if decoupled:
            start = self._decoupled_start(request)
        recorder = entry.recorder
        token = request.run
        charge = self._enter(request)
        assert charge is not None
        stream = ResponseStream(token, entry.name, request.outputs)
        if request.unread is not None:
            stream.max_items = max(stream.max_items, request.unread[0])
            stream.max_bytes = max(stream.max_bytes, request.unread[1])
        admitted = time.perf_counter()
        refused: list[BaseException] = []
        # a traced request's model span, from admission to its last response; a decoupled
        # run's wait in the queue and its run (infer_decoupled) under it
        stage = None
        if request.trace is not None:
            stage = Stage(request.trace, entry, request.checked, queued=decoupled)

        def ended(error: BaseException | None) -> None:
            if stage is not None:
                stage.set("plugserve.responses", stream.sent)
                stage.finished(error)
            self._leave(request, charge)
            if refused:
                recorder.refused("overloaded" if isinstance(error, ResourceExhausted) else "")
            elif error is None:
                recorder.success(0.0, time.perf_counter() - admitted)
            else:
                recorder.failure(failure_status(error))
                if isinstance(error, PlugserveError):
                    forget_frames(error)

        stream.when_ended(ended)
        try:  # the producer is handed the model's span: what it records opens under it (the
            # generation engine's queue, prefill and decode spans)
            start(stream, stage)  # the model's span (a Stage is one), or None
        except BaseException as exc:
            refused.append(exc)
            stream.fail(exc)
            raise
        return stream

    def _decoded(self, request: Request, then: Callable[[Request], Any]) -> Any:
        """``then(request)`` once its bytes are charged and its inputs decoded: for a
        protocol whose decoding allocates memory of its own (KServe's typed contents,
        strings), which must be charged before it is allocated. The charge is held until the
        request is answered. A charge that does not fit is ResourceExhausted, counted as the
        network's refusal."""
        entry = request.entry
        try:
            charge = self.budget.charge(request.holds, f"a request to network {entry.name!r}")
        except ResourceExhausted:
            entry.recorder.refused("overloaded")
            raise
        try:
            request.inputs, request.decode, request.holds = request.decode(), None, 0
            answer = then(request)
        except BaseException:
            charge.release()
            raise
        if isinstance(answer, ResponseStream):
            answer.when_ended(lambda _error: charge.release())
        else:
            answer.add_done_callback(lambda _: charge.release())
        return answer

    def _sequenced(self, request: Request) -> Future:
        """A request that names a sequence, or to a network that keeps sequences: its
        network's sequence batcher (or an ensemble's relay) admits it."""
        entry = request.entry
        step = request.step
        if entry.sequences is None:
            entry.recorder.refused("invalid")
            raise InvalidInput(
                f"inference request to model '{entry.name}' names a sequence (sequence_id "
                f"{step.id!r}), but the model has no sequence batching (Triton's "
                "sequence_batching in its config.pbtxt); send it without the sequence_* "
                "parameters"
            )
        hidden = sorted(entry.sequences.hidden_outputs.intersection(request.outputs or ()))
        try:
            if hidden:
                raise InvalidInput(
                    f"network {entry.name!r}: {listing(hidden)} are state outputs, which the "
                    "server keeps for the sequence; ask for the model's other outputs"
                )
            wanted = self._outputs(entry, request.outputs)
            if request.checked is not None:  # the batcher reads inputs by name: a client's
                request.inputs = dict(zip((s.name for s in entry.inputs), request.checked))
            return entry.sequences.submit(request, wanted)
        except ResourceExhausted:
            entry.recorder.refused("overloaded")
            raise
        except PlugserveError:
            entry.recorder.refused("invalid")
            raise

    def _admit(self, request: Request) -> Future | Finished:
        """Queue one plain inference (no sequence's) on its network's executor, or run it
        inline; what :meth:`infer` does for a request of no sequence, and what a sequence
        batcher admits each of its runs through (:meth:`admission`)."""
        entry = request.entry
        name = entry.name
        recorder = entry.recorder
        arrays, wanted = self._checked(request)
        executor = entry.executor
        most = self.max_answer_bytes
        budget = self.budget
        deadline = request.deadline
        after = request.after
        token = request.run
        admitted = time.perf_counter()
        gathers = entry.network.gathers  # its runs start when their batch does
        stage: Stage | None = None  # a traced request's model span, queue wait and run
        small = small_inputs(arrays)  # its run tells how long small requests run

        def run(device: InferRequest) -> dict[str, np.ndarray]:
            started = time.perf_counter()
            if token.error is not None:
                raise token.failure()
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"network {name!r}: the deadline passed while queued "
                    f"({started - admitted:.3f} s in the queue)"
                )
            if token.on_start is not None and not gathers:
                cancel.started(token)
            told = request.context(
                budget.free(),  # what an output its values size may hold at most
                0 if after is not None else most,  # shared memory: not in the answer
                wanted,
                name,
                None if stage is None else stage.running(),  # the span devices open theirs under
            )
            try:
                result = device.infer_checked(arrays, told)  # checked once, above
            except PlugserveError:
                raise
            except Exception as exc:  # the device's own failure: INTERNAL, naming it
                log.exception(
                    "network %s version %d on %s failed", name, entry.version, entry.device
                )
                raise InferenceError(
                    f"network {name!r} on {entry.device}: {type(exc).__name__}: {exc}"
                ) from exc
            answer = _answer(name, result, wanted, after, most)
            finished = time.perf_counter()
            took = finished - started
            entry.run_seconds += (took - entry.run_seconds) * 0.125
            if small:
                last = entry.small_run_seconds
                entry.small_run_seconds = took if last is None else last + (took - last) * 0.125
            if entry.perf_enabled:
                recorder.layers(device.get_performance_counts())
            recorder.success(started - admitted, finished - started)
            if stage is not None:
                stage.ran(answer)
            return answer

        charge = self._enter(request, reroute=True)
        if charge is None:  # reloaded since the caller's lookup: its replacement answers
            return self._readmit(request, arrays)
        ticket = None if entry.queue is None else self._ticket(request, charge)
        if request.trace is not None:
            stage = Stage(request.trace, entry, arrays)
        try:
            inline = request.inline
            if inline and entry.run_seconds > LONG_RUN:
                with blocked():
                    future = executor.run_inline(run)
            else:
                future = inline and executor.run_inline(run)
            if not future:
                place = ticket.place if ticket is not None else None
                if stage is not None:  # it waits in the queue: the trace shows its wait
                    stage.queued = True
                future = entry.waiting.submit(executor, run, request.tenant, token, place)
        except BaseException as exc:
            if ticket is not None:
                ticket.ended()
            self._leave(request, charge)
            recorder.refused("overloaded" if isinstance(exc, ResourceExhausted) else "")
            if stage is not None:
                stage.finished(exc)
            raise
        if ticket is not None:
            _follow(ticket, future, executor)
        if type(future) is Finished:  # ran inline: its callback would run now anyway
            self._finished(request, future, charge, stage)
        else:
            future.add_done_callback(lambda f: self._finished(request, f, charge, stage))
        return future

    def _checked(self, request: Request) -> tuple[list[Any], list[str]]:
        """The request's inputs as checked arrays in the network's order (once: a protocol's
        fast path may have done it), and the outputs it wants; a refusal counted as invalid."""
        entry = request.entry
        try:
            arrays = request.checked
            if arrays is None:
                arrays = check_inputs(entry.name, entry.network.inputs, request.inputs)
            if entry.max_batch_size > 0:
                _check_batch(entry.name, entry.max_batch_size, arrays)
            outputs = request.outputs
            return arrays, self._outputs(entry, outputs) if outputs else entry.output_names
        except PlugserveError:
            entry.recorder.refused("invalid")
            raise

    def _ticket(self, request: Request, charge: Charge) -> Ticket:
        """The request's place under its model's queue policies (Triton's: its level's bound
        and waiting timeout); a refusal releases what :meth:`_enter` took."""
        try:
            return request.entry.queue.enter(request.run, request.priority, request.timeout)
        except PlugserveError as exc:
            self._leave(request, charge)
            request.entry.recorder.refused("overloaded" if _overload(exc) else "")
            raise

    def _readmit(self, request: Request, arrays: list[Any]) -> Future | Finished:
        """``request``, whose network was replaced (a reload) after the caller's lookup, to
        the replacement: checked again against it, by name; unloaded, UNAVAILABLE."""
        entry = request.entry
        request.inputs = {spec.name: a for spec, a in zip(entry.network.inputs, arrays)}
        request.checked = None
        try:
            request.entry = self.get(entry.name, entry.version)
        except NotFound:  # unloaded while it was on its way: retried, it is answered anew
            raise Unloaded(
                f"network {entry.name!r} was unloaded while this request was on its way; retry"
            ) from None
        return self._admit(request)

    def _decoupled_start(self, request: Request) -> Callable[[ResponseStream, Stage | None], None]:
        """How :meth:`stream` starts a request to a network's own decoupled run: its inputs
        checked as :meth:`_admit` checks them, then ``infer_decoupled`` on its executor."""
        entry = request.entry
        name = entry.name
        arrays, wanted = self._checked(request)
        if request.outputs:
            request.outputs = wanted
        if entry.sequences is not None and not entry.sequences.relay:
            entry.recorder.refused("invalid")
            raise InvalidInput(
                f"network {name!r}: a sequence model's requests are not streamed as "
                "decoupled responses; send them as ordinary requests"
            )
        request.checked = arrays  # (what a traced request's span counts)
        token = request.run
        deadline = request.deadline
        budget = self.budget
        queue = entry.queue
        gathers = entry.network.gathers

        def start(stream: ResponseStream, stage: Stage | None = None) -> None:
            def run(device: InferRequest) -> None:
                if token.error is not None:
                    raise token.failure()
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"network {name!r}: the deadline passed while queued")
                if token.on_start is not None and not gathers:
                    cancel.started(token)
                # as it was: no answer's bound on a stream; the run's span, when traced
                told = request.context(
                    budget.free(), trace=None if stage is None else stage.running()
                )
                try:
                    device.infer_decoupled(arrays, stream, told)
                except PlugserveError as exc:
                    stream.fail(exc)
                except Exception as exc:  # the device's own failure: INTERNAL, naming it
                    log.exception("network %s on %s failed", name, entry.device)
                    stream.fail(
                        InferenceError(
                            f"network {name!r} on {entry.device}: {type(exc).__name__}: {exc}"
                        )
                    )
                finally:
                    if stage is not None:
                        stage.ran(None)

            ticket = (
                queue.enter(token, request.priority, request.timeout) if queue is not None else None
            )
            place = ticket.place if ticket is not None else None
            try:
                future = entry.waiting.submit(entry.executor, run, request.tenant, token, place)
            except BaseException:
                if ticket is not None:
                    ticket.ended()
                raise
            if ticket is not None:
                _follow(ticket, future, entry.executor)
            future.add_done_callback(lambda f: f.cancelled() or _fail_from(stream, f))

        return start

    # --- admission's bookkeeping, written once for every kind of request

    def _enter(self, request: Request, reroute: bool = False) -> Charge | None:
        """Admit ``request`` into the server: refused while draining; counted in flight (what
        draining and an unload wait for); its :attr:`Request.holds` charged to
        --max-inflight-bytes; its deadline watched. :meth:`_leave` undoes each, once.
        ``reroute``: None, and nothing done, when a reload or an unload retired its network
        since the caller's lookup (decided under the same lock as the count a retired
        network's close waits for)."""
        entry = request.entry
        with self._inflight_lock:
            if self.draining:
                raise ShuttingDown(
                    f"network {entry.name!r}: the server is shutting down; send the request "
                    "elsewhere"
                )
            if reroute and entry.retired:
                return None
            self._inflight += 1
            entry.inflight += 1
            tenants = entry.inflight_tenants
            tenants[request.tenant] = tenants.get(request.tenant, 0) + 1
        entry.last_used = time.monotonic()
        try:
            charge = self.budget.charge(request.holds, f"a request to network {entry.name!r}")
        except ResourceExhausted:
            self._count_out(request)
            entry.recorder.refused("overloaded")
            raise
        self._watch(entry.name, request.run, request.deadline)
        return charge

    def _leave(self, request: Request, charge: Charge) -> None:
        """The request is over (answered, failed, cancelled, or refused after :meth:`_enter`)."""
        token = request.run
        self.deadlines.forget(token)
        token.finish()
        charge.release()
        self._count_out(request)

    def _count_out(self, request: Request) -> None:
        entry = request.entry
        with self._inflight_lock:
            self._inflight -= 1
            entry.inflight -= 1
            tenants = entry.inflight_tenants
            left = tenants.get(request.tenant, 0) - 1
            if left > 0:
                tenants[request.tenant] = left
            else:
                tenants.pop(request.tenant, None)

    def _finished(
        self,
        request: Request,
        future: Future | Finished,
        charge: Charge,
        stage: Stage | None = None,
    ) -> None:
        """Successes are recorded where they ran; here the admitted ones that failed."""
        self._leave(request, charge)
        exc = future.exception()
        if stage is not None:
            stage.finished(exc)
        if exc is not None:
            request.entry.recorder.failure(failure_status(exc))
            if isinstance(exc, PlugserveError):  # an unexpected one is logged whole, later
                forget_frames(exc)

    def _watch(self, name: str, token: cancel.Token, deadline: float | None) -> None:
        """Have the deadline watch cancel ``token`` at the client's deadline or the server's
        --max-request-seconds, whichever comes first."""
        now = time.monotonic()
        limit = self.max_request_seconds
        server_end = now + limit if limit else float("inf")
        if deadline is not None and deadline <= server_end:
            self.deadlines.watch(token, deadline, _past_deadline, name, now)
        else:
            self.deadlines.watch(token, server_end, _past_limit, name, limit)

    def drain(self) -> None:
        """Refuse new requests and loads (UNAVAILABLE); admitted ones still run."""
        with self._inflight_lock:
            self.draining = True

    def wait_idle(self, timeout: float, give_up: threading.Event | None = None) -> int:
        """Wait until every admitted request finished and no load is running, at most
        ``timeout`` seconds (or until ``give_up`` is set); returns how many are left."""
        end = time.monotonic() + timeout
        while True:
            with self.table.lock:
                left = self._inflight + len(self.table.loading)
            if not left or time.monotonic() >= end or (give_up and give_up.is_set()):
                return left
            time.sleep(0.02)

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

    # --- what model control needs of the request path

    def admission(self, entry: LoadedNetwork) -> Callable[..., Future | Finished]:
        """How ``entry``'s sequence batcher (or an ensemble's relay) admits each run it makes:
        ``admit(inputs, outputs, deadline, inline, token, holds, after=None, checked=None,
        like=None, tenant="")``, a :class:`Request` of no sequence to ``entry`` through
        :meth:`_admit` (``like``: the request it runs for, whose id, parameters, sequence...
        its device is told; None: a run for several, of ``tenant``)."""

        def admit(
            inputs, outputs, deadline, inline, token, holds, after=None, checked=None, like=None,
            tenant="",
        ):  # fmt: skip
            request = Request(
                entry, inputs, outputs=outputs, checked=checked, deadline=deadline, run=token,
                holds=holds, inline=inline, after=after, protocol="sequence", like=like,
                tenant=tenant,
            )  # fmt: skip
            return self._admit(request)

        return admit

    def retire(self, entry: LoadedNetwork) -> None:
        """``entry`` was replaced (a reload): a request that reaches it from now on goes to
        its replacement (see :meth:`admit`)."""
        with self._inflight_lock:
            entry.retired = True

    def close(self) -> None:
        """Stop the deadline watches (model control's ``close`` stops the networks' streams)."""
        self.deadlines.close()
        self.queue_timeouts.close()
