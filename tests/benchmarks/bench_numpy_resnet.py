"""NUMPY vs onnxruntime latency at batch 1 on ResNet-18, a transformer encoder and an MLP.

Run: ``python tests/benchmarks/bench_numpy_resnet.py [--runs N] [--blocks B] [--models ...]
[--batch 1 8] [--load]``; as issue 15 asks, with numpy's OpenBLAS left to pick its own kernel:
``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_numpy_resnet.py``.

The models are built in code (random weights, opset 17). Both backends run in this process,
interleaved in blocks (B blocks of N runs each, alternating which goes first), so machine noise
(2 shared cores) hits both alike; the report is medians and best-of per backend and their
ratio (NUMPY / onnxruntime) within this one run; on ResNet-18 a plain numpy sketch
(``sketch.py``: im2col + matmul, BN folded) runs too, the floor NUMPY must beat. The report
starts with the CPU, its vector extensions and the BLAS kernel threadpoolctl sees.
onnxruntime gets intra_op_num_threads=2 and allow_spinning=0 so it does not burn a core the
other backend needs. Each runner's output is checked against onnxruntime's before timing.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _Builder:
    """A tiny graph builder: named nodes, random initializers, unique names."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, prefix: str, value: np.ndarray) -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def rand(self, prefix: str, shape, scale: float) -> str:
        return self.const(prefix, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def model(self, name: str, inputs, outputs) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8
        )
        onnx.checker.check_model(model)
        return model


def resnet18() -> onnx.ModelProto:
    """torchvision's ResNet-18 topology: Conv+BN+Relu, BasicBlocks with residual Adds."""
    b = _Builder(0)

    def conv_bn(x, cin, cout, k, stride, relu):
        w = b.rand("w", (cout, cin, k, k), (2.0 / (cin * k * k)) ** 0.5)
        p = k // 2
        y = b.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride] * 2, pads=[p] * 4)
        bn = [
            b.const("gamma", b.rng.uniform(0.5, 1.5, cout).astype(np.float32)),
            b.const("beta", (b.rng.standard_normal(cout) * 0.1).astype(np.float32)),
            b.const("mean", (b.rng.standard_normal(cout) * 0.1).astype(np.float32)),
            b.const("var", b.rng.uniform(0.5, 1.5, cout).astype(np.float32)),
        ]
        y = b.op("BatchNormalization", [y, *bn], epsilon=1e-5)
        return b.op("Relu", [y]) if relu else y

    def block(x, cin, cout, stride):
        y = conv_bn(x, cin, cout, 3, stride, True)
        y = conv_bn(y, cout, cout, 3, 1, False)
        short = conv_bn(x, cin, cout, 1, stride, False) if stride != 1 or cin != cout else x
        return b.op("Relu", [b.op("Add", [y, short])])

    x = conv_bn("input", 3, 64, 7, 2, True)
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = block(x, cin, cout, stride)
        x = block(x, cout, cout, 1)
        cin = cout
    x = b.op("GlobalAveragePool", [x])
    x = b.op("Flatten", [x], axis=1)
    fc_w = b.rand("fc_w", (1000, 512), 0.03)
    fc_b = b.rand("fc_b", (1000,), 0.01)
    b.op("Gemm", [x, fc_w, fc_b], transB=1)
    b.nodes[-1].output[0] = "logits"
    return b.model(
        "resnet18",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 1000])],
    )


def encoder(layers: int = 4, hidden: int = 256, heads: int = 4, seq: int = 128) -> onnx.ModelProto:
    """A post-LN transformer encoder: MHA, erf GELU FFN, LayerNormalization."""
    b = _Builder(1)
    head = hidden // heads
    ffn = 4 * hidden
    x = "input"
    shape_heads = b.const("shape_heads", np.array([0, seq, heads, head], np.int64))
    shape_back = b.const("shape_back", np.array([0, seq, hidden], np.int64))
    scale = b.const("scale", np.array(1.0 / head**0.5, np.float32))
    sqrt2 = b.const("sqrt2", np.array(2**0.5, np.float32))
    one = b.const("one", np.array(1.0, np.float32))
    half = b.const("half", np.array(0.5, np.float32))

    def linear(v, cin, cout):
        y = b.op("MatMul", [v, b.rand("w", (cin, cout), cin**-0.5)])
        return b.op("Add", [y, b.rand("b", (cout,), 0.02)])

    def split_heads(v, perm):
        return b.op("Transpose", [b.op("Reshape", [v, shape_heads])], perm=perm)

    def layer_norm(v):
        gamma = b.const("ln_g", np.ones(hidden, np.float32))
        beta = b.const("ln_b", np.zeros(hidden, np.float32))
        return b.op("LayerNormalization", [v, gamma, beta], axis=-1, epsilon=1e-5)

    for _ in range(layers):
        q = split_heads(linear(x, hidden, hidden), [0, 2, 1, 3])
        k = split_heads(linear(x, hidden, hidden), [0, 2, 3, 1])
        v = split_heads(linear(x, hidden, hidden), [0, 2, 1, 3])
        scores = b.op("Mul", [b.op("MatMul", [q, k]), scale])
        probs = b.op("Softmax", [scores], axis=-1)
        ctx = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        attn = linear(b.op("Reshape", [ctx, shape_back]), hidden, hidden)
        x = layer_norm(b.op("Add", [x, attn]))
        h = linear(x, hidden, ffn)
        gelu = b.op("Add", [b.op("Erf", [b.op("Div", [h, sqrt2])]), one])
        h = b.op("Mul", [b.op("Mul", [h, gelu]), half])
        x = layer_norm(b.op("Add", [x, linear(h, ffn, hidden)]))
    b.nodes.append(helper.make_node("Identity", [x], ["output"], name="output_identity"))
    return b.model(
        "encoder",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", seq, hidden])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", seq, hidden])],
    )


