"""One decoupled request's responses, between the thread that makes them and the protocol that
sends them (``plugins/responses.py`` is the producer's interface; this is the server's side).

The producer (a Python model's worker process, through its reader; the generation engine's
loop; a network's stream) calls :meth:`ResponseStream.send` from any thread and never blocks:
a producer serves many requests, and one slow client must not stall the others. What is sent
waits in the stream until the protocol's consumer takes it: blocking iteration on a gRPC
thread (``for item, final in stream``), ``async for`` on the REST event loop, or a listener
that wakes a stream pump. The buffer is bounded: a consumer that leaves more than
``MAX_ITEMS`` responses or ``MAX_BYTES`` of them unread has its request cancelled
(ResourceExhausted, "not reading its responses"), so a client that stops reading costs the
server a bounded amount of memory, never an unbounded one. A response counts its tensors'
bytes and its strings' (an object array's ``nbytes`` is only its pointers); any other item its
own ``nbytes`` (a generation event's Python size). A producer may tighten the bounds before its
first send (a generation stream holds 1 MiB: ``server/apps/generate/limits.py``), and bound the
time a response may wait unread (:attr:`ResponseStream.max_wait`, checked at each send: a
generation stream's is --request-read-timeout).

The request's cancellation token is the stream's: the client going away, its deadline or the
server's limit cancel the token, which ends the stream with the token's error (the consumer
raises it), tells the producer (:attr:`cancelled`, :meth:`on_cancel`: a Python model's
``is_cancelled()``, the engine freeing the sequence's cache at its next step), and makes
further sends return False. The stream ends exactly once (final response, failure or
cancellation); :meth:`when_ended` callbacks then run once (the data plane's accounting).

An event loop's consumer (:meth:`ResponseStream.batches`) is woken once per batch, not once
per response: a send wakes it only if it waits (armed, its queue empty), and the wake-ups of
all the streams one loop consumes go through that loop's :class:`_Wakeups`, one
``call_soon_threadsafe`` for all that producers send until the loop runs them (the engine
sends a token to each of 32 streams in a step: counted at 32 streams, 17 streams a wake on
average, 216 of 1,000 wakes all 32, where there were 32 handles and 32 task wake-ups through
``asyncio.Event`` a step; the loop runs whenever the step lets the GIL go). Each wake then
takes everything queued. Measured with ``tests/benchmarks/bench_stream_cost.py`` (the HTTP
thread's share per streamed token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Cancelled,
    InferenceError,
    PlugserveError,
    ResourceExhausted,
    Response,
    ResponseSender,
)

__all__ = ["MAX_BYTES", "MAX_ITEMS", "ResponseStream"]

log = logging.getLogger(__name__)

#: responses a stream holds unread at most, by count and by bytes (a generated token is one
#: small response; a decoupled model's tensors may be large)
MAX_ITEMS = 4096
MAX_BYTES = 64 << 20


_OBJECT = np.dtype(object)


class _Wakeups:
    """The wake-ups one event loop's consumers wait for, posted from producers' threads: the
    first posted since the loop last ran them asks the loop to run them (one
    ``call_soon_threadsafe``), the others join it; the loop then resolves them all at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Future[None] | Callable[[], object]] = []

    def post(self, waiter: asyncio.Future[None] | Callable[[], object]) -> None:
        with self._lock:
            self._due.append(waiter)
            if len(self._due) > 1:  # the loop is already asked to run them
                return
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for waiter in due:
            if not isinstance(waiter, asyncio.Future):
                try:  # a callback (caller()): one that fails must not stop the others
                    waiter()
                except Exception:
                    log.exception("a stream's consumer failed")
            elif not waiter.done():  # (a consumer cancelled meanwhile)
                waiter.set_result(None)


_local = threading.local()


def _wakeups(loop: asyncio.AbstractEventLoop) -> _Wakeups:
    """The running ``loop``'s :class:`_Wakeups` (a loop runs on one thread: kept per thread)."""
    wakeups = getattr(_local, "wakeups", None)
    if wakeups is None or wakeups.loop is not loop:
        wakeups = _local.wakeups = _Wakeups(loop)
    return wakeups


