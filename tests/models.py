"""ONNX models built in code for the tests: small, real, and deterministic."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _model(nodes, inputs, outputs, initializers=(), name="model", opset=OPSET, **kwargs):
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), *kwargs.pop("extra_opsets", [])],
        **kwargs,
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def small_cnn(seed: int = 0, batch: int | str = 1) -> onnx.ModelProto:
    """Conv, BatchNorm, Relu, MaxPool, Conv, Relu, GlobalAveragePool, Flatten, Gemm, Softmax."""
    rng = np.random.default_rng(seed)
    f = np.float32
    inits = [
        _init("w1", rng.normal(0, 0.3, (8, 3, 3, 3)).astype(f)),
        _init("b1", rng.normal(0, 0.1, 8).astype(f)),
        _init("scale", rng.uniform(0.5, 1.5, 8).astype(f)),
        _init("shift", rng.normal(0, 0.1, 8).astype(f)),
        _init("mean", rng.normal(0, 0.1, 8).astype(f)),
        _init("var", rng.uniform(0.5, 1.5, 8).astype(f)),
        _init("w2", rng.normal(0, 0.2, (16, 8, 3, 3)).astype(f)),
        _init("fc_w", rng.normal(0, 0.2, (16, 10)).astype(f)),
        _init("fc_b", rng.normal(0, 0.1, 10).astype(f)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization",
            ["c1", "scale", "shift", "mean", "var"],
            ["bn1"],
            name="bn1",
            epsilon=1e-5,
        ),
        helper.make_node("Relu", ["bn1"], ["r1"], name="relu1"),
        helper.make_node(
            "MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [batch, 10])],
        inits,
        name="small_cnn",
    )


def mlp(seed: int = 0, sizes=(32, 64, 64, 10)) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        inits.append(_init(f"w{i}", rng.normal(0, 1 / np.sqrt(a), (a, b)).astype(np.float32)))
        inits.append(_init(f"b{i}", rng.normal(0, 0.1, b).astype(np.float32)))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"], name=f"matmul{i}"))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"))
        prev = f"a{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [prev], [f"r{i}"], name=f"relu{i}"))
            prev = f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
        inits,
        name="mlp",
    )


def with_custom_op(domain: str = "com.example") -> onnx.ModelProto:
    """x -> Relu -> com.example.Scale(factor=2.5) -> Add(1) -> y."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Scale", ["r"], ["s"], name="scale", domain=domain, factor=2.5),
        helper.make_node("Add", ["s", "one"], ["y"], name="add"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [_init("one", np.ones((1,), np.float32))],
        name="custom",
        extra_opsets=[helper.make_opsetid(domain, 1)],
    )


def chain(ops: list[tuple[str, dict]], shape=(2, 3, 4), dtype=TensorProto.FLOAT, name="chain"):
    """x -> op1 -> op2 -> ... -> y, each op unary with the given attributes."""
    nodes = []
    prev = "x"
    for i, (op, attrs) in enumerate(ops):
        out = "y" if i == len(ops) - 1 else f"t{i}"
        nodes.append(helper.make_node(op, [prev], [out], name=f"{op.lower()}{i}", **attrs))
        prev = out
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", dtype, list(shape))],
        [helper.make_tensor_value_info("y", dtype, list(shape))],
        name=name,
    )
