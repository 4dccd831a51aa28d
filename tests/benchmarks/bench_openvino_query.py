"""What answering QueryNetwork on OPENVINO in a helper process costs (plugins/openvino/
query_process.py): each benchmark model queried through the Core in the server's process as
before (``in process``) and through the helper (``helper``), interleaved round after round, a
warm helper (its start is timed once, apart); medians of the wall time of one query, with the
node checks against NUMPY on, as a server runs them.

``python tests/benchmarks/bench_openvino_query.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import harness  # noqa: F401  (sets sys.path for the imports below)
import zoo

from plugserve.plugins.openvino import query_process
from plugserve.server import Core

MODELS = {
    "mlp": lambda: zoo.mlp(),
    "resnet18": lambda: zoo.resnet18(),
    "encoder": lambda: zoo.encoder(),
}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _timed(core: Core, data: bytes) -> float:
    start = time.perf_counter()
    core.query_network(data, "OPENVINO")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    core = Core()
    plugin = core.plugin("OPENVINO")
    precision = plugin.precision(plugin.merged_config({}))
    print(f"CPU: {_cpu()}; OPENVINO computes in {precision}")
    start = time.perf_counter()
    with query_process._helpers.one(60.0):
        pass
    took = time.perf_counter() - start
    print(f"a helper's start (openvino and NUMPY imported, one tiny query): {took:.2f} s")
    for name, make in MODELS.items():
        data = make().SerializeToString()
        times: dict[str, list[float]] = {"in process": [], "helper": []}
        for mode in ("in process", "helper"):  # a first query of each, not counted
            plugin.query_in_helper = mode == "helper"
            _timed(core, data)
        for _ in range(args.rounds):
            for mode in ("in process", "helper"):
                plugin.query_in_helper = mode == "helper"
                times[mode].append(_timed(core, data))
        before, after = (statistics.median(times[m]) for m in ("in process", "helper"))
        print(
            f"{name:9s} {len(data) / 1e6:6.1f} MB  in process {before * 1e3:7.1f} ms  "
            f"helper {after * 1e3:7.1f} ms  ratio {after / before:.2f}"
        )


if __name__ == "__main__":
    main()
