"""What a hop through Ray costs: a tiny request through Ray Serve's gRPC proxy and through
``MULTI:RAY`` against the same request to a plugserve server, and Serve's throughput from one
replica to two.

``python tests/benchmarks/bench_ray.py [--seconds S] [--rounds N] [--concurrency C]`` (root:
it builds a three-node cluster in network namespaces, tests/support/ray_cluster.py)

The request is a [1, 16] float32 identity on NUMPY (``bench_before_after.identity16``),
pre-serialized KServe ``ModelInferRequest`` bytes sent by one raw-bytes gRPC client
(``harness.RawRunner``, with Serve's ``application`` metadata where it routes by it) from the
host over the cluster's bridge. Cases, interleaved in blocks (medians over the rounds):

* ``local``: ``plugserve serve`` on the head node, the model on NUMPY in its process;
* ``MULTI:RAY``: the same server, the model on ``MULTI:RAY.w1,RAY.w2``: a request goes from the
  server to the actor on w1 (the first device with room) and back;
* ``Serve proxy``: Serve's gRPC proxy on the head, to a replica of ``plugserve.ray:app`` on a
  worker (app ``two``: two replicas, one per worker).

Throughput at ``--concurrency`` in flight: app ``one`` (one replica) against app ``two`` (two
replicas, one per worker), and the local server beside them. On this machine every node
shares the same 2 cores with the client and the proxy, so a second replica adds no cores: the
figure shows the scheduling works (both replicas serve), not what a second machine would add.
Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np
from bench_before_after import identity16
from bench_small import request_bytes

from plugserve.client.bench import measure, summarize

METHOD = "/inference.GRPCInferenceService/ModelInfer"


class AppRunner(harness.RawRunner):
    """:class:`harness.RawRunner` with gRPC metadata (Serve's ``application``)."""

    def __init__(self, target: str, payload: bytes, label: str, metadata=()) -> None:
        super().__init__(target, METHOD, payload, label)
        self.metadata = tuple(metadata)

    def call(self) -> None:
        self.method(self.payload, timeout=60, metadata=self.metadata)

    def submit(self, done) -> None:
        future = self.method.future(self.payload, timeout=60, metadata=self.metadata)
        future.add_done_callback(lambda f: done(f.exception()))


def _payload(model: str) -> bytes:
    data = request_bytes(np.random.default_rng(0).normal(size=(1, 16)).astype(np.float32))
    from plugserve.proto import grpc_service_pb2 as kpb

    request = kpb.ModelInferRequest.FromString(data)
    request.model_name = model
    return request.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    import ray_cluster

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    folder = Path(tempfile.mkdtemp(prefix="plugserve-ray-bench-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        repo = folder / "models"
        for name, device in (("tiny", "NUMPY"), ("tiny_ray", "MULTI:RAY.w1,RAY.w2")):
            (repo / name / "1").mkdir(parents=True)
            identity16(repo / name / "1" / "model.onnx")
            (repo / name / "config.json").write_text(json.dumps({"device": device}))
        serve_repo = folder / "serve"
        shutil.copytree(repo / "tiny", serve_repo / "tiny")
        cluster = ray_cluster.RayCluster()
        stack.callback(cluster.close)
        cluster.start()
        log("cluster up")
        server = ray_cluster.NodeServer(cluster, "head", "--model-repository", str(repo))
        stack.callback(server.stop)
        server.start(timeout=300)
        apps = [
            {
                "name": name,
                "route_prefix": f"/{name}",
                "import_path": "plugserve.ray:app",
                "args": {
                    "name": name,
                    "model_repository": str(serve_repo),
                    "num_replicas": replicas,
                    "max_replicas_per_node": 1,
                },
            }
            for name, replicas in (("one", 1), ("two", 2))
        ]
        head = f"http://{cluster.head.ip}:{ray_cluster.HTTP_PORT}"
        cluster.serve_run(apps, [f"{head}/one/v2/health/ready", f"{head}/two/v2/health/ready"])
        harness.wait_until(lambda: sum(cluster.replicas("two:two").values()) == 2, 120)
        log("serve up")
        proxy = f"{cluster.head.ip}:{ray_cluster.GRPC_PORT}"
        runners = {
            "local": AppRunner(server.target, _payload("tiny"), "local"),
            "MULTI:RAY": AppRunner(server.target, _payload("tiny_ray"), "MULTI:RAY"),
            "Serve proxy": AppRunner(
                proxy, _payload("tiny"), "Serve proxy", [("application", "two")]
            ),
        }
        for runner in runners.values():
            stack.callback(runner.close)
        latency = harness.interleave(
            {
                name: (lambda r=r: harness.p50_block(r.call, args.seconds))
                for name, r in runners.items()
            },
            args.rounds,
            log,
            alternate=True,
        )
        replicas_runners = {
            "local": runners["local"],
            "Serve, 1 replica": AppRunner(proxy, _payload("tiny"), "one", [("application", "one")]),
            "Serve, 2 replicas": runners["Serve proxy"],
        }
        stack.callback(replicas_runners["Serve, 1 replica"].close)
        throughput = harness.interleave(
            {
                name: (
                    lambda r=r: summarize(
                        measure(r, "async", args.concurrency, duration=args.seconds, warmup=5)
                    )
                )
                for name, r in replicas_runners.items()
            },
            args.rounds,
            log,
            alternate=True,
        )
    local = [b["p50_ms"] for b in latency["local"]]
    print("| case | p50 ms | x local | extra ms |")
    print("|---|---|---|---|")
    for name, blocks in latency.items():
        p50 = statistics.median(b["p50_ms"] for b in blocks)
        ratio = statistics.median(b["p50_ms"] / l for b, l in zip(blocks, local))
        extra = statistics.median(b["p50_ms"] - l for b, l in zip(blocks, local))
        print(f"| {name} | {p50:.3f} | {ratio:.2f}x | {extra:+.3f} |")
    print()
    print(f"| {args.concurrency} in flight | requests/s | p50 ms |")
    print("|---|---|---|")
    for name, blocks in throughput.items():
        rps = statistics.median(b["throughput_rps"] for b in blocks)
        p50 = statistics.median(b["latency_ms"]["p50"] for b in blocks)
        print(f"| {name} | {rps:.0f} | {p50:.2f} |")
    print()
    print(json.dumps({"machine": harness.machine(), "load": harness.load_average()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
