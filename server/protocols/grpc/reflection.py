"""gRPC server reflection under both its names: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection serves only ``v1alpha``, while current tools (grpcurl, Postman, grpc-java's
and grpc-go's clients) ask ``v1`` first and some never fall back. The two protocols are the
same messages under another package: every field has the same number and type, so one
servicer answers both, its bytes read and written by the ``v1alpha`` message classes. The
``v1`` file is the ``v1alpha`` one with its package and name changed, added to the default
descriptor pool, so a tool that describes ``grpc.reflection.v1.ServerReflection`` finds it.
Described symbols are looked up in the KServe messages' own pool (``proto/pools.py``), then in
the default one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from plugserve.proto import pools

__all__ = ["SERVICE_NAMES", "enable"]

V1 = "grpc.reflection.v1.ServerReflection"
SERVICE_NAMES = (V1, reflection.SERVICE_NAME)


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "grpc/reflection/v1/reflection.proto"
    file.package = "grpc.reflection.v1"
    for message in file.message_type:
        for field in message.field:
            if field.type_name.startswith(".grpc.reflection.v1alpha."):
                field.type_name = ".grpc.reflection.v1." + field.type_name.rsplit(".", 1)[1]
    for service in file.service:
        for method in service.method:
            for attr in ("input_type", "output_type"):
                name = getattr(method, attr).rsplit(".", 1)[1]
                setattr(method, attr, ".grpc.reflection.v1." + name)
    pool.Add(file)


class _Pools:
    """The pools a described symbol or file may be in, looked up in order: plugserve's KServe
    messages have a pool of their own (``proto/pools.py``), the rest are in the default one."""

    def __init__(self, *pools: descriptor_pool.DescriptorPool) -> None:
        self._pools = pools

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not name.startswith("Find"):
            raise AttributeError(name)

        def find(*args: Any) -> Any:
            for pool in self._pools[:-1]:
                try:
                    return getattr(pool, name)(*args)
                except KeyError:
                    continue
            return getattr(self._pools[-1], name)(*args)

        return find


def enable(service_names: Sequence[str], server: grpc.Server) -> None:
    """Reflection of ``service_names`` (and of itself, both versions) on ``server``."""
    _add_v1_descriptor()
    servicer = reflection.ReflectionServicer(
        [*service_names, *SERVICE_NAMES],
        pool=_Pools(pools.KSERVE, descriptor_pool.Default()),  # type: ignore[arg-type]
    )
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
            for name in SERVICE_NAMES
        ]
    )
