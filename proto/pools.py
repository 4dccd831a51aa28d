"""The descriptor pool of plugserve's KServe v2 / Triton messages (package ``inference``).

tritonclient, the KServe SDK and Triton's own generated modules all add the same ``inference.*``
symbols to protobuf's default pool, each from a file of another name; the default pool refuses
a symbol defined twice, so with ours there too, a process could not import both the server and
any of those clients (a test harness serving in-process and calling with tritonclient, say).
The generated ``grpc_service_pb2`` and ``model_config_pb2`` add their files to this pool instead
(``generate.py`` writes them so); their message classes work as any others. plugserve.v1's own
messages stay in the default pool: no other package defines them.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

__all__ = ["KSERVE"]

#: ``grpc_service.proto`` and ``model_config.proto`` (``generate.PRIVATE``)
KSERVE = descriptor_pool.DescriptorPool()
