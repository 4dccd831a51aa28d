"""QueryNetwork of a long chain on NUMPY, this checkout's server beside a base's.

A client's QueryNetwork reads, checks and transforms its model in the server; the servers
here answer the same chains of Relu nodes (onnx's helper) over gRPC, rounds interleaved
between them (who goes first alternating); medians of the wall time of one query.

``python tests/benchmarks/bench_query_network.py --baseline-path DIR [--rounds 5]``

``DIR``: a folder holding ``plugserve`` (a link to a checkout of the base commit), put first on
the base server's PYTHONPATH (``bench_rest_beside_big.py`` says how to make one).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import harness  # noqa: F401  (sets sys.path for the imports below)
from models import chain
from serving import RunningServer

from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto import plugserve_pb2_grpc as pb_grpc


def one_query(target: str, model: bytes) -> float:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.PlugserveStub(channel)
        began = time.perf_counter()
        answer = stub.QueryNetwork(
            pb.QueryNetworkRequest(model=pb.ModelSource(onnx=model), device="NUMPY"), timeout=600
        )
        took = time.perf_counter() - began
    assert answer.supported
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-path", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2_000, 20_000])
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; NUMPY")
    models = {
        n: chain([("Relu", {})] * n, shape=(1, 4), name="long").SerializeToString()
        for n in args.nodes
    }
    times: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        empty = Path(folder)
        env = {"base": {"PYTHONPATH": args.baseline_path}, "this": {}}
        servers = {
            name: RunningServer("--model-repository", str(empty), "--max-read-seconds", "0",
                                env=env[name])
            for name in env
        }  # fmt: skip
        for server in servers.values():
            server.start()
        try:
            for round_ in range(args.rounds):
                order = ("base", "this") if round_ % 2 == 0 else ("this", "base")
                for nodes, model in models.items():
                    for name in order:
                        took = one_query(servers[name].target, model)
                        times.setdefault((name, nodes), []).append(took)
                print(f"round {round_ + 1}/{args.rounds} done", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print("\nnodes | base | this | this/base")
    for nodes in models:
        base = statistics.median(times[("base", nodes)])
        this = statistics.median(times[("this", nodes)])
        print(f"{nodes:,} | {base:.2f} s | {this:.2f} s | {this / base:.2f}")


if __name__ == "__main__":
    main()
