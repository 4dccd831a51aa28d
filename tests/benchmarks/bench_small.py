"""A tiny request's cost: a [1, 16] float32 identity through KServe gRPC against a bare echo.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_small.py
[--seconds S] [--rounds N] [--device ORT] [--baseline PYTHON]``

The server's cost per request, with nothing else in it: the same pre-serialized
``ModelInferRequest`` bytes go to plugserve's ``ModelInfer`` and to a bare grpcio echo server
(``bench_echo.py``, thread-pool server, plugserve's malloc tuning too) through one raw-bytes
client (``harness.RawRunner``: the reply is not decoded), in interleaved blocks; p50 at
concurrency 1 and requests/s at 16 in flight, medians over the rounds, and each as a ratio to
the echo's. Issue 22's target: p50 <= 1.3x the echo's, requests/s >= 75 % of it. Beside
them, two floors of any Python KServe server on grpcio (``bench_echo.py --kind kserve`` and
``kserve-ort``): the request parsed and a response built with protobuf and nothing else, and
that plus one onnxruntime run of the same model (no checks, limits, cancellation or metrics),
each on grpcio's thread-pool server with as many threads as plugserve runs calls at once by
default (``--grpc-active-workers``). With
``--baseline`` (another checkout's venv python) that checkout's server runs the same blocks
beside this one's, for before/after figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np
from bench_before_after import identity16

from plugserve.proto import grpc_service_pb2 as kpb
from plugserve.server.process.settings import Settings

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def request_bytes(x: np.ndarray) -> bytes:
    request = kpb.ModelInferRequest(model_name="identity16")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="ORT")
    parser.add_argument("--baseline", metavar="PYTHON")
    args = parser.parse_args(argv)
    from serving import RunningServer

    from plugserve.client import Client

    folder = Path(tempfile.mkdtemp(prefix="plugserve-small-"))
    path = identity16(folder / "identity16.onnx")
    repo = folder / "repo"
    repo.mkdir()
    payload = request_bytes(np.random.default_rng(0).normal(size=(1, 16)).astype(np.float32))
    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    # the floors run calls on as many threads as plugserve does by default
    threads = ("--workers", str(Settings().active_grpc_workers()))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        targets = {
            "echo": stack.enter_context(harness.echo_server("thread", "--reuse-freed-memory")),
            "kserve-echo": stack.enter_context(
                harness.echo_server("kserve", "--reuse-freed-memory", *threads)
            ),
            "kserve-ort": stack.enter_context(
                harness.echo_server(
                    "kserve-ort", "--reuse-freed-memory", "--model", str(path), *threads
                )
            ),
        }
        servers = {"plugserve": None}
        if args.baseline:
            servers["baseline"] = args.baseline
        for label, python in servers.items():
            extra = {"python": python} if python else {}
            running = stack.enter_context(RunningServer("--model-repository", str(repo), **extra))
            with Client(running.target, timeout=600) as client:
                client.load("identity16", path, args.device, {"PERFORMANCE_HINT": "LATENCY"})
            targets[label] = running.target
        cases = {}
        for label, target in targets.items():
            method = "/bench.Echo/Echo" if label == "echo" else METHOD
            runner = harness.RawRunner(target, method, payload, label)
            cases[f"{label}/c1"] = harness.block(runner, args.seconds)
            cases[f"{label}/c16"] = harness.block(runner, args.seconds, "async", 16)
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
    result: dict = {"machine": harness.machine(), "device": args.device}
    echo_p50 = harness.median_of(blocks["echo/c1"], "latency_ms.p50")
    echo_rps = harness.median_of(blocks["echo/c16"], "throughput_rps")
    for label in targets:
        p50 = harness.median_of(blocks[f"{label}/c1"], "latency_ms.p50")
        rps = harness.median_of(blocks[f"{label}/c16"], "throughput_rps")
        result[label] = {
            "p50_ms_c1": round(p50, 4),
            "rps_c16": round(rps, 1),
            "p50 / echo": round(p50 / echo_p50, 3),
            "rps / echo": round(rps / echo_rps, 3),
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
