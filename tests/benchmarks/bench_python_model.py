"""A Python model's process hop against the same op as an ONNX model (issue 36): Triton's
add_sub (INPUT0 + INPUT1, INPUT0 - INPUT1 on [4] float32) as a python-backend model and as an
ONNX graph on NUMPY, in one server, beside a bare grpcio echo, through one raw-bytes gRPC
client (harness.RawRunner: what differs is the server's), interleaved rounds, medians. The
goal: the Python model's p50 within 1.35x of the ONNX model's. Then a model whose ``execute``
holds the GIL for 2 ms, with one instance and with as many as the machine has cores, 16
requests in flight: the goal is >= 0.8 x cores x one instance's requests/s (each instance is a
process of its own, with its own GIL); the same again with the processes at the server's own
priority (PROCESS_NICENESS 0, where the default runs them 10 below it).

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_python_model.py
[--rounds N] [--seconds S] [--baseline PYTHON]``

``--baseline``: another interpreter's plugserve (a base commit's virtual environment) serves the
same repository beside this one, and its add_sub p50 and GIL-bound requests/s are measured in the
same interleaved rounds (a change to the process hop, before and after, on one noisy machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np

METHOD = "/inference.GRPCInferenceService/ModelInfer"
CONFIG = """name: "{name}"
{kind}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
input [ {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""
MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
"""


GIL = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:  # 2 ms holding the GIL
                pass
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", a), pb_utils.Tensor("OUTPUT1", a)]))
        return responses
"""


#: the processes at the server's own priority (the default runs them 10 below it)
NICENESS = 'parameters {{ key: "PROCESS_NICENESS" value: {{ string_value: "{}" }} }}\n'


def _repository(root: Path) -> None:
    import onnx
    from models import add_sub

    (root / "add_sub" / "1").mkdir(parents=True)
    (root / "add_sub" / "config.pbtxt").write_text(
        CONFIG.format(name="add_sub", kind='backend: "python"')
    )
    (root / "add_sub" / "1" / "model.py").write_text(MODEL)
    cores = os.cpu_count() or 1
    for name, count, niceness in (
        ("gil_one", 1, ""),
        ("gil_cores", cores, ""),
        ("gil_cores_nice0", cores, "0"),
    ):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            CONFIG.format(name=name, kind='backend: "python"')
            + f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]\n"
            + (NICENESS.format(niceness) if niceness else "")
        )
        (root / name / "1" / "model.py").write_text(GIL)
    model = add_sub()
    (root / "add_sub_onnx" / "1").mkdir(parents=True)
    onnx.save(model, root / "add_sub_onnx" / "1" / "model.onnx")
    (root / "add_sub_onnx" / "config.json").write_text('{"device": "NUMPY"}')


def _request(model: str) -> bytes:
    x = np.arange(4, dtype=np.float32)
    return harness.kserve_request(model, {"INPUT0": x, "INPUT1": x})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--baseline", default="", metavar="PYTHON")
    args = parser.parse_args(argv)
    from serving import RunningServer

    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    folder = Path(tempfile.mkdtemp(prefix="plugserve-python-model-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        _repository(folder)
        echo = stack.enter_context(harness.echo_server("thread", "--reuse-freed-memory"))
        server = stack.enter_context(RunningServer("--model-repository", str(folder)))
        runners = {
            "echo": harness.RawRunner(echo, "/bench.Echo/Echo", _request("add_sub")),
            "onnx on NUMPY": harness.RawRunner(server.target, METHOD, _request("add_sub_onnx")),
            "python model": harness.RawRunner(server.target, METHOD, _request("add_sub")),
        }
        for runner in runners.values():
            stack.callback(runner.close)
        cases = {
            name: (lambda r=r: harness.p50_block(r.call, args.seconds))
            for name, r in runners.items()
        }
        servers = {"": server}
        if args.baseline:
            # a base without PROCESS_NICENESS refuses gil_cores_nice0 and serves the rest
            base = RunningServer(
                "--model-repository", str(folder), "--exit-on-error", "0", python=args.baseline
            )
            servers[" (baseline)"] = stack.enter_context(base)
            runner = harness.RawRunner(base.target, METHOD, _request("add_sub"))
            stack.callback(runner.close)
            cases["python model (baseline)"] = lambda r=runner: harness.p50_block(
                r.call, args.seconds
            )
        for suffix, running in servers.items():
            for name in ("gil_one", "gil_cores", "gil_cores_nice0")[: 3 if not suffix else 2]:
                runner = harness.RawRunner(running.target, METHOD, _request(name))
                stack.callback(runner.close)
                cases[name + suffix] = harness.block(
                    runner, args.seconds, mode="async", concurrency=16
                )
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
    result: dict = {"machine": harness.machine(), "precision": "NUMPY: f32; python: numpy"}
    for name, runs in blocks.items():
        if name.startswith("gil"):
            result[f"{name} requests/s"] = round(harness.median_of(runs, "throughput_rps"), 1)
        else:
            result[name] = round(harness.median_of(runs, "p50_ms"), 4)
    cores = os.cpu_count() or 1
    for suffix in ("", " (baseline)") if args.baseline else ("",):
        result[f"gil: cores instances / (cores x one instance){suffix}"] = round(
            result[f"gil_cores{suffix} requests/s"]
            / (cores * result[f"gil_one{suffix} requests/s"]),
            3,
        )
        if not suffix:
            result["gil: the same at PROCESS_NICENESS 0"] = round(
                result["gil_cores_nice0 requests/s"] / (cores * result["gil_one requests/s"]), 3
            )
        result[f"python / onnx{suffix}"], result[f"python / onnx{suffix}, per round"] = (
            harness.ratio_of(blocks, f"python model{suffix}", "onnx on NUMPY")
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
