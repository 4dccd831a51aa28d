"""A streams executor: N worker threads ("streams") fed from one bounded queue.

Each stream owns whatever per-thread backend state its network needs (``state_factory``), so
backends that are not re-entrant still run N requests at once. A full queue raises
:class:`ResourceExhausted` at once rather than blocking the caller.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

from plugserve.plugins.api import Cancelled, FailedPrecondition, ResourceExhausted

__all__ = ["RequestFuture", "StreamsExecutor"]


class RequestFuture(Future):
    """A future whose cancellation reads as plugserve's typed :class:`Cancelled` error.

    ``concurrent.futures.CancelledError`` is not a plugserve error, so a caller mapping errors
    to statuses would report a cancelled request as an internal error.
    """

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except CancelledError:
            raise Cancelled("the request was cancelled before a stream ran it") from None


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
        self._pending: deque[tuple[Callable[[Any], Any], Future]] = deque()
        self._ready = threading.Condition()
        self._state_factory = state_factory
        self._busy = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"{name}-stream-{i}", daemon=True)
            for i in range(self.streams)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, fn: Callable[[Any], Any]) -> Future:
        """Queue ``fn(stream_state)``; its result or error lands in the returned future.

        Cancelling the future before a stream picks it up takes it out of the queue at once,
        so abandoned requests (a client gone, a deadline passed) free their place.
        """
        future: Future = RequestFuture()
        with self._ready:
            if self._closed:
                raise FailedPrecondition(f"{self.name}: executor is shut down")
            if len(self._pending) >= self.queue_size:
                raise ResourceExhausted(
                    f"{self.name}: queue full ({self.queue_size} requests waiting); retry later"
                )
            self._pending.append((fn, future))
            self._ready.notify()
        future.add_done_callback(self._discard)
        return future

    def _discard(self, future: Future) -> None:
        if not future.cancelled():
            return
        with self._ready:
            for i, item in enumerate(self._pending):
                if item[1] is future:
                    del self._pending[i]
                    return

    def _work(self, index: int) -> None:
        state = self._state_factory(index) if self._state_factory else None
        while True:
            with self._ready:
                while not self._pending and not self._closed:
                    self._ready.wait()
                if not self._pending:
                    return  # closed and drained
                fn, future = self._pending.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                self._busy += 1
            try:
                future.set_result(fn(state))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                with self._ready:
                    self._busy -= 1

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new work; the streams finish what is queued, then stop."""
        with self._ready:
            if self._closed:
                return
            self._closed = True
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
