"""The device part of the prepared GPU check (``tests/gpu/gpu_check.py`` runs it as its
``device`` part, bounded; it runs alone too): what it found goes to a folder, ``checks``
(pass/fail each, with the reason), speed figures and the card, as ``gpu_check.json`` and
``gpu_check.txt``.

    python tests/gpu/device_check.py OUT_DIR [--device GPU] [--budget 1.0]

Checks, on ``--device`` (GPU; TORCH runs the same on the CPU, which is how it is tested here):
the device is listed with its card, memory and compute capability; a CNN matches NUMPY in f32
(TF32 off) and stays within f16's and bf16's tolerance; a Det node goes to NUMPY through
HETERO; export/import gives the same answer; a TorchScript file and a torch.export program run
whole (f32 and f16) and export/import. Speed: ResNet-50 (torchvision's, random weights,
exported to ONNX here) at batch 32 and batch 1 through the device, numpy in and out, beside
torch's own eager forward of the same module in fp16 in the same run (the issue's bar: at
least 1.0x eager at batch 32). Without torchvision a small conv net stands in (said in the
output). Graphs (:func:`graph_checks`, issue 49): a repeated shape is replayed with eager's
answers within f16's tolerance, a data-dependent one stays eager, a TorchScript program's shape
listed at load is captured then and replayed, a BERT-like block whose shapes are computed in the
graph is captured and replayed (its shape values on the host; skipped on the CPU), float
shape arithmetic at f16 is exact above 2,048, a replayed request is not charged its
activations again (skipped on the CPU), and the ResNet's batch-1
latency eager (CUDA_GRAPHS=0) beside replayed. Bounded: each figure is timed for ``--budget``
seconds (default 1).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "tests" / "plugins" / "torch_device")]


class Skipped(Exception):
    """A check this device cannot show (a CUDA graph on the CPU): recorded as a skip with the
    reason, not a failure."""


def timed(fn, budget: float, sync) -> float:
    """Median milliseconds of ``fn`` over ``budget`` seconds (at least 5 runs, 3 warm-up)."""
    for _ in range(3):
        fn()
    sync()
    times: list[float] = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(times) < 5:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="GPU")
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--resnet-batch", type=int, default=32)
    ap.add_argument(
        "--eviction-canary",
        action="store_true",
        help="run only the graph-eviction canary (graphs_eviction), in this process",
    )
    args = ap.parse_args()
    if args.eviction_canary:  # alone, in a fresh process
        from plugserve.server import Core

        print(eviction_canary(Core(), args.device), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import onnx
    import torch
    from models import small_cnn
    from test_torch_device import _det_model

    from plugserve.server import Core

    core = Core()
    device = args.device
    result: dict = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "checks": {}, "figures": {}}  # fmt: skip
    checks = result["checks"]

    def check(name: str, fn) -> None:
        try:
            detail = fn()
            checks[name] = {"pass": True, "detail": detail or ""}
        except Skipped as exc:  # not this machine's to show (a GPU's): passed, said so
            checks[name] = {"pass": True, "skip": True, "detail": str(exc)}
        except Exception as exc:  # every check reports, none stops the others
            checks[name] = {"pass": False, "detail": f"{type(exc).__name__}: {exc}",
                            "trace": traceback.format_exc()[-2000:]}  # fmt: skip
        said = "SKIP" if checks[name].get("skip") else "PASS" if checks[name]["pass"] else "FAIL"
        print(f"{said} {name}: {checks[name]['detail']}", flush=True)
        save()

    def save() -> None:
        """The results so far, after every check: a part cut by its time cap keeps them."""
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, default=str))
        tmp.replace(out / "gpu_check.json")

    def listed() -> str:
        devices = {d.name: d for d in core.devices()}
        info = devices.get(device.split(".")[0])
        if info is None or not info.available:
            raise RuntimeError(f"{device} unavailable: {info.reason if info else 'unknown'}")
        skip = ("SUPPORTED_OPS", "SUPPORTED_METRICS", "SUPPORTED_CONFIG_KEYS")
        names = [m for m in core.get_metric(device, "SUPPORTED_METRICS") if m not in skip]
        facts = {m: core.get_metric(device, m) for m in names}
        result["card"] = {k: str(v) for k, v in facts.items()}
        return str(facts.get("FULL_DEVICE_NAME"))

    check("listed", listed)
    image = np.random.default_rng(1).normal(size=(4, 3, 16, 16)).astype(np.float32)
    cnn = small_cnn(batch="n")
    want = core.load_network(cnn, "NUMPY").infer({"x": image})["probs"]

    def precision(hint: str, tolerance: float):
        def run() -> str:
            config = {"INFERENCE_PRECISION_HINT": hint} if hint else {}
            network = core.load_network(cnn, device, config)
            got = network.infer({"x": image})["probs"]
            error = float(np.max(np.abs(got - want)))
            if not error <= tolerance:
                raise AssertionError(f"max error {error:.3g} over {tolerance}")
            return f"{network.get_metric('INFERENCE_PRECISION')}: max error {error:.3g}"

        return run

    check("cnn_f32_equals_numpy", precision("f32", 1e-5))
    check("cnn_default_precision", precision("", 2e-2))
    check("cnn_f16", precision("f16", 2e-2))
    check("cnn_bf16", precision("bf16", 6e-2))

    def hetero() -> str:
        model = _det_model()
        placed = core.query_network(model, f"HETERO:{device},NUMPY")
        x = np.random.default_rng(3).normal(size=(2, 3, 3)).astype(np.float32)
        got = core.load_network(model, f"HETERO:{device},NUMPY").infer({"x": x})["y"]
        ref = core.load_network(model, "NUMPY").infer({"x": x})["y"]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        return str(placed)

    check("hetero_det_on_numpy", hetero)
    check("index_out_of_range", lambda: index_bounds(core, device))

    def export_import() -> str:
        network = core.load_network(cnn, device, {"INFERENCE_PRECISION_HINT": "f32"})
        again = core.import_network(network.export(), device)
        np.testing.assert_array_equal(again.infer({"x": image})["probs"],
                                      network.infer({"x": image})["probs"])  # fmt: skip
        return f"{len(network.export())} bytes"

    check("export_import", export_import)

    def programs() -> str:
        """A TorchScript file and a torch.export .pt2 of one module, whole on the device (f32
        equal to the module on the CPU, f16 within its tolerance), and exported/imported."""
        torch.manual_seed(0)
        module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 16 * 16, 10),
        ).eval()
        with torch.no_grad():
            ref = module(torch.from_numpy(image)).numpy()
        tensors = json.dumps({"inputs": [["INPUT__0", "float32", [-1, 3, 16, 16]]],
                              "outputs": [["OUTPUT__0", "float32", [-1, 10]]]})  # fmt: skip
        script, exported = io.BytesIO(), io.BytesIO()
        torch.jit.save(torch.jit.script(module), script)
        dim = torch.export.Dim("batch", min=1, max=64)
        torch.export.save(torch.export.export(module, (torch.from_numpy(image),),
                                              dynamic_shapes=({0: dim},)), exported)  # fmt: skip
        found = []
        for kind, data in (("torchscript", script.getvalue()), ("pt2", exported.getvalue())):
            for hint, tolerance in (("f32", 1e-4), ("f16", 2e-2)):
                config = {"MODEL_TENSORS": tensors, "INFERENCE_PRECISION_HINT": hint}
                # the check's own programs: trusted (a program runs the code it carries)
                network = core.load_network(data, device, config, trusted=True)
                got = network.infer({"INPUT__0": image})["OUTPUT__0"]
                error = float(np.max(np.abs(got - ref)))
                if not error <= tolerance:
                    raise AssertionError(f"{kind} {hint}: max error {error:.3g} over {tolerance}")
                found.append(f"{kind} {hint} {error:.2g}")
            again = core.import_network(network.export(), device, trusted=True)
            np.testing.assert_allclose(again.infer({"INPUT__0": image})["OUTPUT__0"], got,
                                       rtol=1e-3, atol=1e-3)  # fmt: skip
        return ", ".join(found)

    check("pytorch_programs", programs)

    # --- speed: ResNet-50 through the device beside torch's own eager forward
    cuda = torch.cuda.is_available() and device.startswith("GPU")
    dev = "cuda" if cuda else "cpu"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    try:
        import torchvision

        module = torchvision.models.resnet50(weights=None).eval()
        label, size = "resnet50", 224
    except ImportError:
        module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
        ).eval()  # fmt: skip
        label, size = "small_convnet (no torchvision here)", 64
    result["figures"]["model"] = label
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(module, torch.zeros(1, 3, size, size), buffer, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "n"}}, dynamo=False,
                          opset_version=17)  # fmt: skip
    proto = onnx.load_from_string(buffer.getvalue())
    half = torch.float16 if cuda else torch.float32
    eager = module.to(dev, dtype=half)
    if cuda:
        eager = eager.to(memory_format=torch.channels_last)
    for batch in (args.resnet_batch, 1):
        x = np.random.default_rng(batch).random((batch, 3, size, size), dtype=np.float32)

        def torch_eager(x=x):
            with torch.inference_mode():
                t = torch.from_numpy(x).to(dev, non_blocking=True).to(half)
                return eager(t).float().cpu().numpy()

        ms = timed(torch_eager, args.budget, sync)
        rate = round(batch / ms * 1e3, 1)
        result["figures"][f"torch_eager_b{batch}"] = {"ms": round(ms, 3), "img_per_s": rate}
        try:
            network = core.load_network(proto, device)
            request = network.create_infer_request()
            ms = timed(lambda x=x, r=request: r.infer({"x": x}), args.budget, sync)
            result["figures"][f"{device}_b{batch}"] = {
                "ms": round(ms, 3), "img_per_s": round(batch / ms * 1e3, 1),
                "precision": network.get_metric("INFERENCE_PRECISION"),
            }  # fmt: skip
        except Exception as exc:
            result["figures"][f"{device}_b{batch}"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"b{batch}: {result['figures'][f'torch_eager_b{batch}']} "
              f"{device}: {result['figures'][f'{device}_b{batch}']}", flush=True)  # fmt: skip
    graph_checks(core, device, cnn, image, proto, size, result, check, args.budget, sync)
    # last: a failure leaves the process's CUDA context unusable (an illegal address is sticky),
    # so nothing runs after it but writing the results (no subprocess: no second torch import
    # and CUDA start inside the device part's budget)
    check("graphs_eviction", lambda: eviction_canary(core, device))
    big = result["figures"].get(f"{device}_b{args.resnet_batch}", {})
    base = result["figures"][f"torch_eager_b{args.resnet_batch}"]
    if "img_per_s" in big:
        result["figures"]["ratio_to_eager"] = round(big["img_per_s"] / base["img_per_s"], 3)
    save()
    lines = [f"{device} ({result.get('card', {}).get('FULL_DEVICE_NAME', '?')}), torch "
             f"{result['torch']}, CUDA {result['cuda']}"]  # fmt: skip
    lines += [f"{'SKIP' if c.get('skip') else 'PASS' if c['pass'] else 'FAIL'} {n}: {c['detail']}"
              for n, c in checks.items()]  # fmt: skip
    lines += [f"{k}: {v}" for k, v in result["figures"].items()]
    (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["pass"] for c in checks.values()) else 1


def index_bounds(core, device: str) -> str:
    """A Gather index out of range (a token id past the vocabulary) is refused INVALID_ARGUMENT
    naming the node, never a device-side assert (a sticky CUDA error would leave every later
    request failing): good, bad, good, on one request's stream, three times, so that the shape
    is run eagerly, then captured as a CUDA graph and replayed with the bounds flag
    (plugins/torch/ops/bounds.py); the device is not marked failed and computes after."""
    from onnx import TensorProto, helper, numpy_helper

    from plugserve.plugins.api import InvalidArgument
    from plugserve.plugins.torch import devmem

    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], name="lookup", axis=0)],
        "bounds",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    network = core.load_network(
        model, device, {"CUDA_GRAPHS": "4", "EXECUTION_MODE_HINT": "ACCURACY"}
    )
    request = network.create_infer_request()
    good, bad = np.array([1, -1], np.int64), np.array([1, 10], np.int64)
    for _ in range(3):
        got = request.infer({"ids": good})["y"]
        np.testing.assert_allclose(got, table[[1, 9]])
        try:
            request.infer({"ids": bad})
        except InvalidArgument as exc:
            said = str(exc)
        else:
            raise AssertionError("an index out of range was answered")
        if "node 'lookup' (Gather)" not in said or "out of range" not in said:
            raise AssertionError(f"the refusal does not name the node: {said}")
    np.testing.assert_allclose(request.infer({"ids": good})["y"], table[[1, 9]])
    failed = devmem.device_failure(network.torch_device)
    if failed is not None:
        raise AssertionError(f"the device was marked failed: {failed}")
    return f"{said[:160]}; graphs {network.graph_statistics()}"


def graph_checks(core, device, cnn, image, proto, size, result, check, budget, sync) -> None:
    """Issue 49's graphs (``plugins/torch/graphs.py``): a repeated shape is replayed (the
    replay counter above 0) with outputs equal to the eager path's within f16's tolerance;
    and the batch-1 latency of the ResNet-style model served eagerly (CUDA_GRAPHS=0) beside
    replayed (CUDA_GRAPHS=8), through one infer request each. On TORCH (the CPU) the same
    runs the cache's CPU twin (no graphs: the figure shows the static-buffer path's cost)."""

    def replayed() -> str:
        eager = core.load_network(cnn, device, {"CUDA_GRAPHS": "0"}).create_infer_request()
        network = core.load_network(cnn, device, {"CUDA_GRAPHS": "4"})
        request = network.create_infer_request()
        worst = 0.0
        for seed in range(4):  # the first captures, the rest replay
            x = image + np.float32(seed)
            got = request.infer({"x": x})["probs"]
            worst = max(worst, float(np.max(np.abs(got - eager.infer({"x": x})["probs"]))))
        counts = network.graph_statistics()
        if not counts["replayed"] > 0:
            raise AssertionError(f"nothing replayed: {counts}")
        if not worst <= 2e-2:
            raise AssertionError(f"replayed outputs differ from eager by {worst:.3g}: {counts}")
        return f"{counts}, max difference to eager {worst:.3g}"

    check("graphs_replayed", replayed)

    def fallback() -> str:
        """A shape that depends on the data (NonZero) cannot be captured: on CUDA the capture
        fails (counted, logged once) and the shape runs eagerly, its answers still right."""
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("NonZero", ["x"], ["y"])], "nonzero",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
            [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "n"])],
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        network = core.load_network(model, device, {"CUDA_GRAPHS": "4"})
        request = network.create_infer_request()
        numpy = core.load_network(model, "NUMPY")
        for seed in range(3):
            x = (np.random.default_rng(seed).random(8) > 0.5).astype(np.float32)
            np.testing.assert_array_equal(request.infer({"x": x})["y"], numpy.infer({"x": x})["y"])
        counts = network.graph_statistics()
        if device.startswith("GPU") and not (counts["failed"] >= 1 and counts["replayed"] == 0):
            raise AssertionError(f"NonZero's capture should fail and stay eager: {counts}")
        return str(counts)

    check("graphs_fallback", fallback)

    def program_replayed() -> str:
        """A TorchScript program through the same lanes: its shape listed at load by name
        (what a config.pbtxt's graph_spec becomes) is captured when the stream's request is
        made, before any request; the first request of it replays, equal to the module's own
        answer; a warm-up run (``model_warmup``) of another shape captures it at once."""
        import torch

        from plugserve.plugins.run_context import RunContext

        torch.manual_seed(1)
        module = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        ).eval()
        script = io.BytesIO()
        torch.jit.save(torch.jit.script(module), script)
        tensors = json.dumps({"inputs": [["INPUT__0", "float32", [-1, 16]]],
                              "outputs": [["OUTPUT__0", "float32", [-1, 4]]]})  # fmt: skip
        network = core.load_network(script.getvalue(), device, {
            "MODEL_TENSORS": tensors, "CUDA_GRAPHS": "4", "CUDA_GRAPH_SHAPES": "INPUT__0=2x16",
        }, trusted=True)  # fmt: skip
        request = network.create_infer_request()
        at_load = network.graph_statistics()
        x = np.random.default_rng(5).random((2, 16), dtype=np.float32)
        got = request.infer({"INPUT__0": x})["OUTPUT__0"]
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        after = network.graph_statistics()
        warm = np.zeros((3, 16), np.float32)
        request.infer({"INPUT__0": warm}, RunContext(warmup=True))
        warmed = network.graph_statistics()
        if at_load["captured"] != 1 or after["replayed"] != 1 or warmed["captured"] != 2:
            raise AssertionError(f"at load {at_load}, after one request {after}, "
                                 f"after a warm-up {warmed}")  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        return f"at load {at_load}, then {after}, after a warm-up {warmed}"

    check("graphs_program_replayed", program_replayed)

    def shape_values() -> str:
        """Review finding 17: a BERT-like block whose shapes are computed in the graph
        (Shape -> Gather -> Unsqueeze -> Concat -> Reshape, Range over the sequence's length,
        the exporter's ConstantOfShape/Where/Expand; tests/support/models.py shaped_encoder)
        reads nothing of the device on the host (plugins/torch/hostvalues.py), so it is
        captured and replayed (no capture failed), its answers NUMPY's within 1e-4 (f32, TF32
        off). Before, its Reshapes synced and it ran eagerly. The CPU shows the scan and the
        answers; the graphs are the GPU's (skipped there)."""
        from models import shaped_encoder

        model = shaped_encoder()
        numpy = core.load_network(model, "NUMPY")
        network = core.load_network(
            model, device, {"CUDA_GRAPHS": "4", "EXECUTION_MODE_HINT": "ACCURACY"}
        )
        if network.program.host_reads:
            raise AssertionError(f"nodes read on the host: {network.program.host_reads}")
        request = network.create_infer_request()
        rng = np.random.default_rng(17)
        worst = 0.0
        for batch, seq in [(2, 5)] * 4 + [(1, 7)] * 3:  # each shape captured, then replayed
            ids = rng.integers(1, 50, (batch, seq)).astype(np.int64)
            ids[0, -1] = 0  # a padded position, masked
            got, want = request.infer({"ids": ids})["y"], numpy.infer({"ids": ids})["y"]
            worst = max(worst, float(np.max(np.abs(got - want))))
        counts = network.graph_statistics()
        if not worst <= 1e-4:
            raise AssertionError(f"answers differ from NUMPY's by {worst:.3g}: {counts}")
        if not device.startswith("GPU"):
            raise Skipped(f"the CPU has no CUDA graphs (host reads none, answers within "
                          f"{worst:.2g} of NUMPY's, CPU twin {counts})")  # fmt: skip
        if counts["failed"] or not counts["replayed"] > 0:
            raise AssertionError(f"not replayed as a graph: {counts}")
        return f"{counts}, max difference to NUMPY {worst:.3g}"

    check("graphs_shape_values", shape_values)

    def shape_floats_f16() -> str:
        """Issue 49: at f16 (the GPU's default) a shape cast to FLOAT and the arithmetic over
        it run on the host in float32 (plugins/torch/program.py ``host_compute``), so sizes
        made from a length of 3,001 are exact (in f16 it is 3,000): a ConstantOfShape of
        ceil(n / 2) has 1,501 elements, x + Range(0, n) 3,001 columns, n / 7 (an output) is
        3001 / 7 rounded to f16 once; eager, captured and replayed alike."""
        from models import shape_floats

        model = shape_floats()
        x = np.zeros((1, 3001), np.float32)
        numpy = core.load_network(model, "NUMPY").infer({"x": x})
        network = core.load_network(
            model, device, {"CUDA_GRAPHS": "2", "INFERENCE_PRECISION_HINT": "f16"}
        )
        request = network.create_infer_request()
        for _ in range(3):  # eager, captured, replayed
            got = request.infer({"x": x})
            if got["zeros"].shape != (1501,) or got["ramp"].shape != (1, 3001):
                raise AssertionError(f"sizes {got['zeros'].shape}, {got['ramp'].shape}: "
                                     "the shape arithmetic lost precision")  # fmt: skip
            np.testing.assert_allclose(got["ramp"], numpy["ramp"], rtol=1e-2)
            np.testing.assert_array_equal(got["ratio"], [np.float16(3001 / 7)])
        return f"exact at 3,001 in f16; {network.graph_statistics()}"

    check("graphs_shape_floats_f16", shape_floats_f16)

    def replay_charge() -> str:
        """Issue 49: a request replayed from a captured CUDA graph computes in the graph's
        memory pool, charged to the budget at the capture (plugins/torch/devmem.py
        ``RequestCharge``, graphs.py ``Lane._entry``): it is not charged its activations
        again. Under a DEVICE_MEMORY_BUDGET that holds what is charged (weights, the pool)
        plus half the shape's estimate, the replayed shape is served (before, it was refused
        after waiting for room that never came) and the budget is as it was after it; a
        larger shape, eager at its first sight, is charged and refused RESOURCE_EXHAUSTED
        naming its activations. The device's budget is set back after. GPU only: on the
        CPU every run allocates and is charged (test_devmem.py's lane test)."""
        if not device.startswith("GPU"):
            raise Skipped("no CUDA graph pools on the CPU: every run there allocates and is "
                          "charged (tests/plugins/torch_device/test_devmem.py)")  # fmt: skip
        from models import mlp
        from onnx import TensorProto, helper

        def set_budget(nbytes: int) -> None:  # a weightless load sets the device's budget
            graph = helper.make_graph(
                [helper.make_node("Relu", ["x"], ["y"])], "budget",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
            )  # fmt: skip
            relu = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            relu.ir_version = 8
            core.load_network(relu, device, {"DEVICE_MEMORY_BUDGET": str(nbytes)})

        network = core.load_network(
            mlp(sizes=(256, 1024, 1024, 64)),
            device, {"CUDA_GRAPHS": "2", "INFERENCE_PRECISION_HINT": "f32"},
        )  # fmt: skip
        request = network.create_infer_request()
        rng = np.random.default_rng(3)
        x = rng.normal(size=(64, 256)).astype(np.float32)
        want = request.infer({"x": x})["y"]  # eager (first sight)
        request.infer({"x": x})  # captured: its pool charged while the graph lives
        gc.collect()  # earlier checks' networks: their charges given back now, not meanwhile
        memory, estimate = network.memory, network.activations.estimate([x])
        before, held = memory.limit, memory.charged
        set_budget(held + estimate // 2)
        refused = ""
        try:
            got = request.infer({"x": x})["y"]  # replayed: not charged
            after = memory.charged
            try:
                request.infer({"x": rng.normal(size=(1024, 256)).astype(np.float32)})
            except Exception as exc:  # eager at its first sight: charged, no room
                refused = f"{type(exc).__name__}: {exc}"
        finally:
            set_budget(before)
        counts = network.graph_statistics()
        if counts["replayed"] < 1:
            raise AssertionError(f"not replayed: {counts}")
        if after > held:
            raise AssertionError(f"charged {held} before the replay, {after} after")
        if "activations" not in refused:
            raise AssertionError(f"the eager shape was not refused for its activations: "
                                 f"{refused or 'served'}")  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        return (f"replayed under {held + estimate // 2} bytes (held {held}, estimate "
                f"{estimate}); refused: {refused[:160]}; {counts}")  # fmt: skip

    check("graphs_replay_charge", replay_charge)

    def moves_without_waits() -> str:
        """Review2 findings 1 and 2 (plugins/torch/hostvalues.py ``Moves``): host values are
        copied to the card with no host synchronisation (torch's sync debug mode set to
        "error": a blocking copy raises), a kept copy read on another stream is waited for on
        the GPU (its values right), and inside a capture a kept value is its copy while a
        large value not moved is refused with RuntimeError before any CUDA call (the capture
        then ends, and its graph replays). The CPU's Moves is the meta device's, in
        tests/plugins/torch_device/test_host_values.py (skipped here)."""
        import torch

        from plugserve.plugins.torch import hostvalues

        if not device.startswith("GPU"):
            raise Skipped("no CUDA streams on the CPU (test_host_values.py drives Moves on meta)")
        cuda = torch.device("cuda", int(device.split(".")[1]) if "." in device else 0)
        moves = hostvalues.Moves(torch, cuda)
        small, large = torch.arange(8), torch.arange(1000, dtype=torch.float32)
        with torch.cuda.device(cuda):
            side, capturer = torch.cuda.Stream(cuda), torch.cuda.Stream(cuda)
            torch.cuda.set_sync_debug_mode("error")
            try:
                a, b = moves(small), moves(large)  # copied, kept: no host wait
                with torch.cuda.stream(side):
                    doubled = moves(large.clone()) * 2  # a hit: ``side`` waits on the GPU
                with torch.cuda.stream(capturer):
                    moves(large.clone())  # the warm-up before a capture
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize(cuda)
            graph = torch.cuda.CUDAGraph()
            refused = ""
            with torch.cuda.stream(capturer):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    kept = moves(large.clone())
                    tripled = kept * 3
                    try:
                        moves(torch.arange(500, dtype=torch.float32) + 7)
                    except RuntimeError as exc:
                        refused = str(exc)
                finally:
                    graph.capture_end()
            graph.replay()
            torch.cuda.synchronize(cuda)
        if not (torch.equal(a.cpu(), small) and torch.equal(b.cpu(), large)):
            raise AssertionError("a moved value differs from the host's")
        if not torch.equal(doubled.cpu(), large * 2) or kept is not b:
            raise AssertionError("the kept copy was not read whole on another stream")
        if not refused or not torch.equal(tripled.cpu(), large * 3):
            raise AssertionError(f"the capture: refused {refused!r}, replayed {tripled[:4]}")
        return f"{len(moves)} kept ({moves.nbytes} bytes), no host wait; refused: {refused}"

    check("graphs_moves_no_host_wait", moves_without_waits)
    x = np.random.default_rng(11).random((1, 3, size, size), dtype=np.float32)
    figures: dict = {}
    for label, limit in (("eager", "0"), ("replayed", "8")):
        try:
            network = core.load_network(proto, device, {"CUDA_GRAPHS": limit})
            request = network.create_infer_request()
            ms = timed(lambda r=request: r.infer({"x": x}), budget, sync)
            figures[label] = {"ms": round(ms, 3), "graphs": network.graph_statistics()}
        except Exception as exc:
            figures[label] = {"error": f"{type(exc).__name__}: {exc}"}
    if "ms" in figures.get("eager", {}) and "ms" in figures.get("replayed", {}):
        figures["speedup"] = round(figures["eager"]["ms"] / figures["replayed"]["ms"], 3)
    result["figures"][f"{device}_b1_graphs"] = figures
    print(f"b1 eager vs replayed: {figures}", flush=True)


def eviction_canary(core, device: str) -> str:
    """Review finding 8: with CUDA_GRAPHS=2, three batch sizes of a GEMM network, each sent
    twice (the second captures), the third's capture evicting the first's graph. Destroying a
    graph freed its capture stream's cuBLAS workspace, which the other graphs of that stream
    still used (pytorch#193402); ``torch.cuda.empty_cache()`` then gives that memory back, and
    the next replay reads and writes freed memory. Here the remaining shapes' replays must
    still equal the eager path's (plugins/torch/capture.py clears the workspaces around each
    capture, so each graph owns its own). And 40 infer requests' lanes have 40 CUDA streams
    (finding 9: torch's pooled streams would repeat after 32)."""
    import torch
    from models import mlp

    model = mlp(sizes=(256, 1024, 1024, 64))  # GEMMs large enough to take cuBLAS's workspace
    eager = core.load_network(model, device, {"CUDA_GRAPHS": "0", "INFERENCE_PRECISION_HINT":
                                              "f32"}).create_infer_request()  # fmt: skip
    network = core.load_network(model, device, {"CUDA_GRAPHS": "2",
                                                "INFERENCE_PRECISION_HINT": "f32"})  # fmt: skip
    request = network.create_infer_request()
    feeds = {n: np.random.default_rng(n).normal(size=(n, 256)).astype(np.float32)
             for n in (3, 5, 7)}  # fmt: skip
    for x in feeds.values():
        for _ in range(2):
            request.infer({"x": x})
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    worst = 0.0
    for _ in range(3):
        for n in (5, 7):
            got = request.infer({"x": feeds[n]})["y"]
            want = eager.infer({"x": feeds[n]})["y"]
            worst = max(worst, float(np.max(np.abs(got - want))))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # an illegal address surfaces here at the latest
    counts = network.graph_statistics()
    if counts["evicted"] < 1 or counts["replayed"] < 6:
        raise AssertionError(f"expected an eviction and 6 replays: {counts}")
    if not worst <= 1e-4:
        raise AssertionError(f"replays differ from eager by {worst:.3g}: {counts}")
    # finding 9: each lane's stream its own (torch's pool has 32 a device, handed out in turn)
    lanes = [network.create_infer_request() for _ in range(40)]
    streams = {r._lane.stream.cuda_stream for r in lanes if r._lane.stream is not None}
    if streams and len(streams) != len(lanes):
        raise AssertionError(f"{len(lanes)} lanes share {len(streams)} CUDA streams")
    return f"{counts}, max difference to eager {worst:.3g}; {len(streams)} streams for 40 lanes"


if __name__ == "__main__":
    sys.exit(main())
