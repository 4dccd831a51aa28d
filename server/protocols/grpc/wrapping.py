"""Method handlers wrapped once, where they are registered, instead of by interceptors per call.

What the call gate (``callgate.py``) and the local-control check (``auth.py``) do to a
method's handler depends on the method alone, not on the call. As grpcio interceptors they
ran for every call: the interceptor pipeline made a handler-call-details object and two
closures per interceptor each time, and took a call off grpcio's registered-method fast path.
Measured on a bare echo, the two took 20 % of its requests/s at 16 in flight (BENCHMARKS.md,
issue 22). Here every handler is wrapped when a service is registered, through
:class:`WrappingServer`, which stands in for the ``grpc.Server`` that generated
``add_*Servicer_to_server`` functions, reflection and plugserve's own services register on.
Interceptors stay for what depends on the call (a token in its metadata).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

__all__ = ["Wrap", "WrappingServer"]

#: ``(fully qualified method, handler) -> handler``
Wrap = Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]


class _WrappedGeneric(grpc.GenericRpcHandler):
    """A generic handler whose answers are wrapped, each method once."""

    def __init__(self, inner: grpc.GenericRpcHandler, wrap: Callable[..., Any]) -> None:
        self.inner = inner
        self.wrap = wrap
        self._done: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = self.inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        known = self._done.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self.wrap(method, handler)
        if len(self._done) < 4096:  # unknown method names are a client's to invent
            self._done[method] = (handler, wrapped)
        return wrapped


class WrappingServer:
    """A ``grpc.Server`` whose registered handlers pass through ``wraps`` (in order: the
    first is the outermost, as the first interceptor was)."""

    def __init__(self, server: grpc.Server, wraps: Sequence[Wrap]) -> None:
        self.server = server
        self.wraps = list(wraps)

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        for wrap in reversed(self.wraps):
            handler = wrap(method, handler)
        return handler

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.server.add_registered_method_handlers(
            service_name,
            {
                name: self._wrap(f"/{service_name}/{name}", handler)
                for name, handler in method_handlers.items()
            },
        )

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[Any]) -> None:
        self.server.add_generic_rpc_handlers(
            tuple(_WrappedGeneric(h, self._wrap) for h in generic_rpc_handlers)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)
