"""The REST port's application: a :class:`Router` that every REST face (KServe v2, OpenAI, the
generate extension) registers a table of routes on, and :class:`HttpService`, which serves it
over HTTP/1.1 (``http_server.py``) on its own thread and uvloop event loop.

The router owns what is the same for every face (issue 52: the front door in one place):

* routing: each row ``(pattern, {method: (the gRPC method it stands for, handler)})``; an
  unknown path is 404, a method the path does not take 405 with ``Allow``;
* authorization, on the request's headers, before its body is read or charged: each route is
  authorized as the gRPC method it stands for (``auth.AuthInterceptor.authorize``), so one
  table decides who may call what on both protocols; health routes follow ``--open-health``;
  without tokens, admin routes answer this machine only (``auth.control_refusal``);
* request bodies: gzip or deflate (``Content-Encoding``) inflated on a worker and charged as
  they inflate (others are 415); a JSON body over INLINE_BYTES decoded on a worker before its
  handler runs, unless the handler decodes its own off the loop (infer, generate, OpenAI);
* the worker pool for large requests (bounded: past it 503);
* the bounds of one client (``http_server.Bounds``) from the settings.

A face's handlers take a :class:`Call` and return a reply, an awaitable of one, or a
:class:`StreamReply`; they decode, call the data plane, and encode.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import grpc
import orjson
import uvloop

from plugserve.plugins import cancel
from plugserve.plugins.api import InvalidInput, PlugserveError, ResourceExhausted
from plugserve.plugins.threads import start_daemon
from plugserve.server.plane.budget import MemoryBudget, body_factor
from plugserve.server.plane.networks import ModelLoading
from plugserve.server.protocols.auth import (
    KSERVE,
    AuthInterceptor,
    control_refusal,
    setting_denial,
    token_key,
)
from plugserve.server.protocols.http import offload as rest_offload
from plugserve.server.protocols.http.http_server import (
    Bounds,
    HttpServer,
    Reply,
    StreamReply,
    error_reply,
)
from plugserve.server.protocols.status import HTTP_STATUS

if TYPE_CHECKING:
    from plugserve.server.process.settings import Settings

__all__ = [
    "INLINE_BYTES",
    "Call",
    "HttpService",
    "Route",
    "Router",
    "TooLarge",
    "WorkersBusy",
]

#: the get-or-set routes: setting (a POST with fields) needs an admin token, as on gRPC (and
#: without tokens, a caller on this machine: auth.guard_settings)
_SETTERS = {f"/{KSERVE}/TraceSetting", f"/{KSERVE}/LogSettings"}
# Content-Encoding of a request body -> zlib's wbits (0: plain)
_WBITS = {b"identity": 0, b"gzip": 31, b"deflate": 15}
#: connections the kernel queues for the REST port until the loop accepts them (capped by
#: net.core.somaxconn); more than the port's limit of connections, so a burst of them is
#: answered or refused by the server, never dropped by the kernel
BACKLOG = 2048
#: Triton's binary tensor extension's header: a body with it is charged as binary
_BINARY_HEADER = b"inference-header-content-length"
_error = error_reply


class WorkersBusy(PlugserveError):
    """Every REST worker is taken and their queue is full (503)."""

    code = "UNAVAILABLE"


#: A JSON request body (and a reply's tensors) up to this size is decoded (encoded) on the
#: event loop: a 64 KiB JSON body parses in about 0.1 ms here, so the loop stalls no longer
#: than that; a larger one goes to a worker thread, so a 200 MB body delays nobody else.
INLINE_BYTES = 64 << 10
#: A compressed body is inflated, and charged to the memory budget, a step at a time: the
#: first this small, each next as large as what came so far (charged at most 2x), at most
#: _INFLATE_STEP.
_FIRST_INFLATE_STEP = 64 << 10
_INFLATE_STEP = 16 << 20
#: REST worker threads: decoding is CPU-bound and holds the GIL part of the time.
_WORKERS = max(2, min(8, os.cpu_count() or 2))


class TooLarge(PlugserveError):
    """A body over --max-message-bytes (413)."""

    code = "INVALID_ARGUMENT"


class Call:
    """One HTTP request as the handlers see it: made by :meth:`Router.admit` from its
    headers (routed and authorized), its body set once it is read."""

    __slots__ = (
        "_json",
        "body",
        "factor",
        "handler",
        "headers",
        "path",
        "peer",
        "probe",
        "query",
        "quota_key",
        "role",
        "rpc",
        "sets",
        "tenant",
        "wbits",
    )

    def __init__(
        self,
        path: dict[str, str],
        body: Any,
        headers: dict[bytes, bytes],
        handler: Callable[[Call], Any] | None = None,
        rpc: str = "",
        role: str = "",
        wbits: int = 0,
        probe: bool = False,
    ) -> None:
        self.path = path
        self.body = body
        self.headers = headers
        self.handler = handler
        self.rpc = rpc  # the gRPC method the route stands for
        self.role = role  # the token's role ("" without tokens, or for an open route)
        self.wbits = wbits  # the body's Content-Encoding, as zlib's wbits (0: plain)
        self.probe = probe  # a health route: exempt from the connection limits
        self.factor = 0  # a compressed body's charge per inflated byte
        self.sets = False  # a POST to a get-or-set route (its body says whether it sets)
        self.peer = ""  # the client's address (kept for get-or-set routes only)
        #: the caller's tenant, as its token makes it (auth.py: "" without tokens, one tenant)
        self.tenant = ""
        #: with tokens, the digest of the valid token it came with: its requests in flight
        #: are bounded by --http-token-requests, not by its address's (None: no token)
        self.quota_key: bytes | None = None
        self._json: Any = None
        #: the URL's query, each name's values (GET /v1/responses/{id}/input_items's paging)
        self.query: dict[str, list[str]] = {}

    def json(self) -> dict[str, Any]:
        """The body as a JSON object (decoded once: :meth:`Router.handle` decodes a large
        one on a worker first)."""
        if self._json is not None:
            if isinstance(self._json, Exception):
                raise self._json
            return self._json
        if not self.body:
            return {}
        value = _loads(self.body)
        if not isinstance(value, dict):
            raise InvalidInput("the request body must be a JSON object")
        self._json = value
        return value

    def decode(self) -> None:
        """:meth:`json` now, its value or its error kept for the handler (on a worker)."""
        try:
            self.json()
        except InvalidInput as exc:
            self._json = exc


#: a face's handler: a Call in, a reply (or an awaitable of one, or a StreamReply) out
Handler = Callable[["Call"], Any]
#: one row of a face's table: (path pattern, {HTTP method: (gRPC method, handler)})
Route = tuple[str, dict[str, tuple[str, Handler]]]


def _loads(body: Any) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None


class Router:
    """Route, authorize, inflate or decode the body, call a handler: the faces' routes."""

    def __init__(
        self,
        budget: MemoryBudget,
        max_body: int,
        auth: AuthInterceptor | None = None,
        local_control: bool = False,
    ) -> None:
        """``budget``: --max-inflight-bytes; ``max_body``: --max-message-bytes;
        ``local_control``: without tokens, the admin routes answer this machine only."""
        self.budget = budget
        self.max_body = max_body
        self.auth = auth
        self.local_control = local_control and auth is None
        #: large requests' decoding, running and encoding (the loop only does I/O for them)
        self.workers = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="rest-worker")
        #: most large requests given to the workers at once (queued or working); more: 503.
        #: Each connection has one request served at a time, so the connection limit bounds
        #: them already (HttpService sets it to that); this is a backstop.
        self.worker_queue = 256
        self._in_workers = 0  # only the loop's thread counts
        self.routes: list[tuple[re.Pattern[str], dict[str, tuple[str, Handler]]]] = []
        #: routes with an error body of their own, and its renderer (add_routes)
        self._refusals: list[tuple[list[re.Pattern[str]], Callable[..., Reply]]] = []
        #: of them, those whose token refusals (401, 403) are in that body too
        self._auth_refusals: list[tuple[list[re.Pattern[str]], Callable[..., Reply]]] = []
        #: the health routes: answered whatever the connection limits (a probe is never
        #: refused because infer traffic holds the port)
        self._probes: set[Handler] = set()
        #: handlers that decode a large body off the loop themselves
        self._decode_own: set[Handler] = set()

    def add_routes(
        self,
        table: list[Route],
        refusal: Callable[[int, str, PlugserveError | None], Reply] | None = None,
        *,
        decode_own: Iterable[Handler] | None = None,
        probes: Iterable[Handler] = (),
        auth_errors: bool = False,
    ) -> None:
        """A face's routes, after those registered before: ``(pattern, {method: (the gRPC
        method it is authorized as, handler)})``. A handler takes a :class:`Call` and returns
        a reply, an awaitable of one, or a :class:`StreamReply`. ``refusal(status, message,
        error)``: the reply for a request to these routes refused before its handler runs
        (its body over the memory budget, too large, too slow), in the routes' own error body.
        ``decode_own``: the handlers that decode a large body off the loop themselves (None:
        all of them; the others' JSON bodies over INLINE_BYTES are decoded on a worker first);
        ``probes``: health handlers, answered past the connection limits; ``auth_errors``:
        ``refusal`` also answers a missing, unknown or too weak token (Anthropic's clients
        read the error's type from the body: ``authentication_error``)."""
        compiled = [(re.compile(pattern + "/?"), methods) for pattern, methods in table]
        self.routes += compiled
        if decode_own is None:
            decode_own = [handler for _, methods in table for _, handler in methods.values()]
        self._decode_own.update(decode_own)
        self._probes.update(probes)
        if refusal is not None:
            self._refusals.append(([pattern for pattern, _ in compiled], refusal))
            if auth_errors:
                self._auth_refusals.append(self._refusals[-1])

    def refusal(self, url: bytes, status: int, message: str, error: PlugserveError | None) -> Reply:
        """The reply refusing a request to ``url`` before it is routed (rest_http's): the
        error body of the routes it is for."""
        if self._refusals:
            path = unquote(url.split(b"?", 1)[0].decode("latin-1"))
            for patterns, render in self._refusals:
                if any(p.fullmatch(path) for p in patterns):
                    return render(status, message, error)
        return _error(status, message)

    # --- the entry points: server/protocols/http/http_server.py calls admit on a request's
    # headers, handle once its body is read

    def dispatch(
        self,
        method: str,
        path: str,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes,
        peer: str = "127.0.0.1",
    ) -> Reply | Awaitable[Reply] | StreamReply:
        """:meth:`admit` and :meth:`handle` at once (a request read whole elsewhere: Ray
        Serve's proxy)."""
        call = self.admit(method, path, raw_headers, peer)
        if type(call) is tuple:
            return call
        return self.handle(call, body)

    def admit(
        self, method: str, path: str, raw_headers: list[tuple[bytes, bytes]], peer: str
    ) -> Reply | Call:
        """Route and authorize a request on its headers: the :class:`Call` its handler will
        take, or the refusal to answer before its body is read (404, 405, 401, 403, 415).
        ``peer``: the client's address (in process: this machine)."""
        for pattern, handlers in self.routes:
            match = pattern.fullmatch(path)
            if match is not None:
                methods = handlers
                break
        else:
            return _error(404, f"no such path {path!r}; KServe v2 REST paths start with /v2")
        entry = methods.get(method)
        if entry is None:  # RFC 9110: a 405 names the methods the path allows
            status, pieces, extra = _error(
                405, f"{path} accepts {', '.join(methods)}, not {method}"
            )
            return status, pieces, [*extra, (b"allow", ", ".join(methods).encode())]
        rpc, handler = entry
        headers = dict(raw_headers)
        role = tenant = ""
        if self.auth is not None:
            metadata = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers]
            code, role, tenant = self.auth.check(rpc, metadata)
            if code is not None:
                render = next((r for ps, r in self._auth_refusals if pattern in ps), None)
                status, pieces, extra = (
                    _error(HTTP_STATUS[code], role)
                    if render is None
                    else render(HTTP_STATUS[code], role, None)
                )
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    extra = [*extra, (b"www-authenticate", b"Bearer")]
                return status, pieces, extra
        elif self.local_control:
            why = control_refusal(rpc, peer)
            if why:
                return _error(403, why)
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        wbits = _WBITS.get(encoding)
        if wbits is None:
            return _error(
                415,
                f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; "
                "send the body plain, gzip or deflate",
            )
        params = {k: v for k, v in match.groupdict().items() if v is not None}
        call = Call(params, b"", headers, handler, rpc, role, wbits, handler in self._probes)
        call.tenant = tenant
        if role:  # a valid token: its quota bounds it (http_server.Connection._quota)
            call.quota_key = token_key(metadata)
        if rpc in _SETTERS:  # whether it sets anything is known from its body (handle)
            call.sets = method == "POST"
            call.peer = peer
        if wbits:  # charged per inflated byte as the body would be (server/plane/budget.py)
            call.factor = body_factor(path.encode(), _BINARY_HEADER in headers)
        return call

    def handle(self, call: Call, body: Any) -> Reply | Awaitable[Reply] | StreamReply:
        """Call an admitted request's handler with its body: its reply, or an awaitable of it
        when the handler has to wait (an inference queued on its streams, a load). A large
        body is inflated or decoded on a worker first (the infer and generate routes decode
        their own)."""
        call.body = body
        if call.sets and bytes(body).strip(b" \t\r\n{}"):
            # as the gRPC setters (auth.guard_settings): an infer token reads the settings,
            # sets none; without tokens, only a caller on this machine sets them (a compressed
            # body counts as setting: refused rather than guessed)
            if self.auth is not None:
                why = setting_denial(call.rpc, call.role)
            else:
                why = control_refusal(call.rpc, call.peer, True) if self.local_control else ""
            if why:
                return _error(403, why)
        if call.wbits:
            return self._inflated(call, call.factor)
        if len(body) > INLINE_BYTES and call.handler not in self._decode_own:
            return self._decoded(call)
        return self._call(call)

    def _call(self, call: Call) -> Reply | Awaitable[Reply] | StreamReply:
        """The handler's reply; for a model that a request is loading on demand (which the
        loop's thread must not wait for), the load awaited off the loop and the handler
        called again."""
        try:
            return call.handler(call)  # type: ignore[misc]
        except ModelLoading as loading:
            return self._after_load(call, loading)

    async def _after_load(self, call: Call, loading: ModelLoading) -> Reply:
        """The handler once the model its call asked for has loaded on demand; again (at most
        three loads, as a gRPC call's ``OnDemand.acquire``) when the model was unloaded to
        make room before the handler ran: under churn, 14 % of a red team's REST requests
        were answered 503 within a second of a 30 s wait that gRPC's retry served."""
        for attempt in range(3):
            await loading.loaded()
            try:
                reply = call.handler(call)  # type: ignore[misc]
                return await reply if inspect.isawaitable(reply) else reply
            except ModelLoading as again:
                if attempt == 2:
                    raise
                loading = again
        raise AssertionError("unreachable")

    async def _decoded(self, call: Call) -> Reply:
        """A large JSON body decoded on a worker, then its handler on the loop."""
        await self.in_worker(call.decode)
        reply = self._call(call)
        return await reply if inspect.isawaitable(reply) else reply

    async def _inflated(self, call: Call, factor: int) -> Reply:
        """A compressed body, inflated on a worker (a 1 MB gzip body can be 1 GB inflated)
        and charged as it inflates; then its handler, the charge held until it answers."""
        charge = self.budget.holder()
        try:
            try:
                call.body = await self.in_worker(
                    self._inflate, call.body, call.wbits, factor, charge
                )
            except TooLarge as exc:
                return _error(413, str(exc))
            except ResourceExhausted as exc:
                return _error(503, str(exc))
            if len(call.body) > INLINE_BYTES and call.handler not in self._decode_own:
                await self.in_worker(call.decode)
            reply = self._call(call)
            return await reply if inspect.isawaitable(reply) else reply
        finally:
            charge.release()

    def _inflate(self, body: bytes, wbits: int, factor: int = 0, charge: Any = None) -> bytes:
        """A gzip or deflate (zlib) body, never inflated past --max-message-bytes; each
        piece is charged to ``charge`` (at ``factor`` per byte) before it is inflated."""
        inflater = zlib.decompressobj(wbits)
        pieces: list[bytes] = []
        size = 0
        try:
            while True:  # steps grow with what came (a small body is not charged 16 MiB)
                step = min(max(_FIRST_INFLATE_STEP, size), _INFLATE_STEP, self.max_body + 1 - size)
                if charge is not None:
                    self.budget.charge(step * factor, "this compressed request", charge)
                piece = inflater.decompress(body, step)
                body = inflater.unconsumed_tail
                pieces.append(piece)
                size += len(piece)
                if size > self.max_body:
                    raise TooLarge(self.too_large(size) + " once inflated")
                if not body or not piece:
                    break
        except zlib.error as exc:
            raise InvalidInput(f"the compressed body cannot be inflated: {exc}") from None
        if not inflater.eof:
            raise InvalidInput("the compressed body is truncated")
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def too_large(self, size: int) -> str:
        """Triton's words (``EVBufferToJson``), which its L0_http test matches; ``size``: the
        declared length, or what has come of a body still arriving."""
        return (
            f"request JSON size of {size} bytes exceeds the maximum allowed input size of "
            f"{self.max_body} bytes. Use --max-message-bytes (PLUGSERVE_MAX_MESSAGE_BYTES) to "
            "increase the limit"
        )

    def in_worker(
        self, fn: Callable[..., Any], *args: Any, token: cancel.Token | None = None
    ) -> Awaitable[Any]:
        """``fn(*args)`` on the bounded worker pool, or a 503 at once when it is full. A
        client that goes away cancels what awaits this, and so ``token``."""
        if self._in_workers >= self.worker_queue:
            raise WorkersBusy(
                f"the REST workers are busy with {self._in_workers} large requests "
                "(decoding, running or encoding); retry later"
            )
        self._in_workers += 1
        return self._await_worker(fn, args, token)

    async def _await_worker(
        self, fn: Callable[..., Any], args: tuple[Any, ...], token: cancel.Token | None
    ) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)
        except asyncio.CancelledError:
            if token is not None:
                token.cancel()
            raise
        finally:
            self._in_workers -= 1


