"""KServe v2 over HTTP/REST (Triton's paths and its binary tensor extension) on its own port.

A thin adapter, the REST twin of ``kserve/service.py``: each route decodes its body
(``convert.py``), calls the :class:`DataPlane` (inference) or :class:`ModelControl` (the
repository, what is loaded), and encodes the answer; errors are
``{"error": "..."}`` with the HTTP status of the typed error (``errors.http_status_of``). Its
routes are a table (:meth:`RestApp._table`) registered on the port's :class:`Router`
(``server/protocols/http/app.py``), which routes, authorizes each route as the gRPC method it
stands for (``auth.AuthInterceptor.authorize``: one table decides who may call what on both
protocols) on the request's headers, before its body is read, inflates and decodes bodies;
the health routes follow ``--open-health`` like the gRPC health service, so probes need no
token. The OpenAI face registers its own table on the same router.

The stack was chosen by measurement (BENCHMARKS.md, "REST stack" and "REST without ASGI"):
httptools' parser under an asyncio protocol of our own (``http_server.py``, which admits each
request on its headers and hands it to its handler once its body is read) on uvloop, JSON by
orjson. It runs its own event loop on a thread of the server process, next to the gRPC server,
so both share the DataPlane and ModelControl. A small request (body up to INLINE_BYTES, inputs
up to SMALL_RUN_BYTES) to a network whose recent small requests ran in under 1 ms runs inline
on the loop when a stream is idle (answered within the parser's callback); others run on the
network's streams while the loop awaits the future, and a larger body is decoded and run on a
worker whatever the network's speed (issue 52); loads and unloads run on a worker thread.

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
import binascii
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import orjson

from plugserve.plugins import cancel
from plugserve.plugins.api import InvalidInput, PlugserveError, Unsupported
from plugserve.plugins.tracing import Trace
from plugserve.plugins.version import plugserve_version
from plugserve.proto import grpc_service_pb2 as pb
from plugserve.server.control.model_control import ModelControl
from plugserve.server.plane.budget import charging_strings
from plugserve.server.plane.dataplane import DataPlane
from plugserve.server.plane.errors import FieldError
from plugserve.server.plane.networks import LoadedNetwork, ModelLoading, small_inputs
from plugserve.server.plane.request import Request
from plugserve.server.plane.response_stream import ResponseStream
from plugserve.server.plane.sequences import echoed
from plugserve.server.plane.shm import OutputWriter, cuda_device_of
from plugserve.server.plane.tracing import name_request
from plugserve.server.protocols.auth import (
    HEALTH,
    KSERVE,
)
from plugserve.server.protocols.http import json_bounds, sse
from plugserve.server.protocols.http import offload as rest_offload
from plugserve.server.protocols.http.app import INLINE_BYTES, Call, Router
from plugserve.server.protocols.http.http_server import (
    Reply,
    StreamReply,
    error_reply,
)
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.kserve import codec as kserve_convert
from plugserve.server.protocols.kserve import grpc_service as kserve
from plugserve.server.protocols.kserve import json_offload
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
    message_json,
    parse_infer,
    parse_raw,
)
from plugserve.server.protocols.kserve.rest_generate import (
    GenerateCall,
    decode_in_helper,
    parse_generate,
    response_json,
)
from plugserve.server.protocols.status import status_of

__all__ = ["RestApp"]

_BINARY = b"application/octet-stream"


#: What a raw binary BYTES body (Triton's Inference-Header-Content-Length: 0 to a BYTES input)
#: is charged beyond its body's 2x while it is decoded and run: the element's copy, its text
#: (a str takes up to 4 bytes a character) and the answer made of it.
RAW_BYTES_FACTOR = 6


def _bytes_of(outputs: dict[str, Any]) -> int:
    return sum(getattr(v, "nbytes", 0) for v in outputs.values())


#: what a body naming a shared memory region holds (it is decoded and run on a worker)
_SHARED = b"shared_memory_region"
#: what a JSON value is, by its Python type, for a refusal that names it
_JSON_KINDS = {list: "an array", dict: "an object", float: "a number", bool: "a boolean"}
#: the bytes of events a generate_stream writes at a time (see RestApp._generate_stream)
_SLICE = 64 << 10
_NOT_A_BOOLEAN = "Invalid value for 'ready': expected a boolean (true or false)"
#: a repository index body whose 'ready' opens a value other than true or false
_NOT_A_BOOLEAN_READY = re.compile(rb'\s*\{\s*"ready"\s*:\s*[^\stf]')


def _json(value: Any, status: int = 200) -> Reply:
    return status, [dumps(value)], JSON


def _done() -> Reply:
    """A shared-memory region registered or unregistered: Triton answers 200, an empty body."""
    return 200, [b""], JSON


_error = error_reply


class RestApp:
    """The application: route, authorize, inflate the body, call a handler, answer."""

    def __init__(self, plane: DataPlane, control: ModelControl, router: Router) -> None:
        """KServe v2's routes, registered on the port's ``router`` (built by the process or Ray
        Serve's replica: ``server/process/rest_faces.py``; other faces add theirs to it)."""
        self.plane = plane
        self.control = control
        merged: dict[str, dict[str, tuple[str, Callable[[Call], Any]]]] = {}
        for pattern, verbs, method, handler in self._table():  # a path's methods in one route
            merged.setdefault(pattern, {}).update({verb: (method, handler) for verb in verbs})
        router.add_routes(
            list(merged.items()),
            decode_own=[self.infer, self.generate, self.generate_stream],
            probes=[self.live, self.ready],
        )
        self._in_worker = router.in_worker

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
            (r"/v2/logging", both, k + "LogSettings", _refuse("log settings")),
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
        regions = self.plane.shm.status(_name_or_all(call), call.tenant)
        return _json(
            [
                {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in regions
            ]
        )

    def shm_register(self, call: Call) -> Reply:
        self.plane.shm.register(call.path["name"], *_system_region(call.json()), call.tenant)
        return _done()

    def shm_unregister(self, call: Call) -> Reply:
        self.plane.shm.unregister(_name_or_all(call), call.tenant)
        return _done()

    def cuda_status(self, call: Call) -> Reply:
        regions = self.plane.shm.cuda_status(_name_or_all(call), call.tenant)
        return _json(
            [{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions]
        )

    def cuda_register(self, call: Call) -> Reply:
        self.plane.shm.cuda_register(call.path["name"], *_cuda_region(call.json()), call.tenant)
        return _done()

    def cuda_unregister(self, call: Call) -> Reply:
        self.plane.shm.cuda_unregister(_name_or_all(call), call.tenant)
        return _done()

    def model_ready(self, call: Call) -> Reply | Awaitable[Reply]:
        entry = self.plane.get(call.path["name"], _version(call), load=False)  # NotFound: 404
        if entry.network.slow_readiness:  # it asks the model's processes: off the loop
            return self._in_worker(_readiness, entry)
        return _readiness(entry)

    def model_metadata(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], _version(call))
        versions = sorted(n.version for n in self.control.networks() if n.name == entry.name)
        body = message_json(kserve_convert.model_metadata(entry, versions))
        # as MLServer's metadata: gRPC's message has no parameters (the model config has them)
        body["parameters"] = {"device": entry.device, "precision": entry.network.precision}
        return _json(body)

    def model_config(self, call: Call) -> Reply:
        entry = self.plane.get(call.path["name"], _version(call))
        policy = self.control.version_policy(entry.name)
        return _json(message_json(kserve_convert.model_config(entry, policy)))

    def statistics(self, call: Call) -> Reply:
        if "name" in call.path:
            entries = self.control.versions(call.path["name"], _version(call))
        else:
            entries = self.control.networks()
        entries.sort(key=lambda n: (n.name, n.version))
        response = pb.ModelStatisticsResponse(
            model_stats=[kserve_convert.model_statistics(n) for n in entries]
        )
        return _json(message_json(response))

    # --- trace settings (Triton's trace extension: server/plane/tracing.py)

    def trace_setting(self, call: Call) -> Reply:
        return _json(_setting_json(self.plane.tracing.setting(_name_or_all(call))))

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
                raise InvalidInput(  # (the value's type: its repr of 990 '[' was a 500)
                    f"trace setting {key[:100]!r} must be a string (a list of strings for "
                    f"trace_level) or null, not {_JSON_KINDS.get(type(value), 'that')}"
                )
        answer = self.plane.tracing.update(_name_or_all(call), changes)
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
        entry = self.plane.get(call.path["name"], _version(call))
        if entry.network.decoupled:
            entry.recorder.refused("invalid")
            raise InvalidInput(
                "HTTP end point doesn't support models with decoupled transaction policy: "
                f"model {entry.name!r} answers a request with any number of responses; use "
                f"/v2/models/{entry.name}/generate_stream (or gRPC ModelStreamInfer)"
            )
        header_length = _text(call.headers.get(HEADER_LENGTH.encode()))
        if len(call.body) > INLINE_BYTES or _SHARED in call.body:
            # decoding this much (JSON, a raw body, binary BYTES) or running a model on it
            # would stall the loop, however fast the model is on average: a worker does it
            # all (issue 52: a 320 MB binary tensor run inline held REST health 0.5 s). So
            # does a small body naming a shared memory region, whose tensors may be as large
            # (a red team's 263-byte body reading a 512 MiB region held health 2-9 s)
            token = cancel.Token()
            return self._in_worker(self._infer_whole, entry, call, token, trace, token=token)
        if header_length == "0":  # Triton's raw binary request: the body is the one input
            request = parse_raw(
                call.body, entry.name, entry.inputs, entry.expect, entry.max_batch_size, entry.dims
            )
        else:
            request = parse_infer(
                call.body,
                header_length,
                entry.expect,
                self.plane.shm.of(call.tenant),
                cuda_device_of(entry),
            )
        ask = _request(entry, request, _fast(entry, request), trace=trace, tenant=call.tenant)
        if trace is not None and request.id:
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

    def _infer_whole(
        self, entry: LoadedNetwork, call: Call, token: cancel.Token, trace: Trace | None
    ) -> Reply:
        """A large request, on a worker thread: decode, run (inline when a stream is idle,
        as a gRPC unary call does), encode."""
        header_length = _text(call.headers.get(HEADER_LENGTH.encode()))
        extra = None
        strings = self.plane.budget.holder()  # BYTES elements, charged before decoded
        expect = charging_strings(entry.expect, self.plane.budget, strings)
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
                request = json_offload.decode(call.body)  # parsing here would hold the GIL
                for name, array in request.inputs.items():
                    expect(name, array.dtype, list(array.shape))
            else:
                request = parse_infer(
                    call.body,
                    header_length,
                    expect,
                    self.plane.shm.of(call.tenant),
                    cuda_device_of(entry),
                )
            if trace is not None:
                name_request(trace, request.id)
            future = self.plane.infer(_request(entry, request, True, token, trace, call.tenant))
            return _infer_reply(entry, request, future.result())
        finally:
            strings.release()
            if extra is not None:
                extra.release()

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
        try:
            entry = self.plane.get(call.path["name"], _version(call))
        except ModelLoading as loading:  # loading on demand: awaited off the loop
            await loading.loaded()
            entry = self.plane.get(call.path["name"], _version(call))
        bounds = json_bounds.bounds()
        body = call.body
        inline = len(body) <= INLINE_BYTES and json_bounds.surely_within(body, bounds)
        if inline:
            request = parse_generate(call.json(), entry)  # (small, of a few values)
        elif len(body) <= rest_offload.PROCESS_BYTES:  # counted before it is built, its
            # parsed form charged, off the loop: as the OpenAI routes'
            values = await self._in_worker(json_bounds.check_structure, body, bounds)
            size = json_bounds.parsed_bytes(len(body), values)
            charge = self.plane.budget.charge(size, "this request's parsed JSON body")
            try:
                request = await self._in_worker(lambda: parse_generate(call.json(), entry))
            finally:
                charge.release()
        else:  # scanned and parsed in the JSON helper process (three 100 MB texts parsed on
            # the REST loop held its health 0.13-6 s; on workers, the GIL still 0.35 s)
            charge = self.plane.budget.charge(
                json_bounds.parsed_bytes(len(body), 1), "this request's parsed JSON body"
            )
            try:
                specs = {spec.name: spec for spec in entry.inputs}
                value, refused = await self._in_worker(
                    rest_offload.call, decode_in_helper, body, bounds, specs
                )
                if refused is not None:
                    message, param, status, code = refused
                    raise FieldError(message, param, status, code)
                request = await self._in_worker(parse_generate, value, entry, True)
            finally:
                charge.release()
        ask = Request(
            entry, request.inputs, parameters=model_parameters(request.parameters),
            timeout=request_timeout(request.parameters),
            priority=request_priority(request.parameters), protocol="rest", trace=trace,
            tenant=call.tenant,
        )  # fmt: skip
        if not inline:  # its inputs checked off the loop too (a long text is decoded)
            await self._in_worker(self.plane.check, ask)
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
            return 200, [response_json(entry, request.id, outputs)], JSON
        responses = []
        try:
            async for item, _final in answer:
                if item is not None:
                    responses.append(item)
                    if len(responses) > 1:  # refused already: the rest of the work is waste
                        answer.cancel()
                        break
        except asyncio.CancelledError:
            answer.cancel()
            raise
        if len(responses) != 1:
            raise InvalidInput(
                "generate expects model to produce exactly 1 response, use generate stream "
                "for model that generates various number of responses (model "
                f"{entry.name!r} answered {'more than one' if responses else 'none'})"
            )
        (only,) = responses
        if only.error is not None:
            raise only.error
        return 200, [response_json(entry, request.id, only.outputs, only.parameters)], JSON

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
        batches = answer.batches()  # what came together is written together
        try:
            first = await batches.__anext__()
        except StopAsyncIteration:
            first = []
        except asyncio.CancelledError:
            answer.cancel()
            raise

        async def events() -> AsyncIterator[bytes]:
            """What came together is written together, in slices of about _SLICE bytes:
            each slice waits for the peer to read the one before (the writer's backpressure)
            and lets the loop run other work. A red team's backlog of 4,096 unread 100 KB
            responses was encoded whole on the loop and written at once: REST health waited
            4.8 s, and eight such streams grew the server 2 GB."""
            try:
                pending = first
                while True:
                    out: list[bytes] = []
                    size = 0
                    for item, _final in pending:
                        if item is not None and item.error is not None:
                            out.append(sse.event(orjson.dumps({"error": status_of(item.error)[1]})))
                        elif item is not None:
                            data = response_json(entry, request.id, item.outputs, item.parameters)
                            out.append(sse.event(data))
                        else:
                            continue
                        size += len(out[-1])
                        if size >= _SLICE:
                            yield b"".join(out)
                            out, size = [], 0
                            await asyncio.sleep(0)
                    pending = []  # (the slices' responses are free once written)
                    if out:
                        yield b"".join(out)
                    try:
                        pending = await batches.__anext__()
                    except StopAsyncIteration:
                        return
                    except PlugserveError as exc:
                        yield sse.event(orjson.dumps({"error": status_of(exc)[1]}))
                        return
            finally:
                await batches.aclose()
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
                {"name": name, "version": str(version), "state": state, "reason": reason}
                for name, version, state, reason in self.control.index(ready)
            ]
        )

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
    entry: LoadedNetwork,
    request: InferCall,
    inline: bool,
    token: cancel.Token | None = None,
    trace: Trace | None = None,
    tenant: str = "",
) -> Request:
    """The data plane's request for a decoded infer call: with what a Python model reads of
    it (the client's id, its parameters, its sequence), its trace, its shared memory
    outputs and its caller's tenant."""
    return Request(
        entry, request.inputs, outputs=request.outputs, run=token, timeout=request.timeout,
        priority=request.priority, id=request.id or "", parameters=request.parameters,
        step=request.step, inline=inline, trace=trace,
        after=OutputWriter(request.regions, request.classes) if request.regions else None,
        protocol="rest", tenant=tenant,
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
        pieces, header_length = json_offload.encode(
            entry.name, entry.version, request, outputs, echo
        )
    else:
        pieces, header_length = encode_infer(
            entry.name, entry.version, request, outputs, entry.max_batch_size > 0, entry.labels,
            echo,
        )  # fmt: skip
    if header_length is None:
        return 200, pieces, JSON
    return (
        200,
        pieces,
        [(b"content-type", _BINARY), (HEADER_LENGTH.encode(), str(header_length).encode())],
    )


#: a network whose small requests run in less than this runs them on the event loop when a
#: stream is idle
_INLINE_SECONDS = 1e-3


def _fast(entry: LoadedNetwork, request: InferCall) -> bool:
    """Run inline on the loop: two thread hand-offs saved (~0.25 ms at batch 1 here), and the
    loop stalls no longer than the JSON decoding of a request does. Only a small request
    (``small_inputs``: its body may be small while its inputs are in shared memory), and only
    on a network whose recent small requests ran that fast: a slower network (or one not yet
    measured) runs on its streams so the loop keeps admitting requests meanwhile, and so does
    one whose run the request can lengthen at will (a Loop: ``open_ended``), whose client
    could otherwise hold the loop until --max-request-seconds. Large requests' runs do not
    count: after one 200 MB add, small ones lost this path for a thousand requests and waited
    30-100 ms for the GIL on their hand-offs while that add's answer was copied out."""
    seconds = entry.small_run_seconds
    return (
        seconds is not None
        and seconds < _INLINE_SECONDS
        and not entry.network.open_ended
        and small_inputs(request.inputs.values())
    )


def _name_or_all(call: Call) -> str:
    """The route's ``{name}``, or "" where the route has none: every region's status, the
    server-wide trace setting."""
    return call.path.get("name") or ""


def _version(call: Call) -> int:
    return kserve.parse_version(call.path.get("version") or "")


def _system_region(body: dict[str, Any]) -> tuple[str, int, int]:
    """A system region's register body (Triton's ``{"key": ..., "offset": n, "byte_size":
    n}``) read: its key, offset and size."""
    key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
    if not isinstance(key, str):
        raise InvalidInput("the register request needs a 'key' (a string)")
    _integers(offset=offset, byte_size=size)
    return key, offset, size


def _cuda_region(body: dict[str, Any]) -> tuple[bytes | None, int, int]:
    """A CUDA region's register body (Triton's ``{"raw_handle": {"b64": ...}, "device_id": n,
    "byte_size": n}``) read: its IPC handle (None: none, or not base64), device and size."""
    raw = body.get("raw_handle")
    encoded = raw.get("b64") if isinstance(raw, dict) else None
    try:  # a bad handle is named after the CUDA check, which Triton answers first
        handle = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else None
    except (binascii.Error, ValueError):
        handle = None
    device, size = body.get("device_id", 0), body.get("byte_size")
    _integers(device_id=device, byte_size=size)
    return handle, device, size


def _integers(**fields: Any) -> None:
    """InvalidInput naming the first of a shared-memory register request's ``fields`` that is
    not an integer (JSON's true and false are not)."""
    for what, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(f"the register request's {what!r} must be an integer")


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1").strip()


def _refuse(feature: str) -> Callable[[Call], Reply]:
    def refuse(call: Call) -> Reply:
        raise Unsupported(
            f"plugserve does not support {feature}; send tensors in the request and "
            "configure the server from its command line"
        )

    return refuse
