"""What an idle gap costs one gRPC call here: the bare echo and plugserve, back to back and
after sleeping 10 ms between calls (as a client does while a 10 ms inference runs).

Run: ``python tests/benchmarks/bench_idle_gap.py``. Explains the concurrency-1 column of the
throughput section: ResNet-18 through the server pays about 2 ms over in-process although the
identity round trip is about 1 ms, because the machine is slower to wake idle threads.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import harness  # sets sys.path for the imports below
import zoo
from harness import RawRunner
from run_all import Server, inputs_for

from plugserve.client.client import infer_request


def median_ms(runner: RawRunner, gap: float, calls: int) -> float:
    times = []
    for _ in range(calls):
        if gap:
            time.sleep(gap)
        start = time.perf_counter()
        runner.call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    paths = zoo.save_all(Path(tempfile.gettempdir()) / "plugserve-bench-models")
    server = Server()
    server.load("identity", paths["identity"], "NUMPY")
    payload = infer_request("identity", inputs_for("identity")).SerializeToString()
    with harness.echo_server("thread") as echo:
        runners = {
            "echo": RawRunner(echo, "/bench.Echo/Echo", payload, "echo"),
            "plugserve": RawRunner(server.target, "/plugserve.v1.Plugserve/Infer", payload),
        }
        for runner in runners.values():
            for _ in range(20):
                runner.call()
        for _ in range(2):
            for name, runner in runners.items():
                busy, idle = median_ms(runner, 0, 200), median_ms(runner, 0.01, 100)
                print(f"{name:10s} back to back {busy:.2f} ms, after 10 ms idle {idle:.2f} ms")
        for runner in runners.values():
            runner.close()
    server.close()


if __name__ == "__main__":
    main()