def _bounds(s: Settings, limit: int, budget: int) -> Bounds:
    """What one client may hold of the REST port (docs/security.md), from the settings: -1
    is half of the port's connection limit, of the memory budget (0 without a budget), and
    for one token's requests its share of the port's limit (-1 kept: ``plane/shares.py``)."""
    peer_connections = limit // 2 if s.http_peer_connections < 0 else s.http_peer_connections
    peer_bytes = budget // 2 if s.max_inflight_bytes_per_peer < 0 else s.max_inflight_bytes_per_peer
    tokens = s.http_token_requests
    return Bounds(peer_connections, peer_bytes, s.http_min_body_rate, s.http_body_grace, tokens)


class HttpService:
    """A :class:`Router` over HTTP/1.1 (``http_server.py``) on its own thread and uvloop event
    loop: the REST port."""

    def __init__(self, app: Router, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace = 5.0
        self._thread: threading.Thread | None = None
        self.server: HttpServer | None = None  # once started: its connections' counts

    def start(self) -> int:
        """Bind the port (an occupied one is a one-line SystemExit) and serve; the port."""
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        limit = 4 * s.grpc_workers  # as gRPC's maximum_concurrent_rpcs
        backlog = max(BACKLOG, limit)  # the listen queue, asked of the socket and the loop
        try:
            sock = socket.create_server((s.host, s.http_port), family=family, backlog=backlog)
        except OSError as exc:
            raise SystemExit(
                f"plugserve: cannot listen on {s.host}:{s.http_port} (--http-port): {exc.strerror}"
            ) from None
        self.port = sock.getsockname()[1]
        context = None
        if s.tls_cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(s.tls_cert, s.tls_key)
            if s.tls_client_ca:
                context.load_verify_locations(s.tls_client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
        self.app.worker_queue = limit
        budget = self.app.budget
        server = HttpServer(
            self.app.admit,
            self.app.handle,
            self.app.max_body,
            s.request_read_timeout,
            limit,
            self.app.too_large,
            budget,
            self.app.refusal,
            _bounds(s, limit, budget.limit),
        )
        self.server = server
        started = threading.Event()
        self._thread = start_daemon("rest", self._run, sock, backlog, context, server, started)
        started.wait(30)
        return self.port

    def _run(
        self,
        sock: socket.socket,
        backlog: int,
        context: ssl.SSLContext | None,
        server: HttpServer,
        started: threading.Event,
    ) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            tls: dict[str, Any] = {}
            if context is not None:  # a handshake is bounded as a request's headers are
                tls = {"ssl": context, "ssl_handshake_timeout": server.read_timeout}
            # (the loop listens again, at its own default of 100 unless told: a thousand
            # clients connecting at once overflowed that queue, and a client whose handshake
            # was dropped so got its connection reset mid-request)
            listener = await self._loop.create_server(
                server.protocol, sock=sock, backlog=backlog, **tls
            )
            started.set()
            await self._stop.wait()
            listener.close()
            server.close_idle()
            end = time.monotonic() + self._grace  # admitted requests finish, within the grace
            while server.busy and time.monotonic() < end:
                await asyncio.sleep(0.02)
            for connection in list(server.connections):
                connection.close()

        try:
            uvloop.run(serve())
        finally:
            started.set()

    def stop(self, grace: float = 5.0) -> None:
        self.app.workers.shutdown(wait=False, cancel_futures=True)
        rest_offload.shutdown()
        if self._loop is None or self._stop is None:
            return
        self._grace = min(grace, 5.0)
        self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(grace + 5)
        self._loop = None
