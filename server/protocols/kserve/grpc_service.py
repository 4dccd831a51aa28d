"""The KServe v2 / Triton gRPC service (``inference.GRPCInferenceService``).

A thin adapter: each RPC converts its message, calls the :class:`DataPlane` (inference) or
:class:`ModelControl` (the repository, what is loaded), and converts back, so
``tritonclient.grpc`` (and perf_analyzer) work unchanged. Errors are plugserve's typed errors,
mapped to status codes in one place (``server/protocols/status.py``).

Choices where KServe/Triton leave room or plugserve differs:

* Model versions are strings on the wire: ``""`` is the latest loaded version, anything that is
  not a non-negative integer is INVALID_ARGUMENT (``"0"`` also means latest).
* Inputs come either all in ``raw_input_contents`` (one entry per input, in order) or each in its
  typed ``contents`` field, as Triton requires; outputs always leave in ``raw_output_contents``.
  BYTES elements are decoded as UTF-8 text (invalid bytes become U+FFFD), as plugserve.v1 does.
* ``sequence_id`` / ``sequence_start`` / ``sequence_end`` are refused (INVALID_ARGUMENT): no
  network here has a sequence batcher. Triton's ``timeout`` parameter (microseconds) is a
  deadline beside the gRPC one (the earlier counts; past it the request is cancelled, queued
  or running); other request parameters (priority, ...) are accepted and ignored. Output
  ``classification`` is not offered (UNIMPLEMENTED).
* ``RepositoryModelLoad`` loads the repository's latest version of the model. If that version is
  already loaded it is reloaded, so edits to the model file or its ``config.json`` take effect,
  seamlessly as Triton reloads: the new network is compiled while the old one serves, then
  replaces it; requests the old one admitted finish there; a failed reload leaves the old one
  serving.
  Triton's overrides are taken: ``config`` (a ModelConfig as JSON) and ``file:<version>/<name>``
  (the file's bytes) load the model from them instead of its folder, which is left as it is.
* ``RepositoryModelUnload`` unloads every loaded version and never deletes files: the model can
  be loaded again (plugserve.v1's UnloadNetwork deletes only with ``remove_from_repository``).
* Statistics count requests: ``inference_count`` is the number of successful requests and
  ``success.ns`` is queue + compute time. On a BATCH device (dynamic batching: a repository
  model with ``max_batch_size`` > 0, or a network loaded on ``BATCH:D(n)``) ``execution_count``
  is the number of batches run and ``batch_stats`` has one entry per batch size (rows) with its
  count and compute time; elsewhere ``execution_count`` equals ``inference_count``. The model
  configuration of such a network shows ``dynamic_batching`` (preferred size = the batch size,
  queue delay = BATCH_TIMEOUT_MS).
* Log settings are UNIMPLEMENTED. ``TraceSetting`` reads and changes Triton's trace settings
  (``server/plane/tracing.py``); a sampled ``ModelInfer`` or ``ModelStreamInfer`` request is
  traced from here (its ``InferRequest`` span, continuing the W3C ``traceparent`` of the call's
  metadata) until its answer is composed (unary) or ready (streams). See docs/tracing.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import grpc

from plugserve.plugins.api import (
    NotFound,
    Unsupported,
)
from plugserve.plugins.version import plugserve_version
from plugserve.proto import grpc_service_pb2 as pb
from plugserve.proto import grpc_service_pb2_grpc as pb_grpc
from plugserve.server.control.model_control import ModelControl
from plugserve.server.plane.budget import GRPC_FACTOR
from plugserve.server.plane.dataplane import DataPlane
from plugserve.server.plane.request import Request, checked_id
from plugserve.server.plane.sequences import sequence_step
from plugserve.server.plane.shm import OutputWriter
from plugserve.server.plane.versions import parse_version
from plugserve.server.protocols.grpc.handlers import Inference, PlaneServicer, add_service, deadline
from plugserve.server.protocols.kserve.codec import (
    EXTENSIONS,
    compose_response,
    decoding_nbytes,
    model_config,
    model_metadata,
    model_parameters,
    model_statistics,
    output_targets,
    parameter_values,
    plain_lane,
    request_inputs,
    request_priority,
    request_timeout,
    requested_outputs,
    stream_decoupled,
    stream_error,
    stream_response,
)

__all__ = ["KServeServicer", "add_kserve_service"]

_UNIMPLEMENTED = {
    "LogSettings": "log settings",
}


# ------------------------------------------------------------------ the service


class KServeServicer(PlaneServicer, pb_grpc.GRPCInferenceServiceServicer):
    def _serve_inference(self) -> None:
        self.shm = self.plane.shm
        inference = Inference(
            self.plane.tracing,
            self._admit,
            _names,
            functools.partial(compose_response, shm=self.shm),
            stream_response(self.shm),
            stream_error,
            stream_decoupled,
            "kserve-stream-reader",
        )
        # ModelInfer and ModelStreamInfer: the calls every protocol shares (_admit is this one's)
        self.ModelInfer, self.ModelStreamInfer = inference.unary, inference.stream

    # --- health and metadata

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        plane = self.plane
        return pb.ServerReadyResponse(
            ready=plane.ready and not plane.draining and not self.control.unready()
        )

    def ModelReady(self, request, context):
        version = parse_version(request.version)
        try:
            entry = self.plane.get(request.name, version, load=False)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=entry.network.ready())

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(
            name="plugserve", version=plugserve_version(), extensions=EXTENSIONS
        )

    def ModelMetadata(self, request, context):
        entry = self.plane.get(request.name, parse_version(request.version))
        versions = sorted(n.version for n in self.control.networks() if n.name == entry.name)
        return model_metadata(entry, versions)

    def ModelConfig(self, request, context):
        entry = self.plane.get(request.name, parse_version(request.version))
        policy = self.control.version_policy(entry.name)
        return pb.ModelConfigResponse(config=model_config(entry, policy))

    # --- inference

    def _admit(self, request, context, size, inline, token, streaming, trace=None):
        """One lookup: the entry runs the request and names
        the response. ``size``: the bytes the message took on the wire, which it is charged
        for (twice: ``GRPC_FACTOR``).
        ``streaming``: the request came on ModelStreamInfer, where a decoupled network's
        responses (a :class:`ResponseStream`) may go; ModelInfer refuses such a network as
        Triton does."""
        entry = self.plane.get(request.model_name, parse_version(request.model_version))
        when, step, own, timeout, priority = deadline(context), None, None, None, 0
        if request.parameters:
            parameters = parameter_values(request.parameters)
            step = sequence_step(parameters)
            own = model_parameters(parameters)
            timeout, priority = request_timeout(parameters), request_priority(parameters)
        ask = Request(
            entry, deadline=when, run=token, id=checked_id(request.id), parameters=own, step=step,
            timeout=timeout, priority=priority, inline=inline, holds=size * GRPC_FACTOR,
            protocol="grpc", trace=trace,
            tenant=self.tenant(context),
        )  # fmt: skip
        if entry.network.decoupled:
            return entry, self._submit_decoupled(request, ask, streaming)
        lane = plain_lane(entry)
        plain = lane.decode(request)
        if plain is not None:  # views of the message: charged when admitted
            ask.checked, ask.outputs = plain
            return entry, self.plane.infer(ask)
        # typed contents and strings are decoded into memory of their own: charged first
        ask.holds += decoding_nbytes(request)
        ask.decode = functools.partial(request_inputs, request, entry, self.shm.of(ask.tenant))
        ask.outputs = requested_outputs(request)
        targets = output_targets(request, self.shm.of(ask.tenant))
        if targets:
            classified = {o.name for o in request.outputs if "classification" in o.parameters}
            ask.after = OutputWriter(targets, classified)
        return entry, self.plane.infer(ask)

    def _submit_decoupled(self, request, ask: Request, streaming: bool):
        """A request to a decoupled network: its responses as a stream, on ModelStreamInfer
        only (Triton's refusal on ModelInfer)."""
        entry = ask.entry
        if not streaming:
            entry.recorder.refused("invalid")
            raise Unsupported(
                "ModelInfer RPC doesn't support models with decoupled transaction policy: "
                f"model {entry.name!r} answers a request with any number of responses; send "
                "it on ModelStreamInfer (tritonclient's start_stream / async_stream_infer)"
            )
        if output_targets(request, self.shm.of(ask.tenant)):
            raise Unsupported(
                f"model {entry.name!r} is decoupled: its outputs cannot be written to shared "
                "memory; ask for them in the responses"
            )
        ask.holds += decoding_nbytes(request)
        ask.inputs = request_inputs(request, entry, self.shm.of(ask.tenant))
        ask.outputs = requested_outputs(request)
        return self.plane.stream(ask)

    # --- trace settings (Triton's trace extension)

    def TraceSetting(self, request, context):
        """Reads (no settings) or changes (auth: an admin token) the global trace setting or
        ``model_name``'s; an empty value clears a field, as Triton's."""
        tracing = self.plane.tracing
        if request.settings:
            changes = {k: list(v.value) or None for k, v in request.settings.items()}
            answer = tracing.update(request.model_name, changes)
        else:
            answer = tracing.setting(request.model_name)
        response = pb.TraceSettingResponse()
        for key, values in answer.items():
            response.settings[key].value.extend(values)
        return response

    # --- system shared memory

    def SystemSharedMemoryStatus(self, request, context):
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.shm.status(request.name, self.tenant(context)):
            status = response.regions[region.name]
            status.name, status.key = region.name, region.key
            status.offset, status.byte_size = region.offset, region.byte_size
        return response

    def SystemSharedMemoryRegister(self, request, context):
        self.shm.register(
            request.name, request.key, request.offset, request.byte_size, self.tenant(context)
        )
        return pb.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request, context):
        self.shm.unregister(request.name, self.tenant(context))
        return pb.SystemSharedMemoryUnregisterResponse()

    def CudaSharedMemoryStatus(self, request, context):
        response = pb.CudaSharedMemoryStatusResponse()
        for region in self.shm.cuda_status(request.name, self.tenant(context)):
            status = response.regions[region.name]
            status.name, status.device_id = region.name, region.device_id
            status.byte_size = region.byte_size
        return response

    def CudaSharedMemoryRegister(self, request, context):
        self.shm.cuda_register(
            request.name,
            request.raw_handle,
            request.device_id,
            request.byte_size,
            self.tenant(context),
        )
        return pb.CudaSharedMemoryRegisterResponse()

    def CudaSharedMemoryUnregister(self, request, context):
        self.shm.cuda_unregister(request.name, self.tenant(context))
        return pb.CudaSharedMemoryUnregisterResponse()

    # --- statistics and repository

    def ModelStatistics(self, request, context):
        version = parse_version(request.version)
        if request.name:
            entries = self.control.versions(request.name, version)
        else:
            entries = self.control.networks()
        entries.sort(key=lambda n: (n.name, n.version))
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(n) for n in entries])

    def RepositoryIndex(self, request, context):
        response = pb.RepositoryIndexResponse()
        for name, version, state, reason in self.control.index(ready_only=request.ready):
            response.models.add(name=name, version=str(version), state=state, reason=reason)
        return response

    def RepositoryModelLoad(self, request, context):
        self.control.check_control(f"load of model {request.model_name!r}")
        self.control.load_request(request.model_name, parameter_values(request.parameters))
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request, context):
        """Unload every version without deleting: the model can be loaded again."""
        self.control.check_control(f"unload of model {request.model_name!r}")
        self.control.unload(request.model_name, 0, remove=False)
        return pb.RepositoryModelUnloadResponse()


def _unimplemented(method: str, feature: str):
    def handler(self, request, context):
        raise Unsupported(
            f"{method}: plugserve does not support {feature}; "
            "send tensors in the request and configure the server from its command line"
        )

    handler.__name__ = method
    return handler


for _method, _feature in _UNIMPLEMENTED.items():
    setattr(KServeServicer, _method, _unimplemented(_method, _feature))


def add_kserve_service(
    plane: DataPlane,
    control: ModelControl,
    server: grpc.Server,
    tenant_of: Callable[[Any], str] | None = None,
) -> list[str]:
    """Register the KServe v2 service on ``server``; the service names, for reflection."""
    service = KServeServicer(plane, control, tenant_of)
    return [add_service(server, pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], service)]


def _names(request) -> tuple[str, str]:
    """A request's network and id, which name its trace."""
    return request.model_name, request.id
