"""A model's load beside traffic: how long another model's requests wait while a large model
loads, this checkout's server beside a base commit's.

``python tests/benchmarks/bench_load_stall.py [--baseline PYTHON] [--rounds N] [--nodes N]
[--width W] [--devices NUMPY,ORT,OPENVINO]`` (``--width 0``: a chain of ``--nodes`` Relus
without weights, whose load is the graph's work: 20,000 of them on ORT is the case of
``ort/held.py``'s session made without the GIL)

A server loads what the KServe repository API asks for on a thread of its own, but parts of a
load are single calls into C that hold the GIL (protobuf's serializer and parser, onnx's
checker): while one runs, no other request of the server moves. Each server (``--baseline``:
a base commit's Python, made as a venv with that checkout installed editable) serves a tiny
model ``ping`` on NUMPY; a client sends it a request every 2 ms over REST while the server
loads a chain of ``--nodes`` MatMul+Relu of ``--width`` x ``--width`` float32 weights (4,000
of 128: 262 MB) on each device through ``POST /v2/repository/models/NAME/load``, and unloads
it. Reported, medians over the rounds (before and after interleaved, who goes first
alternating): the load's seconds, the longest a ping waited during it, and the load's peak
resident memory above the server's before it (``VmHWM``, reset through ``clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import harness  # sets sys.path for the tests' support modules
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from serving import RunningServer

PING = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


def chain(nodes: int, width: int) -> onnx.ModelProto:
    """``nodes`` MatMul+Relu pairs of ``width`` x ``width`` float32 weights; with ``width``
    0, ``nodes`` Relus of a [1, 4] input, no weights: the work is the graph's."""
    rng = np.random.default_rng(0)
    graph_nodes, weights, x = [], [], "x"
    for i in range(nodes):
        if width:
            w = (rng.standard_normal((width, width)) / width).astype(np.float32)
            weights.append(numpy_helper.from_array(w, f"w{i}"))
            graph_nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
            x = f"m{i}"
        graph_nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
        x = f"r{i}"
    side = width or 4
    graph = helper.make_graph(
        graph_nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, side])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, side])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def repository(root: Path, nodes: int, width: int, devices: list[str]) -> None:
    def save(name: str, model: onnx.ModelProto, device: str) -> None:
        (root / name / "1").mkdir(parents=True)
        onnx.save(model, root / name / "1" / "model.onnx")
        (root / name / "config.json").write_text(json.dumps({"device": device}))

    save("ping", chain(1, 4), "NUMPY")
    big = chain(nodes, width)
    for device in devices:
        save(f"big_{device.lower()}", big, device)


def _post(server: RunningServer, path: str, body: bytes, timeout: float = 600) -> bytes:
    request = urllib.request.Request(server.http_url + path, data=body, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read()


def _status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` figure in bytes (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def one_load(server: RunningServer, device: str) -> dict[str, float]:
    """Load and unload ``big_<device>`` while pinging; its figures."""
    assert server.process is not None
    pid = server.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to VmRSS
    before = _status(pid, "VmRSS")
    waits: list[tuple[float, float]] = []
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            sent = time.perf_counter()
            _post(server, "/v2/models/ping/infer", PING, timeout=60)
            waits.append((sent, time.perf_counter() - sent))
            time.sleep(0.002)

    pinger = threading.Thread(target=ping)
    pinger.start()
    time.sleep(0.3)
    started = time.perf_counter()
    try:
        _post(server, f"/v2/repository/models/big_{device.lower()}/load", b"{}")
    finally:
        ended = time.perf_counter()
        stop.set()
        pinger.join()
    peak = _status(pid, "VmHWM")
    _post(server, f"/v2/repository/models/big_{device.lower()}/unload", b"{}")
    during = [wait for sent, wait in waits if started <= sent + wait and sent <= ended]
    return {
        "load_s": ended - started,
        "longest_wait_ms": max(during, default=0.0) * 1e3,
        "peak_mb": (peak - before) / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="", metavar="PYTHON")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=4000)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--devices", default="NUMPY,ORT,OPENVINO")
    args = parser.parse_args(argv)
    devices = args.devices.split(",")
    machine = harness.machine()
    print(f"{machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, load "
          f"average {harness.load_average()}; float32 on every device")  # fmt: skip
    sides = {"after": ""} | ({"before": args.baseline} if args.baseline else {})
    figures: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        repository(root, args.nodes, args.width, devices)
        size = (root / f"big_{devices[0].lower()}" / "1" / "model.onnx").stat().st_size
        kind = f"MatMul+Relu of {args.width}x{args.width}" if args.width else "Relu"
        print(f"the loaded model: {args.nodes} {kind}, {size / 1e6:.1f} MB")
        servers = {
            side: RunningServer(
                "--model-repository", str(root), "--model-control-mode", "explicit",
                "--load-model", "ping", python=python,
            ).start()
            for side, python in sides.items()
        }  # fmt: skip
        try:
            for round_ in range(args.rounds):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for device in devices:
                    for side in order:
                        got = one_load(servers[side], device)
                        figures.setdefault((side, device), []).append(got)
                        print(f"round {round_} {side:6s} {device:8s} " + ", ".join(
                            f"{k} {v:.2f}" for k, v in got.items()), flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    print(f"\nmedians over {args.rounds} rounds; load average {harness.load_average()}")
    print("| device | side | load (s) | longest wait of a ping during it (ms) | peak RSS above "
          "the server's (MB) |\n|---|---|---|---|---|")  # fmt: skip
    for device in devices:
        for side in sides:
            rows = figures[(side, device)]
            med: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"| {device} | {side} | {med['load_s']:.2f} | {med['longest_wait_ms']:.0f} | "
                  f"{med['peak_mb']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
