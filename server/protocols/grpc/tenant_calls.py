"""The gRPC calls one tenant may have running at once (``--grpc-token-calls``).

grpcio's thread-pool server runs each call on one of --grpc-workers threads for as long as its
handler runs: a unary call whose request waits in a busy network's queue holds its thread
until it is answered. With tokens, a red team's tenant sent 40 slow calls at a one-stream
model under --grpc-workers 8: another tenant's call to an unrelated model waited 13.7 s for a
thread. REST bounds a token's requests in flight (--http-token-requests); this is gRPC's: a
token's tenant may have at most its share of the threads running its calls (by default:
``plane/shares.py``, seven eighths alone, less as more tenants have calls running), a call
past it RESOURCE_EXHAUSTED as soon as it gets a thread, so that another tenant always finds
one. Calls without a tenant (open health checks, a server without tokens) are not counted.

The bound wraps a call's handler as the auth interceptor lets it through (``auth.py``): only
with tokens, a closure a call.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from plugserve.server.plane import shares

__all__ = ["TenantCalls"]


class TenantCalls:
    """Running calls by tenant, at most ``most`` each (-1: each its share of ``threads``; 0:
    no bound), and of them the streams a client sends requests on (ModelStreamInfer) each its
    share of ``streams``, the server's --max-open-streams (0: no bound): one tenant's 32
    streams had taken them all, another's refused 10 of 10 (a red team's)."""

    def __init__(self, most: int, threads: int = 0, streams: int = 0) -> None:
        self.most = most
        self.threads = threads
        self.streams = streams
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()
        self._streams: Counter[str] = Counter()

    def bounded(self, handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
        """``handler`` counted against ``tenant``'s calls while it runs."""
        if handler is None or not tenant:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._plain(handler.unary_unary, tenant))
        # a stream a client sends requests on, as the call gate counts it (every unary call
        # reaches here as stream-unary too: the gate reads its one message)
        if handler.stream_unary is not None:
            stream = getattr(handler.stream_unary, "client_stream", False)
            stream_unary = self._plain(handler.stream_unary, tenant, stream)
            return handler._replace(stream_unary=stream_unary)
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streamed(handler.unary_stream, tenant))
        stream = getattr(handler.stream_stream, "client_stream", False)
        stream_stream = self._streamed(handler.stream_stream, tenant, stream)
        return handler._replace(stream_stream=stream_stream)

    def _enter(self, tenant: str, context: grpc.ServicerContext, stream: bool) -> None:
        with self._lock:
            running = self._running[tenant]
            if self.most and not (
                running < self.most
                if self.most > 0
                else shares.may_take(self._running, tenant, self.threads)
            ):
                refusal = (
                    f"this token's tenant has {running} gRPC calls running, its share of the "
                    "server's handler threads (--grpc-token-calls); retry once one is answered"
                )
            elif (
                stream and self.streams and not shares.may_take(self._streams, tenant, self.streams)
            ):
                refusal = (
                    f"this token's tenant has {self._streams[tenant]} streams open, its share "
                    "of the server's (--max-open-streams); close one or send unary requests"
                )
            else:
                self._running[tenant] = running + 1
                if stream:
                    self._streams[tenant] += 1
                return
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

    def _leave(self, tenant: str, stream: bool) -> None:
        with self._lock:
            for counts in (self._running, self._streams) if stream else (self._running,):
                left = counts.pop(tenant, 0) - 1
                if left > 0:
                    counts[tenant] = left

    def _plain(
        self, behavior: Callable[..., Any], tenant: str, stream: bool = False
    ) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._enter(tenant, context, stream)
            try:
                return behavior(request, context)
            finally:
                self._leave(tenant, stream)

        return counted

    def _streamed(
        self, behavior: Callable[..., Any], tenant: str, stream: bool = False
    ) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._enter(tenant, context, stream)
            try:
                yield from behavior(request, context)
            finally:  # (also when the stream is cancelled: grpcio closes the generator)
                self._leave(tenant, stream)

        return counted
