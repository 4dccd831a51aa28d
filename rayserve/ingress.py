"""The ingress of a prefix-routed application (``prefix_routing=true``): Serve's HTTP proxy
hands it each request; it reads the body, keys the generation routes by their prefix
(``routing.py``) and forwards the request, read, to a replica through a deployment handle
whose router is :class:`~plugserve.ray.routing.PrefixAffinityRouter`. The replica answers it
with the server's own REST code (``http.answer``); nothing of REST is done here but reading
the body within ``--max-message-bytes``.

Why an ingress: Serve's router runs in the proxy, which hands a replica the request's headers
and streams its body later; a router that is to see the prompt must sit behind a deployment
that has read it (Ray Serve LLM's ingress and ``PrefixCacheAffinityRouter`` are split the
same way).

A replica lost with requests on it: Serve's router never re-sends a request a replica had, so
the ingress does: a request whose replica died before it answered (``RayActorError``) is
forwarded again, at most :data:`ATTEMPTS` times in all, and Serve's router, which has dropped
the dead replica, sends it to a live one. A reply already streaming when its replica dies
cannot be taken back: its stream ends there, cut.

With tokens on, a request whose token is unknown is forwarded without its body (the replica
refuses it on its headers, 401, as ``plugserve serve`` does before reading a body).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from plugserve.ray.http import reply_response, request_path
from plugserve.ray.routing import prefix_blocks
from plugserve.server.process.settings import Settings
from plugserve.server.protocols.auth import AuthInterceptor, load_tokens
from plugserve.server.protocols.http.http_server import error_reply

__all__ = ["ATTEMPTS", "ROUTED", "Forwarded", "PlugserveIngress"]

log = logging.getLogger("plugserve.ray")

#: the routes keyed by their prompt's prefix (OpenAI's and Anthropic's generation routes)
ROUTED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
#: times a request is sent at most when the replica it went to dies before answering
ATTEMPTS = 3


@dataclass(frozen=True)
class Forwarded:
    """A request as the ingress forwards it: the router reads ``prefix_blocks``, the replica
    the rest."""

    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    peer: str
    body: bytes
    prefix_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReplyHead:
    """The first item a replica yields for a forwarded request; the body's chunks follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    streamed: bool


def _response(head: ReplyHead, body: Any) -> Response:
    if head.streamed:
        response: Response = StreamingResponse(body, status_code=head.status)
    else:
        response = Response(body, status_code=head.status)
    for name, value in head.headers:
        response.headers[name.decode("latin-1")] = value.decode("latin-1")
    return response


class PlugserveIngress:
    """The application's ingress under prefix routing (see the module's docstring)."""

    def __init__(self, replicas: DeploymentHandle, settings: dict[str, Any]) -> None:
        s = Settings.load(argparse.Namespace(**settings))
        self.replicas = replicas.options(method_name="routed", stream=True)
        self.max_body = s.max_message_bytes
        self.auth = AuthInterceptor(load_tokens(s.auth_tokens)) if s.auth_tokens else None

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The caller's tenant: "" without tokens, None for a token that is not known."""
        if self.auth is None:
            return ""
        strings = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        return self.auth.tenant(strings) or None

    async def _body(self, request: Request, tenant: str | None) -> bytes | Response:
        if tenant is None or request.method in ("GET", "HEAD"):
            return b""
        limit = self.max_body
        length = request.headers.get("content-length", "")
        size = int(length) if length.isdigit() else 0
        pieces: list[bytes] = []
        try:
            if size <= limit:
                size = 0
                async for piece in request.stream():
                    size += len(piece)
                    if size > limit:
                        break
                    pieces.append(piece)
        except ClientDisconnect:
            return reply_response(error_reply(499, "the client went away"))
        if size > limit:
            return reply_response(error_reply(413, f"a body of {size} bytes or more exceeds "
                                  f"--max-message-bytes ({limit})"))  # fmt: skip
        return b"".join(pieces)

    async def __call__(self, request: Request) -> Response:
        headers = [(k.lower(), v) for k, v in request.headers.raw]
        path = request_path(request)
        tenant = self._tenant(headers)
        body = await self._body(request, tenant)
        if isinstance(body, Response):
            return body
        keyed = tenant is not None and request.method == "POST" and path in ROUTED
        forwarded = Forwarded(
            request.method,
            path,
            headers,
            request.client.host if request.client is not None else "127.0.0.1",
            body,
            prefix_blocks(body, tenant or "") if keyed else (),
        )
        handle = self.replicas
        model_id = request.headers.get("serve_multiplexed_model_id", "")
        if model_id:
            handle = handle.options(multiplexed_model_id=model_id)
        for attempt in range(1, ATTEMPTS + 1):
            stream = handle.remote(forwarded)
            try:
                head: ReplyHead = await stream.__anext__()
                if head.streamed:
                    return _response(head, _rest(stream))
                return _response(head, b"".join([chunk async for chunk in stream]))
            except RayActorError as exc:
                if attempt == ATTEMPTS:
                    raise
                log.warning("prefix routing: a replica died with %s %s: sent again (%s)",
                            request.method, path, type(exc).__name__)  # fmt: skip
        raise AssertionError("unreachable")


async def _rest(stream: Any) -> AsyncIterator[bytes]:
    """The chunks after the head; a client that goes away cancels the replica's generator."""
    try:
        async for chunk in stream:
            yield chunk
    except BaseException:  # the client went away (GeneratorExit), or the replica died
        stream.cancel()
        raise
