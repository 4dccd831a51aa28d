"""KServe v2 over HTTP/REST (Triton's paths and its binary tensor extension) on its own port.

A thin adapter, the REST twin of ``kserve.py``: each route decodes its body
(``rest_convert``), calls the one :class:`DataPlane`, and encodes the answer; errors are
``{"error": "..."}`` with the HTTP status of the typed error (``errors.http_status_of``). A
route is authorized as the gRPC method it stands for (``security.AuthInterceptor.authorize``),
so one table decides who may call what on both protocols; the health routes follow
``--open-health`` like the gRPC health service, so probes need no token.

The stack was chosen by measurement (BENCHMARKS.md, "REST stack"): uvicorn with httptools'
parser and uvloop, serving a raw ASGI application (no framework between the parser and these
handlers), JSON by orjson. It runs its own event loop on a thread of the server process, next
to the gRPC server, so both share the DataPlane. Inference runs on the network's streams (the
loop awaits the future, it never computes); loads and unloads run on a worker thread.

Choices where Triton or KServe leave room:

* Not ready is 503 for ``/v2/health/ready``; an unknown model or version is 404 everywhere
  (``/ready`` too); a body over ``--max-message-bytes`` is 413.
* Request bodies may be gzip or deflate (``Content-Encoding``, as tritonclient's
  ``request_compression_algorithm`` sends them; inflated no further than
  ``--max-message-bytes``); any other encoding is 415. Responses are never compressed
  (``Accept-Encoding`` is a preference: compressing a 600 KB tensor costs more than sending it
  over the networks a server like this runs on). Shared memory, trace and log settings are
  501, as their gRPC methods are UNIMPLEMENTED.
* A client that disconnects does not cancel its queued request (ASGI tells it only to a reader
  of the request stream); the request runs and its answer is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import re
import socket
import ssl
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn
import uvloop

from plugserve.plugins.api import InvalidInput, PlugserveError, Unsupported
from plugserve.plugins.version import plugserve_version
from plugserve.proto import grpc_service_pb2 as pb
from plugserve.server import kserve, kserve_convert
from plugserve.server.dataplane import DataPlane, LoadedNetwork
from plugserve.server.errors import HTTP_STATUS, http_status_of
from plugserve.server.rest_convert import (
    HEADER_LENGTH,
    dumps,
    encode_infer,
    loads,
    message_json,
    parse_infer,
)
from plugserve.server.rest_gate import gated_protocol
from plugserve.server.security import HEALTH, KSERVE, AuthInterceptor
from plugserve.server.settings import Settings

__all__ = ["RestApp", "RestServer"]

_JSON = [(b"content-type", b"application/json")]
# Content-Encoding of a request body -> zlib's wbits (0: plain)
_WBITS = {b"identity": 0, b"gzip": 31, b"deflate": 15}
_BINARY = b"application/octet-stream"

#: what a handler returns: status, body pieces, extra headers
Reply = tuple[int, list[bytes | memoryview], list[tuple[bytes, bytes]]]


class TooLarge(PlugserveError):
    """A body over --max-message-bytes (413)."""

    code = "INVALID_ARGUMENT"


@dataclass
class Call:
    """One HTTP request as the handlers see it."""

    path: dict[str, str]
    body: bytes
    headers: dict[bytes, bytes]

    def json(self) -> dict[str, Any]:
        if not self.body:
            return {}
        value = loads(self.body, "the request body")
        if not isinstance(value, dict):
            raise InvalidInput("the request body must be a JSON object")
        return value

    @property
    def version(self) -> int:
        return kserve.parse_version(self.path.get("version") or "")


def _json(value: Any, status: int = 200) -> Reply:
    return status, [dumps(value)], _JSON


def _error(status: int, message: str) -> Reply:
    return _json({"error": message}, status)


class RestApp:
    """The ASGI application: route, authorize, read the body, call a handler, answer."""

    def __init__(
        self,
        plane: DataPlane,
        max_body: int,
        auth: AuthInterceptor | None = None,
        read_timeout: float = 30.0,
    ) -> None:
        """``read_timeout``: --request-read-timeout, the longest a body may take to arrive."""
        self.plane = plane
        self.max_body = max_body
        self.auth = auth
        self.read_timeout = read_timeout
        model = r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?"
        unsupported = {
            r"/v2/systemsharedmemory(?:/.*)?": "system shared memory",
            r"/v2/cudasharedmemory(?:/.*)?": "CUDA shared memory",
            r"/v2(?:/models/[^/]+)?/trace/setting": "trace settings",
            r"/v2/logging": "log settings",
        }
        # (pattern, {method: (gRPC method it stands for, handler)})
        # the infer route first (no other route's pattern matches a path ending in /infer):
        # the one whose lookup is paid per inference
        table: list[tuple[str, dict[str, tuple[str, Callable[[Call], Any]]]]] = [
            (model + "/infer", {"POST": (f"/{KSERVE}/ModelInfer", self.infer)}),
            (r"/v2/health/live", {"GET": (f"/{HEALTH}/Check", self.live)}),
            (r"/v2/health/ready", {"GET": (f"/{HEALTH}/Check", self.ready)}),
            (r"/v2", {"GET": (f"/{KSERVE}/ServerMetadata", self.server_metadata)}),
            (r"/v2/models/stats", {"GET": (f"/{KSERVE}/ModelStatistics", self.statistics)}),
            (r"/v2/repository/index", {"POST": (f"/{KSERVE}/RepositoryIndex", self.index)}),
            (
                r"/v2/repository/models/(?P<name>[^/]+)/load",
                {"POST": (f"/{KSERVE}/RepositoryModelLoad", self.load)},
            ),
            (
                r"/v2/repository/models/(?P<name>[^/]+)/unload",
                {"POST": (f"/{KSERVE}/RepositoryModelUnload", self.unload)},
            ),
            *(
                (
                    pattern,
                    {m: (f"/{KSERVE}/ServerMetadata", _refuse(feature)) for m in ("GET", "POST")},
                )
                for pattern, feature in unsupported.items()
            ),
            (model, {"GET": (f"/{KSERVE}/ModelMetadata", self.model_metadata)}),
            (model + "/ready", {"GET": (f"/{KSERVE}/ModelReady", self.model_ready)}),
            (model + "/config", {"GET": (f"/{KSERVE}/ModelConfig", self.model_config)}),
            (model + "/stats", {"GET": (f"/{KSERVE}/ModelStatistics", self.statistics)}),
        ]
        self.routes = [(re.compile(pattern + "/?"), methods) for pattern, methods in table]

    # --- the ASGI entry point

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        try:
            status, pieces, headers = await self._handle(scope, receive)
        except Exception as exc:
            status, message = http_status_of(exc)
            status, pieces, headers = _error(status, message)
        length = sum(memoryview(p).nbytes for p in pieces)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*headers, (b"content-length", str(length).encode())],
            }
        )
        await send({"type": "http.response.body", "body": b"".join(pieces)})

    async def _handle(self, scope: dict[str, Any], receive: Any) -> Reply:
        path = scope["path"]
        found = next(
            ((m, methods) for pattern, methods in self.routes if (m := pattern.fullmatch(path))),
            None,
        )
        if found is None:
            return _error(404, f"no such path {path!r}; KServe v2 REST paths start with /v2")
        match, methods = found
        entry = methods.get(scope["method"])
        if entry is None:
            return _error(405, f"{path} accepts {', '.join(methods)}, not {scope['method']}")
        rpc, handler = entry
        headers = dict(scope["headers"])
        if self.auth is not None:
            metadata = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            code, message = self.auth.authorize(rpc, metadata)
            if code is not None:
                status, pieces, extra = _error(HTTP_STATUS[code], message)
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    extra = [*extra, (b"www-authenticate", b"Bearer")]
                return status, pieces, extra
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in _WBITS:
            return _error(
                415,
                f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; "
                "send the body plain, gzip or deflate",
            )
        try:
            body = await asyncio.wait_for(self._body(headers, receive), self.read_timeout)
            if _WBITS[encoding]:
                body = self._inflate(body, _WBITS[encoding])
        except TooLarge as exc:
            return _error(413, str(exc))
        except TimeoutError:
            return _error(
                408,
                f"the request body did not arrive within {self.read_timeout:g} s "
                "(--request-read-timeout)",
            )
        call = Call({k: v for k, v in match.groupdict().items() if v is not None}, body, headers)
        result = handler(call)
        return await result if asyncio.iscoroutine(result) else result

    async def _body(self, headers: dict[bytes, bytes], receive: Any) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise TooLarge(self._too_large(int(declared)))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise TooLarge(self._too_large(size))
            chunks.append(chunk)
            more = message.get("more_body", False)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _inflate(self, body: bytes, wbits: int) -> bytes:
        """A gzip or deflate (zlib) body, never inflated past --max-message-bytes."""
        inflater = zlib.decompressobj(wbits)
        try:
            data = inflater.decompress(body, self.max_body + 1)
        except zlib.error as exc:
            raise InvalidInput(f"the compressed body cannot be inflated: {exc}") from None
        if len(data) > self.max_body:
            raise TooLarge(self._too_large(len(data)) + " once inflated")
        if not inflater.eof:
            raise InvalidInput("the compressed body is truncated")
        return data

    def _too_large(self, size: int) -> str:
        return (
            f"the request body is {size} bytes or more, over this server's limit of "
            f"{self.max_body} bytes (--max-message-bytes / PLUGSERVE_MAX_MESSAGE_BYTES)"
        )

    # --- health and metadata

    def live(self, call: Call) -> Reply:
        return 200, [], []

    def ready(self, call: Call) -> Reply:
        if self.plane.ready and not self.plane.draining:
            return 200, [], []
        why = "shutting down" if self.plane.draining else "still loading its models"
        return _error(503, f"the server is not ready: {why}")

    def server_metadata(self, call: Call) -> Reply:
        return _json(
            {
                "name": "plugserve",
                "version": plugserve_version(),
                "extensions": kserve_convert.EXTENSIONS,
            }
        )

    def model_ready(self, call: Call) -> Reply:
        self.plane.get(call.path["name"], call.version)  # NotFound: 404
        return 200, [], []

    def model_metadata(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], call.version)
        versions = sorted(n.version for n in self.plane.networks() if n.name == entry.name)
        return _json(message_json(kserve_convert.model_metadata(entry, versions)))

    def model_config(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], call.version)
        policy = self.plane.version_policy(entry.name)
        return _json(message_json(kserve_convert.model_config(entry, policy)))

    def statistics(self, call: Call) -> Reply:
        if "name" in call.path:
            entries = self.plane.versions(call.path["name"], call.version)
        else:
            entries = self.plane.networks()
        entries.sort(key=lambda n: (n.name, n.version))
        response = pb.ModelStatisticsResponse(
            model_stats=[kserve_convert.model_statistics(n) for n in entries]
        )
        return _json(message_json(response))

    # --- inference

    async def infer(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], call.version)
        header_length = _text(call.headers.get(HEADER_LENGTH.encode()))
        request = parse_infer(call.body, header_length, entry.expect)
        future = self.plane.submit(entry, request.inputs, request.outputs, inline=_fast(entry))
        # run inline: done already, no hand-off back to the loop (wrap_future's would cost
        # a loop wake-up through its self-pipe)
        outputs = future.result() if future.done() else await asyncio.wrap_future(future)
        pieces, header_length = encode_infer(entry.name, entry.version, request, outputs)
        if header_length is None:
            return 200, pieces, _JSON
        return (
            200,
            pieces,
            [(b"content-type", _BINARY), (HEADER_LENGTH.encode(), str(header_length).encode())],
        )

    # --- repository

    def index(self, call: Call) -> Reply:
        ready = call.json().get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"'ready' must be true or false, not {ready!r}")
        return _json(
            [
                {"name": name, "version": str(version)}
                | ({"state": "READY", "reason": ""} if loaded else
                   {"state": "UNAVAILABLE", "reason": "unloaded"})
                for name, version, loaded in self.plane.index(ready)
            ]
        )  # fmt: skip

    async def load(self, call: Call) -> Reply:
        parameters = call.json().get("parameters", {})
        if not isinstance(parameters, dict):
            raise InvalidInput("'parameters' must be a JSON object")
        self.plane.check_control(f"load of model {call.path['name']!r}")
        files = {}
        for key, value in parameters.items():  # tritonclient.http sends files as base64
            if key.startswith("file:"):
                if not isinstance(value, str):
                    raise InvalidInput(f"'{key}' must be the file's bytes in base64")
                try:
                    files[key] = base64.b64decode(value, validate=True)
                except ValueError:
                    raise InvalidInput(f"'{key}' is not valid base64") from None
        values = {**parameters, **files}
        await asyncio.to_thread(kserve.load, self.plane, call.path["name"], values)
        return 200, [], []

    async def unload(self, call: Call) -> Reply:
        call.json()  # unload_dependents and other parameters: checked as JSON, nothing to do
        self.plane.check_control(f"unload of model {call.path['name']!r}")
        await asyncio.to_thread(self.plane.unload, call.path["name"], 0, False)
        return 200, [], []


#: a network whose mean compute is below this runs on the event loop when a stream is idle
_INLINE_NS = 1_000_000


def _fast(entry: LoadedNetwork) -> bool:
    """Run inline on the loop: two thread hand-offs saved (~0.25 ms at batch 1 here), and the
    loop stalls no longer than the JSON decoding of a request does. A slower network (or one
    not yet measured) runs on its streams so the loop keeps admitting requests meanwhile."""
    return entry.recorder.mean_compute_below(_INLINE_NS)


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1").strip()


def _refuse(feature: str) -> Callable[[Call], Reply]:
    def refuse(call: Call) -> Reply:
        raise Unsupported(
            f"plugserve does not support {feature}; send tensors in the request and "
            "configure the server from its command line"
        )

    return refuse


class RestServer:
    """uvicorn serving :class:`RestApp` on its own thread and event loop."""

    def __init__(self, app: RestApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.port = 0
        self._server: Any = None
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
        tls: dict[str, Any] = {}
        if s.tls_cert:
            tls = {"ssl_certfile": s.tls_cert, "ssl_keyfile": s.tls_key}
            if s.tls_client_ca:
                tls |= {"ssl_ca_certs": s.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            self.app,
            http=gated_protocol(s.request_read_timeout),
            loop="uvloop",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            limit_concurrency=4 * s.grpc_workers,  # as gRPC's maximum_concurrent_rpcs
            timeout_keep_alive=60,
            timeout_graceful_shutdown=5,
            **tls,
        )
        self._server = uvicorn.Server(config)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(sock, started), name="rest", daemon=True
        )
        self._thread.start()
        started.wait(30)
        return self.port

    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        async def serve() -> None:
            task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            while not self._server.started and not task.done():
                await asyncio.sleep(0.01)
            started.set()
            await task

        try:
            uvloop.run(serve())
        finally:
            started.set()

    def stop(self, grace: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(grace + 5)
        self._server = None
