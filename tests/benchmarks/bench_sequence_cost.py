"""What the sequence path adds to a request (issue 38): the same Silero VAD chunk as a stateful
request through the sequence batcher (its state kept on the server) and as a stateless request
of the same model (the client sends the state), beside a bare grpcio echo of the sequence
request's bytes, all from one raw-bytes gRPC client (tests/benchmarks/harness.RawRunner: the
request serialized once, the reply not decoded), so the differences are the server's alone.
Unary ModelInfer and ModelStreamInfer (one request in flight on a stream), interleaved rounds,
medians; the goal is sequence / stateless <= 1.10.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_sequence_cost.py
[--rounds N] [--seconds S]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import shutil
import sys
import tempfile
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np
from bench_sequences import CHUNK, _vad_path

METHOD = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _repository(root: Path) -> None:
    state = 'state [ { input_name: "state" output_name: "stateN" data_type: TYPE_FP32 '
    for name, config in (
        (
            "vad",
            "sequence_batching { max_sequence_idle_microseconds: 600000000 "
            f"{state}dims: [ 2, 1, 128 ] }} ] }}",
        ),
        ("vad_plain", ""),
    ):
        (root / name / "1").mkdir(parents=True)
        shutil.copy(_vad_path(), root / name / "1" / "model.onnx")
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 0\n{config}'
        )


def _requests() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    chunk = {
        "input": (rng.normal(size=(1, CHUNK)) * 0.1).astype(np.float32),
        "sr": np.array(16000, np.int64),
    }
    stateless = {**chunk, "state": np.zeros((2, 1, 128), np.float32)}
    return {
        "start": harness.kserve_request("vad", chunk, id=7, start=True),
        "sequence": harness.kserve_request("vad", chunk, id=7),
        "stateless": harness.kserve_request("vad_plain", stateless),
    }


class StreamRunner:
    """One request at a time on one ModelStreamInfer stream (raw bytes both ways)."""

    def __init__(self, target: str, payload: bytes) -> None:
        import grpc

        self.channel = grpc.insecure_channel(target)
        self.payload = payload
        self.outgoing: queue.Queue = queue.Queue()
        self.replies = self.channel.stream_stream(STREAM)(iter(self.outgoing.get, None))
        self.description = f"stream {target}"

    def call(self) -> None:
        self.outgoing.put(self.payload)
        next(self.replies)

    def submit(self, done) -> None:  # pragma: no cover - sync only
        raise NotImplementedError

    def close(self) -> None:
        self.outgoing.put(None)
        self.channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--python", default="", help="a baseline's interpreter for the server")
    args = parser.parse_args(argv)
    from serving import RunningServer

    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    folder = Path(tempfile.mkdtemp(prefix="plugserve-sequence-cost-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        _repository(folder)
        echo = stack.enter_context(harness.echo_server("thread", "--reuse-freed-memory"))
        server = stack.enter_context(
            RunningServer("--model-repository", str(folder), python=args.python)
        )
        payloads = _requests()
        harness.RawRunner(server.target, METHOD, payloads["start"]).call()
        runners = {
            "echo": harness.RawRunner(echo, "/bench.Echo/Echo", payloads["sequence"]),
            "stateless unary": harness.RawRunner(server.target, METHOD, payloads["stateless"]),
            "sequence unary": harness.RawRunner(server.target, METHOD, payloads["sequence"]),
            "stateless stream": StreamRunner(server.target, payloads["stateless"]),
            "sequence stream": StreamRunner(server.target, payloads["sequence"]),
        }
        for runner in runners.values():
            stack.callback(runner.close)
        cases = {
            name: (lambda r=r: harness.p50_block(r.call, args.seconds))
            for name, r in runners.items()
        }
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
    result: dict = {"machine": harness.machine(), "precision": "ORT: f32"}
    for name, runs in blocks.items():
        result[name] = round(harness.median_of(runs, "p50_ms"), 4)
    for mode in ("unary", "stream"):
        median, rounds = harness.ratio_of(blocks, f"sequence {mode}", f"stateless {mode}")
        result[f"sequence / stateless, {mode}"] = median
        result[f"sequence / stateless, {mode}, per round"] = rounds
    result["stateless unary / echo"] = round(result["stateless unary"] / result["echo"], 3)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
