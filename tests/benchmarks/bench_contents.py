"""KServe typed ``contents`` against raw bytes: what the KServe SDK's requests cost the server.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_contents.py
[--seconds S] [--rounds N] [--baseline PYTHON]``

The KServe Python SDK, grpcurl's JSON and MLServer's clients send a tensor's values in
``InferTensorContents``' repeated fields; tritonclient and perf_analyzer send raw bytes. The
same pre-serialized ``ModelInferRequest`` bytes go through one raw-bytes gRPC client
(``harness.RawRunner``, the reply not decoded) to plugserve's ORT identity of each input, at
concurrency 1, in interleaved blocks; p50 per case, medians over the rounds. With
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
import onnx
from onnx import TensorProto, helper

from plugserve.proto import grpc_service_pb2 as kpb

METHOD = "/inference.GRPCInferenceService/ModelInfer"

#: case -> (model, input datatype, ONNX element type, shape, values)
_RNG = np.random.default_rng(0)
CASES = {
    "image fp32 [1,3,224,224]": (
        "image",
        "FP32",
        TensorProto.FLOAT,
        (1, 3, 224, 224),
        _RNG.standard_normal((1, 3, 224, 224)).astype(np.float32),
    ),
    "tokens int64 [1,512]": (
        "tokens",
        "INT64",
        TensorProto.INT64,
        (1, 512),
        _RNG.integers(0, 30522, (1, 512)).astype(np.int64),
    ),
    "ids int64 [1,262144]": (
        "ids",
        "INT64",
        TensorProto.INT64,
        (1, 262144),
        _RNG.integers(0, 30522, (1, 262144)).astype(np.int64),
    ),
}
_FIELDS = {"FP32": "fp32_contents", "INT64": "int64_contents"}


def identity(path: Path, elem: int, shape: tuple[int, ...]) -> str:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        path.stem,
        [helper.make_tensor_value_info("x", elem, list(shape))],
        [helper.make_tensor_value_info("y", elem, list(shape))],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def request_bytes(model: str, datatype: str, values: np.ndarray, typed: bool) -> bytes:
    request = kpb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="x", datatype=datatype, shape=list(values.shape))
    if typed:
        getattr(tensor.contents, _FIELDS[datatype]).extend(values.ravel().tolist())
    else:
        request.raw_input_contents.append(values.tobytes())
    return request.SerializeToString()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", metavar="PYTHON")
    args = parser.parse_args(argv)
    from serving import RunningServer

    from plugserve.client import Client

    folder = Path(tempfile.mkdtemp(prefix="plugserve-contents-"))
    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    servers = {"plugserve": None, **({"baseline": args.baseline} if args.baseline else {})}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        (folder / "repo").mkdir()
        paths = {
            model: identity(folder / f"{model}.onnx", elem, shape)
            for model, _, elem, shape, _ in CASES.values()
        }
        targets = {}
        for label, python in servers.items():
            extra = {"python": python} if python else {}
            running = stack.enter_context(
                RunningServer("--model-repository", str(folder / "repo"), **extra)
            )
            with Client(running.target, timeout=600) as client:
                for model, path in paths.items():
                    client.load(model, path, "ORT", {"PERFORMANCE_HINT": "LATENCY"})
            targets[label] = running.target
        cases = {}
        for case, (model, datatype, _, _, values) in CASES.items():
            for typed in (False, True):
                payload = request_bytes(model, datatype, values, typed)
                for label, target in targets.items():
                    name = f"{case} {'contents' if typed else 'raw'} / {label}"
                    runner = harness.RawRunner(target, METHOD, payload, name)
                    cases[name] = harness.block(runner, args.seconds)
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
    result: dict = {"machine": harness.machine(), "p50_ms": {}}
    for name, summaries in blocks.items():
        result["p50_ms"][name] = round(harness.median_of(summaries, "latency_ms.p50"), 4)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
