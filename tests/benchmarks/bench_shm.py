"""Tensors in system shared memory against tensors in the message, perf_analyzer as the client.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_shm.py
[--rounds N] [--protocol grpc|http]``

The 1x3x224x224 float32 identity and ResNet-18 (ORT, batch 1), each run by Triton's
perf_analyzer (the tritonclient 2.51.0 wheel's, tests/support/perf_analyzer.py) at concurrency 1
with ``--shared-memory system`` (inputs and outputs in regions it registers) and without
(tensors in the message), interleaved over rounds; medians of p50 latency and requests/s. A bare
grpcio echo of the identity's request bytes (one raw-bytes client) runs in the same rounds: what
any server pays to move those bytes through gRPC, which shared memory should undercut. The
server runs with ``--shared-memory-prefix /``: perf_analyzer names its regions itself.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np
import onnx
from bench_numpy_resnet import resnet18
from onnx import TensorProto, helper

SHAPE = [1, 3, 224, 224]


def identity() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _repository(root: Path) -> Path:
    for name, model in (("identity", identity()), ("resnet18", resnet18())):
        (root / name / "1").mkdir(parents=True)
        onnx.save(model, root / name / "1" / "model.onnx")
        (root / name / "config.json").write_text(json.dumps({"device": "ORT"}))
    return root


def _perf(binary, env, target, protocol, model, shm, report) -> dict[str, float]:
    command = [
        str(binary), "-u", target, "-i", protocol, "-m", model,
        "--concurrency-range", "1", "--measurement-mode", "count_windows",
        "--measurement-request-count", "200", "--max-trials", "6",
        "--stability-percentage", "100", "--percentile", "50", "-f", str(report),
    ]  # fmt: skip
    if model == "resnet18":  # its batch dimension is dynamic
        command += ["--shape", "input:1,3,224,224"]
    if shm:
        command += ["--shared-memory", "system", "--output-shared-memory-size", str(1 << 21)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)}\n{done.stdout}\n{done.stderr}")
    with open(report) as f:
        row = next(csv.DictReader(f))
    return {"p50_ms": float(row["p50 latency"]) / 1000, "rps": float(row["Inferences/Second"])}


@contextlib.contextmanager
def _removed(folder: Path) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    args = parser.parse_args(argv)
    from perf_analyzer import environment, missing
    from serving import RunningServer

    from plugserve.proto import grpc_service_pb2 as kpb

    why = missing()
    if why:
        raise SystemExit(why)
    binary, env = environment()
    folder = Path(tempfile.mkdtemp(prefix="plugserve-shm-bench-"))
    repo = _repository(folder / "repo")
    x = np.random.default_rng(0).normal(size=SHAPE).astype(np.float32)
    request = kpb.ModelInferRequest(model_name="identity")
    request.inputs.add(name="x", datatype="FP32", shape=SHAPE)
    request.raw_input_contents.append(x.tobytes())
    payload = request.SerializeToString()
    results: dict[str, list[dict[str, float]]] = {}
    with (
        _removed(folder),
        RunningServer("--model-repository", str(repo), "--shared-memory-prefix", "/") as server,
        harness.echo_server("thread", "--reuse-freed-memory") as echo,
    ):
        target = server.target if args.protocol == "grpc" else server.http_target
        echo_runner = harness.RawRunner(echo, "/bench.Echo/Echo", payload, "echo")
        echo_block = harness.block(echo_runner, 2.0)
        for r in range(args.rounds):
            for model in ("identity", "resnet18"):
                for shm in (False, True):
                    key = f"{model} {'shared memory' if shm else 'in the message'}"
                    report = folder / f"{model}-{shm}-{r}.csv"
                    results.setdefault(key, []).append(
                        _perf(binary, env, target, args.protocol, model, shm, report)
                    )
            summary = echo_block()
            results.setdefault("bare gRPC echo of the identity's bytes", []).append(
                {"p50_ms": summary["latency_ms"]["p50"], "rps": summary["throughput_rps"]}
            )
            print(f"    round {r + 1}/{args.rounds} done", file=sys.stderr)
    table = {
        key: {
            "p50_ms": round(statistics.median(v["p50_ms"] for v in rows), 3),
            "rps": round(statistics.median(v["rps"] for v in rows), 1),
        }
        for key, rows in results.items()
    }
    print(json.dumps({"machine": harness.machine(), "protocol": args.protocol, **table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
