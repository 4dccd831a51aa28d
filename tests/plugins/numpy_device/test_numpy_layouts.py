"""NUMPY's load-time kernel choices: Winograd 3x3 convs and the fused erf GELU.

Each path is checked against onnxruntime on models that take it (and on neighbours that must
not), and the passes must keep every original node name so QueryNetwork is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins.numpy.kernels import winograd

ort = pytest.importorskip("onnxruntime")

#: The rule-based kernel choices these tests pin down (the timed choice is tested in
#: test_numpy_tuning.py, where each candidate is checked on its own).
FIXED_RULES = {"KERNEL_TUNING": "NO"}

F32 = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _close(ours, ref, tol=2e-5):
    scale = float(np.max(np.abs(ref))) or 1.0
    assert ours.shape == ref.shape
    assert float(np.max(np.abs(ours - ref))) <= tol * scale


@pytest.fixture
def winograd_calls(monkeypatch):
    """Counts the convolutions that ran on the Winograd path."""
    calls: list[tuple] = []
    original = winograd.Winograd.forward

    def forward(self, spec, x, bias):
        calls.append(x.shape)
        return original(self, spec, x, bias)

    monkeypatch.setattr(winograd.Winograd, "forward", forward)
    return calls


def _conv_model(n, c, m, h, w, rng, bias=True, **attrs):
    weight = (rng.standard_normal((m, c // attrs.get("group", 1), 3, 3)) * 0.05).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], name="conv", kernel_shape=[3, 3], **attrs)
    x_info = helper.make_tensor_value_info("x", F32, [n, c, h, w])
    y_info = helper.make_tensor_value_info("y", F32, ["N", "M", "H", "W"])
    return _model([node], [x_info], [y_info], inits)


WINOGRAD_CASES = [
    # n, c, m, h, w, attrs
    (1, 256, 256, 14, 14, {"pads": [1, 1, 1, 1]}),
    (1, 128, 128, 28, 28, {"pads": [1, 1, 1, 1]}),
    (2, 256, 320, 9, 11, {"pads": [1, 1, 1, 1]}),  # odd sizes: a cropped last tile row/column
    (1, 256, 256, 15, 13, {"pads": [0, 2, 1, 0]}),  # asymmetric pads
    (1, 288, 256, 16, 16, {}),  # no padding
    (1, 256, 256, 13, 17, {"auto_pad": "SAME_UPPER"}),
    (3, 256, 256, 8, 8, {"pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1]}),
]


@pytest.mark.parametrize(("n", "c", "m", "h", "w", "attrs"), WINOGRAD_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_winograd_matches_onnxruntime(numpy_plugin, winograd_calls, n, c, m, h, w, attrs, bias):
    rng = np.random.default_rng(c + h + w)
    model = _conv_model(n, c, m, h, w, rng, bias=bias, **attrs)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    request = numpy_plugin.load_network(model, FIXED_RULES).create_infer_request()
    for _ in range(2):  # the second run uses the cached per-shape plan
        ours = request.infer({"x": x})["y"]
        _close(ours, _ort(model, {"x": x})[0])
    assert winograd_calls and winograd_calls[0] == (n, c, h, w)


@pytest.mark.parametrize(
    ("c", "h", "attrs"),
    [
        (256, 14, {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
        (256, 14, {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
        (256, 14, {"pads": [1, 1, 1, 1], "group": 2}),
        (64, 28, {"pads": [1, 1, 1, 1]}),  # too narrow: transforms would cost more
        (512, 7, {"pads": [1, 1, 1, 1]}),  # too few tiles for the 16 GEMMs
    ],
)
def test_other_convs_take_the_direct_path(numpy_plugin, winograd_calls, c, h, attrs):
    rng = np.random.default_rng(1)
    model = _conv_model(1, c, c, h, h, rng, **attrs)
    x = rng.standard_normal((1, c, h, h)).astype(np.float32)
    ours = numpy_plugin.load_network(model, FIXED_RULES).infer({"x": x})["y"]
    _close(ours, _ort(model, {"x": x})[0])
    assert winograd_calls == []


def _residual_model(rng, c=256, h=14):
    """Conv+BN+Relu, Conv+BN, residual Add, Relu, MaxPool, GlobalAveragePool: a ResNet stage."""
    nodes, inits = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def conv_bn(x, i, relu):
        w = const(f"w{i}", rng.standard_normal((c, c, 3, 3)) * (2 / (9 * c)) ** 0.5)
        bn = [
            const(f"g{i}", rng.uniform(0.5, 1.5, c)),
            const(f"be{i}", rng.standard_normal(c) * 0.1),
            const(f"mu{i}", rng.standard_normal(c) * 0.1),
            const(f"var{i}", rng.uniform(0.5, 1.5, c)),
        ]
        nodes.append(helper.make_node("Conv", [x, w], [f"c{i}"], name=f"conv{i}", pads=[1] * 4))
        nodes.append(
            helper.make_node("BatchNormalization", [f"c{i}", *bn], [f"n{i}"], name=f"bn{i}")
        )
        if not relu:
            return f"n{i}"
        nodes.append(helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"))
        return f"r{i}"

    y = conv_bn(conv_bn("x", 0, True), 1, False)
    nodes.append(helper.make_node("Add", [y, "x"], ["sum"], name="add"))
    nodes.append(helper.make_node("Relu", ["sum"], ["act"], name="relu_sum"))
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes.append(helper.make_node("MaxPool", ["act"], ["pool"], name="pool", **pool))
    nodes.append(helper.make_node("GlobalAveragePool", ["pool"], ["y"], name="gap"))
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", F32, [1, c, h, h])],
        [helper.make_tensor_value_info("y", F32, [1, c, 1, 1])],
        inits,
    )


def test_resnet_stage_matches_onnxruntime(numpy_plugin, winograd_calls):
    rng = np.random.default_rng(7)
    model = _residual_model(rng)
    x = rng.standard_normal((1, 256, 14, 14)).astype(np.float32)
    ours = numpy_plugin.load_network(model, FIXED_RULES).infer({"x": x})["y"]
    _close(ours, _ort(model, {"x": x})[0])
    assert len(winograd_calls) == 2
    assert numpy_plugin.query_network(model) == {n.name: "NUMPY" for n in model.graph.node}


def test_winograd_is_thread_safe(numpy_plugin):
    """Requests running the same plan at once do not share work buffers."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(3)
    model = _conv_model(1, 256, 256, 14, 14, rng, pads=[1, 1, 1, 1])
    net = numpy_plugin.load_network(model, FIXED_RULES)
    xs = [rng.standard_normal((1, 256, 14, 14)).astype(np.float32) for _ in range(8)]
    expected = [net.infer({"x": x})["y"] for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: net.create_infer_request().infer({"x": x})["y"], xs * 4))
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, expected[i % len(xs)])


