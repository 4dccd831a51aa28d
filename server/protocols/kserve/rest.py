"""KServe v2 over HTTP/REST (Triton's paths and its binary tensor extension) on its own port.

A thin adapter, the REST twin of ``kserve/service.py``: each route decodes its body
(``convert.py``), calls the :class:`DataPlane` (inference) or :class:`ModelControl` (the
repository, what is loaded), and encodes the answer; errors are
``{"error": "..."}`` with the HTTP status of the typed error (``errors.http_status_of``). A
route is authorized as the gRPC method it stands for (``auth.AuthInterceptor.authorize``),
so one table decides who may call what on both protocols; the health routes follow
``--open-health`` like the gRPC health service, so probes need no token.

The stack was chosen by measurement (BENCHMARKS.md, "REST stack" and "REST without ASGI"):
httptools' parser under an asyncio protocol of our own (``http_server.py``, which reads each
request whole and calls :meth:`RestApp.dispatch`) on uvloop, JSON by orjson. It runs its own
event loop on a thread of the server process, next to the gRPC server, so both share the
DataPlane and ModelControl. A network whose mean compute is under 1 ms runs inline on the loop
when a stream is idle (answered within the parser's callback); others run on the network's
streams while the loop awaits the future; loads and unloads run on a worker thread.

Choices where Triton or KServe leave room:

* Not ready is 503 for ``/v2/health/ready`` (body ``{"ready": false, "error": ...}``); an
  unknown model or version is 404 everywhere (``/ready`` too); a body over
  ``--max-message-bytes`` is 413; a method a path does not take is 405 with ``Allow``.
* Request bodies may be gzip or deflate (``Content-Encoding``, as tritonclient's
  ``request_compression_algorithm`` sends them; inflated no further than
  ``--max-message-bytes``); any other encoding is 415. Responses are never compressed
  (``Accept-Encoding`` is a preference: compressing a 600 KB tensor costs more than sending it
  over the networks a server like this runs on). Log settings are 501, as their gRPC method
  is UNIMPLEMENTED.
* Trace settings are Triton's (``GET``/``POST /v2[/models/NAME]/trace/setting``, answered as
  ``TraceSetting`` is; setting needs an admin token when tokens are on). A sampled ``/infer``
  or ``generate`` request is traced from its routing to its reply, a ``generate_stream`` to
  its last response (its ``InferRequest`` span, continuing the W3C ``traceparent`` header);
  docs/tracing.md.
* A client that disconnects cancels its request, queued or running (``plugins/cancel.py``).
  A request past the server's --max-request-seconds is stopped and answered 504.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import re
import socket
import ssl
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import grpc
import numpy as np
import orjson
import uvloop

from plugserve.plugins import cancel
from plugserve.plugins.api import InvalidInput, PlugserveError, ResourceExhausted, Unsupported
from plugserve.plugins.threads import start_daemon
from plugserve.plugins.tracing import Trace
from plugserve.plugins.version import plugserve_version
from plugserve.proto import grpc_service_pb2 as pb
from plugserve.server.control.model_control import ModelControl
from plugserve.server.plane.budget import body_factor
from plugserve.server.plane.dataplane import DataPlane
from plugserve.server.plane.networks import LoadedNetwork
from plugserve.server.plane.request import Request
from plugserve.server.plane.response_stream import ResponseStream
from plugserve.server.plane.sequences import echoed
from plugserve.server.plane.shm import write_outputs
from plugserve.server.plane.tracing import name_request
from plugserve.server.protocols.auth import (
    ADMIN,
    HEALTH,
    KSERVE,
    AuthInterceptor,
    control_refusal,
)
from plugserve.server.protocols.http import offload as rest_offload
from plugserve.server.protocols.http import sse
from plugserve.server.protocols.http.http_server import (
    Bounds,
    HttpServer,
    Reply,
    StreamReply,
    error_reply,
)
from plugserve.server.protocols.kserve import codec as kserve_convert
from plugserve.server.protocols.kserve import grpc_service as kserve
from plugserve.server.protocols.kserve.codec import (
    model_parameters,
    request_priority,
    request_timeout,
)
from plugserve.server.protocols.kserve.json_codec import (
    HEADER_LENGTH,
    InferCall,
    dumps,
    encode_infer,
    loads,
    message_json,
    parse_infer,
    parse_raw,
)
from plugserve.server.protocols.kserve.rest_generate import (
    GenerateCall,
    parse_generate,
    response_json,
)
from plugserve.server.protocols.status import HTTP_STATUS, status_of

if TYPE_CHECKING:
    from plugserve.server.process.settings import Settings

__all__ = ["RestApp", "RestServer"]

_JSON = [(b"content-type", b"application/json")]
#: the get-or-set routes: setting (a POST with fields) needs an admin token, as on gRPC
_SETTERS = {f"/{KSERVE}/TraceSetting"}
# Content-Encoding of a request body -> zlib's wbits (0: plain)
_WBITS = {b"identity": 0, b"gzip": 31, b"deflate": 15}
_BINARY = b"application/octet-stream"


class WorkersBusy(PlugserveError):
    """Every REST worker is taken and their queue is full (503)."""

    code = "UNAVAILABLE"


#: A JSON request body (and a reply's tensors) up to this size is decoded (encoded) on the
#: event loop: a 64 KiB JSON body parses in about 0.1 ms here, so the loop stalls no longer
#: than that; a larger one goes to a worker thread, so a 200 MB body delays nobody else.
INLINE_BYTES = 64 << 10
#: What a raw binary BYTES body (Triton's Inference-Header-Content-Length: 0 to a BYTES input)
#: is charged beyond its body's 2x while it is decoded and run: the element's copy, its text
#: (a str takes up to 4 bytes a character) and the answer made of it.
RAW_BYTES_FACTOR = 6
#: A compressed body is inflated, and charged to the memory budget, a step at a time: the
#: first this small, each next as large as what came so far (charged at most 2x), at most
#: _INFLATE_STEP.
_FIRST_INFLATE_STEP = 64 << 10
_INFLATE_STEP = 16 << 20
#: REST worker threads: decoding is CPU-bound and holds the GIL part of the time.
_WORKERS = max(2, min(8, os.cpu_count() or 2))


def _bytes_of(outputs: dict[str, Any]) -> int:
    return sum(getattr(v, "nbytes", 0) for v in outputs.values())


class TooLarge(PlugserveError):
    """A body over --max-message-bytes (413)."""

    code = "INVALID_ARGUMENT"


class Call:
    """One HTTP request as the handlers see it: made by :meth:`RestApp.admit` from its
    headers (routed and authorized), its body set once it is read."""

    __slots__ = ("_json", "body", "handler", "headers", "path", "probe", "role", "rpc", "wbits")

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
        self._json: Any = None

    def json(self) -> dict[str, Any]:
        """The body as a JSON object (decoded once: :meth:`RestApp.handle` decodes a large
        one on a worker first)."""
        if self._json is not None:
            if isinstance(self._json, Exception):
                raise self._json
            return self._json
        if not self.body:
            return {}
        value = loads(self.body, "the request body")
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

    @property
    def version(self) -> int:
        return kserve.parse_version(self.path.get("version") or "")


_NOT_A_BOOLEAN = "Invalid value for 'ready': expected a boolean (true or false)"
#: a repository index body whose 'ready' opens a value other than true or false
_NOT_A_BOOLEAN_READY = re.compile(rb'\s*\{\s*"ready"\s*:\s*[^\stf]')


def _json(value: Any, status: int = 200) -> Reply:
    return status, [dumps(value)], _JSON


_error = error_reply


class RestApp:
    """The application: route, authorize, inflate the body, call a handler, answer."""

    def __init__(
        self,
        plane: DataPlane,
        control: ModelControl,
        max_body: int,
        auth: AuthInterceptor | None = None,
        local_control: bool = False,
    ) -> None:
        """``local_control``: without tokens, the admin routes answer this machine only
        (``auth.control_refusal``)."""
        self.plane = plane
        self.control = control
        self.max_body = max_body
        self.auth = auth
        self.local_control = local_control and auth is None
        #: large requests' decoding, running and encoding (the loop only does I/O for them)
        self.workers = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="rest-worker")
        #: most large requests given to the workers at once (queued or working); more: 503.
        #: Each connection has one request served at a time, so the connection limit bounds
        #: them already (RestServer sets it to that); this is a backstop.
        self.worker_queue = 256
        self._in_workers = 0  # only the loop's thread counts
        table = self._table()
        merged: dict[str, dict[str, tuple[str, Callable[[Call], Any]]]] = {}
        for pattern, verbs, method, handler in table:  # a path's methods in one route
            merged.setdefault(pattern, {}).update({verb: (method, handler) for verb in verbs})
        self.routes = [(re.compile(pattern + "/?"), methods) for pattern, methods in merged.items()]
        #: routes with an error body of their own, and its renderer (add_routes)
        self._refusals: list[tuple[list[re.Pattern[str]], Callable[..., Reply]]] = []
        #: the health routes: answered whatever the connection limits (a probe is never
        #: refused because infer traffic holds the port)
        self._probes: set[Callable[[Call], Any]] = {self.live, self.ready}
        #: handlers that decode a large body off the loop themselves (the others' bodies over
        #: INLINE_BYTES are decoded on a worker before they run)
        self._decode_own: set[Callable[[Call], Any]] = {
            self.infer,
            self.generate,
            self.generate_stream,
        }

    def _table(self) -> list[tuple[str, tuple[str, ...], str, Callable[[Call], Any]]]:
        """The routes, one row each: (path pattern, HTTP methods, the gRPC method the route
        stands for, which authorizes it as that method, handler). The infer route first (no
        other route's pattern matches a path ending in /infer): the one whose lookup is paid
        per inference."""
        model = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
        shm = r"/v2/systemsharedmemory"
        region = shm + r"/region/(?P<name>[^/]+)"
        cuda = r"/v2/cudasharedmemory"
        cuda_region = cuda + r"/region/(?P<name>[^/]+)"
        trace = r"/v2(?:/models/(?P<name>[^/]+))?/trace/setting"
        get, post, both = ("GET",), ("POST",), ("GET", "POST")
        k = f"/{KSERVE}/"
        return [
            (model + "/infer", post, k + "ModelInfer", self.infer),
            (model + "/generate", post, k + "ModelInfer", self.generate),
            (model + "/generate_stream", post, k + "ModelStreamInfer", self.generate_stream),
            (r"/v2/health/live", get, f"/{HEALTH}/Check", self.live),
            (r"/v2/health/ready", get, f"/{HEALTH}/Check", self.ready),
            (r"/v2", get, k + "ServerMetadata", self.server_metadata),
            (r"/v2/models/stats", get, k + "ModelStatistics", self.statistics),
            (r"/v2/repository/index", post, k + "RepositoryIndex", self.index),
            (r"/v2/repository/models/(?P<name>[^/]+)/load", post, k + "RepositoryModelLoad",
             self.load),
            (r"/v2/repository/models/(?P<name>[^/]+)/unload", post,
             k + "RepositoryModelUnload", self.unload),
            (r"/v2/logging", both, k + "ServerMetadata", _refuse("log settings")),
            (trace, get, k + "TraceSetting", self.trace_setting),
            (trace, post, k + "TraceSetting", self.update_trace_setting),
            (shm + "/status", both, k + "SystemSharedMemoryStatus", self.shm_status),
            (region + "/status", both, k + "SystemSharedMemoryStatus", self.shm_status),
            (region + "/register", post, k + "SystemSharedMemoryRegister", self.shm_register),
            (shm + "/unregister", post, k + "SystemSharedMemoryUnregister", self.shm_unregister),
            (region + "/unregister", post, k + "SystemSharedMemoryUnregister",
             self.shm_unregister),
            (cuda + "/status", both, k + "CudaSharedMemoryStatus", self.cuda_status),
            (cuda_region + "/status", both, k + "CudaSharedMemoryStatus", self.cuda_status),
            (cuda_region + "/register", post, k + "CudaSharedMemoryRegister", self.cuda_register),
            (cuda + r"(?:/region/(?P<name>[^/]+))?/unregister", post,
             k + "CudaSharedMemoryUnregister", self.cuda_unregister),
            (model, get, k + "ModelMetadata", self.model_metadata),
            (model + "/ready", get, k + "ModelReady", self.model_ready),
            (model + "/config", get, k + "ModelConfig", self.model_config),
            (model + "/stats", get, k + "ModelStatistics", self.statistics),
        ]  # fmt: skip

    def add_routes(
        self,
        table: list[tuple[str, dict[str, tuple[str, Callable[[Call], Any]]]]],
        refusal: Callable[[int, str, PlugserveError | None], Reply] | None = None,
    ) -> None:
        """More routes, after the KServe ones: ``(pattern, {method: (the gRPC method it is
        authorized as, handler)})``, as the table above (a package such as the OpenAI adapter
        brings its own). A handler takes a :class:`Call` and returns a reply, an awaitable of
        one, or a :class:`StreamReply`. ``refusal(status, message, error)``: the reply for a
        request to these routes refused before its handler runs (its body over the memory
        budget, too large, too slow), in the routes' own error body."""
        compiled = [(re.compile(pattern + "/?"), methods) for pattern, methods in table]
        self.routes += compiled
        for _, methods in table:  # a package's handlers decode their bodies themselves
            self._decode_own.update(handler for _, handler in methods.values())
        if refusal is not None:
            self._refusals.append(([pattern for pattern, _ in compiled], refusal))

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
        role = ""
        if self.auth is not None:
            metadata = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers]
            code, role = self.auth.authorize(rpc, metadata)
            if code is not None:
                status, pieces, extra = _error(HTTP_STATUS[code], role)
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
        return Call(params, b"", headers, handler, rpc, role, wbits, handler in self._probes)

    def handle(self, call: Call, body: Any) -> Reply | Awaitable[Reply] | StreamReply:
        """Call an admitted request's handler with its body: its reply, or an awaitable of it
        when the handler has to wait (an inference queued on its streams, a load). A large
        body is inflated or decoded on a worker first (the infer and generate routes decode
        their own)."""
        call.body = body
        rpc = call.rpc
        if (
            rpc in _SETTERS
            and self.auth is not None
            and call.role != ADMIN
            and call.handler == self.update_trace_setting
            and bytes(body).strip(b" {}")
        ):  # as the gRPC setters (auth.py): an infer token reads the settings, sets none
            return _error(
                403,
                f"{rpc.rpartition('/')[2]} with settings needs a token with the 'admin' "
                f"role; this token has the '{call.role}' role",
            )
        if call.wbits:
            path = b"/infer" if call.handler == self.infer else b""
            factor = body_factor(path, HEADER_LENGTH.encode() in call.headers)
            return self._inflated(call, factor)
        if len(body) > INLINE_BYTES and call.handler not in self._decode_own:
            return self._decoded(call)
        return call.handler(call)  # type: ignore[misc]

    async def _decoded(self, call: Call) -> Reply:
        """A large JSON body decoded on a worker, then its handler on the loop."""
        await self._in_worker(call.decode)
        reply = call.handler(call)  # type: ignore[misc]
        return await reply if not isinstance(reply, tuple) else reply

    async def _inflated(self, call: Call, factor: int) -> Reply:
        """A compressed body, inflated on a worker (a 1 MB gzip body can be 1 GB inflated)
        and charged as it inflates; then its handler, the charge held until it answers."""
        charge = self.plane.budget.holder()
        try:
            try:
                call.body = await self._in_worker(
                    self._inflate, call.body, call.wbits, factor, charge
                )
            except TooLarge as exc:
                return _error(413, str(exc))
            except ResourceExhausted as exc:
                return _error(503, str(exc))
            if len(call.body) > INLINE_BYTES and call.handler not in self._decode_own:
                await self._in_worker(call.decode)
            reply = call.handler(call)  # type: ignore[misc]
            return await reply if not isinstance(reply, tuple) else reply
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
                    self.plane.budget.charge(step * factor, "this compressed request", charge)
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

    # --- health and metadata

    # The Open Inference Protocol's bodies ({"live": true}, {"ready": true}, {"name", "ready"}):
    # Triton sends none and its clients read only the status, but the KServe SDK's
    # is_server_live / is_server_ready / is_model_ready parse them and fail on an empty body.

    def live(self, call: Call) -> Reply:
        return _json({"live": True})

    def ready(self, call: Call) -> Reply:
        unready = self.control.unready() if self.plane.ready else []
        if self.plane.ready and not self.plane.draining and not unready:
            return _json({"ready": True})
        why = (
            "shutting down"
            if self.plane.draining
            else "still loading its models"
            if not self.plane.ready
            else "; ".join(unready[:8]) + (f"; {len(unready) - 8} more" if len(unready) > 8 else "")
        )
        return _json({"ready": False, "error": f"the server is not ready: {why}"}, 503)

    def server_metadata(self, call: Call) -> Reply:
        return _json(
            {
                "name": "plugserve",
                "version": plugserve_version(),
                "extensions": kserve_convert.EXTENSIONS,
            }
        )

    # --- system shared memory (server/plane/shm.py)

    def shm_status(self, call: Call) -> Reply:
        regions = self.plane.shm.status(call.path.get("name") or "")
        return _json(
            [
                {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in regions
            ]
        )

    def shm_register(self, call: Call) -> Reply:
        body = call.json()
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str):
            raise InvalidInput("the register request needs a 'key' (a string)")
        for what, value in (("offset", offset), ("byte_size", size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInput(f"the register request's {what!r} must be an integer")
        self.plane.shm.register(call.path["name"], key, offset, size)
        return 200, [b""], _JSON

    def shm_unregister(self, call: Call) -> Reply:
        self.plane.shm.unregister(call.path.get("name") or "")
        return 200, [b""], _JSON

    def cuda_status(self, call: Call) -> Reply:
        return _json(self.plane.shm.cuda_status(call.path.get("name") or ""))

    def cuda_register(self, call: Call) -> Reply:
        self.plane.shm.cuda_register(call.path["name"])

    def cuda_unregister(self, call: Call) -> Reply:
        self.plane.shm.cuda_unregister(call.path.get("name") or "")
        return 200, [b""], _JSON

    def model_ready(self, call: Call) -> Reply | Awaitable[Reply]:
        entry = self.plane.get(call.path["name"], call.version)  # NotFound: 404
        if entry.network.slow_readiness:  # it asks the model's processes: off the loop
            return self._in_worker(_readiness, entry)
        return _readiness(entry)

    def model_metadata(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], call.version)
        versions = sorted(n.version for n in self.control.networks() if n.name == entry.name)
        body = message_json(kserve_convert.model_metadata(entry, versions))
        # as MLServer's metadata: gRPC's message has no parameters (the model config has them)
        body["parameters"] = {"device": entry.device, "precision": entry.network.precision}
        return _json(body)

    def model_config(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], call.version)
        policy = self.control.version_policy(entry.name)
        return _json(message_json(kserve_convert.model_config(entry, policy)))

    def statistics(self, call: Call) -> Reply:
        if "name" in call.path:
            entries = self.control.versions(call.path["name"], call.version)
        else:
            entries = self.control.networks()
        entries.sort(key=lambda n: (n.name, n.version))
        response = pb.ModelStatisticsResponse(
            model_stats=[kserve_convert.model_statistics(n) for n in entries]
        )
        return _json(message_json(response))

    # --- trace settings (Triton's trace extension: server/plane/tracing.py)

    def trace_setting(self, call: Call) -> Reply:
        return _json(_setting_json(self.plane.tracing.setting(call.path.get("name") or "")))

    def update_trace_setting(self, call: Call) -> Reply:
        """Triton's body: each field a string (a list for ``trace_level``), null to clear."""
        changes: dict[str, list[str] | None] = {}
        for key, value in call.json().items():
            if value is None:
                changes[key] = None
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                changes[key] = value
            elif isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
                changes[key] = [str(value)]
            else:
                raise InvalidInput(
                    f"trace setting {key!r} must be a string (a list of strings for "
                    f"trace_level) or null, not {value!r}"
                )
        answer = self.plane.tracing.update(call.path.get("name") or "", changes)
        return _json(_setting_json(answer))

    # --- inference

    def _traced(self, trace: Trace, call: Call) -> Reply | Awaitable[Reply]:
        """:meth:`infer` within the request's span, which ends once the reply is made (the
        bytes of its body counted) or the request fails."""
        trace.request_bytes = len(call.body)
        try:
            reply = self.infer(call, trace)
        except BaseException as exc:
            _end(trace, None, exc)
            raise
        if type(reply) is tuple:  # answered at once (200: a failure raises)
            trace.response_bytes = sum(map(len, reply[1]))
            trace.end()
            return reply
        return self._traced_later(trace, reply)

    async def _traced_later(self, trace: Trace, reply: Awaitable[Reply]) -> Reply:
        try:
            done = await reply
        except BaseException as exc:
            _end(trace, None, exc)
            raise
        _end(trace, done)
        return done

    def infer(self, call: Call, trace: Trace | None = None) -> Reply | Awaitable[Reply]:
        """``trace``: the request's span (:meth:`_traced` passes it); a request the trace
        settings sample is traced from here."""
        if trace is None and self.plane.tracing.on:
            trace = self.plane.tracing.start(
                call.path["name"], "", call.headers.get(b"traceparent"), "HTTP"
            )
            if trace is not None:
                return self._traced(trace, call)
        entry = self.plane.get(call.path["name"], call.version)
        if entry.network.decoupled:
            entry.recorder.refused("invalid")
            raise InvalidInput(
                "HTTP end point doesn't support models with decoupled transaction policy: "
                f"model {entry.name!r} answers a request with any number of responses; use "
                f"/v2/models/{entry.name}/generate_stream (or gRPC ModelStreamInfer)"
            )
        header_length = _text(call.headers.get(HEADER_LENGTH.encode()))
        if len(call.body) > INLINE_BYTES:
            # decoding this much (JSON, a raw body, binary BYTES) or running a model on it
            # would stall the loop, however fast the model is on average: a worker does it
            # all (issue 52: a 320 MB binary tensor run inline held REST health 0.5 s)
            token = cancel.Token()
            token.trace = trace
            return self._in_worker(self._infer_whole, entry, call, token, token=token)
        if header_length == "0":  # Triton's raw binary request: the body is the one input
            request = parse_raw(
                call.body, entry.name, entry.inputs, entry.expect, entry.max_batch_size, entry.dims
            )
        else:
            request = parse_infer(call.body, header_length, entry.expect, self.plane.shm)
        ask = _request(entry, request, _fast(entry))
        if trace is not None:
            ask.run.trace = trace
            if request.id:
                name_request(trace, request.id)
        future = self.plane.infer(ask)
        if future.done():  # ran inline: answered without leaving the parser's callback
            outputs = future.result()
            if _bytes_of(outputs) <= INLINE_BYTES:
                return _infer_reply(entry, request, outputs)
            return self._in_worker(_infer_reply, entry, request, outputs)
        return self._infer_later(entry, request, future)

    async def _infer_later(self, entry: LoadedNetwork, request: InferCall, future: Any) -> Reply:
        outputs = await asyncio.wrap_future(future)
        if _bytes_of(outputs) <= INLINE_BYTES:
            return _infer_reply(entry, request, outputs)
        return await self._in_worker(_infer_reply, entry, request, outputs)

    def _infer_whole(self, entry: LoadedNetwork, call: Call, token: cancel.Token) -> Reply:
        """A large request, on a worker thread: decode, run (inline when a stream is idle,
        as a gRPC unary call does), encode."""
        header_length = _text(call.headers.get(HEADER_LENGTH.encode()))
        extra = None
        try:
            if header_length == "0":  # Triton's raw binary request: the body is the input
                if len(entry.inputs) == 1 and entry.inputs[0].dtype == np.dtype(object):
                    # one BYTES element: its copy and its text (up to 4 bytes a character)
                    extra = self.plane.budget.charge(
                        RAW_BYTES_FACTOR * len(call.body), "this raw BYTES request"
                    )
                request = parse_raw(
                    call.body, entry.name, entry.inputs, entry.expect, entry.max_batch_size,
                    entry.dims,
                )  # fmt: skip
            elif header_length is None and len(call.body) > rest_offload.PROCESS_BYTES:
                request = rest_offload.decode(call.body)  # parsing here would hold the GIL
                for name, array in request.inputs.items():
                    entry.expect(name, array.dtype, list(array.shape))
            else:
                request = parse_infer(call.body, header_length, entry.expect, self.plane.shm)
            if token.trace is not None:
                name_request(token.trace, request.id)
            future = self.plane.infer(_request(entry, request, True, token))
            return _infer_reply(entry, request, future.result())
        finally:
            if extra is not None:
                extra.release()

    def _in_worker(
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

    # --- Triton's generate extension (server/protocols/kserve/rest_generate.py)

    def _generate_trace(self, call: Call) -> Trace | None:
        """A generate request's span, when the trace settings sample it (continuing the W3C
        ``traceparent`` header, as ``/infer``)."""
        if not self.plane.tracing.on:
            return None
        trace = self.plane.tracing.start(
            call.path["name"], "", call.headers.get(b"traceparent"), "HTTP"
        )
        if trace is not None:
            trace.request_bytes = len(call.body)
        return trace

    async def _generate_call(
        self, call: Call, trace: Trace | None = None
    ) -> tuple[LoadedNetwork, GenerateCall, Any]:
        """Decode a generate request and submit it: its entry, the decoded call, and a
        future (an ordinary network) or a :class:`ResponseStream` (a decoupled one).
        ``trace``: the request's span."""
        entry = self.plane.get(call.path["name"], call.version)
        if len(call.body) > INLINE_BYTES:  # parsing this much would stall the loop
            request = await self._in_worker(lambda: parse_generate(call.json(), entry))
        else:
            request = parse_generate(call.json(), entry)
        ask = Request(
            entry, request.inputs, parameters=model_parameters(request.parameters),
            timeout=request_timeout(request.parameters),
            priority=request_priority(request.parameters), protocol="rest", trace=trace,
        )  # fmt: skip
        if trace is not None and request.id:
            name_request(trace, request.id)
        if entry.network.decoupled:
            return entry, request, self.plane.stream(ask)
        return entry, request, self.plane.infer(ask)

    def generate(self, call: Call) -> Awaitable[Reply]:
        return self._traced_generate(call, self._generate)

    def generate_stream(self, call: Call) -> Awaitable[Reply | StreamReply]:
        return self._traced_generate(call, self._generate_stream)

    async def _traced_generate(
        self, call: Call, handler: Callable[[Call, Trace | None], Awaitable[Any]]
    ) -> Any:
        """``handler(call, trace)``, within the request's span when the trace settings
        sample it: ended with its reply, or with its stream of responses (a ``StreamReply``:
        :meth:`_generate_stream` ends it)."""
        trace = self._generate_trace(call)
        if trace is None:
            return await handler(call, None)
        try:
            reply = await handler(call, trace)
        except BaseException as exc:
            _end(trace, None, exc)
            raise
        if type(reply) is tuple:
            _end(trace, reply)
        return reply

    async def _generate(self, call: Call, trace: Trace | None) -> Reply:
        """One response, as JSON (a decoupled model must answer exactly one)."""
        entry, request, answer = await self._generate_call(call, trace)
        if not isinstance(answer, ResponseStream):
            outputs = await asyncio.wrap_future(answer)
            return 200, [response_json(entry, request.id, outputs)], _JSON
        responses = []
        try:
            async for item, _final in answer:
                if item is not None:
                    responses.append(item)
        except asyncio.CancelledError:
            answer.cancel()
            raise
        if len(responses) != 1:
            raise InvalidInput(
                "generate expects model to produce exactly 1 response, use generate stream "
                "for model that generates various number of responses "
                f"(model {entry.name!r} answered {len(responses)})"
            )
        (only,) = responses
        if only.error is not None:
            raise only.error
        return 200, [response_json(entry, request.id, only.outputs, only.parameters)], _JSON

    async def _generate_stream(self, call: Call, trace: Trace | None) -> Reply | StreamReply:
        """Each response as a server-sent event. The status is decided by the first response:
        a request that fails before it is answered with a JSON error and that status; a
        later failure is an event ``{"error": ...}`` (Triton's generate_stream). A traced
        request's span lasts until its stream of responses ends (as a gRPC stream's)."""
        entry, request, answer = await self._generate_call(call, trace)
        if not isinstance(answer, ResponseStream):
            outputs = await asyncio.wrap_future(answer)
            event = sse.event(response_json(entry, request.id, outputs))
            return 200, [event], sse.HEADERS
        if trace is not None:  # the request's span ends with its stream of responses
            answer.when_ended(lambda error: _end(trace, None, error))
        items = answer.__aiter__()
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            first = None
        except asyncio.CancelledError:
            answer.cancel()
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                pending = [first] if first is not None else []
                while True:
                    for item, _final in pending:
                        if item is not None and item.error is not None:
                            yield sse.event(orjson.dumps({"error": status_of(item.error)[1]}))
                        elif item is not None:
                            data = response_json(entry, request.id, item.outputs, item.parameters)
                            yield sse.event(data)
                    try:
                        pending = [await items.__anext__()]
                    except StopAsyncIteration:
                        return
                    except PlugserveError as exc:
                        yield sse.event(orjson.dumps({"error": status_of(exc)[1]}))
                        return
            finally:
                await items.aclose()
                if not answer.exhausted:
                    answer.cancel()

        return StreamReply(200, sse.HEADERS, events())

    # --- repository

    def index(self, call: Call) -> Reply:
        try:
            ready = call.json().get("ready", False)
        except InvalidInput:
            # a 'ready' that is no boolean is named as such even where the body is nested too
            # deep to be read whole (Triton checks the value before its depth limit)
            if _NOT_A_BOOLEAN_READY.match(call.body):
                raise InvalidInput(_NOT_A_BOOLEAN) from None
            raise
        if not isinstance(ready, bool):
            raise InvalidInput(f"{_NOT_A_BOOLEAN}, not {ready!r}")
        return _json(
            [
                {"name": name, "version": str(version)}
                | ({"state": "READY", "reason": ""} if loaded else
                   {"state": "UNAVAILABLE", "reason": "unloaded"})
                for name, version, loaded in self.control.index(ready)
            ]
        )  # fmt: skip

    async def load(self, call: Call) -> Reply:
        parameters = call.json().get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidInput("'parameters' must be a JSON object")
        self.control.check_control(f"load of model {call.path['name']!r}")
        await asyncio.to_thread(self._load, call.path["name"], parameters)
        return 200, [], []

    def _load(self, name: str, parameters: dict[str, Any]) -> None:
        """A load request's files decoded (off the loop: they may be a model's megabytes),
        then the load."""
        files = {}
        for key, value in parameters.items():  # tritonclient.http sends files as base64
            if key.startswith("file:"):
                if not isinstance(value, str):
                    raise InvalidInput(f"'{key}' must be the file's bytes in base64")
                try:
                    files[key] = base64.b64decode(value, validate=True)
                except ValueError:
                    raise InvalidInput(f"'{key}' is not valid base64") from None
        self.control.load_request(name, {**parameters, **files})

    async def unload(self, call: Call) -> Reply:
        call.json()  # unload_dependents and other parameters: checked as JSON, nothing to do
        self.control.check_control(f"unload of model {call.path['name']!r}")
        await asyncio.to_thread(self.control.unload, call.path["name"], 0, False)
        return 200, [], []


def _request(
    entry: LoadedNetwork, request: InferCall, inline: bool, token: cancel.Token | None = None
) -> Request:
    """The data plane's request for a decoded infer call: with what a Python model reads of
    it (the client's id, its parameters, its sequence) and its shared memory outputs."""
    return Request(
        entry, request.inputs, outputs=request.outputs, run=token, timeout=request.timeout,
        priority=request.priority, id=request.id or "", parameters=request.parameters,
        step=request.step, inline=inline,
        after=functools.partial(write_outputs, request.regions) if request.regions else None,
        protocol="rest",
    )  # fmt: skip


def _setting_json(setting: dict[str, list[str]]) -> dict[str, Any]:
    """Triton's JSON: each value a string, ``trace_level`` (and a repeated one) a list."""
    return {
        key: values if key == "trace_level" or len(values) != 1 else values[0]
        for key, values in setting.items()
    }


def _end(trace: Trace, reply: Reply | None, error: BaseException | None = None) -> None:
    """End a traced request's span with its reply's body size, or the error that ended it
    (neither: it ended without a reply of its own, a stream of responses)."""
    if error is not None:
        trace.fail(error)
    elif reply is not None:
        if reply[0] >= 400:
            trace.fail(f"HTTP {reply[0]}")
        trace.response_bytes = sum(map(len, reply[1]))
    trace.end()


def _readiness(entry: LoadedNetwork) -> Reply:
    """200 when the model is ready; 400 when it is loaded but not (as Triton answers)."""
    if entry.network.ready():
        return _json({"name": entry.name, "ready": True})
    return _json({"error": f"model '{entry.name}' is not ready"}, 400)


def _infer_reply(entry: LoadedNetwork, request: InferCall, outputs: dict[str, Any]) -> Reply:
    """The answer; JSON tensors over rest_offload.PROCESS_BYTES are written by the helper
    process (only ever on a worker thread: larger answers never reach here on the loop).
    Either way it carries an ensemble's sequence flags back (``echoed``)."""
    echo = echoed(entry.sequences, request.step)
    if (
        not request.regions
        and not request.classes
        and _bytes_of(outputs) > rest_offload.PROCESS_BYTES
        and any(not request.binary.get(name, request.binary_default) for name in outputs)
    ):
        pieces, header_length = rest_offload.encode(
            entry.name, entry.version, request, outputs, echo
        )
    else:
        pieces, header_length = encode_infer(
            entry.name, entry.version, request, outputs, entry.max_batch_size > 0, entry.labels,
            echo,
        )  # fmt: skip
    if header_length is None:
        return 200, pieces, _JSON
    return (
        200,
        pieces,
        [(b"content-type", _BINARY), (HEADER_LENGTH.encode(), str(header_length).encode())],
    )


#: a network whose mean compute is below this runs on the event loop when a stream is idle
_INLINE_NS = 1_000_000


def _fast(entry: LoadedNetwork) -> bool:
    """Run inline on the loop: two thread hand-offs saved (~0.25 ms at batch 1 here), and the
    loop stalls no longer than the JSON decoding of a request does. A slower network (or one
    not yet measured) runs on its streams so the loop keeps admitting requests meanwhile, and
    so does one whose run the request can lengthen at will (a Loop: ``open_ended``), whose
    client could otherwise hold the loop until --max-request-seconds."""
    return not entry.network.open_ended and entry.recorder.mean_compute_below(_INLINE_NS)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1").strip()


def _refuse(feature: str) -> Callable[[Call], Reply]:
    def refuse(call: Call) -> Reply:
        raise Unsupported(
            f"plugserve does not support {feature}; send tensors in the request and "
            "configure the server from its command line"
        )

    return refuse


def _bounds(s: Settings, limit: int, budget: int) -> Bounds:
    """What one client may hold of the REST port (docs/security.md), from the settings: -1
    is half of the port's connection limit, of the memory budget (0 without a budget)."""
    peer_connections = limit // 2 if s.http_peer_connections < 0 else s.http_peer_connections
    peer_bytes = budget // 2 if s.max_inflight_bytes_per_peer < 0 else s.max_inflight_bytes_per_peer
    return Bounds(peer_connections, peer_bytes, s.http_min_body_rate, s.http_body_grace)


class RestServer:
    """:class:`RestApp` over HTTP/1.1 (``server/protocols/http/http_server.py``) on its own thread
    and uvloop event loop."""

    def __init__(self, app: RestApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace = 5.0
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind the port (an occupied one is a one-line SystemExit) and serve; the port."""
        s = self.settings
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        try:
            sock = socket.create_server((s.host, s.http_port), family=family, backlog=2048)
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
        limit = 4 * s.grpc_workers  # as gRPC's maximum_concurrent_rpcs
        self.app.worker_queue = limit
        budget = self.app.plane.budget
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
        started = threading.Event()
        self._thread = start_daemon("rest", self._run, sock, context, server, started)
        started.wait(30)
        return self.port

    def _run(
        self,
        sock: socket.socket,
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
            listener = await self._loop.create_server(server.protocol, sock=sock, **tls)
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
