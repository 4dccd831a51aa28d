"""Each device's default and best precision beside openvino's own default, in one process.

Run: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_precision.py
[--runs N] [--blocks B] [--models resnet18 encoder mlp]``.

Issue 22: on a CPU with bf16 arithmetic openvino's own default (what OpenVINO Model Server
runs) computes in bf16; plugserve's OPENVINO used to pin f32 and AUTO picked it. For ResNet-18,
a transformer encoder and an MLP (built in code, batch 1) this times, interleaved in blocks:
bare openvino with no properties (its own default), plugserve OPENVINO as configured by default
and with ``EXECUTION_MODE_HINT=ACCURACY``, AUTO as it chooses by default, ORT and NUMPY. It
prints each one's median, its ratio to openvino's own default and the precision it ran in
(AUTO: which device and precision it took, and its load time, the measuring included), after
the CPU, its flags and the BLAS kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_numpy_resnet import encoder, mlp, resnet18
from harness import machine

from plugserve.server import Core

MODELS = {"resnet18": resnet18, "encoder": encoder, "mlp": mlp}


def _feeds(model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def _runners(model) -> dict[str, tuple[str, object]]:
    """``{case: (precision, run)}``."""
    import openvino as ov

    from plugserve.plugins.openvino.config import precision_name

    core = Core()
    feeds = _feeds(model)
    own = ov.Core().compile_model(ov.Core().read_model(model.SerializeToString()), "CPU")
    own_request = own.create_infer_request()
    cases: dict[str, tuple[str, object]] = {
        "openvino own default": (
            precision_name(own.get_property("INFERENCE_PRECISION_HINT")),
            lambda: own_request.infer(feeds),
        )
    }
    loads = {
        "OPENVINO (default)": ("OPENVINO", {}),
        "OPENVINO ACCURACY": ("OPENVINO", {"EXECUTION_MODE_HINT": "ACCURACY"}),
        "AUTO (default)": ("AUTO", {}),
        "ORT": ("ORT", {}),
        "NUMPY": ("NUMPY", {}),
    }
    for case, (device, config) in loads.items():
        start = time.perf_counter()
        network = core.load_network(model, device, config)
        took = time.perf_counter() - start
        label = network.precision
        if device == "AUTO":
            chosen = network.get_metric("EXECUTION_DEVICES")[0]
            label = f"{chosen} {network.precision}, load {took:.1f} s"
        request = network.create_infer_request()
        cases[case] = (label, lambda request=request: request.infer(feeds))
    return cases


def bench(name: str, runs: int, blocks: int) -> None:
    model = MODELS[name]()
    cases = _runners(model)
    for _, run in cases.values():  # warm
        run()
    times: dict[str, list[float]] = {case: [] for case in cases}
    order = list(cases)
    for b in range(blocks):
        for case in order if b % 2 == 0 else reversed(order):
            run = cases[case][1]
            for _ in range(runs):
                start = time.perf_counter()
                run()  # type: ignore[operator]
                times[case].append((time.perf_counter() - start) * 1e3)
    own = statistics.median(times["openvino own default"])
    print(f"\n{name}, batch 1 ({blocks} blocks x {runs} runs, interleaved)")
    print(f"  {'case':<22} {'p50 ms':>8} {'x own':>6}  precision")
    for case, (label, _) in cases.items():
        p50 = statistics.median(times[case])
        print(f"  {case:<22} {p50:8.3f} {p50 / own:6.2f}  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    for key, value in machine().items():
        print(f"{key}: {value}")
    for name in args.models:
        bench(name, args.runs, args.blocks)


if __name__ == "__main__":
    main()
