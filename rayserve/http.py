"""KServe v2 REST and the OpenAI routes through Ray Serve's HTTP proxy: the request Serve
hands a replica, given to plugserve's own REST router (``Router.admit`` and ``Router.handle``,
``server/protocols/http/app.py``, with the KServe and OpenAI routes), whose reply goes back as
a Starlette response.

Nothing of REST is written twice: routing, authorization, inflating, decoding, the inline
fast path, the OpenAI adapter and Triton's generate extension are the server's. What this
module adds is what the server's HTTP layer (``server/protocols/http/http_server.py``) does before
``handle`` and that Serve's proxy does not do for us:

* the request is routed and authorized on its headers first (``admit``): a caller without a
  valid token gets its 401 before any body byte is read or charged;
* a body over ``--max-message-bytes`` is refused (413) from its Content-Length, before it is
  read; one that grows past it as it arrives (chunked) is refused when it does;
* the body is charged to the replica's memory budget (``--max-inflight-bytes``) at the
  server's factors (``budget.body_factor``: 20x for a JSON infer body) before it is read, a
  503 when it does not fit, and released when the reply has been handed to Serve;
* an application deployed under a ``route_prefix`` serves its paths below it (Serve hands
  the prefix as the request's root path);
* a typed error becomes ``{"error": ...}`` with its HTTP status (``errors.http_status_of``);
* a streamed reply (``StreamReply``: Triton's generate_stream, OpenAI's server-sent events)
  goes out chunk by chunk as a ``StreamingResponse``: Serve streams it through the proxy; a
  client that goes away cancels the generator, whose ``finally`` cancels the request (the
  same ``aclose`` the server's own HTTP layer calls).

A client that disconnects while its request is queued or running cancels it: Serve cancels
the replica's task, and the awaited reply's ``CancelledError`` reaches the REST app's
awaitables, which cancel their request (``plugins/cancel.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from plugserve.plugins.api import PlugserveError
from plugserve.server.plane.budget import Charge, MemoryBudget, body_factor
from plugserve.server.plane.errors import forget_frames
from plugserve.server.protocols.http.app import Router
from plugserve.server.protocols.http.http_server import Reply, StreamReply, error_reply
from plugserve.server.protocols.status import http_status_of

__all__ = ["answer", "reply_response", "request_path", "serve_http", "stream_chunks"]


def reply_response(reply: Reply) -> Response:
    """A whole reply of the server's REST code as Starlette's response."""
    status, pieces, headers = reply
    body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    response = Response(bytes(body), status_code=status)
    for name, value in headers:
        response.headers[name.decode("latin-1")] = value.decode("latin-1")
    return response


async def stream_chunks(reply: StreamReply) -> AsyncIterator[bytes]:
    """A streamed reply's chunks as bytes; closing it (a client gone) cancels the request."""
    try:
        async for chunk in reply.chunks:
            if chunk:
                yield bytes(chunk)
    finally:
        close = getattr(reply.chunks, "aclose", None)
        if close is not None:
            await close()


def _streaming(reply: StreamReply) -> StreamingResponse:
    response = StreamingResponse(stream_chunks(reply), status_code=reply.status)
    for name, value in reply.headers:
        response.headers[name.decode("latin-1")] = value.decode("latin-1")
    return response


async def _read(request: Request, limit: int, too_large: Any) -> bytes | Reply:
    """The body, read whole, or the 413 refusing it once it passes ``limit``."""
    pieces: list[bytes] = []
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            return error_reply(413, too_large(size))
        if piece:
            pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def answer(
    app: Router,
    budget: MemoryBudget,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    peer: str,
    declared: int | None,
    read: Callable[[], Awaitable[bytes | Reply]],
) -> Reply | StreamReply:
    """One HTTP request answered by ``app``: admitted on its headers, charged, its body
    ``read`` (the body, or the reply refusing it), handled. Serve's proxy hands the request
    (:func:`serve_http`); under prefix routing the ingress forwards it read (``ingress.py``)."""
    call = app.admit(method, path, headers, peer)
    if type(call) is tuple:  # refused on its headers (404, 405, 401, 403, 415)
        return call
    if declared is not None and declared > app.max_body:
        return error_reply(413, app.too_large(declared))
    charge: Charge | None = None
    try:
        if budget.limit:
            binary = any(k == b"inference-header-content-length" for k, _ in headers)
            factor = body_factor(path.encode(), binary)
            # a chunked body is charged as large as the server allows one to be
            expected = declared if declared is not None else app.max_body
            try:
                charge = budget.charge(expected * factor, "this request")
            except PlugserveError as exc:
                return app.refusal(path.encode(), 503, str(exc), exc)
        body = await read()
        if isinstance(body, tuple):
            return body
        try:
            reply = app.handle(call, body)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception as exc:
            reply = error_reply(*http_status_of(exc))
            forget_frames(exc)
        return reply
    finally:
        if charge is not None:
            charge.release()


def request_path(request: Request) -> str:
    """The request's path below the application's ``route_prefix`` (Serve hands the prefix as
    the request's root path)."""
    path = request.url.path
    root = request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


async def serve_http(app: Router, budget: MemoryBudget, request: Request) -> Response:
    """One HTTP request of Serve's proxy, answered by ``app`` (see the module's docstring)."""
    headers = [(k.lower(), v) for k, v in request.headers.raw]
    peer = request.client.host if request.client is not None else "127.0.0.1"
    length = request.headers.get("content-length", "")
    declared = int(length) if length.isdigit() else None

    async def read() -> bytes | Reply:
        try:
            return await _read(request, app.max_body, app.too_large)
        except ClientDisconnect:
            return error_reply(499, "the client went away")

    path = request_path(request)
    reply = await answer(app, budget, request.method, path, headers, peer, declared, read)
    if isinstance(reply, StreamReply):
        return _streaming(reply)
    return reply_response(reply)
