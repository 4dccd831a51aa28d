"""The KServe v2 / Triton gRPC service (``inference.GRPCInferenceService``).

A thin adapter: each RPC converts its message, calls the :class:`DataPlane` (inference) or
:class:`ModelControl` (the repository, what is loaded), and converts back, so
``tritonclient.grpc`` (and perf_analyzer) work unchanged. Errors are plugserve's typed errors,
mapped to status codes in one place (``server/errors.py``).

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
* Shared memory, trace and log settings are UNIMPLEMENTED.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import grpc

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    InvalidInput,
    NotFound,
    PlugserveError,
    Unsupported,
)
from plugserve.plugins.version import plugserve_version
from plugserve.proto import grpc_service_pb2 as pb
from plugserve.proto import grpc_service_pb2_grpc as pb_grpc
from plugserve.server.budget import GRPC_FACTOR
from plugserve.server.dataplane import DataPlane
from plugserve.server.handlers import Inference, add_service, deadline
from plugserve.server.kserve.convert import (
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
from plugserve.server.model_control import ModelControl, failed_to_load
from plugserve.server.sequences import sequence_step
from plugserve.server.shm import write_outputs
from plugserve.server.versions import parse_version

__all__ = ["KServeServicer", "add_kserve_service", "load"]

_UNIMPLEMENTED = {
    "TraceSetting": "trace settings",
    "LogSettings": "log settings",
}


# ------------------------------------------------------------------ the service


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, control: ModelControl) -> None:
        self.plane = plane
        self.control = control
        self.shm = plane.shm
        inference = Inference(
            self._submit,
            functools.partial(compose_response, shm=self.shm),
            functools.partial(stream_response, shm=self.shm),
            stream_error,
            stream_decoupled,
            "kserve-stream-reader",
        )
        # ModelInfer and ModelStreamInfer: the calls every protocol shares (_submit is this one's)
        self.ModelInfer, self.ModelStreamInfer = inference.unary, inference.stream

    # --- health and metadata

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.plane.ready)

    def ModelReady(self, request, context):
        version = parse_version(request.version)
        try:
            entry = self.plane.get(request.name, version)
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

    def _submit(
        self,
        request: pb.ModelInferRequest,
        context: grpc.ServicerContext,
        size: int,
        inline: bool = False,
        token: Any = None,
        streaming: bool = False,
    ):
        """One lookup: the entry runs the request and names the response. ``size``: the bytes
        the message took on the wire, which it is charged for (twice: ``GRPC_FACTOR``).
        ``streaming``: the request came on ModelStreamInfer, where a decoupled network's
        responses (a :class:`ResponseStream`) may go; ModelInfer refuses such a network as
        Triton does."""
        entry = self.plane.get(request.model_name, parse_version(request.model_version))
        when = deadline(context)
        step = None
        parameters: dict[str, Any] = {}
        if request.parameters:
            parameters = parameter_values(request.parameters)
            step = sequence_step(parameters)
            timeout, priority = request_timeout(parameters), request_priority(parameters)
            if timeout is not None or priority:  # the model's queue policy, or a deadline
                token = token if token is not None else cancel.Token()
                token.timeout, token.priority = timeout, priority
            own_parameters = model_parameters(parameters)
            if own_parameters is not None:
                token = token if token is not None else cancel.Token()
                token.parameters = own_parameters
            if step is not None:  # a Python model's correlation_id() and flags()
                token = token if token is not None else cancel.Token()
                token.sequence = (step.id, int(step.start) | int(step.end) << 1)
        if request.id:  # a Python model's request_id()
            token = token if token is not None else cancel.Token()
            token.request_id = request.id
        if entry.network.decoupled:
            return entry, self._submit_decoupled(request, entry, size, when, token, streaming)
        lane = plain_lane(entry)
        plain = lane.decode(request)
        if plain is not None:  # views of the message: charged when admitted
            checked, outputs = plain
            if step is None and entry.sequences is None:
                future = self.plane.admit(
                    entry,
                    {},
                    outputs,
                    when,
                    token=token,
                    holds=size * GRPC_FACTOR,
                    inline=inline,
                    checked=checked,
                )
            else:  # a request of a sequence: the sequence batcher's (server/sequences.py)
                future = self.plane.submit(
                    entry,
                    dict(zip(lane.names, checked)),
                    outputs,
                    when,
                    inline=inline,
                    token=token,
                    holds=size * GRPC_FACTOR,
                    step=step,
                    checked=checked,
                )
            return entry, future

        def decode_and_submit():
            inputs = request_inputs(request, entry, self.shm)
            targets = output_targets(request, self.shm)
            return self.plane.submit(
                entry,
                inputs,
                requested_outputs(request),
                when,
                token=token,
                inline=inline,
                after=functools.partial(write_outputs, targets) if targets else None,
                step=step,
            )

        # typed contents and strings are decoded into memory of their own: charged first
        nbytes = size * GRPC_FACTOR + decoding_nbytes(request)
        future = self.plane.charged(entry, nbytes, decode_and_submit)
        return entry, future

    def _submit_decoupled(self, request, entry, size, when, token, streaming):
        """A request to a decoupled network: its responses as a stream, on ModelStreamInfer
        only (Triton's refusal on ModelInfer)."""
        if not streaming:
            entry.recorder.refused("invalid")
            raise Unsupported(
                "ModelInfer RPC doesn't support models with decoupled transaction policy: "
                f"model {entry.name!r} answers a request with any number of responses; send "
                "it on ModelStreamInfer (tritonclient's start_stream / async_stream_infer)"
            )
        if output_targets(request, self.shm):
            raise Unsupported(
                f"model {entry.name!r} is decoupled: its outputs cannot be written to shared "
                "memory; ask for them in the responses"
            )
        nbytes = size * GRPC_FACTOR + decoding_nbytes(request)
        inputs = request_inputs(request, entry, self.shm)
        return self.plane.submit_decoupled(
            entry, inputs, requested_outputs(request), when, token, holds=nbytes
        )

    # --- system shared memory

    def SystemSharedMemoryStatus(self, request, context):
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.shm.status(request.name):
            status = response.regions[region.name]
            status.name, status.key = region.name, region.key
            status.offset, status.byte_size = region.offset, region.byte_size
        return response

    def SystemSharedMemoryRegister(self, request, context):
        self.shm.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request, context):
        self.shm.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    def CudaSharedMemoryStatus(self, request, context):
        self.shm.cuda_status(request.name)
        return pb.CudaSharedMemoryStatusResponse()

    def CudaSharedMemoryRegister(self, request, context):
        self.shm.cuda_register(request.name)

    def CudaSharedMemoryUnregister(self, request, context):
        self.shm.cuda_unregister(request.name)
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
        for name, version, ready in self.control.index(ready_only=request.ready):
            response.models.add(
                name=name,
                version=str(version),
                state="READY" if ready else "UNAVAILABLE",
                reason="" if ready else "unloaded",
            )
        return response

    def RepositoryModelLoad(self, request, context):
        self.control.check_control(f"load of model {request.model_name!r}")
        load(self.control, request.model_name, parameter_values(request.parameters))
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request, context):
        """Unload every version without deleting: the model can be loaded again."""
        self.control.check_control(f"unload of model {request.model_name!r}")
        self.control.unload(request.model_name, 0, remove=False)
        return pb.RepositoryModelUnloadResponse()


def load(control: ModelControl, name: str, parameters: Mapping[str, Any]) -> None:
    """RepositoryModelLoad for both protocols: a reload, or one with Triton's overrides
    (``config``: ModelConfig JSON; ``file:<version>/<name>``: a file's bytes). Whatever
    fails says Triton's ``failed to load 'NAME'`` first, which its clients match on."""
    try:
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidInput(f"model {name!r}: the 'config' parameter must be a JSON string")
        files = {k[5:]: v for k, v in parameters.items() if k.startswith("file:")}
        for key, value in files.items():
            if not isinstance(value, bytes):
                raise InvalidInput(f"model {name!r}: 'file:{key}' must carry the file's bytes")
        if config is None and not files:
            control.reload(name)
        else:
            control.load_with_overrides(name, config, files)
    except PlugserveError as exc:
        error = failed_to_load(name, exc)
        if error is exc:
            raise
        raise error from exc


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


def add_kserve_service(plane: DataPlane, control: ModelControl, server: grpc.Server) -> list[str]:
    """Register the KServe v2 service on ``server``; the service names, for reflection."""
    service = KServeServicer(plane, control)
    return [add_service(server, pb.DESCRIPTOR.services_by_name["GRPCInferenceService"], service)]
