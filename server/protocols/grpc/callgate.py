"""Bounds on what an open gRPC call may hold, for the thread-pool server.

grpcio's synchronous server runs each call on a pool thread from the moment its headers arrive:
a unary method's thread waits there for the request message, a streaming method's thread for
as long as the stream is open. A peer that opens calls and sends nothing therefore holds
threads, and a few dozen such calls used to stop every client, health probes included. The
thread-pool server is kept because its per-call overhead is the lowest measured (BENCHMARKS.md);
this gate makes an idle call cheap to get rid of instead:

- Unary methods are served as client-streaming ones, so the handler runs at once and reads the
  one message itself. While more than ``read_slots`` calls wait for their message, the ones
  waiting longest are cancelled once they have waited ``EVICT_AFTER`` seconds (a real client's
  message follows its headers within milliseconds), on the next call's arrival or by the
  watchdog; a burst of real calls is never refused. A message not there after
  ``read_timeout`` cancels the call.
- Streaming calls (InferStream, ModelStreamInfer, health Watch) are at most ``max_streams``
  at once, the rest of the pool staying for unary calls; beyond, RESOURCE_EXHAUSTED. A stream
  that sends no message for ``idle_timeout`` seconds is cancelled.
- Server keepalive pings find peers that vanished without closing (see ``server_options``).

One watchdog thread per gate enforces the timeouts; its work is bounded by the slots. The
gate wraps each method's handler once, where it is registered (``wrapping.py``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from plugserve.plugins.threads import start_daemon
from plugserve.server.plane.callpool import blocked

__all__ = ["CallGate", "keepalive_options"]

#: A call waiting this long for its request message may be cancelled to make room.
EVICT_AFTER = 0.5

_NO_MESSAGE = object()


def keepalive_options(idle_timeout: float) -> list[tuple[str, int]]:
    """Server pings an idle connection every minute and closes it when the peer does not answer
    in 20 s (a half-open peer); a connection with no call for ``idle_timeout`` is closed."""
    options = [
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # clients' own keepalives (tritonclient sends them when asked) are not abuse
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    if idle_timeout > 0:
        options.append(("grpc.max_connection_idle_ms", int(idle_timeout * 1000)))
    return options


class _Open:
    """One call the gate watches: since when it waits, and how to end it."""

    __slots__ = ("context", "since")

    def __init__(self, context: grpc.ServicerContext) -> None:
        self.context = context
        self.since = time.monotonic()


class CallGate:
    """Wraps every method handler of a server (see the module's docstring)."""

    def __init__(
        self,
        max_streams: int,
        read_slots: int,
        read_timeout: float,
        idle_timeout: float,
        name: str = "grpc",
    ) -> None:
        self.max_streams = max_streams
        self.read_slots = max(1, read_slots)
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._reading: dict[int, _Open] = {}  # insertion order: the longest waiting first
        self._streams: dict[int, _Open] = {}
        self._stop = threading.Event()
        self._watchdog = start_daemon(f"{name}-gate", self._watch)

    def close(self) -> None:
        self._stop.set()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # --- wrapping, once per method

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary
            if handler.response_streaming:
                return grpc.stream_stream_rpc_method_handler(self._streaming(behavior), **kwargs)
            return grpc.stream_unary_rpc_method_handler(self._stream_unary(behavior), **kwargs)
        if handler.response_streaming:
            unary_stream = handler.unary_stream

            def first_then_stream(requests: Iterator[Any], context: grpc.ServicerContext):
                request = self._first(requests, context)
                if request is not _NO_MESSAGE:
                    with blocked():  # health's Watch: open for as long as its client likes
                        yield from unary_stream(request, context)

            return grpc.stream_stream_rpc_method_handler(first_then_stream, **kwargs)
        unary_unary = handler.unary_unary

        def first_then_answer(requests: Iterator[Any], context: grpc.ServicerContext):
            request = self._first(requests, context)
            return None if request is _NO_MESSAGE else unary_unary(request, context)

        return grpc.stream_unary_rpc_method_handler(first_then_answer, **kwargs)

    # --- unary calls: the one message, read under a slot

    def _first(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        key = next(self._ids)
        with self._lock:
            self._reading[key] = _Open(context)
            evicted = self._evict(time.monotonic())
        for late in evicted:
            late.cancel()
        try:
            request = next(requests, _NO_MESSAGE)
        except grpc.RpcError:  # cancelled: evicted, timed out, or the client went away
            return _NO_MESSAGE
        finally:
            with self._lock:
                self._reading.pop(key, None)
        if request is _NO_MESSAGE and context.is_active():
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "a unary call needs one request message")
        return request

    def _evict(self, now: float) -> list[grpc.ServicerContext]:
        """Over ``read_slots`` waiting calls: the ones waiting longest, if over EVICT_AFTER.
        A burst of real calls is never refused (each waits for milliseconds at most)."""
        evicted = []
        while len(self._reading) > self.read_slots:
            key, oldest = next(iter(self._reading.items()))
            if now - oldest.since < EVICT_AFTER:
                break
            del self._reading[key]
            evicted.append(oldest.context)
        return evicted

    # --- streaming calls: a bounded number, each cancelled when idle

    def _admit_stream(self, context: grpc.ServicerContext) -> tuple[int, _Open]:
        key = next(self._ids)
        watched = _Open(context)
        with self._lock:
            full = len(self._streams) >= self.max_streams
            if not full:
                self._streams[key] = watched
        if full:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_streams} streams are open (--max-open-streams); close one or "
                "send unary requests",
            )
        context.add_callback(lambda: self._release(key))
        return key, watched

    def _release(self, key: int) -> None:
        with self._lock:
            self._streams.pop(key, None)

    @staticmethod
    def _touching(requests: Iterator[Any], watched: _Open) -> Iterator[Any]:
        for request in requests:
            watched.since = time.monotonic()
            yield request

    def _streaming(self, behavior: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def gated(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            key, watched = self._admit_stream(context)
            try:
                with blocked():  # a stream mostly waits: its requests run on other threads
                    yield from behavior(self._touching(requests, watched), context)
            finally:
                self._release(key)

        gated.client_stream = True  # type: ignore[attr-defined]  # (tenant_calls.py reads it)
        return gated

    def _stream_unary(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def gated(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            key, watched = self._admit_stream(context)
            try:
                with blocked():
                    return behavior(self._touching(requests, watched), context)
            finally:
                self._release(key)

        gated.client_stream = True  # type: ignore[attr-defined]
        return gated

    # --- timeouts

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                late = self._evict(now) + [
                    w.context
                    for limit, calls in (
                        (self.read_timeout, self._reading),
                        (self.idle_timeout, self._streams),
                    )
                    if limit > 0
                    for w in calls.values()
                    if now - w.since > limit
                ]
            for context in late:
                context.cancel()
