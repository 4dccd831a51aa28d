"""A bare grpcio echo server: the floor for a Python gRPC call on this machine.

``python tests/benchmarks/bench_echo.py [--kind thread|aio] [--port N] [--reuse-freed-memory]``
prints ``port N`` once listening on 127.0.0.1 and echoes the bytes of ``/bench.Echo/Echo`` (no
serialization on either side) until terminated. ``thread`` is grpcio's thread-pool server,
``aio`` the grpc.aio one. ``--reuse-freed-memory`` gives it the malloc tuning plugserve's
server applies to itself (``server/allocator.py``), for a floor that has it too.
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
    parser.add_argument("--kind", choices=("thread", "aio"), default="thread")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--reuse-freed-memory", action="store_true")
    args = parser.parse_args(argv)
    if args.reuse_freed_memory:
        from plugserve.server.allocator import reuse_freed_memory

        reuse_freed_memory(32 << 20)
    if args.kind == "aio":
        asyncio.run(serve_aio(args.port))
    else:
        serve_thread(args.port, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
