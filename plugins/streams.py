"""A streams executor: N worker threads ("streams") fed from one bounded queue.

Each stream owns whatever per-thread backend state its network needs (``state_factory``), so
backends that are not re-entrant still run N requests at once. A full queue raises
:class:`ResourceExhausted` at once rather than blocking the caller.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from plugserve.plugins.api import FailedPrecondition, ResourceExhausted

__all__ = ["StreamsExecutor"]

_STOP = object()


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
        self._queue: queue.Queue[Any] = queue.Queue(queue_size or 64 * self.streams)
        self._state_factory = state_factory
        self._busy = 0
        self._lock = threading.Lock()
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
        return self._queue.qsize()

    def submit(self, fn: Callable[[Any], Any]) -> Future:
        """Queue ``fn(stream_state)``; its result or error lands in the returned future."""
        if self._closed:
            raise FailedPrecondition(f"{self.name}: executor is shut down")
        future: Future = Future()
        try:
            self._queue.put_nowait((fn, future))
        except queue.Full:
            raise ResourceExhausted(
                f"{self.name}: queue full ({self._queue.maxsize} requests waiting); retry later"
            ) from None
        return future

    def _work(self, index: int) -> None:
        state = self._state_factory(index) if self._state_factory else None
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._busy += 1
            try:
                future.set_result(fn(state))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._busy -= 1

    def shutdown(self, wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(_STOP)
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
