"""The benchmark models, built in code with random weights (nothing binary in git).

``resnet18`` (the torchvision topology: 7x7 stem, max pool, 4 stages of 2 basic blocks with
BatchNormalization, 1x1 stride-2 downsample shortcuts, global average pool, 1000-way Gemm;
dynamic batch), ``encoder`` (4 post-norm transformer encoder layers, hidden 256, 4 heads,
sequence 128, feed-forward 1024, erf GELU, LayerNormalization), ``mlp`` (784-1024-1024-1024-10,
dynamic batch) and ``identity`` (1x3x224x224 float32).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
f32 = np.float32


def _model(nodes, inputs, outputs, inits, name) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="plugserve-bench"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.inits: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def node(self, op: str, inputs: list[str], prefix: str | None = None, **attrs) -> str:
        out = self.fresh(prefix or op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def resnet18(seed: int = 0) -> onnx.ModelProto:
    b = _Builder(seed)
    rng = b.rng

    def conv_bn(x: str, cin: int, cout: int, k: int, stride: int, relu: bool) -> str:
        w = rng.normal(0, np.sqrt(2 / (cin * k * k)), (cout, cin, k, k)).astype(f32)
        name = b.fresh("conv")
        y = b.node(
            "Conv",
            [x, b.init(f"{name}_w", w)],
            "conv",
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
        )
        y = b.node(
            "BatchNormalization",
            [
                y,
                b.init(f"{name}_gamma", rng.uniform(0.5, 1.5, cout).astype(f32)),
                b.init(f"{name}_beta", rng.normal(0, 0.1, cout).astype(f32)),
                b.init(f"{name}_mean", rng.normal(0, 0.1, cout).astype(f32)),
                b.init(f"{name}_var", rng.uniform(0.5, 1.5, cout).astype(f32)),
            ],
            "bn",
            epsilon=1e-5,
        )
        return b.node("Relu", [y], "relu") if relu else y

    x = conv_bn("input", 3, 64, 7, 2, True)
    x = b.node("MaxPool", [x], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            y = conv_bn(x, cin, cout, 3, stride, True)
            y = conv_bn(y, cout, cout, 3, 1, False)
            shortcut = conv_bn(x, cin, cout, 1, stride, False) if stride != 1 or cin != cout else x
            x = b.node("Relu", [b.node("Add", [y, shortcut], "add")], "relu")
            cin = cout
    x = b.node("GlobalAveragePool", [x], "gap")
    x = b.node("Flatten", [x], "flatten", axis=1)
    fc_w = b.init("fc_w", rng.normal(0, 1 / np.sqrt(512), (1000, 512)).astype(f32))
    fc_b = b.init("fc_b", np.zeros(1000, f32))
    b.nodes.append(helper.make_node("Gemm", [x, fc_w, fc_b], ["logits"], name="fc", transB=1))
    return _model(
        b.nodes,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])],
        b.inits,
        "resnet18",
    )


def encoder(
    seed: int = 0, layers: int = 4, d: int = 256, heads: int = 4, ff: int = 1024, seq: int = 128
) -> onnx.ModelProto:
    b = _Builder(seed)
    rng = b.rng
    dh = d // heads

    def w(*shape: int, scale: float | None = None) -> np.ndarray:
        return rng.normal(0, scale or 1 / np.sqrt(shape[0]), shape).astype(f32)

    heads_shape = b.init("heads_shape", np.array([0, 0, heads, dh], np.int64))
    model_shape = b.init("model_shape", np.array([0, 0, d], np.int64))
    scale = b.init("scale", np.array(1 / np.sqrt(dh), f32))
    sqrt2 = b.init("sqrt2", np.array(np.sqrt(2), f32))
    one = b.init("one", np.array(1, f32))
    half = b.init("half", np.array(0.5, f32))
    x = "input"
    for i in range(layers):
        p = f"l{i}_"

        def dense(v: str, din: int, dout: int, tag: str, p: str = p) -> str:
            mm = b.node("MatMul", [v, b.init(f"{p}{tag}_w", w(din, dout))], f"{p}{tag}")
            return b.node("Add", [mm, b.init(f"{p}{tag}_b", w(dout, scale=0.1))], f"{p}{tag}_bias")

        q, k, v = (
            b.node("Reshape", [dense(x, d, d, t), heads_shape], f"{p}{t}_split") for t in "qkv"
        )
        q = b.node("Transpose", [q], f"{p}q_perm", perm=[0, 2, 1, 3])
        k = b.node("Transpose", [k], f"{p}k_perm", perm=[0, 2, 3, 1])
        v = b.node("Transpose", [v], f"{p}v_perm", perm=[0, 2, 1, 3])
        s = b.node("Mul", [b.node("MatMul", [q, k], f"{p}qk"), scale], f"{p}scale")
        a = b.node("Softmax", [s], f"{p}softmax", axis=-1)
        c = b.node(
            "Transpose", [b.node("MatMul", [a, v], f"{p}attend")], f"{p}ctx", perm=[0, 2, 1, 3]
        )
        c = b.node("Reshape", [c, model_shape], f"{p}merge")
        o = dense(c, d, d, "o")
        x = b.node("Add", [x, o], f"{p}res1")
        x = b.node(
            "LayerNormalization",
            [x, b.init(f"{p}ln1_g", np.ones(d, f32)), b.init(f"{p}ln1_b", np.zeros(d, f32))],
            f"{p}ln1",
            epsilon=1e-5,
        )
        h = dense(x, d, ff, "ff1")
        g = b.node("Erf", [b.node("Div", [h, sqrt2], f"{p}gelu_div")], f"{p}gelu_erf")
        g = b.node("Mul", [h, b.node("Add", [g, one], f"{p}gelu_add")], f"{p}gelu_mul")
        g = b.node("Mul", [g, half], f"{p}gelu_half")
        x = b.node("Add", [x, dense(g, ff, d, "ff2")], f"{p}res2")
        x = b.node(
            "LayerNormalization",
            [x, b.init(f"{p}ln2_g", np.ones(d, f32)), b.init(f"{p}ln2_b", np.zeros(d, f32))],
            f"{p}ln2",
            epsilon=1e-5,
        )
    b.nodes.append(helper.make_node("Identity", [x], ["output"], name="output"))
    return _model(
        b.nodes,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", seq, d])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", seq, d])],
        b.inits,
        "encoder",
    )


def mlp(seed: int = 0, sizes: tuple[int, ...] = (784, 1024, 1024, 1024, 10)) -> onnx.ModelProto:
    b = _Builder(seed)
    x = "input"
    for i, (a, o) in enumerate(itertools.pairwise(sizes)):
        wi = b.init(f"w{i}", b.rng.normal(0, 1 / np.sqrt(a), (a, o)).astype(f32))
        bi = b.init(f"b{i}", np.zeros(o, f32))
        x = b.node("Gemm", [x, wi, bi], f"dense{i}")
        if i < len(sizes) - 2:
            x = b.node("Relu", [x], f"relu{i}")
    b.nodes.append(helper.make_node("Identity", [x], ["output"], name="output"))
    return _model(
        b.nodes,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", sizes[-1]])],
        b.inits,
        "mlp",
    )


def identity(shape: tuple[int, ...] = (1, 3, 224, 224)) -> onnx.ModelProto:
    return _model(
        [helper.make_node("Identity", ["input"], ["output"], name="identity")],
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, list(shape))],
        [],
        "identity",
    )


MODELS = {"resnet18": resnet18, "encoder": encoder, "mlp": mlp, "identity": identity}


def input_shape(name: str, batch: int = 1) -> tuple[int, ...]:
    return {
        "resnet18": (batch, 3, 224, 224),
        "encoder": (batch, 128, 256),
        "mlp": (batch, 784),
        "identity": (1, 3, 224, 224),
    }[name]


def save_all(folder) -> dict[str, str]:
    """Write every model as ``folder/NAME.onnx``; returns the paths by name."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, build in MODELS.items():
        path = folder / f"{name}.onnx"
        if not path.exists():
            onnx.save(build(), str(path))
        paths[name] = str(path)
    return paths
