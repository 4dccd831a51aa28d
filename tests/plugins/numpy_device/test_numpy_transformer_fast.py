"""The transformer fast paths (Linear, Attention, Q/K/V merge) against the plain computation.

Models are built with ``onnx.helper`` and run through the public API; the reference is onnx's
own evaluator on the original model. Each test also checks that the fusion it is about really
happened (or, for the negative cases, did not), so the fast path is what is being compared.
Tolerance: max abs error <= 1e-4 * max |y| (float32 rounding of long dot products).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from benchmarks import zoo
from benchmarks.bench_numpy_resnet import encoder as bench_encoder
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from plugserve.plugins.numpy import NumpyPlugin

RTOL = 1e-4


def _fused_ops(net) -> list[tuple[str, str]]:
    return [(n.op_type, n.attr("epilogue", "")) for n in net.transformed.nodes if n.domain]


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], plugin=None):
    plugin = plugin or NumpyPlugin()
    net = plugin.load_network(model)
    got = net.create_infer_request().infer(feeds)
    ref = ReferenceEvaluator(model).run(None, feeds)
    for name, expected in zip([o.name for o in model.graph.output], ref):
        scale = float(np.max(np.abs(expected))) or 1.0
        err = float(np.max(np.abs(got[name] - expected))) / scale
        assert err <= RTOL, f"{name}: relative error {err:.2e}"
    return net


def _model(nodes, inputs, outputs, inits, opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "t",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# --------------------------------------------------------------------------- whole encoders


@pytest.mark.parametrize("batch", [1, 3])
def test_bench_encoder_matches_reference(batch):
    model = bench_encoder(layers=2, hidden=32, heads=4, seq=8)
    x = _rand(np.random.default_rng(batch), batch, 8, 32)
    net = _check(model, {"input": x})
    ops = _fused_ops(net)
    assert ops.count(("Attention", "")) == 2
    assert ("Linear", "gelu") in ops and ("Linear", "layernorm") in ops
    merged = [n for n in net.transformed.nodes if n.op_type == "Linear" and len(n.outputs) == 3]
    assert len(merged) == 2
    assert all(n.attr("scale") == 1.0 for n in net.transformed.nodes if n.op_type == "Attention")


@pytest.mark.parametrize("batch,seq", [(1, 5), (2, 9)])
def test_zoo_encoder_matches_reference(batch, seq):
    model = zoo.encoder(layers=2, d=24, heads=3, ff=40, seq=seq)
    x = _rand(np.random.default_rng(seq), batch, seq, 24)
    net = _check(model, {"input": x})
    assert ("Attention", "") in _fused_ops(net)


def test_fused_network_survives_export_and_import():
    model = bench_encoder(layers=1, hidden=16, heads=2, seq=4)
    plugin = NumpyPlugin()
    net = plugin.load_network(model)
    x = _rand(np.random.default_rng(0), 2, 4, 16)
    expected = net.create_infer_request().infer({"input": x})["output"]
    again = plugin.import_network(net.export())
    np.testing.assert_array_equal(
        again.create_infer_request().infer({"input": x})["output"], expected
    )


# --------------------------------------------------------------------------- Linear


def _dense(rng, k, n, bias_shape, tail, lead=(3, 5), transpose_x=False, res_first=False):
    """x [Transpose] -> MatMul(W) -> Add(b) -> tail; tail in none/res/ln/res_ln/gelu/gelu5."""
    inits = {"W": _rand(rng, k, n, scale=k**-0.5), "b": _rand(rng, *bias_shape)}
    x_shape = [*lead, k]
    nodes = []
    x = "x"
    if transpose_x:
        x_shape = [k, *lead]
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 2, 0]))
        x = "xt"
    nodes += [
        helper.make_node("MatMul", [x, "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["y0"]),
    ]
    last, inputs = "y0", [("x", x_shape)]
    feeds = {"x": _rand(rng, *x_shape)}
    if tail.startswith("res"):
        pair = ["r", last] if res_first else [last, "r"]
        nodes.append(helper.make_node("Add", pair, ["y1"]))
        last = "y1"
        inputs.append(("r", [*lead, n]))
        feeds["r"] = _rand(rng, *lead, n)
    if tail.endswith("ln"):
        inits["g"], inits["be"] = _rand(rng, n), _rand(rng, n)
        nodes.append(helper.make_node("LayerNormalization", [last, "g", "be"], ["y2"], axis=-1))
        last = "y2"
    if tail == "gelu":
        nodes.append(helper.make_node("Gelu", [last], ["y2"]))
        last = "y2"
    if tail == "gelu5":
        inits["s2"] = np.array(math.sqrt(2), np.float32)
        inits["one"] = np.array(1, np.float32)
        inits["half"] = np.array(0.5, np.float32)
        nodes += [
            helper.make_node("Div", [last, "s2"], ["g1"]),
            helper.make_node("Erf", ["g1"], ["g2"]),
            helper.make_node("Add", ["g2", "one"], ["g3"]),
            helper.make_node("Mul", [last, "g3"], ["g4"]),
            helper.make_node("Mul", ["g4", "half"], ["y2"]),
        ]
        last = "y2"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    opset = 20 if tail == "gelu" else 17
    return _model(nodes, inputs, [("y", [*lead, n])], inits, opset), feeds


@pytest.mark.parametrize(
    "tail,epilogue",
    [
        ("none", "none"),
        ("res", "none"),
        ("ln", "layernorm"),
        ("res_ln", "layernorm"),
        ("gelu", "gelu"),
        ("gelu5", "gelu"),
    ],
)
@pytest.mark.parametrize("k,n", [(16, 8), (37, 19), (64, 130)])
def test_linear_epilogues(tail, epilogue, k, n):
    rng = np.random.default_rng(k * n)
    model, feeds = _dense(rng, k, n, (n,), tail)
    net = _check(model, feeds)
    assert _fused_ops(net) == [("Linear", epilogue)]


@pytest.mark.parametrize("lead", [(7,), (2, 3, 4), (1, 1)])
def test_linear_ranks_bias_shapes_and_strided_inputs(lead):
    rng = np.random.default_rng(len(lead))
    model, feeds = _dense(rng, 12, 10, (1, 10), "res_ln", lead=lead, res_first=True)
    assert _fused_ops(_check(model, feeds)) == [("Linear", "layernorm")]
    if len(lead) == 2:
        model, feeds = _dense(rng, 12, 10, (10,), "res", lead=lead, transpose_x=True)
        assert _fused_ops(_check(model, feeds)) == [("Linear", "none")]


def test_linear_large_values_gelu_saturates():
    rng = np.random.default_rng(5)
    model, feeds = _dense(rng, 8, 6, (6,), "gelu")
    feeds["x"] = feeds["x"] * 1e4
    _check(model, feeds)


def test_linear_not_fused_when_intermediate_is_shared_or_bias_broadcasts_rows():
    rng = np.random.default_rng(9)
    inits = {"W": _rand(rng, 6, 4), "b": _rand(rng, 4), "c": _rand(rng, 3, 1)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["y"]),
        helper.make_node("Relu", ["m"], ["z"]),  # m has a second reader
        helper.make_node("MatMul", ["x", "W"], ["m2"]),
        helper.make_node("Add", ["m2", "c"], ["w"]),  # bias over rows, not columns
    ]
    model = _model(nodes, [("x", [3, 6])], [("y", [3, 4]), ("z", [3, 4]), ("w", [3, 4])], inits)
    net = _check(model, {"x": _rand(rng, 3, 6)})
    assert not any(op == "Linear" for op, _ in _fused_ops(net))


def test_linear_residual_that_broadcasts_is_left_alone():
    rng = np.random.default_rng(11)
    inits = {"W": _rand(rng, 6, 4), "b": _rand(rng, 4)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["y0"]),
        helper.make_node("Add", ["y0", "r"], ["y"]),
    ]
    model = _model(nodes, [("x", [2, 3, 6]), ("r", [3, 4])], [("y", [2, 3, 4])], inits)
    net = _check(model, {"x": _rand(rng, 2, 3, 6), "r": _rand(rng, 3, 4)})
    linear = [n for n in net.transformed.nodes if n.op_type == "Linear"]
    assert len(linear) == 1 and len(linear[0].inputs) == 3


# --------------------------------------------------------------------------- attention


def _attention(rng, b, h, s, t, d, scale_op, transpose, qk_from_linear=False):
    inits = {}
    if scale_op == "Mul":
        inits["c"] = np.array(d**-0.5, np.float32)
    elif scale_op == "Div":
        inits["c"] = np.array(d**0.5, np.float32)
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s0"])]
    last = "s0"
    if scale_op:
        nodes.append(helper.make_node(scale_op, [last, "c"], ["s1"]))
        last = "s1"
    nodes += [
        helper.make_node("Softmax", [last], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    out_shape = [b, h, s, d]
    if transpose:
        nodes.append(helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]))
        out_shape = [b, s, h, d]
    nodes.append(helper.make_node("Identity", [nodes[-1].output[0]], ["y"]))
    inputs = [("q", [b, h, s, d]), ("k", [b, h, d, t]), ("v", [b, h, t, d])]
    feeds = {"q": _rand(rng, b, h, s, d), "k": _rand(rng, b, h, d, t), "v": _rand(rng, b, h, t, d)}
    return _model(nodes, inputs, [("y", out_shape)], inits), feeds


@pytest.mark.parametrize("scale_op", ["", "Mul", "Div"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("b,h,s,t,d", [(1, 4, 8, 8, 16), (2, 3, 5, 7, 6)])
def test_attention_matches_reference(scale_op, transpose, b, h, s, t, d):
    rng = np.random.default_rng(s * t + d)
    model, feeds = _attention(rng, b, h, s, t, d, scale_op, transpose)
    net = _check(model, feeds)
    assert [op for op, _ in _fused_ops(net)] == ["Attention"]


@pytest.mark.parametrize("spread", [50.0, 500.0])
def test_attention_softmax_large_scores(spread):
    """Scores beyond the no-shift range (+-30) take the shifted paths; no overflow or NaN."""
    rng = np.random.default_rng(int(spread))
    model, feeds = _attention(rng, 1, 2, 6, 6, 4, "", False)
    feeds["q"] = feeds["q"] * spread
    _check(model, feeds)


def test_attention_with_mask_is_not_fused():
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["s0"]),
        helper.make_node("Add", ["s0", "mask"], ["s1"]),
        helper.make_node("Softmax", ["s1"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    mask = np.where(rng.random((4, 4)) < 0.3, -1e9, 0).astype(np.float32)
    model = _model(
        nodes,
        [("q", [1, 2, 4, 3]), ("k", [1, 2, 3, 4]), ("v", [1, 2, 4, 3])],
        [("y", [1, 2, 4, 3])],
        {"mask": mask},
    )
    feeds = {
        n: _rand(rng, *s)
        for n, s in (("q", (1, 2, 4, 3)), ("k", (1, 2, 3, 4)), ("v", (1, 2, 4, 3)))
    }
    net = _check(model, feeds)
    assert "Attention" not in [op for op, _ in _fused_ops(net)]


def test_linear_residual_produced_later_and_sum_of_two_linears():
    """Add(L1, L2): one Linear takes the other's output as its residual and moves after it."""
    rng = np.random.default_rng(12)
    inits = {n: _rand(rng, 6, 5) for n in ("W1", "W2")} | {n: _rand(rng, 5) for n in ("b1", "b2")}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["y1"]),
        helper.make_node("MatMul", ["x", "W2"], ["m2"]),
        helper.make_node("Add", ["b2", "m2"], ["y2"]),
        helper.make_node("Add", ["y1", "y2"], ["y"]),
    ]
    model = _model(nodes, [("x", [2, 3, 6])], [("y", [2, 3, 5])], inits)
    net = _check(model, {"x": _rand(rng, 2, 3, 6)})
    linear = [n for n in net.transformed.nodes if n.op_type == "Linear"]
    assert len(linear) == 2 and sorted(len(n.inputs) for n in linear) == [3, 4]


