"""What parsing a client's large model first in the shape-inference helper costs
(``plugins/reading.py``, ``parse_model``): each model's bytes parsed directly in this process
(``ModelProto.ParseFromString``, as before) and through ``reading.parse_model`` (the helper
parses and counts them, then this process parses them), interleaved round after round with a
warm helper; medians of the wall time of one parse. Models: weights of a few sizes (their
bytes cross the pipe: the probe's cost is proportional to them) and a graph of many nodes
(its structure, not its bytes, is what the parse amplifies).

``python tests/benchmarks/bench_parse_probe.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from plugserve.plugins import reading


def _weights(megabytes: int) -> bytes:
    weight = numpy_helper.from_array(np.ones((megabytes << 20) // 4, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "weights",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _nodes(count: int) -> bytes:
    nodes = [
        helper.make_node("Relu", [f"/model/layer.{i}/out"], [f"/model/layer.{i + 1}/out"])
        for i in range(count)
    ]
    graph = helper.make_graph(
        nodes,
        "nodes",
        [helper.make_tensor_value_info("/model/layer.0/out", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(f"/model/layer.{count}/out", onnx.TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


MODELS: dict[str, Callable[[], bytes]] = {
    "weights 4 MB": lambda: _weights(4),
    "weights 32 MB": lambda: _weights(32),
    "weights 128 MB": lambda: _weights(128),
    "50,000 nodes": lambda: _nodes(50_000),
}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def _direct(data: bytes) -> None:
    onnx.ModelProto().ParseFromString(data)


def _timed(parse: Callable[[bytes], object], data: bytes) -> float:
    start = time.perf_counter()
    parse(data)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"CPU: {_cpu()}; --max-read-bytes {reading.limits().max_bytes >> 20} MiB")
    ways = {"direct": _direct, "probed": reading.parse_model}
    for name, make in MODELS.items():
        data = make()
        times: dict[str, list[float]] = {way: [] for way in ways}
        for parse in ways.values():  # a first parse of each (the helper's start), not counted
            parse(data)
        for _ in range(args.rounds):
            for way, parse in ways.items():
                times[way].append(_timed(parse, data))
        before, after = (statistics.median(times[w]) for w in ways)
        print(
            f"{name:15s} {len(data) / 1e6:6.1f} MB  direct {before * 1e3:7.1f} ms  "
            f"probed {after * 1e3:7.1f} ms  ratio {after / before:.2f}"
        )


if __name__ == "__main__":
    main()
