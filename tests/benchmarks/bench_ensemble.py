"""An ensemble against its client making the calls itself (issue 36): three tiny ONNX steps
(``y = x + 1`` on [1, 16] float32, NUMPY) chained as a Triton ensemble, against one client
calling the three models in turn, through one raw-bytes gRPC client (harness.RawRunner),
interleaved rounds, medians. Round trips dominate there: the goal is the ensemble at <= 0.5x.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_ensemble.py
[--rounds N] [--seconds S]``
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

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STEP = """name: "{name}"
max_batch_size: 0
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1, 16 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1, 16 ] }} ]
"""
ENSEMBLE = """name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1, 16 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1, 16 ] } ]
ensemble_scheduling { step [
  { model_name: "step1" model_version: -1 input_map { key: "x" value: "x" }
    output_map { key: "y" value: "a" } },
  { model_name: "step2" model_version: -1 input_map { key: "x" value: "a" }
    output_map { key: "y" value: "b" } },
  { model_name: "step3" model_version: -1 input_map { key: "x" value: "b" }
    output_map { key: "y" value: "y" } }
] }
"""


def _repository(root: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "step",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    for name in ("step1", "step2", "step3"):
        (root / name / "1").mkdir(parents=True)
        onnx.save(model, root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(STEP.format(name=name))
        (root / name / "config.json").write_text('{"device": "NUMPY"}')
    (root / "chain" / "1").mkdir(parents=True)
    (root / "chain" / "config.pbtxt").write_text(ENSEMBLE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5)
    args = parser.parse_args(argv)
    from serving import RunningServer

    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    folder = Path(tempfile.mkdtemp(prefix="plugserve-ensemble-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        _repository(folder)
        server = stack.enter_context(RunningServer("--model-repository", str(folder)))
        x = {"x": np.zeros((1, 16), np.float32)}
        ensemble = harness.RawRunner(server.target, METHOD, harness.kserve_request("chain", x))
        steps = [
            harness.RawRunner(server.target, METHOD, harness.kserve_request(f"step{i}", x))
            for i in (1, 2, 3)
        ]
        for runner in (ensemble, *steps):
            stack.callback(runner.close)

        def three_calls() -> None:
            for step in steps:  # the client's own chain: each answer before the next call
                step.call()

        cases = {
            "ensemble": lambda: harness.p50_block(ensemble.call, args.seconds),
            "client's three calls": lambda: harness.p50_block(three_calls, args.seconds),
        }
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
    result: dict = {"machine": harness.machine(), "precision": "NUMPY: f32"}
    for name, runs in blocks.items():
        result[name] = round(harness.median_of(runs, "p50_ms"), 4)
    result["ensemble / three calls"], result["per round"] = harness.ratio_of(
        blocks, "ensemble", "client's three calls"
    )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
