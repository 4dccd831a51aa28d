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
    """Running calls by tenant, at most ``most`` each (-1: each its share of ``threads``)."""

    def __init__(self, most: int, threads: int = 0) -> None:
        self.most = most
        self.threads = threads
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()

    def bounded(self, handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
        """``handler`` counted against ``tenant``'s calls while it runs."""
        if handler is None or not tenant:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._plain(handler.unary_unary, tenant))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._plain(handler.stream_unary, tenant))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streamed(handler.unary_stream, tenant))
        return handler._replace(stream_stream=self._streamed(handler.stream_stream, tenant))

    def _enter(self, tenant: str, context: grpc.ServicerContext) -> None:
        with self._lock:
            running = self._running[tenant]
            if (
                running < self.most
                if self.most >= 0
                else shares.may_take(self._running, tenant, self.threads)
            ):
                self._running[tenant] = running + 1
                return
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this token's tenant has {running} gRPC calls running, its share of the "
            "server's handler threads (--grpc-token-calls); retry once one is answered",
        )

    def _leave(self, tenant: str) -> None:
        with self._lock:
            left = self._running.pop(tenant, 0) - 1
            if left > 0:
                self._running[tenant] = left

    def _plain(self, behavior: Callable[..., Any], tenant: str) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._enter(tenant, context)
            try:
                return behavior(request, context)
            finally:
                self._leave(tenant)

        return counted

    def _streamed(self, behavior: Callable[..., Any], tenant: str) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._enter(tenant, context)
            try:
                yield from behavior(request, context)
            finally:  # (also when the stream is cancelled: grpcio closes the generator)
                self._leave(tenant)

        return counted