# --------------------------------------------------------------------------- GELU


def _gelu_model(spelling: str, extra_output: bool = False):
    """0.5 x (1 + erf(x / sqrt 2)) after a MatMul, in one of the spellings exporters use."""
    rng = np.random.default_rng(5)
    inits = [
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(math.sqrt(2), np.float32), "sqrt2"),
        numpy_helper.from_array(np.array(1 / math.sqrt(2), np.float32), "inv_sqrt2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    mk = helper.make_node
    nodes = [mk("MatMul", ["x", "w"], ["h"], name="mm")]
    if spelling == "div":  # Mul(Mul(h, 1 + erf), 0.5)
        nodes += [
            mk("Div", ["h", "sqrt2"], ["s"], name="div"),
            mk("Erf", ["s"], ["e"], name="erf"),
            mk("Add", ["e", "one"], ["p"], name="add"),
            mk("Mul", ["h", "p"], ["m"], name="mul"),
            mk("Mul", ["m", "half"], ["y"], name="mul_half"),
        ]
    else:  # Mul(Mul(0.5, h), 1 + erf) with the scale as a Mul
        nodes += [
            mk("Mul", ["inv_sqrt2", "h"], ["s"], name="scale"),
            mk("Erf", ["s"], ["e"], name="erf"),
            mk("Add", ["one", "e"], ["p"], name="add"),
            mk("Mul", ["half", "h"], ["hh"], name="mul_half"),
            mk("Mul", ["p", "hh"], ["y"], name="mul"),
        ]
    outputs = [helper.make_tensor_value_info("y", F32, [4, 32])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("e", F32, [4, 32]))
    return _model(nodes, [helper.make_tensor_value_info("x", F32, [4, 16])], outputs, inits)


@pytest.mark.parametrize("spelling", ["div", "mul"])
def test_gelu_is_fused_and_matches_onnxruntime(numpy_plugin, spelling):
    model = _gelu_model(spelling)
    x = (np.random.default_rng(0).standard_normal((4, 16)) * 3).astype(np.float32)
    net = numpy_plugin.load_network(model, FIXED_RULES)
    _close(net.infer({"x": x})["y"], _ort(model, {"x": x})[0], tol=1e-6)
    fused = [n for n in net.transformed.nodes if n.op_type == "Gelu"]
    assert len(fused) == 1 and fused[0].domain == "ai.plugserve"
    assert set(fused[0].fused_names) == {n.name for n in model.graph.node} - {"mm"}
    assert [n.op_type for n in net.transformed.nodes] == ["MatMul", "Gelu"]
    assert numpy_plugin.query_network(model) == {n.name: "NUMPY" for n in model.graph.node}
    again = numpy_plugin.import_network(net.export())  # the fused node survives a blob
    np.testing.assert_array_equal(again.infer({"x": x})["y"], net.infer({"x": x})["y"])


def test_gelu_with_an_observed_intermediate_is_left_alone(numpy_plugin):
    model = _gelu_model("div", extra_output=True)
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    net = numpy_plugin.load_network(model, FIXED_RULES)
    assert not any(n.op_type == "Gelu" for n in net.transformed.nodes)
    ours = net.infer({"x": x})
    ref = _ort(model, {"x": x})
    _close(ours["y"], ref[0], tol=1e-6)
    _close(ours["e"], ref[1], tol=1e-6)


def test_winograd_convs_with_one_padded_shape(numpy_plugin, winograd_calls):
    """Two Winograd convs whose padded inputs have one shape but different interiors (pads
    (1, 1) on 14x14 and (1, 2) on 13x13 both pad to 16x16): each keeps its own zero border."""
    rng = np.random.default_rng(11)
    c = 128
    w1 = (rng.standard_normal((c, c, 3, 3)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((c, c, 3, 3)) * 0.05).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Slice", ["a", "st", "en", "ax"], ["s"], name="slice"),
        helper.make_node("Conv", ["s", "w2"], ["y"], name="c2", pads=[1, 1, 2, 2]),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.array([0, 0], np.int64), "st"),
        numpy_helper.from_array(np.array([13, 13], np.int64), "en"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "ax"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", F32, [2, c, 14, 14])],
        [helper.make_tensor_value_info("y", F32, [2, c, 14, 14])],
        inits,
    )
    x = rng.standard_normal((2, c, 14, 14)).astype(np.float32) + 3
    request = numpy_plugin.load_network(model, FIXED_RULES).create_infer_request()
    for _ in range(3):
        _close(request.infer({"x": x})["y"], _ort(model, {"x": x})[0])
    assert {s[2:] for s in winograd_calls} == {(14, 14), (13, 13)}


# --------------------------------------------------------------------------- separable MaxPool


@pytest.mark.parametrize(
    ("shape", "attrs"),
    [
        ((1, 8, 112, 112), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
        ((2, 3, 13, 17), {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [1, 0, 1, 1]}),
        ((1, 4, 15, 15), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
        ((1, 4, 16, 16), {"kernel_shape": [2, 2], "dilations": [2, 3], "pads": [1, 1, 0, 1]}),
        ((1, 4, 9, 9), {"kernel_shape": [5, 5], "pads": [2, 2, 2, 2]}),
        ((1, 2, 31), {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}),
        ((1, 2, 20, 20), {"kernel_shape": [3, 2], "dilations": [3, 2], "pads": [2, 1, 2, 1]}),
        ((1, 2, 6, 7, 8), {"kernel_shape": [2, 3, 2], "strides": [2, 1, 2], "pads": [0, 1, 1] * 2}),
        ((1, 3, 10, 10), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ],
)
def test_separable_max_pool_matches_onnxruntime(numpy_plugin, shape, attrs):
    node = helper.make_node("MaxPool", ["x"], ["y"], name="pool", **attrs)
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", F32, list(shape))],
        [helper.make_tensor_value_info("y", F32, ["d"] * len(shape))],
        [],
    )
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    x -= 5  # all negative: a padded position wrongly taken as 0 would show
    ref = _ort(model, {"x": x})[0]
    np.testing.assert_array_equal(
        numpy_plugin.load_network(model, FIXED_RULES).infer({"x": x})["y"], ref
    )


def test_gelu_whose_constant_broadcasts_to_a_larger_rank_is_left_alone(numpy_plugin):
    model = _gelu_model("div")
    half = next(t for t in model.graph.initializer if t.name == "half")
    half.CopyFrom(numpy_helper.from_array(np.full((1, 1, 1), 0.5, np.float32), "half"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", F32, [1, 4, 32]))
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    net = numpy_plugin.load_network(model, FIXED_RULES)
    assert not any(n.op_type == "Gelu" for n in net.transformed.nodes)
    _close(net.infer({"x": x})["y"], _ort(model, {"x": x})[0], tol=1e-6)
