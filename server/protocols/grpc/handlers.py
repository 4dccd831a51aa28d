"""gRPC method handlers made from a service's descriptor: one serializer, one error guard, one
stream pump and one deadline for every servicer.

The generated ``add_*Servicer_to_server`` functions serialize every response with its message
class. Inference responses are instead composed as wire bytes (``proto.tensors.field_pieces``:
one copy of the tensor data rather than three), so each handler here passes ``bytes`` through
and serializes a message as usual.

Servicer methods raise plugserve's typed errors; the guard put around each of them where it is
registered turns an error into the call's status (``server/protocols/status.py``), so no servicer
method catches or aborts by itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from plugserve.plugins import cancel
from plugserve.plugins.errors import Cancelled, DeadlineExceeded, InvalidInput
from plugserve.plugins.streams import Finished
from plugserve.plugins.threads import start_daemon
from plugserve.server.plane.callpool import blocked
from plugserve.server.plane.errors import forget_frames
from plugserve.server.plane.response_stream import ResponseStream
from plugserve.server.plane.tracing import Tracing, traced
from plugserve.server.protocols.grpc import wire
from plugserve.server.protocols.status import abort

if TYPE_CHECKING:
    from plugserve.server.control.model_control import ModelControl
    from plugserve.server.plane.dataplane import DataPlane

__all__ = ["Inference", "PlaneServicer", "add_service", "call_token", "deadline", "pump"]

_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _serialize(response: Any) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def _guarded(method: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    """``method`` with its errors as the call's status."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(request, context)
            except Exception as exc:
                abort(context, exc)

        return streaming

    @functools.wraps(method)
    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(request, context)
        except Exception as exc:
            abort(context, exc)

    return unary


def _sized(parse: Callable[[bytes], Any], descriptor: Any) -> Callable[[bytes], tuple[Any, int]]:
    """``parse`` that also gives the bytes the message took on the wire: what an inference
    request is charged to the memory budget, known exactly and for free here, where counting
    it from the parsed message means reading (copying) its fields or serializing it again.
    A large message holding too many fields to parse within that charge is not parsed: an
    :class:`wire.Unread` stands for it (``wire.py``)."""

    def sized(data: bytes) -> tuple[Any, int]:
        if len(data) > wire.SCAN_ABOVE:
            why = wire.too_many_fields(data, descriptor)
            if why:
                return wire.Unread(parse(b""), InvalidInput(why)), len(data)
        return parse(data), len(data)

    return sized


