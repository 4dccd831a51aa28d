"""Small requests before and after a change: this checkout's server beside a base commit's.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_before_after.py
--baseline /path/to/base/venv/bin/python [--seconds S] [--rounds N]``

Both servers serve the same two cases on ORT (PERFORMANCE_HINT=LATENCY), driven by the same
clients in interleaved blocks (each before/after pair side by side, who goes first alternating
from round to round: the second of a pair measured faster here): a [1, 16] float32 identity
through KServe gRPC (tritonclient) and the MLP at batch 1 through KServe REST with JSON tensors
(the raw-bytes HTTP client); p50 at concurrency 1 and requests/s at 16 in flight, medians over
the rounds. What a change to the request path costs a small request shows here (cancellation
tokens, the deadline watch, the memory budget); issue 21 asked for these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np
import onnx
import zoo
from bench_mlserver import _rest, json_request
from onnx import TensorProto, helper

from plugserve.client.bench import KserveRunner


def identity16(path: Path) -> str:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "identity16",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 16])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="PYTHON")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    from serving import RunningServer

    from plugserve.client import Client

    folder = Path(tempfile.mkdtemp(prefix="plugserve-before-after-"))
    paths = {
        "identity16": identity16(folder / "identity16.onnx"),
        "mlp": zoo.save_all(folder)["mlp"],
    }
    repo = folder / "repo"
    repo.mkdir()
    rng = np.random.default_rng(0)
    x16 = {"input": rng.normal(size=(1, 16)).astype(np.float32)}
    mlp = {"input": rng.normal(size=zoo.input_shape("mlp")).astype(np.float32)}
    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    with contextlib.ExitStack() as stack:
        servers = {
            "after": stack.enter_context(RunningServer("--model-repository", str(repo))),
            "before": stack.enter_context(
                RunningServer("--model-repository", str(repo), python=args.baseline)
            ),
        }
        cases = {}
        for label, running in servers.items():
            with Client(running.target, timeout=600) as client:
                for name, path in paths.items():
                    client.load(name, path, "ORT", {"PERFORMANCE_HINT": "LATENCY"})
            grpc = KserveRunner(running.target, "identity16", x16)
            rest = _rest(running.http_target, "mlp", json_request(mlp))
            cases[f"grpc/{label}/c1"] = harness.block(grpc, args.seconds)
            cases[f"grpc/{label}/c16"] = harness.block(grpc, args.seconds, "async", 16)
            cases[f"rest/{label}/c1"] = harness.block(rest, args.seconds)
            cases[f"rest/{label}/c16"] = harness.block(rest, args.seconds, "async", 16)
        blocks: dict[str, list] = {k: [] for k in cases}
        for r in range(args.rounds):  # each pair of blocks side by side, who goes first alternating
            for protocol in ("grpc", "rest"):
                for c in ("c1", "c16"):
                    pair = [f"{protocol}/after/{c}", f"{protocol}/before/{c}"]
                    for key in pair if r % 2 == 0 else reversed(pair):
                        blocks[key].append(cases[key]())
            log(f"    round {r + 1}/{args.rounds} done")
    result = {"machine": harness.machine()}
    for protocol in ("grpc", "rest"):
        row = {}
        for label in servers:
            row[label] = {
                "p50_ms_c1": harness.median_of(blocks[f"{protocol}/{label}/c1"], "latency_ms.p50"),
                "rps_c16": harness.median_of(blocks[f"{protocol}/{label}/c16"], "throughput_rps"),
            }
        row["after/before p50"] = row["after"]["p50_ms_c1"] / row["before"]["p50_ms_c1"]
        row["after/before rps"] = row["after"]["rps_c16"] / row["before"]["rps_c16"]
        result[protocol] = row
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