def test_merged_projections_of_different_widths():
    rng = np.random.default_rng(13)
    widths = (4, 7, 3)
    inits = {}
    nodes = []
    for i, n in enumerate(widths):
        inits[f"W{i}"], inits[f"b{i}"] = _rand(rng, 5, n), _rand(rng, n)
        nodes += [
            helper.make_node("MatMul", ["x", f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"y{i}"]),
            helper.make_node("Relu", [f"y{i}"], [f"z{i}"]),
        ]
    outputs = [(f"z{i}", [3, n]) for i, n in enumerate(widths)]
    model = _model(nodes, [("x", [3, 5])], outputs, inits)
    net = _check(model, {"x": _rand(rng, 3, 5)})
    linear = [n for n in net.transformed.nodes if n.op_type == "Linear"]
    assert len(linear) == 1 and linear[0].attr("splits") == list(widths)


def test_standalone_gelu_accuracy_over_the_whole_range():
    """The tanh-form erf GELU against the exact one: a few float32 ulps, saturating cleanly."""
    x = np.concatenate(
        [np.linspace(-12, 12, 200_001), [-1e30, -1e6, -100, 100, 1e6, 1e30, 0.0]]
    ).astype(np.float32)
    model = _model(
        [helper.make_node("Gelu", ["x"], ["y"])], [("x", [x.size])], [("y", [x.size])], {}, 20
    )
    got = NumpyPlugin().load_network(model).create_infer_request().infer({"x": x})["y"]
    x64 = x.astype(np.float64)
    exact = 0.5 * x64 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x64]))
    err = np.abs(got - exact) / np.maximum(1.0, np.abs(exact))
    assert np.all(np.isfinite(got)) and float(err.max()) <= 2e-6


