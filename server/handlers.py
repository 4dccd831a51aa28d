"""gRPC method handlers made from a service's descriptor, with one serializer for all.

The generated ``add_*Servicer_to_server`` functions serialize every response with its message
class. Inference responses are instead composed as wire bytes (``proto.tensors.field_pieces``:
one copy of the tensor data rather than three), so each handler here passes ``bytes`` through
and serializes a message as usual.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

__all__ = ["add_service"]

_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _serialize(response: Any) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_service(server: grpc.Server, service: ServiceDescriptor, servicer: Any) -> str:
    """Register every method of ``service`` on ``server``, served by ``servicer``'s method of
    the same name; returns the service's full name (for reflection)."""
    handlers = {
        method.name: _KINDS[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=GetMessageClass(method.input_type).FromString,
            response_serializer=_serialize,
        )
        for method in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
    return service.full_name
