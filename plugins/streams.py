"""A streams executor: N streams (worker threads and their backend state) fed from one bounded
queue. A worker thread is started when queued work first needs it, so a network that is idle,
or only ever run inline (below), keeps none.

Each stream owns whatever backend state its network needs (``state_factory``; a compiled
network's executor keeps one infer request per stream, as OpenVINO's streams executors do), so
backends that are not re-entrant still run N requests at once. A full queue raises
:class:`QueueFull` (a ResourceExhausted) at once rather than blocking the caller; a caller that
admits work under a tighter bound of its own (the server's ``--queue-size``) passes it as
``limit``.

A synchronous caller may run its request on its own thread when a stream is idle and nothing
is queued (:meth:`StreamsExecutor.run_inline`), the way OpenVINO's ``InferRequest::infer()``
runs the pipeline on the calling thread: the stream is still claimed, so at most N requests run
at once and none overtakes a queued one, but the two thread hand-offs of a queued request
(tens of microseconds each on a busy machine) are saved.

The queue is served in order of each request's ``place`` (Triton's priority levels: a smaller
number first, arrival order within one; the server's queue policies give it, see
``server/queue_policy.py``), and a request may be moved behind the others of its level
(:meth:`StreamsExecutor.delay`: Triton's DELAY) or taken out and failed
(:meth:`StreamsExecutor.reject`: its REJECT). Requests that all share one place (every network
without a policy) cost an append, as a plain FIFO. A queued request whose token is cancelled
(its deadline, its client gone) leaves the queue and its future holds the token's error at once:
an error, not a cancelled future, which ``asyncio.wrap_future`` would hand its awaiting REST
handler as its own cancellation (the answer was never written: 38 of 40 REST requests queued
past a 50 ms deadline got nothing within 60 s).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

from plugserve.plugins import cancel
from plugserve.plugins.errors import (
    BackendUnavailable,
    Cancelled,
    PlugserveError,
    QueueFull,
)

__all__ = ["Finished", "RequestFuture", "StreamsExecutor"]

_UNMADE = object()  # a stream whose state has not been made yet (None is a valid state)
#: why a shut-down executor refuses work: UNAVAILABLE (REST 503), which a client retries; its
#: network was unloaded or replaced, or the server is stopping (it was FAILED_PRECONDITION,
#: REST 400, which read as the client's fault under an unload)
SHUT_DOWN = "executor is shut down: its network was unloaded or the server is stopping; retry"
#: what :meth:`StreamsExecutor.delay` adds to a request's place: behind every request of its
#: priority level that has not been delayed, before the next level's (places are ``2 * level``)
DELAYED = 1


class RequestFuture(Future):
    """A future whose cancellation reads as plugserve's typed errors, and reaches a run that
    already started.

    ``concurrent.futures.CancelledError`` is not a plugserve error, so a caller mapping errors
    to statuses would report a cancelled request as an internal error; a future cancelled by
    its run's token (a deadline) raises that token's error. :meth:`cancel` of a running
    request cancels its token, so the run stops (see ``cancel.py``) and the future then holds
    the run's error; like ``Future.cancel`` it returns True only when the request never ran.
    """

    def __init__(self, token: cancel.Token | None = None) -> None:
        super().__init__()
        self.token = token

    def cancel(self) -> bool:
        if super().cancel():
            return True
        if self.token is not None and not self.done():
            self.token.cancel()
        return False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except CancelledError:
            raise self._cancelled_error() from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        except CancelledError:
            return self._cancelled_error()

    def _cancelled_error(self) -> PlugserveError:
        if self.token is not None and self.token.cancelled:
            return self.token.failure()
        return Cancelled("the request was cancelled before a stream ran it")


class Finished:
    """The outcome of an inline run, as the part of :class:`~concurrent.futures.Future`'s
    interface its callers use. It is known when made, so it needs none of a future's locking
    and notifying (five lock round trips per request: ~4 us of the ~60 a small REST request
    spends in Python here). It cannot be awaited through ``asyncio.wrap_future``; callers
    check ``done()``."""

    __slots__ = ("_exception", "_result")

    def __init__(self, result: Any = None, exception: BaseException | None = None) -> None:
        self._result = result
        self._exception = exception

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._exception

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        fn(self)


class StreamsExecutor:
    def __init__(
        self,
        name: str,
        streams: int,
        queue_size: int = 0,
        state_factory: Callable[[int], Any] | None = None,
    ) -> None:
        self.name = name
        self.streams = max(1, streams)
        self.queue_size = queue_size or 64 * self.streams
        #: (fn, future, stateless, place), in order of place, then arrival
        self._pending: deque[tuple[Callable[[Any], Any], Future, bool, int]] = deque()
        # the hot paths (run_inline, _release) take the lock itself: a Condition's ``with``
        # is two Python-level calls more per request
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)
        self._state_factory = state_factory
        self._states: list[Any] = [_UNMADE] * self.streams
        self._idle = list(range(self.streams - 1, -1, -1))  # stream indices free to claim
        self._closed = False
        #: Worker threads, started as queued work needs them (see :meth:`_grow`), and how
        #: many of them are running a request.
        self._threads: list[threading.Thread] = []
        self._running = 0

    @property
    def busy(self) -> int:
        return self.streams - len(self._idle)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(
        self,
        fn: Callable[[Any], Any],
        limit: int = 0,
        stateless: bool = False,
        token: cancel.Token | None = None,
        place: int = 0,
    ) -> RequestFuture:
        """Queue ``fn(stream_state)``; its result or error lands in the returned future.

        ``limit``: refuse when this many are already waiting (at most the executor's own
        queue size). ``stateless``: ``fn`` brings its own state (an in-process async request)
        and gets None, so a stream does not make state nobody uses. ``token``: the run's
        cancellation token, which ``fn`` answers to: cancelling the token takes a queued
        request out of the queue (its future then holds the token's error), and cancelling
        the future stops a running one. ``place``: where the request queues (smaller first;
        equal places in arrival order).

        Cancelling the future before a stream picks it up takes it out of the queue at once,
        so abandoned requests (a client gone, a deadline passed) free their place.
        """
        future = RequestFuture(token)
        bound = min(limit, self.queue_size) if limit else self.queue_size
        item = (fn, future, stateless, place)
        with self._ready:
            if self._closed:
                raise BackendUnavailable(f"{self.name}: {SHUT_DOWN}")
            pending = self._pending
            if len(pending) >= bound:
                raise QueueFull(
                    f"Exceeds maximum queue size: {self.name}: queue full ({bound} requests "
                    "waiting); retry later"
                )
            if not pending or pending[-1][3] <= place:
                pending.append(item)
            else:
                _insert(pending, item)
            self._grow()
            self._ready.notify()
        future.add_done_callback(self._discard)
        if token is not None:
            token.on_cancel(lambda: self._withdraw(future, token))
        return future

    def _withdraw(self, future: RequestFuture, token: cancel.Token) -> None:
        """``token`` was cancelled: a request still queued leaves the queue with its error; a
        running one is stopped by its token (the future is answered when the run ends)."""
        if self._take_out(future):
            with contextlib.suppress(InvalidStateError):
                future.set_exception(token.failure())

    def _take_out(self, future: Future) -> bool:
        """Remove ``future``'s request from the queue; False when it is not there (running,
        done, or never queued here)."""
        with self._ready:
            pending = self._pending
            for i, item in enumerate(pending):
                if item[1] is future:
                    del pending[i]
                    return True
        return False

    def reject(self, future: Future, error: BaseException) -> bool:
        """Fail a request that still waits with ``error`` (Triton's REJECT of a request past
        its queue timeout); False when a stream took it already (then it runs)."""
        if not self._take_out(future):
            return False
        with contextlib.suppress(InvalidStateError):
            future.set_exception(error)
        return True

    def delay(self, future: Future) -> bool:
        """Move a request that still waits behind every request of its place that was not
        delayed (Triton's DELAY); False when a stream took it already."""
        with self._ready:
            pending = self._pending
            for i, item in enumerate(pending):
                if item[1] is future:
                    if item[3] & DELAYED:
                        return True
                    del pending[i]
                    _insert(pending, (*item[:3], item[3] | DELAYED))
                    return True
        return False

    def _grow(self) -> None:
        """A worker thread more when the queue holds more requests than the workers not
        running one can take, up to one per stream (call with the lock held). An executor
        only ever run inline (unary calls while a stream is idle, in-process ``infer``) starts
        none: a server of hundreds of mostly idle networks kept a sleeping thread per stream
        of each (300 ORT networks: 300 threads of its 614)."""
        free = len(self._threads) - self._running
        if len(self._pending) > free and len(self._threads) < self.streams:
            thread = threading.Thread(
                target=self._work, name=f"{self.name}-stream-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def run_inline(self, fn: Callable[[Any], Any]) -> Finished | None:
        """Run ``fn(stream_state)`` on the calling thread if a stream is idle and nothing is
        queued; its outcome, or None when the caller should :meth:`submit` instead."""
        with self._lock:
            if self._closed:
                raise BackendUnavailable(f"{self.name}: {SHUT_DOWN}")
            if self._pending or not self._idle:
                return None
            index = self._idle.pop()
        try:
            state = self._states[index]
            return Finished(fn(state if state is not _UNMADE else self._state(index)))
        except BaseException as exc:
            return Finished(exception=exc)
        finally:
            self._release(index)

    def each_stream(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(stream_state)`` on every stream in turn, on the calling thread, each stream's
        state made now if it was not: what a load does before the network serves (Triton's
        ``model_warmup`` runs on every instance; TORCH's and GPU's stream states capture their
        listed CUDA graph shapes when made). Each stream is claimed while ``fn`` runs on it;
        one that is busy is waited for (at a load nothing else runs)."""
        results = []
        for index in range(self.streams):
            with self._ready:
                while self._closed or index not in self._idle:
                    if self._closed:
                        raise BackendUnavailable(f"{self.name}: {SHUT_DOWN}")
                    self._ready.wait(0.1)
                self._idle.remove(index)
            try:
                results.append(fn(self._state(index)))
            finally:
                self._release(index)
        return results

    def _run(self, fn: Callable[[Any], Any], future: Future, index: int, stateless: bool) -> None:
        """``fn`` on stream ``index`` (claimed by the worker), its outcome into ``future``,
        then the stream and the worker are free again."""
        try:
            future.set_result(fn(None if stateless else self._state(index)))
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            self._release(index, worker=True)

    def _state(self, index: int) -> Any:
        """The stream's backend state, made on first use by whichever thread runs it first
        (only one thread at a time holds a stream)."""
        if self._states[index] is _UNMADE:
            factory = self._state_factory
            self._states[index] = factory(index) if factory is not None else None
        return self._states[index]

    def _release(self, index: int, worker: bool = False) -> None:
        with self._lock:
            self._idle.append(index)
            if worker:
                self._running -= 1
            if self._pending or self._closed:
                self._ready.notify()

    def _discard(self, future: Future) -> None:
        if future.cancelled():
            self._take_out(future)

    def _work(self) -> None:
        while True:
            with self._ready:
                while not (self._pending and self._idle) and not (
                    self._closed and not self._pending
                ):
                    self._ready.wait()
                if not self._pending:
                    self._ready.notify()  # closed and drained: let the next worker see it
                    return
                fn, future, stateless, _ = self._pending.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                index = self._idle.pop()
                self._running += 1
                if self._pending and self._idle:
                    self._ready.notify()  # more work a sleeping stream can take now
            self._run(fn, future, index, stateless)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work; the streams finish what is queued, then stop."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        if wait:
            with self._ready:
                threads = list(self._threads)
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


def _insert(pending: deque, item: tuple) -> None:
    """``item`` into ``pending`` after every request whose place is not after its own (the
    queue is at most a few hundred long: a scan from the end)."""
    place = item[3]
    index = len(pending)
    while index and pending[index - 1][3] > place:
        index -= 1
    pending.insert(index, item)
