"""Transformation passes: what each does to the graph, the names it keeps, and the numerics."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import _init, _model, chain, mlp, small_cnn
from onnx import TensorProto, helper
from reference import ort_run

from plugserve.plugins.ir import load_model


def _transformed(plugin, model, **config):
    return plugin.transform(load_model(model), plugin.merged_config(config))


def _by_original(graph):
    return {name: node for node in graph.nodes for name in node.fused_names}


def test_conv_bn_relu_fold_and_fuse_keep_original_names(numpy_plugin):
    graph = _transformed(numpy_plugin, small_cnn())
    ops = [n.op_type for n in graph.nodes]
    assert "BatchNormalization" not in ops and "Relu" not in ops
    fused = _by_original(graph)
    assert fused["conv1"] is fused["bn1"] is fused["relu1"] is fused["pool1"]
    assert fused["conv1"].op_type == "FusedConvPool" and fused["conv1"].domain == "ai.plugserve"
    assert fused["conv2"] is fused["relu2"]
    original = {n.name for n in small_cnn().graph.node}
    assert set(graph.original_names()) | set(graph.absorbed) == original


@pytest.mark.parametrize("model_fn", [small_cnn, mlp])
def test_transformed_numerics_match_onnxruntime(numpy_plugin, model_fn):
    model = model_fn()
    shape = [d.dim_value or 2 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(3).normal(size=shape).astype(np.float32)
    expected = ort_run(model, {"x": x})[0]
    fast = numpy_plugin.load_network(model).infer({"x": x})
    plain = numpy_plugin.load_network(model, {"DISABLE_TRANSFORMATIONS": "YES"}).infer({"x": x})
    np.testing.assert_allclose(next(iter(fast.values())), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(next(iter(plain.values())), expected, rtol=1e-4, atol=1e-5)


def test_relu_relu_fusion(numpy_plugin):
    model = chain([("Relu", {}), ("Relu", {}), ("Relu", {})])
    graph = _transformed(numpy_plugin, model)
    assert [n.op_type for n in graph.nodes] == ["Relu"]
    assert graph.nodes[0].fused_names == ["relu0", "relu1", "relu2"]
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
    out = numpy_plugin.load_network(model).infer({"x": x})["y"]
    assert np.array_equal(out, np.maximum(x, 0))


def test_divide_by_constant_becomes_multiply(numpy_plugin):
    model = _model(
        [helper.make_node("Div", ["x", "d"], ["y"], name="div")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [_init("d", np.array([2, 4, 8, 3], np.float32))],
    )
    graph = _transformed(numpy_plugin, model)
    assert [n.op_type for n in graph.nodes] == ["Mul"] and graph.nodes[0].fused_names == ["div"]
    x = np.array([1, 2, 3, 4], np.float32)
    np.testing.assert_allclose(
        numpy_plugin.load_network(model).infer({"x": x})["y"],
        x / np.array([2, 4, 8, 3], np.float32),
        rtol=1e-6,
    )


def test_integer_division_is_not_decomposed(numpy_plugin):
    model = _model(
        [helper.make_node("Div", ["x", "d"], ["y"], name="div")],
        [helper.make_tensor_value_info("x", TensorProto.INT32, [3])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [3])],
        [_init("d", np.array([2, 2, 2], np.int32))],
    )
    graph = _transformed(numpy_plugin, model)
    assert [n.op_type for n in graph.nodes] == ["Div"]
    out = numpy_plugin.load_network(model).infer({"x": np.array([7, -7, 3], np.int32)})["y"]
    assert out.tolist() == [3, -3, 1]


def test_constant_and_shape_subgraphs_fold(numpy_plugin):
    """Reshape(x, Concat(Shape(x)[0], -1)) folds to a constant shape when x is static."""
    model = _model(
        [
            helper.make_node("Shape", ["x"], ["s"], name="shape"),
            helper.make_node("Gather", ["s", "first"], ["n"], name="gather", axis=0),
            helper.make_node("Unsqueeze", ["n", "zero"], ["n1"], name="unsqueeze"),
            helper.make_node("Concat", ["n1", "minus_one"], ["target"], name="concat", axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 12])],
        [
            _init("first", np.array(0, np.int64)),
            _init("zero", np.array([0], np.int64)),
            _init("minus_one", np.array([-1], np.int64)),
        ],
    )
    graph = _transformed(numpy_plugin, model)
    assert [n.op_type for n in graph.nodes] == ["Reshape"]
    assert set(graph.nodes[0].fused_names) == {"reshape", "concat", "unsqueeze", "gather", "shape"}
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert numpy_plugin.load_network(model).infer({"x": x})["y"].shape == (2, 12)


def test_dynamic_shapes_are_not_folded(numpy_plugin):
    model = _model(
        [helper.make_node("Shape", ["x"], ["y"], name="shape")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
    )
    graph = _transformed(numpy_plugin, model)
    assert [n.op_type for n in graph.nodes] == ["Shape"]
    out = numpy_plugin.load_network(model).infer({"x": np.zeros((5, 3), np.float32)})["y"]
    assert out.tolist() == [5, 3]


def test_dead_nodes_are_eliminated(numpy_plugin):
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["y"], name="used"),
            helper.make_node("Neg", ["x"], ["unused"], name="dead"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    graph = _transformed(numpy_plugin, model)
    assert [n.name for n in graph.nodes] == ["used"] and "dead" in graph.absorbed


def test_f16_network_computes_in_f32_and_keeps_its_types(numpy_plugin):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 4)).astype(np.float16)
    model = _model(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
            helper.make_node("Sigmoid", ["m"], ["y"], name="sigmoid"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])],
        [_init("w", w)],
    )
    graph = _transformed(numpy_plugin, model)
    assert graph.initializers[next(i for i in graph.initializers)].dtype == np.float32
    ops = [n.op_type for n in graph.nodes]
    assert ops[0] == "Cast" and ops[-1] == "Cast"
    x = rng.normal(size=(2, 8)).astype(np.float16)
    out = numpy_plugin.load_network(model).infer({"x": x})["y"]
    assert out.dtype == np.float16
    expected = 1 / (1 + np.exp(-(x.astype(np.float32) @ w.astype(np.float32))))
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=2e-3, atol=1e-3)
    kept = _transformed(numpy_plugin, model, INFERENCE_PRECISION_HINT="f16")
    assert all(v.dtype == np.float16 for v in kept.initializers.values())


def test_function_ops_are_inlined_with_the_callers_name(numpy_plugin):
    model = chain([("Softsign", {})], name="softsign")
    graph = _transformed(numpy_plugin, model)
    assert all(n.fused_names == ["softsign0"] for n in graph.nodes)
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    out = numpy_plugin.load_network(model).infer({"x": x})["y"]
    np.testing.assert_allclose(out, x / (1 + np.abs(x)), rtol=1e-6)


def test_model_local_functions_are_inlined(numpy_plugin):
    body = onnx.helper.make_function(
        "local",
        "Double",
        ["a"],
        ["b"],
        [helper.make_node("Add", ["a", "a"], ["b"])],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model = _model(
        [helper.make_node("Double", ["x"], ["y"], name="twice", domain="local")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        functions=[body],
        extra_opsets=[helper.make_opsetid("local", 1)],
    )
    out = numpy_plugin.load_network(model).infer({"x": np.array([1, 2, 3], np.float32)})["y"]
    assert out.tolist() == [2, 4, 6]
