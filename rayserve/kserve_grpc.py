"""KServe v2 gRPC through Ray Serve's gRPC proxy, served by plugserve's own servicer.

Serve's proxy (``grpc_servicer_functions``: ``add_GRPCInferenceServiceServicer_to_server`` of
plugserve's generated module) parses each request with plugserve's message classes and calls
the replica's method of the same name (``ModelInfer``, ``ModelStreamInfer``, ...) with the
message and Serve's picklable context. This module runs that call with
``server/protocols/kserve/grpc_service.py``'s ``KServeServicer``, the one the server's own port
serves, so decoding, admission, the memory budget, deadlines from Triton's ``timeout`` parameter,
decoupled models and the response's wire composition are the server's. tritonclient needs no
change: with one Serve application the proxy routes without metadata; with several, the
client adds ``("application", NAME)`` to its headers (tritonclient's ``headers=``).

What bridges the two:

* :class:`CallContext` is the ``grpc.ServicerContext`` the servicer asks of (its callbacks,
  its remaining time, its metadata for the auth check). Serve's proxy does not forward the
  client's deadline; when it passes (or the client goes away) the proxy cancels the replica's
  task, which ends the context here, which cancels the request's token: queued, it leaves its
  queue; running, its device stops at its next checkpoint.
* The servicer's calls block (a unary call may run its request inline; a stream's pump waits
  on its queue), so they run on a pool of ``max_ongoing_requests`` threads of the replica,
  never on its event loop: Serve admits no more than that many requests at once, so a call
  never waits for a thread. A stream holds two (its pump and its reader) while it lasts.
* A stream's requests arrive on Serve's async input stream; the pump's reader takes them one
  at a time (:class:`_Requests`), so the pump's window (64 requests or 64 MiB unsent) bounds
  what a stream holds here as on the server's port.
* Errors keep their status: a typed error's code and message are set on Serve's context
  before raising, which the proxy answers with (``errors.status_of``: one mapping).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc

from plugserve.proto import grpc_service_pb2 as pb
from plugserve.server.plane.errors import forget_frames
from plugserve.server.protocols.auth import KSERVE, AuthInterceptor, control_refusal
from plugserve.server.protocols.kserve.grpc_service import KServeServicer
from plugserve.server.protocols.status import status_of

__all__ = ["METHODS", "STREAMING", "CallContext", "KServeBridge", "Wire"]

#: the service's methods, by name, as Serve's proxy calls them on the replica
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods]
#: the bidirectional ones (Serve hands them an async stream of requests)
STREAMING = [
    m.name
    for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
    if m.client_streaming
]
#: the ones served by the servicer's ``Inference``, which take ``(message, size on the wire)``
_SIZED = ("ModelInfer", "ModelStreamInfer")
#: how often a stream's reader looks whether its call ended while it waits for a request
_POLL_S = 0.5


class Wire:
    """A response the servicer composed as wire bytes (``proto.tensors``: one copy of the
    tensors), handed to Serve, which asks every response for ``SerializeToString`` (and
    whose proxy takes exactly ``bytes``, no subclass)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


class _Refused(Exception):
    """A call refused with a status already set on Serve's context."""


class CallContext:
    """The ``grpc.ServicerContext`` of one call, as far as the servicer uses one."""

    def __init__(self, serve_context: Any) -> None:
        self.serve = serve_context
        self._callbacks: list[Callable[[], object]] = []
        self._ended = False
        self._lock = threading.Lock()

    def time_remaining(self) -> float | None:
        """None: Serve's proxy ends the call at the client's deadline (see the module)."""
        return None

    def add_callback(self, callback: Callable[[], object]) -> bool:
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return True
        return False

    def is_active(self) -> bool:
        return not self._ended

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return list(self.serve.invocation_metadata() or [])

    def peer(self) -> str:
        return str(self.serve.peer() or "")

    def end(self) -> None:
        """The call is over (answered, failed or cancelled): its callbacks run once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


def _fail(serve_context: Any, exc: BaseException) -> _Refused:
    code, message = status_of(exc)
    forget_frames(exc)
    serve_context.set_code(code)
    serve_context.set_details(message)
    return _Refused(message)


class _Requests:
    """A stream's requests for the pump's reader thread: each taken from Serve's async
    stream on the replica's loop when the reader asks for it, with its size on the wire."""

    def __init__(
        self, stream: AsyncIterator[Any], loop: asyncio.AbstractEventLoop, call: CallContext
    ) -> None:
        self.stream = stream
        self.loop = loop
        self.call = call

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        return self

    def __next__(self) -> tuple[Any, int]:
        future: Future = asyncio.run_coroutine_threadsafe(self._next(), self.loop)
        while True:
            if not self.call.is_active():
                future.cancel()
                raise StopIteration
            try:
                request = future.result(_POLL_S)
            except FutureTimeout:  # (not the builtin one before Python 3.11)
                continue
            if request is None:
                raise StopIteration
            return request, request.ByteSize()

    async def _next(self) -> Any:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            return None


class KServeBridge:
    """The replica's KServe v2 gRPC methods (see the module's docstring)."""

    def __init__(
        self,
        servicer: KServeServicer,
        threads: int,
        auth: AuthInterceptor | None,
        local_control: bool,
    ) -> None:
        self.servicer = servicer
        self.auth = auth
        self.local_control = local_control and auth is None
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="serve-grpc")

    def _check(self, method: str, call: CallContext) -> None:
        rpc = f"/{KSERVE}/{method}"
        if self.auth is not None:
            code, message = self.auth.authorize(rpc, call.invocation_metadata())
            if code is not None:
                call.serve.set_code(code)
                call.serve.set_details(message)
                raise _Refused(message)
        elif self.local_control:
            why = control_refusal(rpc, call.peer())
            if why:
                call.serve.set_code(grpc.StatusCode.PERMISSION_DENIED)
                call.serve.set_details(why)
                raise _Refused(why)

    async def unary(self, method: str, request: Any, serve_context: Any) -> Any:
        """One unary call: the servicer's answer (wire bytes as :class:`Wire`)."""
        call = CallContext(serve_context)
        try:
            self._check(method, call)
            behaviour = getattr(self.servicer, method)
            argument = (request, request.ByteSize()) if method in _SIZED else request
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(self.pool, behaviour, argument, call)
        except _Refused:
            raise
        except asyncio.CancelledError:
            call.end()  # the client went away or its deadline passed: stop its request
            raise
        except Exception as exc:
            raise _fail(serve_context, exc) from None
        finally:
            call.end()
        return Wire(answer) if isinstance(answer, bytes) else answer

    async def stream(
        self, method: str, requests: AsyncIterator[Any], serve_context: Any
    ) -> AsyncIterator[Any]:
        """A bidirectional call: responses as the pump gives them, in completion order."""
        call = CallContext(serve_context)
        self._check(method, call)
        loop = asyncio.get_running_loop()
        responses = getattr(self.servicer, method)(_Requests(requests, loop, call), call)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def drive() -> None:
            try:
                for response in responses:
                    loop.call_soon_threadsafe(queue.put_nowait, response)
            except BaseException as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        loop.run_in_executor(self.pool, drive)
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise _fail(serve_context, item) from None
                yield Wire(item) if isinstance(item, bytes) else item
        finally:
            # the pump cancels what is still queued or streaming, and its thread ends with
            # the requests still running (their responses are dropped)
            call.end()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
