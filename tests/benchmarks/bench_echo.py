"""A bare grpcio echo server: the floor for a Python gRPC call on this machine.

``python tests/benchmarks/bench_echo.py [--kind thread|aio|kserve|kserve-ort] [--port N]
[--workers N] [--reuse-freed-memory] [--model M.onnx]`` prints ``port N`` once listening on
127.0.0.1 and echoes the bytes of ``/bench.Echo/Echo`` (no serialization on either side) until
terminated. ``thread`` is grpcio's
thread-pool server, ``aio`` the grpc.aio one. ``kserve`` is the thread-pool server answering
KServe's ``ModelInfer`` with the least any Python KServe server does: the request parsed by
protobuf and a response built from its raw inputs and serialized, no model at all.
``kserve-ort --model M.onnx`` is that server running the model too: each raw input as an
array, one onnxruntime ``run``, the outputs' bytes in the response (no checks, no limits, no
cancellation, no metrics): what a bare KServe server on onnxruntime costs.
``--reuse-freed-memory`` gives it the malloc tuning plugserve's server applies to itself
(``server/control/allocator.py``), for a floor that has it too.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc

OPTIONS = [
    ("grpc.max_send_message_length", 1 << 30),
    ("grpc.max_receive_message_length", 1 << 30),
]


def _handler(echo):
    return grpc.method_handlers_generic_handler(
        "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )


def serve_thread(port: int, workers: int) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=workers), options=OPTIONS)
    server.add_generic_rpc_handlers((_handler(lambda request, context: request),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"port {bound}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    server.wait_for_termination()


def kserve_echo(request, context):
    """Each input back as an output of the same name, type, shape and raw bytes."""
    from plugserve.proto import grpc_service_pb2 as kpb

    response = kpb.ModelInferResponse(model_name=request.model_name, id=request.id)
    for tensor in request.inputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
    response.raw_output_contents.extend(request.raw_input_contents)
    return response


def ort_infer(model: str):
    """A ModelInfer behaviour running ``model`` in one onnxruntime session."""
    import numpy as np
    import onnxruntime as ort

    from plugserve.proto import grpc_service_pb2 as kpb

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as plugserve's ORT device runs a latency-hinted model
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    types = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}

    def infer(request, context):
        feeds = {
            t.name: np.frombuffer(raw, types[t.datatype]).reshape(t.shape)
            for t, raw in zip(request.inputs, request.raw_input_contents)
        }
        outputs = session.run(names, feeds)
        response = kpb.ModelInferResponse(model_name=request.model_name, id=request.id)
        for name, array in zip(names, outputs):
            response.outputs.add(name=name, datatype="FP32", shape=array.shape)
            response.raw_output_contents.append(array.tobytes())
        return response

    return infer


def serve_kserve(port: int, workers: int, behaviour=kserve_echo) -> None:
    from plugserve.proto import grpc_service_pb2 as kpb

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(
                behaviour,
                request_deserializer=kpb.ModelInferRequest.FromString,
                response_serializer=kpb.ModelInferResponse.SerializeToString,
            )
        },
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=workers), options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(f"port {bound}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    server.wait_for_termination()


async def serve_aio(port: int) -> None:
    async def echo(request, context):
        return request

    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((_handler(echo),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"port {bound}", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = ("thread", "aio", "kserve", "kserve-ort")
    parser.add_argument("--kind", choices=kinds, default="thread")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--reuse-freed-memory", action="store_true")
    parser.add_argument("--model", help="the ONNX model kserve-ort runs")
    args = parser.parse_args(argv)
    if args.reuse_freed_memory:
        from plugserve.server.control.allocator import reuse_freed_memory

        reuse_freed_memory(32 << 20)
    if args.kind == "aio":
        asyncio.run(serve_aio(args.port))
    elif args.kind == "kserve":
        serve_kserve(args.port, args.workers)
    elif args.kind == "kserve-ort":
        serve_kserve(args.port, args.workers, ort_infer(args.model))
    else:
        serve_thread(args.port, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