def _size(item: Any) -> int:
    """What ``item`` holds as the buffer counts it (see the module's docstring)."""
    if not isinstance(item, Response):
        return int(getattr(item, "nbytes", 0))
    total = 0
    for value in item.outputs.values():
        total += getattr(value, "nbytes", 0)
        if getattr(value, "dtype", None) == _OBJECT:  # each element an object of its own
            total += 64 * value.size
            if value.size <= 4096:  # (more: the count above, not a walk on the producer)
                total += sum(len(v) for v in value.flat if isinstance(v, bytes | str))
    return total


class ResponseStream(ResponseSender):
    """The responses of one request: the producer sends, the protocol consumes."""

    def __init__(
        self,
        token: cancel.Token,
        name: str,
        outputs: list[str] | None = None,
        max_items: int = MAX_ITEMS,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        """``token``: the request's cancellation; ``name``: its network, for messages;
        ``outputs``: the outputs the client asked for (a :class:`Response`'s others are left
        out; None: all)."""
        self.token = token
        self.name = name
        self.wanted = set(outputs) if outputs else None
        self.max_items, self.max_bytes = max_items, max_bytes
        #: seconds a response may wait unread before the request is cancelled, checked at each
        #: send (0: no bound; a generation stream's is --request-read-timeout)
        self.max_wait = 0.0
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[tuple[Any, bool]] = deque()
        self._bytes = 0
        self._waiting_since = 0.0  # when the oldest unread item came (0: none waits)
        self._ended = False  # the final response was sent, or the stream failed
        self._error: BaseException | None = None
        self._taken_final = False  # the consumer took the last item (or the error)
        self._listeners: list[Callable[[], object]] = []
        #: an event loop's consumer waiting for the next item (see _Wakeups)
        self._waiter: tuple[_Wakeups, Any] | None = None
        self._sleeping = 0  # blocking consumers waiting on the condition (see __iter__)
        self._on_end: list[Callable[[BaseException | None], object]] = []
        #: responses sent so far (the consumer may not have read them all)
        self.sent = 0
        self._unhook = token.on_cancel(self._cancelled_by_token)

    # --- the producer's side

    @property
    def cancelled(self) -> bool:
        return self._ended or self.token.error is not None

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        return self.token.on_cancel(callback)

    def send(self, item: Any = None, final: bool = False) -> bool:
        if self.wanted is not None and isinstance(item, Response):
            item.outputs = {k: v for k, v in item.outputs.items() if k in self.wanted}
        size = _size(item) if item is not None else 0
        stalled = 0.0
        with self._cond:
            if self._ended:
                return False
            if item is not None or final:
                self._items.append((item, final))
                self._bytes += size
                self.sent += item is not None
                if self.max_wait:
                    now = time.monotonic()
                    if not self._waiting_since:
                        self._waiting_since = now
                    elif now - self._waiting_since > self.max_wait:
                        stalled = now - self._waiting_since
            overflow = len(self._items) > self.max_items or self._bytes > self.max_bytes or stalled
            if final and not overflow:
                self._ended = True
            if self._sleeping:  # a blocking consumer (a gRPC thread) waits
                self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter[0].post(waiter[1])
        if overflow:
            if stalled:
                why = (
                    f"its oldest unread response has waited {stalled:.1f} s; at most "
                    f"{self.max_wait:g} s may"
                )
            else:
                why = f"at most {self.max_items} or {self.max_bytes:,} bytes may"
            self.token.cancel(
                ResourceExhausted(
                    f"network {self.name!r}: stopped, the client is not reading its responses "
                    f"({len(self._items)} responses, {self._bytes:,} bytes wait unread; {why})"
                )
            )
            return False
        self._wake()
        if final:
            self._end(None)
        return True

    def fail(self, error: BaseException, drop: bool = False) -> None:
        """End the stream with ``error``, after what waits unread (``drop``: instead of it)."""
        if not isinstance(error, PlugserveError):
            error = InferenceError(f"network {self.name!r}: {type(error).__name__}: {error}")
        with self._cond:
            if self._ended:
                return
            self._ended = True
            self._error = error
            if drop:
                self._items.clear()
                self._bytes = 0
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter[0].post(waiter[1])
        self._wake()
        self._end(error)

    def _cancelled_by_token(self) -> None:
        """The request was cancelled (its client gone or not reading, its deadline, the
        server's limit): what waits unread is dropped now, not when the last reference to
        the stream goes (the responses of four unread streams held 16,000 descriptors after
        their clients had left). Unless the final response waits among them: then they are
        the whole answer, which a consumer still reading takes (a final response past the
        bound is delivered whatever its size)."""
        with self._cond:
            complete = bool(self._items) and self._items[-1][1]
        error = self.token.error or Cancelled(f"network {self.name!r}: cancelled")
        self.fail(error, drop=not complete)

    def when_ended(self, callback: Callable[[BaseException | None], object]) -> None:
        """Call ``callback(error or None)`` once the stream has ended (at once if it has)."""
        with self._cond:
            if not self._ended:
                self._on_end.append(callback)
                return
            error = self._error
        callback(error)

    def _end(self, error: BaseException | None) -> None:
        self._unhook()
        with self._cond:
            callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            callback(error)

    # --- the consumer's side

    @property
    def ended(self) -> bool:
        """Nothing more will be sent (there may still be items to take)."""
        return self._ended

    def add_listener(self, listener: Callable[[], object]) -> None:
        """Call ``listener()`` (on the producer's thread; it must not block) whenever an item
        or the end arrives; at once if one is waiting."""
        with self._cond:
            self._listeners.append(listener)
            ready = bool(self._items) or self._ended
        if ready:
            listener()

    def _wake(self) -> None:
        for listener in self._listeners:
            listener()

    def take(
        self, waiter: tuple[_Wakeups, Any] | None = None, always: bool = False
    ) -> list[tuple[Any, bool]]:
        """What waits now, without blocking: ``[(item, final), ...]``; raises the stream's
        error once its items are taken. An empty list: nothing yet (or the stream is over);
        then ``waiter``, if given, is posted when the next item or the end comes (``always``:
        armed whatever was taken, the taker going on with the next item that comes)."""
        with self._cond:
            if waiter is not None and not self._ended and (always or not self._items):
                self._waiter = waiter
            if self._items:
                items = list(self._items)
                self._items.clear()
                self._bytes = 0
                self._waiting_since = 0.0
                if items[-1][1]:
                    self._taken_final = True
                    self._listeners = []  # (a pump's listener holds the request it answers)
                return items
            error = self._error
            if error is not None and not self._taken_final:
                self._taken_final = True
                self._listeners = []
                raise error
        return []

    @property
    def exhausted(self) -> bool:
        """The consumer has taken everything, the end included."""
        return self._taken_final or (self._ended and self._error is None and not self._items)

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        """``(item, final)`` until the final one; raises the error the stream ended with."""
        while True:
            with self._cond:
                while not self._items and not self._ended:
                    self._sleeping += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._sleeping -= 1
            items = self.take()
            yield from items
            if self.exhausted:
                return

    def caller(self, callback: Callable[[], object]) -> tuple[_Wakeups, Any]:
        """On an event loop's thread: what :meth:`take` arms to have ``callback()`` called on
        that loop once the next item or the end comes (with the other streams' wake-ups of
        the same batch: see the module's docstring)."""
        return (_wakeups(asyncio.get_running_loop()), callback)

    async def __aiter__(self) -> AsyncIterator[tuple[Any, bool]]:
        async for items in self.batches():
            for item in items:
                yield item

    async def batches(self) -> AsyncIterator[list[tuple[Any, bool]]]:
        """On an event loop: everything that waits, a list at a time, until the final item;
        raises the error the stream ended with. A wait is woken once however many items come
        meanwhile (see the module's docstring)."""
        loop = asyncio.get_running_loop()
        wakeups = _wakeups(loop)
        while True:
            waiter = loop.create_future()  # (armed only if nothing waits)
            items = self.take((wakeups, waiter))
            if items:
                yield items
            if self.exhausted:
                return
            if not items:
                await waiter

    def cancel(self, error: PlugserveError | None = None) -> None:
        """The consumer is gone: cancel the request (the producer hears it)."""
        self.token.cancel(error or Cancelled(f"network {self.name!r}: the client went away"))
