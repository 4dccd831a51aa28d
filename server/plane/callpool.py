"""The gRPC server's handler threads: a few run calls, more start only when those are stuck.

grpcio's synchronous server hands every call to a thread pool. With Python's
``ThreadPoolExecutor`` of ``--grpc-workers`` (64) threads, 16 small calls in flight keep 16
threads running Python at once; they contend for the GIL, and each call wakes a sleeping
thread. On these 2-core machines a context switch is dear, and that contention cost plugserve
a third of its small-request throughput: the same server with 6 threads served ~1.4x the
requests/s, and with 2 (one per core) ~1.75x that again (BENCHMARKS.md, issue 22). A small
fixed pool is no answer either: a call can hold its thread for long without running (a stream,
a request waiting for its turn on a busy network, a client that never sends its message), and
a few of those would stop every other client.

So this pool lets ``allowed`` threads run calls, ``active`` of them while the queue moves:

- A call arriving while fewer than ``allowed`` threads run goes to the longest idle thread
  or a new one (handing it to the thread that went idle last measured ~0.1 ms slower at
  concurrency 1: that thread is often still on its way to sleep); otherwise it waits in the
  queue for the next thread to finish, which takes it without sleeping.
- A thread that waits on something other than the CPU says so with :func:`blocked` (every
  stream, a unary call whose run was queued, and a long run inline, which the device computes
  without the GIL: see ``dataplane.LONG_RUN``): it stops counting as running while it waits,
  so another call may start.
- When no call has started for ``stall`` seconds while calls wait (the running threads are
  stuck in something nobody declared: a silent client, say), one more thread is allowed, up to
  ``max_workers``. A queue that is long but moving is not stuck, and gets no more threads.
  Each time a thread finds the queue empty the allowance shrinks back by one toward
  ``active``; threads beyond ``active`` exit after ``linger`` seconds idle, the first
  ``active`` stay for good (their untimed wait measured a few per cent faster per call at
  concurrency 1 than a timed one).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from concurrent import futures
from typing import Any

from plugserve.plugins.threads import start_daemon

__all__ = ["CallPool", "blocked"]

_here = threading.local()


class _Blocked:
    """The calling pool thread, while inside, does not count as running."""

    __slots__ = ("pool",)

    def __enter__(self) -> None:
        self.pool = getattr(_here, "pool", None)
        if self.pool is not None:
            self.pool._block()

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool._unblock()


def blocked() -> _Blocked:
    """A context for a wait that does not use the CPU (nothing outside a pool thread)."""
    return _Blocked()


class _Item:
    __slots__ = ("args", "fn", "future", "kwargs", "queued")

    def __init__(self, future: futures.Future, fn: Any, args: tuple, kwargs: dict) -> None:
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.queued = time.monotonic()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class _Worker:
    __slots__ = ("core", "item", "wake")

    def __init__(self, item: _Item, core: bool) -> None:
        self.core = core  # one of the first ``active`` threads: it stays for good
        self.item: _Item | None = item
        self.wake = threading.Lock()
        self.wake.acquire()  # released (under the pool's lock) with an item to run


class CallPool(futures.Executor):
    """See the module's docstring."""

    def __init__(
        self,
        max_workers: int,
        active: int,
        stall: float = 0.005,
        linger: float = 30.0,
        name: str = "grpc",
    ) -> None:
        self.max_workers = max(1, max_workers)
        self.active = max(1, min(active, self.max_workers))
        self.stall = stall
        self.linger = linger
        self.name = name
        self._lock = threading.Lock()
        self._queue: collections.deque[_Item] = collections.deque()
        self._idle: collections.deque[_Worker] = collections.deque()  # the longest idle first
        self._threads = 0
        self._cores = 0  # threads that never leave (at most ``active``)
        self._running = 0  # threads running a call, outside blocked()
        self._allowed = self.active  # how many may run; more while the queue is stuck
        self._moved = 0.0  # when a call last started
        self._last = 0.0  # when a call last came
        self._closed = False
        self._stalls = threading.Condition(self._lock)
        self._watching = False
        self._resting = False  # the watcher waits for a call to be queued
        self._napping = False  # the watcher waits out its 0.1 s look, no call queued
        self._ids = itertools.count()

    @property
    def threads(self) -> int:
        return self._threads

    # --- Executor

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> futures.Future:
        future: futures.Future = futures.Future()
        item = _Item(future, fn, args, kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: cannot take calls after shutdown")
            self._queue.append(item)
            self._last = item.queued
            self._fill()
            if self._queue:
                if self._resting or self._napping:  # (looking again only in 0.1 s: now)
                    self._stalls.notify()
                elif not self._watching:
                    self._watching = True
                    start_daemon(f"{self.name}-stalls", self._watcher)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            dropped = list(self._queue) if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
            idle, self._idle = self._idle, collections.deque()
            for worker in idle:
                self._threads -= 1
                self._cores -= worker.core
                worker.wake.release()  # with no item: exit
            self._stalls.notify_all()
        for item in dropped:
            item.future.cancel()
        if wait:
            end = time.monotonic() + 60
            while self._threads and time.monotonic() < end:
                time.sleep(0.01)

    # --- under the lock

    def _take(self) -> _Item:
        self._moved = time.monotonic()
        return self._queue.popleft()

    def _start(self) -> bool:
        """The oldest queued call to the longest idle thread or a new one."""
        if self._idle:
            worker = self._idle.popleft()
            worker.item = self._take()
            self._running += 1
            worker.wake.release()
            return True
        if self._threads >= self.max_workers:
            return False
        worker = _Worker(self._take(), self._cores < self.active)
        self._cores += worker.core
        self._threads += 1
        self._running += 1
        start_daemon(f"{self.name}-{next(self._ids)}", self._work, worker)
        return True

    def _fill(self) -> None:
        """Start queued calls while fewer than ``allowed`` threads run them."""
        while self._queue and self._running < self._allowed and self._start():
            pass

    # --- threads

    def _work(self, worker: _Worker) -> None:
        _here.pool = self
        item = worker.item
        worker.item = None
        while item is not None:
            item.run()
            item = None
            with self._lock:
                if self._queue and self._running <= self._allowed:
                    item = self._take()
                    continue
                self._running -= 1
                if self._allowed > self.active and not self._queue:
                    self._allowed -= 1
                if self._closed:
                    self._threads -= 1
                    self._cores -= worker.core
                    return
                self._idle.append(worker)
            item = self._idle_wait(worker)

    def _idle_wait(self, worker: _Worker) -> _Item | None:
        """The next call handed to this thread, or None once it should exit."""
        woken = worker.wake.acquire(timeout=-1 if worker.core else self.linger)
        with self._lock:
            if not woken and worker.item is not None:
                woken = worker.wake.acquire(blocking=False)  # released under this lock
            if woken:
                item, worker.item = worker.item, None
                return item  # None: shut down
            self._idle.remove(worker)
            self._threads -= 1
            return None

    def _watcher(self) -> None:
        """Allows one more thread each time calls wait and none has started for ``stall``.
        It looks every 0.1 s while calls come, and rests (until a call is queued) after a
        second without any."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                if self._queue:
                    still = now - max(self._moved, self._queue[0].queued)
                    if still < self.stall:
                        self._stalls.wait(self.stall - still)
                    elif self._allowed < self.max_workers:
                        self._allowed += 1
                        self._fill()
                    else:  # every thread there may be is stuck: wait for one to finish
                        self._stalls.wait(self.stall)
                elif now - self._last < 1.0:
                    # a call queued meanwhile wakes it: a small call behind long ones waited
                    # up to this nap (~50 ms on average) for its thread, not ``stall``
                    self._napping = True
                    self._stalls.wait(0.1)
                    self._napping = False
                else:
                    self._resting = True
                    self._stalls.wait()
                    self._resting = False
            self._watching = False

    def _block(self) -> None:
        with self._lock:
            self._running -= 1
            self._fill()

    def _unblock(self) -> None:
        with self._lock:
            self._running += 1
