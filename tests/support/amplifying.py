"""Models whose outputs a tiny request can make huge: each takes the sizes as input values
(a shape, repeats, pads, a count, a trip count) and would allocate what they say."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "amplify", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _in(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def constant_of_shape() -> onnx.ModelProto:
    """``shape`` [k] int64 -> zeros of that shape (float32)."""
    return _model(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"])],
        [_in("shape", I64, [None])],
        [_in("y", F, [None, None])],
    )


def expand_then_add() -> onnx.ModelProto:
    """``x`` [1] broadcast to ``shape``, then materialized by an Add."""
    return _model(
        [
            helper.make_node("Expand", ["x", "shape"], ["e"]),
            helper.make_node("Add", ["e", "x"], ["y"]),
        ],
        [_in("x", F, [1]), _in("shape", I64, [None])],
        [_in("y", F, [None, None])],
    )


def tile() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Tile", ["x", "repeats"], ["y"])],
        [_in("x", F, [2, 2]), _in("repeats", I64, [2])],
        [_in("y", F, [None, None])],
    )


def range_() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Range", ["start", "limit", "delta"], ["y"])],
        [_in("start", F, []), _in("limit", F, []), _in("delta", F, [])],
        [_in("y", F, [None])],
    )


def pad() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Pad", ["x", "pads"], ["y"])],
        [_in("x", F, [2, 2]), _in("pads", I64, [4])],
        [_in("y", F, [None, None])],
    )


def resize() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest")],
        [_in("x", F, [1, 1, 2, 2]), _in("sizes", I64, [4])],
        [_in("y", F, [None, None, None, None])],
    )


def shape_arithmetic() -> onnx.ModelProto:
    """The size comes from arithmetic on a value (as exporters write it): n * n zeros."""
    return _model(
        [
            helper.make_node("Mul", ["n", "n"], ["nn"]),
            helper.make_node("Concat", ["nn", "n"], ["shape"], axis=0),
            helper.make_node("ConstantOfShape", ["shape"], ["y"]),
        ],
        [_in("n", I64, [1])],
        [_in("y", F, [None, None])],
    )


def loop_scan() -> onnx.ModelProto:
    """``M`` trips, each keeping a [1024] float32 scan output (4 KiB a trip)."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("ConstantOfShape", ["size"], ["row"]),
        ],
        "body",
        [_in("i", I64, []), _in("cond_in", TensorProto.BOOL, [])],
        [_in("cond_out", TensorProto.BOOL, []), _in("row", F, [1024])],
        [helper.make_tensor("size", I64, [1], [1024])],
    )
    return _model(
        [helper.make_node("Loop", ["M", ""], ["rows"], body=body)],
        [_in("M", I64, [])],
        [_in("rows", F, [None, 1024])],
    )
