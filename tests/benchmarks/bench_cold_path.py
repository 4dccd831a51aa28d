"""The KServe request path in process, with its caches cold as they are in the server.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_cold_path.py
[--device ORT] [--rounds N] [--baseline PYTHON]``

Back to back, ``ModelInfer``'s path for the [1, 16] identity takes ~16 us; in the server it
takes ~70, because between two requests gRPC and the kernel run and the path finds its code
and data out of the caches. Here every call follows a real gRPC round trip to a bare echo in
another process, so the figure is the server's, and stable to about a microsecond: what a
change to the path is measured by (issue 22). Each stage alone and the whole path (a fresh
request parsed from the same bytes each call, a stand-in for the call's context), medians of
1500 calls; with ``--baseline`` (a python whose ``plugserve`` is another checkout) the two
alternate, one process each per round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CALLS = 1500


class _Context:
    """What the path asks of a unary call's context."""

    def time_remaining(self) -> None:
        return None

    def add_callback(self, callback) -> bool:
        self.callback = callback
        return True

    def is_active(self) -> bool:
        return True


def worker(device: str) -> dict[str, float]:
    sys.path.insert(0, str(HERE))
    import grpc
    import harness  # noqa: F401  (sets sys.path)
    import numpy as np
    from bench_before_after import identity16

    from plugserve.proto import grpc_service_pb2 as kpb
    from plugserve.server.process.app import Server
    from plugserve.server.process.settings import Settings
    from plugserve.server.protocols.kserve.codec import compose_response, plain_lane
    from plugserve.server.protocols.kserve.grpc_service import KServeServicer

    folder = Path(tempfile.mkdtemp(prefix="plugserve-cold-"))
    (folder / "repo").mkdir()
    server = Server(Settings(model_repository=str(folder / "repo")))
    path = identity16(folder / "identity16.onnx")
    server.control.load("identity16", path, device, {"PERFORMANCE_HINT": "LATENCY"})
    plane = server.plane
    infer = KServeServicer(plane, server.control).ModelInfer
    entry = plane.get("identity16")
    lane = plain_lane(entry)
    x = np.zeros((1, 16), np.float32)
    request = kpb.ModelInferRequest(model_name="identity16")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(x.tobytes())
    data = request.SerializeToString()
    stages = {
        "lookup": lambda r: plane.get(r.model_name, 0),
        "decode": lane.decode,
        "run": lambda r: entry.executor.run_inline(lambda q: q.infer_checked([x])),
        "compose": lambda r: b"".join(compose_response(r, entry, {"output": x})),
        "path": lambda r: infer((r, len(data)), _Context()),
    }
    echo = subprocess.Popen(
        [sys.executable, str(HERE / "bench_echo.py")], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(echo.stdout.readline().split()[1])
        call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/bench.Echo/Echo")
        result = {}
        for name, stage in stages.items():
            times = []
            for _ in range(CALLS):
                call(b"x" * 100, timeout=10)
                message = kpb.ModelInferRequest.FromString(data)
                start = time.perf_counter()
                stage(message)
                times.append(time.perf_counter() - start)
            result[name] = round(statistics.median(times) * 1e6, 2)
        return result
    finally:
        echo.terminate()
        echo.wait(10)
        server.control.close()
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="ORT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", metavar="PYTHON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.device)), flush=True)
        os._exit(0)  # the server's threads need no orderly goodbye
    sys.path.insert(0, str(HERE))
    import harness

    pythons = {"this": sys.executable, **({"baseline": args.baseline} if args.baseline else {})}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in pythons}
    for _ in range(args.rounds):
        for label, python in pythons.items():
            command = [python, __file__, "--worker", "--device", args.device]
            out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result: dict = {"machine": harness.machine(), "device": args.device, "unit": "us"}
    for label, rounds in runs.items():
        result[label] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    if args.baseline:
        result["this / baseline"] = {
            k: round(result["this"][k] / result["baseline"][k], 3) for k in result["this"]
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