def add_service(server: grpc.Server, service: ServiceDescriptor, servicer: Any) -> str:
    """Register every method of ``service`` on ``server``, served by ``servicer``'s method of
    the same name under the error guard; returns the service's full name (for reflection).
    An :class:`Inference` call gets each request as ``(message, size on the wire)``."""
    handlers = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        parse = GetMessageClass(method.input_type).FromString
        if isinstance(getattr(behaviour, "__self__", None), Inference):
            parse = _sized(parse, method.input_type)
        handlers[method.name] = _KINDS[method.client_streaming, method.server_streaming](
            _guarded(behaviour), request_deserializer=parse, response_serializer=_serialize
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
    return service.full_name


#: A call that ends this close to its deadline ended for it, not because its client left.
_DEADLINE_SLACK = 0.05


def call_token(context: grpc.ServicerContext) -> cancel.Token:
    """A cancellation token for a unary call's request, cancelled when the call ends: its
    client cancelled or went away, or its deadline passed. Hooked before the request is
    admitted, so a run inline on this thread stops too (grpc runs the callback on another)."""
    token = cancel.Token()

    def ended() -> None:
        if token.error is not None or token.finished:  # answered: the usual end of a call
            return
        remaining = context.time_remaining()
        # grpc ends a call at its deadline by its own clock, a hair before ours
        if remaining is not None and remaining <= _DEADLINE_SLACK:
            token.cancel(DeadlineExceeded("stopped: the call's deadline passed"))
        else:
            token.cancel(Cancelled("stopped: the client cancelled the call or went away"))

    context.add_callback(ended)
    return token


def deadline(context: grpc.ServicerContext) -> float | None:
    """The call's deadline on the ``time.monotonic`` clock (None: the client set none)."""
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


#: Responses a stream may have finished but not yet sent, by count and by bytes. While either
#: is reached the stream reads no further request: a client that does not read its responses
#: slows itself down (gRPC flow control) instead of growing the server's memory. 64 keeps one
#: tritonclient stream's burst of 64 requests in flight.
STREAM_WINDOW = 64
STREAM_WINDOW_BYTES = 64 << 20


class _Ready:
    """A decoupled request's stream has responses (or its end) to send: the pump's marker."""

    __slots__ = ("entry", "request", "stream")

    def __init__(self, request: Any, entry: Any, stream: ResponseStream) -> None:
        self.request, self.entry, self.stream = request, entry, stream


def pump(
    requests: Iterator[tuple[Any, int]],
    context: grpc.ServicerContext,
    submit: Callable[[Any, grpc.ServicerContext, int], tuple[Any, Future | ResponseStream]],
    respond: Callable[[Any, Any, Any], Any],
    fail: Callable[[Any, BaseException], Any],
    name: str,
    decoupled: Callable[[Any, Any, Any, bool], Any] | None = None,
) -> Iterator[Any]:
    """A bidirectional inference stream: requests (each with its size on the wire) are
    admitted as they arrive (on a reader thread), responses leave in completion order. A
    request answered by a future gets exactly one response: ``respond(request, entry,
    outputs)`` for ``submit(request, context, size) -> (entry, future)``, or ``fail(request,
    error)``; one answered by a :class:`ResponseStream` (a decoupled network) gets
    ``decoupled(request, entry, item, final)`` for each of its items (None: nothing to send
    for it), or ``fail`` once if it fails. At most ``STREAM_WINDOW`` requests are open (read
    and not completed) at once, and ``STREAM_WINDOW_BYTES`` of finished responses wait to be
    sent; when the call ends, what is still queued or streaming is cancelled and the reader
    stops."""
    stream = _Pump(requests, context, submit, respond, fail, decoupled)
    context.add_callback(stream.end)
    start_daemon(name, stream.read)
    try:
        yield from stream.responses()
    finally:
        stream.end()


class _Pump:
    """One inference stream's state, shared by its reader thread (:meth:`read`) and the
    thread that writes its responses (:meth:`responses`); see :func:`pump`."""

    def __init__(self, requests, context, submit, respond, fail, decoupled) -> None:
        self.requests, self.context = requests, context
        self.submit, self.respond, self.fail, self.decoupled = submit, respond, fail, decoupled
        self.done: queue.Queue = queue.Queue()
        self.window = threading.Condition()
        #: requests read and not yet completed on the wire; bytes of those finished
        self.unsent = [0, 0]
        self.admitted = 0  # requests read so far
        self.ended = threading.Event()
        self.outstanding: set[Any] = set()

    def finished(self, message: Any) -> None:
        with self.window:
            self.unsent[1] += len(message) if isinstance(message, bytes) else 0
        self.done.put(message)

    def complete(self, request: Any, entry: Any, future: Future) -> None:
        if future.cancelled():  # by end(): the call is over, nobody reads an answer
            return
        try:
            message = self.respond(request, entry, future.result())
        except BaseException as exc:
            message = self.fail(request, exc)
            forget_frames(exc)
        self.finished(message)

    def room(self) -> bool:
        """Wait until the window lets one more request in; False once the call ended."""
        window, unsent = self.window, self.unsent
        with window:
            while unsent[0] >= STREAM_WINDOW or unsent[1] >= STREAM_WINDOW_BYTES:
                if self.ended.is_set():
                    return False
                window.wait(0.5)
            unsent[0] += 1
            return not self.ended.is_set()

    def read(self) -> None:
        """The reader thread: admit each request as it arrives, while the window has room."""
        outstanding, done = self.outstanding, self.done
        try:
            while self.room():
                item = next(self.requests, None)
                if item is None:
                    break
                request, size = item
                with self.window:
                    self.admitted += 1
                try:
                    if type(request) is wire.Unread:
                        request, refused = request.message, request.error
                        raise refused
                    entry, future = self.submit(request, self.context, size)
                except Exception as exc:
                    self.finished(self.fail(request, exc))
                    continue
                outstanding.add(future)
                if isinstance(future, ResponseStream):
                    future.when_ended(lambda _e, f=future: outstanding.discard(f))
                    ready = _Ready(request, entry, future)
                    future.add_listener(lambda r=ready: done.put(r))
                    continue
                future.add_done_callback(outstanding.discard)
                future.add_done_callback(lambda f, r=request, e=entry: self.complete(r, e, f))
        except grpc.RpcError:
            pass  # the client went away
        finally:
            done.put(None)

    def end(self) -> None:
        self.ended.set()
        with self.window:
            self.window.notify_all()
        for future in list(self.outstanding):
            future.cancel()

    def drain(self, ready: _Ready) -> tuple[list[Any], bool]:
        """The stream's waiting responses as messages, and whether it is complete."""
        messages = []
        try:
            for item, final in ready.stream.take():
                message = self.decoupled(ready.request, ready.entry, item, final)
                if message is not None:
                    messages.append(message)
        except BaseException as exc:
            messages.append(self.fail(ready.request, exc))
            forget_frames(exc)
            return messages, True
        return messages, ready.stream.exhausted

    def _sent(self, nbytes: int = 0) -> None:
        """One request's last response left: the window has room for another."""
        with self.window:
            self.unsent[0] -= 1
            self.unsent[1] -= nbytes
            self.window.notify_all()

    def responses(self) -> Iterator[Any]:
        """The call's responses in completion order, until the reader has stopped and every
        request it admitted is complete."""
        completed, reading = 0, True
        while True:
            message = self.done.get()
            if message is None:
                reading = False
            elif type(message) is _Ready:
                # a stream taken to its end ignores the markers still queued for it (a set of
                # such streams kept each one's request message for as long as the call lasted)
                if not message.stream.exhausted:
                    messages, complete_now = self.drain(message)
                    yield from messages
                    if complete_now:
                        completed += 1
                        self._sent()
            else:
                completed += 1
                yield message
                self._sent(len(message) if isinstance(message, bytes) else 0)
            with self.window:
                total = self.admitted
            if not reading and completed >= total:
                return


def _noting(spans: list[Any], admit: Callable[..., Any], trace: Any) -> Any:
    """``admit(trace)``, keeping ``trace`` in ``spans`` (when there is one)."""
    if trace is not None:
        spans.append(trace)
    return admit(trace)


class PlaneServicer:
    """What every protocol's gRPC servicer serves from: the data plane, the model control,
    and who its callers are."""

    def __init__(
        self,
        plane: DataPlane,
        control: ModelControl,
        tenant_of: Callable[[Any], str] | None = None,
    ) -> None:
        """``tenant_of(metadata)``: the caller's tenant from its token (``auth``'s; None
        without tokens: one tenant), which its requests carry (``Request.tenant``)."""
        self.plane = plane
        self.control = control
        self.tenant_of = tenant_of
        self._serve_inference()

    def _serve_inference(self) -> None:
        """The protocol's unary and streaming infer methods set to an :class:`Inference`'s
        (each servicer's own, made with its ``_admit``)."""
        raise NotImplementedError

    def tenant(self, context: grpc.ServicerContext) -> str:
        """The calling tenant ("" without tokens)."""
        return self.tenant_of(context.invocation_metadata()) if self.tenant_of else ""


@dataclasses.dataclass(frozen=True)
class Inference:
    """A protocol's two inference calls, the same for every protocol over gRPC (a servicer
    serves its unary and streaming infer methods with :meth:`unary` and :meth:`stream`, which
    :func:`add_service` registers under the error guard like any method, each request with
    its size on the wire): ``admit(request, context, size, inline, token, streaming, trace)``
    decodes a request, looks its network up once and admits it (-> ``(entry, future)``);
    ``names(request)`` gives its model and id for its trace; ``respond`` encodes the outputs
    as wire pieces, ``stream_respond`` as a stream message, ``fail`` a stream request's
    error; ``reader`` names the stream's reader thread."""

    tracing: Tracing
    admit: Callable[..., tuple[Any, Future | Finished]]
    names: Callable[[Any], tuple[str, str]]
    respond: Callable[[Any, Any, Any], list[Any]]
    stream_respond: Callable[[Any, Any, Any], Any]
    fail: Callable[[Any, BaseException], Any]
    #: a decoupled request's response as a stream message (None: nothing to send for it)
    stream_decoupled: Callable[[Any, Any, Any, bool], Any] | None
    reader: str

    def submit(
        self,
        request: Any,
        context: grpc.ServicerContext,
        size: int,
        inline: bool = False,
        token: Any = None,
        streaming: bool = False,
        spans: list[Any] | None = None,
    ) -> tuple[Any, Future | Finished]:
        """:attr:`admit`, within the request's ``InferRequest`` span when the trace settings
        sample it (continuing the W3C ``traceparent`` of the call's metadata); ``spans``
        gets that span, for a caller that ends it itself (a unary call)."""
        if self.tracing.on:
            admit = functools.partial(self.admit, request, context, size, inline, token, streaming)
            if spans is not None:
                admit = functools.partial(_noting, spans, admit)
            model, id = self.names(request)
            metadata = context.invocation_metadata()
            return traced(self.tracing, model, id, metadata, size, streaming, admit)
        return self.admit(request, context, size, inline, token, streaming)

    def unary(self, sized: tuple[Any, int], context: grpc.ServicerContext) -> bytes:
        """Runs inline when a stream is idle; the answer is composed without extra copies.
        A request queued behind others waits as :func:`blocked`: its thread runs nothing
        meanwhile, so another call may start."""
        request, size = sized
        if type(request) is wire.Unread:
            raise request.error
        token = call_token(context)
        spans: list[Any] = []  # a traced request's span (its adapter's ``submit`` says)
        try:
            entry, future = self.submit(
                request, context, size, inline=True, token=token, spans=spans
            )
            if type(future) is not Finished:
                with blocked():
                    future.exception()  # waits; result() below raises what it holds
            answer = b"".join(self.respond(request, entry, future.result()))
        except BaseException as exc:
            for trace in spans:
                trace.fail(exc)
                trace.end()
            raise
        for trace in spans:
            trace.response_bytes = len(answer)
            trace.end()
        return answer

    def stream(
        self, requests: Iterator[tuple[Any, int]], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        """Requests are admitted as they arrive; responses leave in completion order
        (:func:`pump`)."""
        submit = functools.partial(self.submit, streaming=True)
        yield from pump(
            requests,
            context,
            submit,
            self.stream_respond,
            self.fail,
            self.reader,
            self.stream_decoupled,
        )
