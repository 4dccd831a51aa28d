"""Generated protocol modules (``python proto/generate.py`` rebuilds them from the .proto files).

``plugserve_pb2``: plugserve's own API (package ``plugserve.v1``); ``grpc_service_pb2`` and
``model_config_pb2``: the KServe v2 / Open Inference Protocol service ``inference`` with the
message and field numbers Triton uses, so tritonclient and perf_analyzer work unchanged.
"""
