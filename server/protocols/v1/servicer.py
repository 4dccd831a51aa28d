"""The plugserve.v1 gRPC service: messages in, data-plane and model-control calls, messages out.

No logic here: inference goes to the data plane, loading and the plugin API to model control.
A sampled ``Infer`` or ``InferStream`` request is traced as a KServe one is (its
``InferRequest`` span, continuing the W3C ``traceparent`` of the call's metadata;
docs/tracing.md).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from plugserve.plugins import cancel
from plugserve.plugins.api import FailedPrecondition, InvalidArgument, PlugserveError, Unsupported
from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc
from plugserve.server.control.core import refuse_server_keys
from plugserve.server.control.model_control import failed_to_load
from plugserve.server.plane.budget import GRPC_FACTOR
from plugserve.server.plane.request import Request, checked_id
from plugserve.server.protocols.grpc.handlers import Inference, PlaneServicer, deadline
from plugserve.server.protocols.v1.convert import (
    decoding_nbytes,
    metric_json,
    network_info,
    request_inputs,
    respond,
    sequence_of,
    stream_decoupled,
    stream_error,
    stream_response,
)

__all__ = ["PlugserveServicer"]


def _stops_when_gone(method: Callable[..., Any]) -> Callable[..., Any]:
    """Load and query work stops (CANCELLED) once its caller cancels or passes its deadline."""

    @functools.wraps(method)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with cancel.stop_when(lambda: not context.is_active()):
            return method(self, request, context)

    return call


class PlugserveServicer(PlaneServicer, pb_grpc.PlugserveServicer):
    def _serve_inference(self) -> None:
        inference = Inference(
            self.plane.tracing,
            self._admit,
            _names,
            respond,
            stream_response,
            stream_error,
            stream_decoupled,
            "infer-stream-reader",
        )
        # Infer and InferStream: the calls every protocol shares (_admit is this one's)
        self.Infer, self.InferStream = inference.unary, inference.stream

    def _model(self, source: pb.ModelSource):
        """The model, its repository settings, and whether it is the operator's (a file of
        the repository on disk) or a client's bytes (trusted only as ModelControl says)."""
        kind = source.WhichOneof("source")
        if kind == "onnx":
            return source.onnx, "", {}, 0, self.control.client_trusted
        if kind == "repository_path":
            return (*self.control.repository_model(source.repository_path), True)
        raise InvalidArgument("model: set either onnx (the model bytes) or repository_path")

    def ListDevices(self, request, context):
        response = pb.ListDevicesResponse()
        for info in self.control.core.devices():
            response.devices.add(
                name=info.name,
                available=info.available,
                reason=info.reason,
                full_name=info.full_name,
            )
        return response

    def GetMetric(self, request, context):
        if not request.device and not request.network and request.name == "SERVER_PORTS":
            return pb.GetMetricResponse(value_json=metric_json(self.plane.ports))
        if request.network:
            entry = self.plane.get(request.network, request.version)
            value = entry.network.get_metric(request.name)
        else:
            value = self.control.core.get_metric(request.device, request.name)
        return pb.GetMetricResponse(value_json=metric_json(value))

    def GetConfig(self, request, context):
        plugin = self.control.core.plugin(request.device)
        if request.key:
            value = plugin.config.to_strings().get(request.key)
            if value is None:
                plugin.get_config(request.key)  # raises the typed error
            return pb.GetConfigResponse(config={request.key: value})
        return pb.GetConfigResponse(config=plugin.config.to_strings())

    def SetConfig(self, request, context):
        refuse_server_keys(request.config, "SetConfig")
        self.control.refuse_code_keys(request.config, "SetConfig")
        self.control.core.set_config(dict(request.config), request.device or None)
        return pb.SetConfigResponse()

    def QueryNetwork(self, request, context):
        with self.control.querying(self.tenant(context), lambda: not context.is_active()):
            # the same config a load would take: a query answers for what a load would do
            refuse_server_keys(request.config, "QueryNetwork")
            self.control.refuse_code_keys(request.config, "QueryNetwork")
            model, *_ = self._model(request.model)
            config = dict(request.config)
            supported, unsupported = self.control.query(model, request.device, config)
            response = pb.QueryNetworkResponse(supported=supported, unsupported=unsupported)
            for split in self.control.subgraphs(model, request.device, config):
                response.subgraphs.add(device=split["device"], nodes=split["nodes"])
            for node, device, reason in self.control.refusals(model, request.device, config):
                response.refusals.add(node=node, device=device, reason=reason)
            return response

    @_stops_when_gone
    def LoadNetwork(self, request, context):
        try:
            refuse_server_keys(request.config, f"LoadNetwork of {request.name!r}")
            self.control.refuse_code_keys(request.config, f"LoadNetwork of {request.name!r}")
            model, device, config, batch, trusted = self._model(request.model)
            config = {**config, **dict(request.config)}
            entry, cached = self.control.load(
                request.name,
                model,
                request.device or device,
                config,
                request.persist,
                request.version,
                batch,
                trusted=trusted,
            )
        except PlugserveError as exc:  # Triton's words first, as on KServe
            error = failed_to_load(request.name, exc)
            if error is exc:
                raise
            raise error from exc
        response = pb.LoadNetworkResponse(loaded_from_cache=cached)
        network_info(response.network, entry)
        return response

    def UnloadNetwork(self, request, context):
        self.control.unload(request.name, request.version, request.remove_from_repository)
        return pb.UnloadNetworkResponse()

    def ListNetworks(self, request, context):
        response = pb.ListNetworksResponse()
        for entry in self.control.networks():
            try:
                network_info(response.networks.add(), entry)
            except Exception:  # one entry that cannot be encoded must not fail every client
                del response.networks[-1]
                logging.getLogger(__name__).exception("ListNetworks: %r left out", entry.name)
        return response

    def _admit(self, request, context, size, inline, token, streaming, trace=None):
        """One lookup: the entry runs the request and names the response. ``size``: the bytes
        the message took on the wire; it is charged for them (twice: ``GRPC_FACTOR``) and for
        its strings before they are decoded. A decoupled network answers on InferStream
        (``streaming``) only."""
        entry = self.plane.get(request.network, request.version)
        checked_id(request.id)  # every response echoes it
        ask = Request(
            entry, outputs=list(request.outputs), deadline=deadline(context), run=token,
            step=sequence_of(request), inline=inline,
            holds=size * GRPC_FACTOR + decoding_nbytes(request), protocol="v1", trace=trace,
            tenant=self.tenant(context),
        )  # fmt: skip
        if entry.network.decoupled:
            if not streaming:
                entry.recorder.refused("invalid")
                raise Unsupported(
                    f"network {entry.name!r} is decoupled (it answers a request with any "
                    "number of responses): send its requests on InferStream"
                )
            ask.inputs = request_inputs(request, entry)
            return entry, self.plane.stream(ask)
        ask.decode = functools.partial(request_inputs, request, entry)
        return entry, self.plane.infer(ask)

    def ExportNetwork(self, request, context):
        return pb.ExportNetworkResponse(blob=self.control.export(request.name, request.version))

    @_stops_when_gone
    def ImportNetwork(self, request, context):
        refuse_server_keys(request.config, f"ImportNetwork of {request.name!r}")
        self.control.refuse_code_keys(request.config, f"ImportNetwork of {request.name!r}")
        entry = self.control.import_network(
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


def _names(request) -> tuple[str, str]:
    """A request's network and id, which name its trace."""
    return request.network, request.id