def test_linear_residual_and_layer_norm_with_symbolic_dims():
    """Symbolic dims the inputs share make the residual's shape provably equal at load."""
    rng = np.random.default_rng(14)
    inits = {"W": _rand(rng, 6, 4), "b": _rand(rng, 4), "g": _rand(rng, 4), "be": _rand(rng, 4)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["y0"]),
        helper.make_node("Add", ["y0", "r"], ["y1"]),
        helper.make_node("LayerNormalization", ["y1", "g", "be"], ["y"], axis=-1),
    ]
    model = _model(nodes, [("x", ["n", 6]), ("r", ["n", 4])], [("y", ["n", 4])], inits)
    for n in (5, 1):
        net = _check(model, {"x": _rand(rng, n, 6), "r": _rand(rng, n, 4)})
        assert _fused_ops(net) == [("Linear", "layernorm")]


@pytest.mark.parametrize("batch", [0, 1])
def test_empty_batches(batch):
    model = bench_encoder(layers=1, hidden=16, heads=2, seq=4)
    x = np.zeros((batch, 4, 16), np.float32)
    out = NumpyPlugin().load_network(model).create_infer_request().infer({"input": x})["output"]
    expected = ReferenceEvaluator(model).run(None, {"input": x})[0]
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, atol=1e-5)
