"""NUMPY's fast 3x3 conv paths: Winograd F(4x4, 3x3) and the per-layer choice between it,
F(2x2, 3x3) and the direct paths.

F(4, 3) uses the interpolation points 0, +-1, +-2, inf, whose transforms amplify float32
rounding more than F(2, 3)'s. The bound accepted (and asserted here against a float64
reference) is max |y - y_ref| <= 1e-4 * max |y_ref| per conv and per ResNet-18 output;
measured ~5e-6 to 1e-5 for single convs and ~1e-6 on ResNet-18's logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins.numpy.kernels import winograd

#: The rule-based kernel choices these tests pin down (the timed choice is tested in
#: test_numpy_tuning.py, where each candidate is checked on its own).
FIXED_RULES = {"KERNEL_TUNING": "NO"}

F32 = TensorProto.FLOAT
BOUND = 1e-4


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _conv_model(n, c, m, h, w, weight, bias, x_shape=None, **attrs):
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], name="conv", kernel_shape=[3, 3], **attrs)
    x_info = helper.make_tensor_value_info("x", F32, x_shape or [n, c, h, w])
    y_info = helper.make_tensor_value_info("y", F32, ["N", "M", "H", "W"])
    return _model([node], [x_info], [y_info], inits)


def _reference(x, weight, bias, pads):
    """The plain computation in float64: one tap at a time over the zero-padded input."""
    top, left, bottom, right = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    oh, ow = xp.shape[2] - 2, xp.shape[3] - 2
    y = np.zeros((x.shape[0], weight.shape[0], oh, ow))
    for i in range(3):
        for j in range(3):
            tap = xp[:, :, i : i + oh, j : j + ow]
            y += np.einsum("mc,nchw->nmhw", weight[:, :, i, j].astype(np.float64), tap)
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1)
    return y


def _rel_err(ours, ref):
    assert ours.shape == ref.shape
    return float(np.max(np.abs(ours - ref))) / (float(np.max(np.abs(ref))) or 1.0)


@pytest.fixture
def winograd_tiles(monkeypatch):
    """The tile size (r of F(r, 3)) of each conv that ran on a Winograd path."""
    calls: list[tuple[int, tuple]] = []
    original = winograd.Winograd.forward

    def forward(self, spec, x, bias):
        calls.append((self.r, x.shape))
        return original(self, spec, x, bias)

    monkeypatch.setattr(winograd.Winograd, "forward", forward)
    return calls


F43_CASES = [
    # n, c, m, h, w, pads (ONNX order: top, left, bottom, right)
    (1, 64, 64, 56, 56, (1, 1, 1, 1)),  # ResNet-18 layer 1
    (1, 128, 128, 28, 28, (1, 1, 1, 1)),  # ResNet-18 layer 2
    (1, 64, 96, 58, 54, (1, 1, 1, 1)),  # more outputs than inputs, cropped last tile row
    (2, 96, 64, 40, 41, (1, 1, 1, 1)),  # batch 2, odd width
    (1, 64, 64, 57, 53, (0, 2, 1, 0)),  # asymmetric pads
    (1, 64, 64, 58, 58, (0, 0, 0, 0)),  # no padding
    (3, 128, 128, 25, 27, (2, 1, 0, 1)),
]


@pytest.mark.parametrize(("n", "c", "m", "h", "w", "pads"), F43_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_f43_matches_reference(numpy_plugin, winograd_tiles, n, c, m, h, w, pads, with_bias):
    rng = np.random.default_rng(n + c + m + h + w)
    weight = (rng.standard_normal((m, c, 3, 3)) * (2 / (9 * c)) ** 0.5).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32) if with_bias else None
    model = _conv_model(n, c, m, h, w, weight, bias, pads=list(pads))
    request = numpy_plugin.load_network(model, FIXED_RULES).create_infer_request()
    for _ in range(2):  # the second run uses the cached per-shape plan
        x = rng.standard_normal((n, c, h, w)).astype(np.float32)
        ours = request.infer({"x": x})["y"]
        assert _rel_err(ours, _reference(x, weight, bias, pads)) <= BOUND
    assert winograd_tiles and all(call == (4, (n, c, h, w)) for call in winograd_tiles)


def test_f43_same_upper(numpy_plugin, winograd_tiles):
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((64, 64, 3, 3)) * 0.06).astype(np.float32)
    model = _conv_model(1, 64, 64, 45, 51, weight, None, auto_pad="SAME_UPPER")
    x = rng.standard_normal((1, 64, 45, 51)).astype(np.float32)
    ours = numpy_plugin.load_network(model, FIXED_RULES).infer({"x": x})["y"]
    assert _rel_err(ours, _reference(x, weight, None, (1, 1, 1, 1))) <= BOUND
    assert [r for r, _ in winograd_tiles] == [4]


@pytest.mark.parametrize(
    ("c", "h", "x_shape", "expected"),
    [
        (256, 14, None, 2),  # 16 F(4, 3) tiles: too thin for 36 GEMMs, F(2, 3) serves
        (64, 28, None, None),  # 64 channels, 49 tiles: too little work for either
        (64, 56, ["N", 64, "H", "W"], None),  # map unknown at load time: no F(4, 3)
        (128, 28, ["N", 128, "H", "W"], 2),
    ],
)
def test_tile_choice(numpy_plugin, winograd_tiles, c, h, x_shape, expected):
    """Which path each conv takes is decided at load time from channels and map size, and
    every path gives the same result."""
    rng = np.random.default_rng(c + h)
    weight = (rng.standard_normal((c, c, 3, 3)) * (2 / (9 * c)) ** 0.5).astype(np.float32)
    model = _conv_model(1, c, c, h, h, weight, None, x_shape=x_shape, pads=[1, 1, 1, 1])
    x = rng.standard_normal((1, c, h, h)).astype(np.float32)
    ours = numpy_plugin.load_network(model, FIXED_RULES).infer({"x": x})["y"]
    assert _rel_err(ours, _reference(x, weight, None, (1, 1, 1, 1))) <= 2e-5
    assert [r for r, _ in winograd_tiles] == ([expected] if expected else [])


def test_f43_shape_too_small_falls_back(numpy_plugin, winograd_tiles):
    """A request whose map is much smaller than the one planned for takes the direct path."""
    rng = np.random.default_rng(4)
    weight = (rng.standard_normal((64, 64, 3, 3)) * 0.06).astype(np.float32)
    model = _conv_model(1, 64, 64, 56, 56, weight, None, x_shape=["N", 64, 56, 56], pads=[1] * 4)
    net = numpy_plugin.load_network(model, FIXED_RULES)
    x = rng.standard_normal((1, 64, 56, 56)).astype(np.float32)
    assert _rel_err(net.infer({"x": x})["y"], _reference(x, weight, None, (1,) * 4)) <= BOUND
    assert [r for r, _ in winograd_tiles] == [4]


def test_resnet18_within_bound(numpy_plugin, winograd_tiles):
    """The whole ResNet-18 (F(4, 3) in layers 1-2, F(2, 3) in layer 3) against onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import bench_numpy_resnet

    model = bench_numpy_resnet.resnet18()
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    ours = numpy_plugin.load_network(model, FIXED_RULES).infer({"input": x})["logits"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = session.run(None, {"input": x})[0]
    assert _rel_err(ours, ref) <= BOUND
    assert sorted({r for r, _ in winograd_tiles}) == [2, 4]
    assert sum(r == 4 for r, _ in winograd_tiles) == 7


# --------------------------------------------------------------------------- conv fusions


def _transformed_ops(plugin, model):
    from plugserve.plugins.ir import load_model

    graph = plugin.transform(load_model(model), plugin.merged_config({}))
    return {node.op_type: node for node in graph.nodes}, graph


def _against_plain_and_ort(plugin, model, feeds, tol=2e-5):
    """The transformed network against the untransformed one and onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    fast = plugin.load_network(model).infer(feeds)
    plain = plugin.load_network(model, {"DISABLE_TRANSFORMATIONS": "YES"}).infer(feeds)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for name, ref in zip([o.name for o in model.graph.output], session.run(None, feeds)):
        assert _rel_err(fast[name], ref) <= tol
        assert _rel_err(fast[name], plain[name]) <= tol


POOLS = [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},  # ResNet's stem
    {"kernel_shape": [2, 2], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [0, 1, 2, 1]},
    {"kernel_shape": [2, 3], "strides": [1, 2], "dilations": [2, 1]},
]


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize(
    ("k", "stride", "relu", "bias"),
    [(7, 2, True, True), (3, 1, True, False), (1, 1, False, True), (3, 2, False, False)],
)
def test_conv_relu_maxpool_fusion(numpy_plugin, pool, k, stride, relu, bias):
    """Pooling the raw conv output and applying bias and Relu after gives the same map."""
    rng = np.random.default_rng(k + stride)
    c, m, h, w = 3, 16, 29, 34
    weight = (rng.standard_normal((m, c, k, k)) * 0.3).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b"))
        inputs.append("b")
    conv = helper.make_node(
        "Conv", inputs, ["c"], name="conv", strides=[stride] * 2, pads=[k // 2] * 4
    )
    nodes = [conv]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["r"], name="relu"))
    nodes.append(helper.make_node("MaxPool", [nodes[-1].output[0]], ["y"], name="pool", **pool))
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F32, [2, c, h, w])],
        [helper.make_tensor_value_info("y", F32, ["n", "m", "h", "w"])],
        inits,
    )
    ops, graph = _transformed_ops(numpy_plugin, model)
    assert list(ops) == ["FusedConvPool"]
    assert sorted(graph.original_names()) == sorted(n.name for n in nodes)
    x = rng.standard_normal((2, c, h, w)).astype(np.float32)
    _against_plain_and_ort(numpy_plugin, model, {"x": x})


def test_maxpool_with_indices_or_other_readers_is_not_fused(numpy_plugin):
    rng = np.random.default_rng(5)
    weight = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1] * 4),
        helper.make_node("MaxPool", ["c"], ["y", "i"], name="pool", **pool),
    ]
    outputs = [
        helper.make_tensor_value_info("y", F32, ["n", "m", "h", "w"]),
        helper.make_tensor_value_info("i", TensorProto.INT64, ["n", "m", "h", "w"]),
    ]
    x_info = helper.make_tensor_value_info("x", F32, [1, 3, 8, 8])
    model = _model(nodes, [x_info], outputs, [weight])
    ops, _ = _transformed_ops(numpy_plugin, model)
    assert "FusedConvPool" not in ops
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    _against_plain_and_ort(numpy_plugin, model, {"x": x})
