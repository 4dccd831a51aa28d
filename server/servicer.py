"""The plugserve.v1 gRPC service: messages in, data-plane calls, messages out. No logic here."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import FailedPrecondition, InvalidArgument, InvalidInput, listing
from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc
from plugserve.proto.tensors import (
    DTYPES,
    Pieces,
    TensorFormatError,
    array_payload,
    dtype_name,
    field_pieces,
    spec_to_proto,
)
from plugserve.proto.tensors import from_tensor as _from_tensor
from plugserve.server.dataplane import DataPlane, LoadedNetwork
from plugserve.server.errors import status_of
from plugserve.server.handlers import deadline, pump, result

__all__ = ["PlugserveServicer", "infer_response", "network_info"]

# Field numbers of the composed messages (plugserve.proto).
_RESPONSE_OUTPUTS = pb.InferResponse.DESCRIPTOR.fields_by_name["outputs"].number
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_STREAM_RESPONSE = pb.InferStreamResponse.DESCRIPTOR.fields_by_name["response"].number


def network_info(message: pb.NetworkInfo, entry: LoadedNetwork) -> pb.NetworkInfo:
    message.name = entry.name
    message.version = entry.version
    message.device = entry.device
    message.persisted = entry.persisted
    message.max_batch_size = entry.max_batch_size
    for spec in entry.network.inputs:
        spec_to_proto(message.inputs.add(), spec)
    for spec in entry.network.outputs:
        spec_to_proto(message.outputs.add(), spec)
    message.config.update(entry.network.config.to_strings())
    return message


def infer_response(
    request_id: str, network: str, version: int, outputs: Mapping[str, Any]
) -> Pieces:
    """An ``InferResponse`` as wire pieces (see ``proto.tensors``): the data is not copied
    until the pieces are joined."""
    head = pb.InferResponse(id=request_id, network=network, version=version)
    pieces: Pieces = [head.SerializeToString()]
    for name, array in outputs.items():
        array = np.asarray(array)
        meta = pb.Tensor(name=name, dtype=dtype_name(array.dtype), shape=array.shape)
        tensor: Pieces = [meta.SerializeToString()]
        payload = array_payload(array)
        if len(payload):  # proto3 leaves an empty bytes field out
            tensor += field_pieces(_TENSOR_DATA, [payload])
        pieces += field_pieces(_RESPONSE_OUTPUTS, tensor)
    return pieces


def _stream_response(request: pb.InferRequest, entry: LoadedNetwork, outputs: dict) -> bytes:
    head = pb.InferStreamResponse(id=request.id).SerializeToString()
    pieces = infer_response(request.id, entry.name, entry.version, outputs)
    return b"".join([head, *field_pieces(_STREAM_RESPONSE, pieces)])


def _stream_error(request: pb.InferRequest, exc: BaseException) -> pb.InferStreamResponse:
    code, message = status_of(exc)
    return pb.InferStreamResponse(
        id=request.id, error=pb.Status(code=code.value[0], message=message)
    )


def from_tensor(tensor: pb.Tensor):
    try:
        return _from_tensor(tensor)
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    except ValueError as exc:  # numpy refuses the shape (a 0-size tensor with huge dims)
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(tensor.shape)} cannot be held: {exc}"
        ) from None


def _json(value: Any) -> str:
    return json.dumps(value, default=lambda v: list(v) if isinstance(v, tuple | set) else str(v))


def _stops_when_gone(method: Callable[..., Any]) -> Callable[..., Any]:
    """Load and query work stops (CANCELLED) once its caller cancels or passes its deadline."""

    @functools.wraps(method)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with cancel.stop_when(lambda: not context.is_active()):
            return method(self, request, context)

    return call


def _repeated(tensors: Any) -> str:
    names = [t.name for t in tensors]
    return listing(sorted({n for n in names if names.count(n) > 1}))


class PlugserveServicer(pb_grpc.PlugserveServicer):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def _model(self, source: pb.ModelSource):
        kind = source.WhichOneof("source")
        if kind == "onnx":
            return source.onnx, "", {}, 0
        if kind == "repository_path":
            return self.plane.repository_model(source.repository_path)
        raise InvalidArgument("model: set either onnx (the model bytes) or repository_path")

    def ListDevices(self, request, context):
        response = pb.ListDevicesResponse()
        for info in self.plane.core.devices():
            response.devices.add(
                name=info.name,
                available=info.available,
                reason=info.reason,
                full_name=info.full_name,
            )
        return response

    def GetMetric(self, request, context):
        if not request.device and not request.network and request.name == "SERVER_PORTS":
            return pb.GetMetricResponse(value_json=_json(self.plane.ports))
        if request.network:
            entry = self.plane.get(request.network, request.version)
            value = entry.network.get_metric(request.name)
        else:
            value = self.plane.core.get_metric(request.device, request.name)
        return pb.GetMetricResponse(value_json=_json(value))

    def GetConfig(self, request, context):
        plugin = self.plane.core.plugin(request.device)
        if request.key:
            value = plugin.config.to_strings().get(request.key)
            if value is None:
                plugin.get_config(request.key)  # raises the typed error
            return pb.GetConfigResponse(config={request.key: value})
        return pb.GetConfigResponse(config=plugin.config.to_strings())

    def SetConfig(self, request, context):
        self.plane.core.set_config(dict(request.config), request.device or None)
        return pb.SetConfigResponse()

    @_stops_when_gone
    def QueryNetwork(self, request, context):
        model, *_ = self._model(request.model)
        config = dict(request.config)
        supported, unsupported = self.plane.query(model, request.device, config)
        response = pb.QueryNetworkResponse(supported=supported, unsupported=unsupported)
        for split in self.plane.subgraphs(model, request.device, config):
            response.subgraphs.add(device=split["device"], nodes=split["nodes"])
        for node, device, reason in self.plane.refusals(model, request.device, config):
            response.refusals.add(node=node, device=device, reason=reason)
        return response

    @_stops_when_gone
    def LoadNetwork(self, request, context):
        model, device, config, batch = self._model(request.model)
        config = {**config, **dict(request.config)}
        entry, cached = self.plane.load(
            request.name,
            model,
            request.device or device,
            config,
            request.persist,
            request.version,
            batch,
        )
        response = pb.LoadNetworkResponse(loaded_from_cache=cached)
        network_info(response.network, entry)
        return response

    def UnloadNetwork(self, request, context):
        self.plane.unload(request.name, request.version, request.remove_from_repository)
        return pb.UnloadNetworkResponse()

    def ListNetworks(self, request, context):
        response = pb.ListNetworksResponse()
        for entry in self.plane.networks():
            try:
                network_info(response.networks.add(), entry)
            except Exception:  # one entry that cannot be encoded must not fail every client
                del response.networks[-1]
                logging.getLogger(__name__).exception("ListNetworks: %r left out", entry.name)
        return response

    def _submit(self, request: pb.InferRequest, context, inline: bool = False):
        """One lookup: the entry runs the request and names the response."""
        entry = self.plane.get(request.network, request.version)
        for tensor in request.inputs:  # element types first: nothing decoded for a wrong one
            if tensor.dtype in DTYPES:
                entry.expect(tensor.name, DTYPES[tensor.dtype])
        inputs = {t.name: from_tensor(t) for t in request.inputs}
        if len(inputs) != len(request.inputs):  # as KServe: one value per input, never two
            raise InvalidInput(f"input(s) sent more than once: {_repeated(request.inputs)}")
        future = self.plane.submit(entry, inputs, list(request.outputs), deadline(context), inline)
        return entry, future

    def Infer(self, request, context):
        entry, future = self._submit(request, context, inline=True)
        return b"".join(
            infer_response(request.id, entry.name, entry.version, result(context, future))
        )

    def InferStream(self, request_iterator: Iterator[pb.InferRequest], context):
        """Requests are admitted as they arrive; responses leave in completion order."""
        yield from pump(
            request_iterator,
            context,
            self._submit,
            _stream_response,
            _stream_error,
            "infer-stream-reader",
        )

    def ExportNetwork(self, request, context):
        return pb.ExportNetworkResponse(blob=self.plane.export(request.name, request.version))

    @_stops_when_gone
    def ImportNetwork(self, request, context):
        entry = self.plane.import_network(
            request.name, request.blob, request.device, dict(request.config)
        )
        response = pb.LoadNetworkResponse(loaded_from_cache=True)
        network_info(response.network, entry)
        return response

    def GetPerformanceCounts(self, request, context):
        entry = self.plane.get(request.name, request.version)
        if not entry.perf_enabled:
            raise FailedPrecondition(
                f"network {entry.name!r}: performance counters are off; load it with PERF_COUNT=YES"
            )
        response = pb.GetPerformanceCountsResponse()
        for count, total, runs in entry.recorder.perf_totals():
            response.counts.add(
                node_name=count.node_name,
                op_type=count.op_type,
                status=count.status,
                exec_type=count.exec_type,
                real_time_s=total,
                device=count.device or entry.device,
                original_names=list(count.original_names),
                count=runs,
            )
        return response
