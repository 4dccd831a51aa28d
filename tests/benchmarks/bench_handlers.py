"""How many gRPC handler threads should run calls at once: servers that differ only in
``--grpc-active-workers`` (and a baseline checkout's server, if given), side by side.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_handlers.py
[--workers 2,3,6] [--baseline PYTHON] [--seconds S] [--rounds N]``

Three requests through KServe gRPC on ORT, each at 16 in flight (requests/s) and at
concurrency 1 (p50), raw pre-serialized bytes (``harness.RawRunner``), in interleaved blocks:

- ``tiny``: a [1, 16] float32 identity (``PERFORMANCE_HINT=LATENCY``): all Python, the run
  itself a few microseconds;
- ``588KiB``: a [1, 150528] float32 identity (an ImageNet image's worth of bytes): the copies
  and gRPC's framing, done without the GIL;
- ``matmuls``: eight 1024x1024 MatMuls on a [1, 1024] input on two streams
  (``PERFORMANCE_HINT=THROUGHPUT``): a run of about a millisecond per core, computed without
  the GIL, long enough that a thread running one inline gives its turn away.

Each server's figures are also given as a ratio to the first server's. ``--workers 0`` is the
server's default.
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
import onnx
from bench_small import METHOD
from onnx import TensorProto, helper, numpy_helper

from plugserve.proto import grpc_service_pb2 as kpb

CASES = {
    "tiny": (16, 0, "LATENCY"),
    "588KiB": (150528, 0, "LATENCY"),
    "matmuls": (1024, 8, "THROUGHPUT"),
}


def model(path: Path, width: int, matmuls: int) -> str:
    """An identity of [1, width] floats, or ``matmuls`` chained [width, width] MatMuls."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(
            (rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32), f"w{i}"
        )
        for i in range(matmuls)
    ]
    names = ["input", *(f"h{i}" for i in range(matmuls - 1)), "output"]
    nodes = [
        helper.make_node("MatMul", [names[i], f"w{i}"], [names[i + 1]]) for i in range(matmuls)
    ]
    graph = helper.make_graph(
        nodes or [helper.make_node("Identity", ["input"], ["output"])],
        path.stem,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, width])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def request_bytes(name: str, width: int) -> bytes:
    request = kpb.ModelInferRequest(model_name=name)
    request.inputs.add(name="input", datatype="FP32", shape=[1, width])
    x = np.random.default_rng(1).normal(size=(1, width)).astype(np.float32)
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,3,6", help="--grpc-active-workers values")
    parser.add_argument("--baseline", metavar="PYTHON", help="another checkout's venv python")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from serving import RunningServer

    from plugserve.client import Client

    folder = Path(tempfile.mkdtemp(prefix="plugserve-handlers-"))
    repo = folder / "repo"
    repo.mkdir()
    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    servers = {
        f"active {w}" if int(w) else "default": ("", int(w)) for w in args.workers.split(",")
    }
    if args.baseline:
        servers["baseline"] = (args.baseline, 0)
    cases = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        for label, (python, workers) in servers.items():
            extra = ["--grpc-active-workers", str(workers)] if workers else []
            running = stack.enter_context(
                RunningServer("--model-repository", str(repo), *extra, python=python)
            )
            with Client(running.target, timeout=600) as client:
                for case, (width, matmuls, hint) in CASES.items():
                    path = model(folder / f"{case}.onnx", width, matmuls)
                    client.load(case, path, "ORT", {"PERFORMANCE_HINT": hint})
            for case, (width, _, _) in CASES.items():
                runner = harness.RawRunner(
                    running.target, METHOD, request_bytes(case, width), f"{label}/{case}"
                )
                cases[f"{case}/{label}/c1"] = harness.block(runner, args.seconds)
                cases[f"{case}/{label}/c16"] = harness.block(runner, args.seconds, "async", 16)
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
    result: dict = {"machine": harness.machine()}
    first = next(iter(servers))
    for case in CASES:
        rps0 = harness.median_of(blocks[f"{case}/{first}/c16"], "throughput_rps")
        p500 = harness.median_of(blocks[f"{case}/{first}/c1"], "latency_ms.p50")
        for label in servers:
            rps = harness.median_of(blocks[f"{case}/{label}/c16"], "throughput_rps")
            p50 = harness.median_of(blocks[f"{case}/{label}/c1"], "latency_ms.p50")
            result[f"{case}/{label}"] = {
                "rps_c16": round(rps, 1),
                f"rps / {first}": round(rps / rps0, 3),
                "p50_ms_c1": round(p50, 4),
                f"p50 / {first}": round(p50 / p500, 3),
            }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