def mlp(sizes=(784, 1024, 1024, 1024, 10)) -> onnx.ModelProto:
    b = _Builder(2)
    x = "input"
    for i, (cin, cout) in enumerate(itertools.pairwise(sizes)):
        w = b.rand("w", (cin, cout), cin**-0.5)
        x = b.op("Gemm", [x, w, b.rand("b", (cout,), 0.02)])
        if i < len(sizes) - 2:
            x = b.op("Relu", [x])
    b.nodes[-1].output[0] = "output"
    return b.model(
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", sizes[-1]])],
    )


MODELS = {
    "resnet18": (resnet18, (1, 3, 224, 224)),
    "encoder": (encoder, (1, 128, 256)),
    "mlp": (mlp, (1, 784)),
}


def _runners(model: onnx.ModelProto, sketch: bool):
    import onnxruntime as ort

    from plugserve.plugins.numpy import NumpyPlugin

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    in_name = sess.get_inputs()[0].name
    request = NumpyPlugin().load_network(model).create_infer_request()
    runners = {
        "numpy": lambda x: next(iter(request.infer({in_name: x}).values())),
        "onnxruntime": lambda x: sess.run(None, {in_name: x})[0],
    }
    if sketch:
        from sketch import Sketch

        runners["sketch"] = Sketch(model)
    return runners


def load_times(name: str) -> str:
    """Compile time with tuning, then a second load of the same model through the Core's
    CACHE_DIR (which must not time the kernels again)."""
    import tempfile

    from plugserve.server import Core

    model = MODELS[name][0]()
    with tempfile.TemporaryDirectory() as cache:
        config = {"CACHE_DIR": cache}
        start = time.perf_counter()
        first = Core().load_network(model, "NUMPY", config)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        second = Core().load_network(model, "NUMPY", config)
        warm = time.perf_counter() - start
    return (
        f"{name:9s} load {cold:.2f} s ({first.tuner.timed} shapes timed), second load from "
        f"CACHE_DIR {warm:.2f} s ({second.tuner.timed} timed, from cache: "
        f"{second.loaded_from_cache})"
    )


def bench(name: str, runs: int, blocks: int, batch: int = 1) -> dict[str, float]:
    build, shape = MODELS[name]
    model = build()
    x = np.random.default_rng(3).standard_normal((batch, *shape[1:])).astype(np.float32)
    runners = _runners(model, sketch=name == "resnet18")
    ref = runners["onnxruntime"](x)
    errors = {}
    for key in runners:
        out = runners[key](x)
        errors[key] = float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-12))
        if errors[key] > 1e-3:
            raise SystemExit(
                f"{name}: {key} differs from onnxruntime (relative error {errors[key]:.2e})"
            )
    times: dict[str, list[float]] = {k: [] for k in runners}
    for fn in runners.values():  # warm-up: plans, caches, NUMPY's choices for this batch
        for _ in range(16):
            fn(x)
    order = list(runners)
    for block in range(blocks):
        for key in order if block % 2 == 0 else order[::-1]:
            fn = runners[key]
            for _ in range(runs):
                start = time.perf_counter()
                fn(x)
                times[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = {k: min(v) * 1e3 for k, v in times.items()}
    line = (
        f"{name:9s} b{batch} numpy p50 {med['numpy']:7.2f} ms (best {best['numpy']:6.2f})  "
        f"ort p50 {med['onnxruntime']:7.2f} ms (best {best['onnxruntime']:6.2f})  "
        f"numpy/ort p50 {med['numpy'] / med['onnxruntime']:.2f}x "
        f"best {best['numpy'] / best['onnxruntime']:.2f}x"
    )
    if "sketch" in med:
        ratio = med["numpy"] / med["sketch"]
        line += f"  sketch p50 {med['sketch']:7.2f} ms: numpy/sketch {ratio:.2f}x"
    print(line + f"  (max rel err {errors['numpy']:.1e})", flush=True)
    return {"p50": med["numpy"] / med["onnxruntime"], "best": best["numpy"] / best["onnxruntime"]}


def _macs(model: onnx.ModelProto, batch: int) -> dict[str, int]:
    """Multiply-adds of each Conv, Gemm and MatMul node at this batch (shape inference)."""
    from onnx import shape_inference

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = batch
    inferred = shape_inference.infer_shapes(m).graph
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.value_info
    }
    shapes.update(
        {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in m.graph.input}
    )
    shapes.update(
        {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.output}
    )
    inits = {i.name: list(i.dims) for i in m.graph.initializer}
    macs = {}
    for node in m.graph.node:
        out = shapes.get(node.output[0])
        w = inits.get(node.input[1]) if len(node.input) > 1 else None
        if not out or not w:
            continue
        if node.op_type == "Conv":
            macs[node.name] = int(np.prod(out)) * int(np.prod(w[1:]))
        elif node.op_type in ("Gemm", "MatMul"):
            macs[node.name] = int(np.prod(out)) * w[0]
    return macs


def nodes(name: str, batch: int, runs: int) -> None:
    """Where NUMPY's time goes, node by node, against onnxruntime's own profile and the GEMM
    floor: each node's multiply-adds at the rate NUMPY's split GEMM reaches on a large square
    GEMM here (what issue 15 asks for when a target is missed)."""
    import collections
    import json
    import tempfile

    import onnxruntime as ort

    from plugserve.plugins.numpy import NumpyPlugin, blas, parallel

    model = MODELS[name][0]()
    x = np.random.default_rng(3).standard_normal((batch, *MODELS[name][1][1:])).astype("f4")
    net = NumpyPlugin().load_network(model, {"PERF_COUNT": "YES"})
    req = net.create_infer_request()
    per: dict[str, list[float]] = collections.defaultdict(list)
    kinds: dict[str, str] = {}
    for _ in range(16):  # NUMPY settles its choices for a batch its load did not time
        req.infer({"input": x})
    for _ in range(runs):
        req.infer({"input": x})
        for pc in req.get_performance_counts():
            per[pc.node_name].append(pc.real_time_s * 1e3)
            kinds[pc.node_name] = pc.exec_type
    ours = {k: statistics.median(v) for k, v in per.items()}
    fused = {pc.node_name: pc.original_names for pc in req.get_performance_counts()}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with tempfile.TemporaryDirectory() as tmp:
        opts.enable_profiling = True
        opts.profile_file_prefix = f"{tmp}/ort"
        sess = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
        for _ in range(runs + 2):
            sess.run(None, {"input": x})
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    theirs_total = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            theirs_total[e["name"]].append(e["dur"] / 1e3)
    ort_sum = sum(statistics.median(v) for v in theirs_total.values())
    blas.set_thread_count(1)
    parallel.use_threads(2)
    a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    best = min(_timed(lambda: parallel.matmul(a, a)) for _ in range(10))
    rate = 2 * 1024**3 / best / 1e9
    macs = _macs(model, batch)
    print(
        f"{name} b{batch}: split GEMM rate {rate:.0f} GFLOP/s (1024^3); onnxruntime's nodes "
        f"sum {ort_sum:.2f} ms; NUMPY's {sum(ours.values()):.2f} ms"
    )
    print("| node | kernel | NUMPY ms | MMACs | GEMM floor ms | NUMPY / floor |")
    print("|---|---|---|---|---|---|")
    floor_sum = 0.0
    for node, ms_ in sorted(ours.items(), key=lambda kv: -kv[1]):
        mm = sum(macs.get(n, 0) for n in fused.get(node, (node,)))
        floor = 2 * mm / rate / 1e6 if mm else 0.0
        floor_sum += floor
        ratio = f"{ms_ / floor:.2f}x" if floor else "-"
        print(f"| {node} | {kinds[node]} | {ms_:.3f} | {mm / 1e6:.1f} | {floor:.3f} | {ratio} |")
    print(f"GEMM floor of the whole network (direct convs): {floor_sum:.2f} ms")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per block")
    parser.add_argument("--blocks", type=int, default=10, help="interleaved blocks per backend")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, nargs="*", default=[1], help="batch sizes")
    parser.add_argument("--load", action="store_true", help="also time loading (with tuning)")
    parser.add_argument("--nodes", action="store_true", help="per-node times and GEMM floors")
    args = parser.parse_args()
    import harness  # the description every benchmark prints (CPU, vector extensions, BLAS kernel)

    print("machine: " + ", ".join(f"{k} {v}" for k, v in harness.machine().items()), flush=True)
    if args.nodes:
        for name in args.models:
            for batch in args.batch:
                nodes(name, batch, args.runs)
        return
    for name in args.models:
        if args.load:
            print(load_times(name), flush=True)
        for batch in args.batch:
            bench(name, args.runs, args.blocks, batch)


if __name__ == "__main__":
    main()
