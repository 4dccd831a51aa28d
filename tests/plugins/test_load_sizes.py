"""The size of a value computed at load time (``plugins/passes/sizes.py``) is told from the
node's own inputs, never from a shape the model declares: NUMPY's folding leaves a node it
cannot size to run time, and the backends that fold without a limit refuse a value-sized op
(a window, AffineGrid, MelWeightMatrix) whose size is not known before."""

from __future__ import annotations

import numpy as np
import pytest
from attack import peak_kb
from models import _init, _model
from onnx import TensorProto, helper

from plugserve.plugins.api import InvalidModel
from plugserve.plugins.ir import load_model
from plugserve.plugins.passes.sizes import check_load_constants

#: elements of the value each model asks for: 80 MB of float32, over the 64 MiB fold limit
N = 20_000_000


def _declared_small(op: str, count: int = N, abs_first: bool = True):
    """``op`` of ``Abs(c)`` (whole-graph inference cannot see the value: ``[?]``) with the
    output declared tiny in ``value_info``, then ReduceMax; without ``abs_first``, of the
    constant itself."""
    vi = helper.make_tensor_value_info
    if op == "HannWindow":
        made = [helper.make_node(op, ["n"], ["w"])]
        c, declared, opset, extra = np.array(-count, np.int64), [1], 17, []
    elif op == "AffineGrid":
        made = [helper.make_node(op, ["theta", "n"], ["w"])]
        c, declared, opset = np.array([-1, -1, -1, -(count // 2)], np.int64), [1, 1, 1, 2], 20
        extra = [_init("theta", np.zeros((1, 2, 3), np.float32))]
    else:  # MelWeightMatrix: (dft_length // 2 + 1) x 64 bins
        made = [helper.make_node(op, ["bins", "n", "rate", "low", "high"], ["w"])]
        c, declared, opset = np.array(-2 * (count // 64), np.int64), [1, 1], 17
        extra = [
            _init("bins", np.array(64, np.int64)),
            _init("rate", np.array(16000, np.int64)),
            _init("low", np.array(0, np.float32)),
            _init("high", np.array(8000, np.float32)),
        ]
    first = [helper.make_node("Abs", ["c"], ["n"])] if abs_first else []
    if not abs_first:
        c = np.abs(c)
    model = _model(
        [*first, *made, helper.make_node("ReduceMax", ["w"], ["y"], keepdims=0)],
        [],
        [vi("y", TensorProto.FLOAT, [])],
        [_init("c" if abs_first else "n", c), *extra],
        opset=opset,
    )
    if abs_first:  # (strict inference refuses the lie where it sees the value)
        model.graph.value_info.append(vi("w", TensorProto.FLOAT, declared))
    return model


@pytest.mark.parametrize("op", ["HannWindow", "AffineGrid", "MelWeightMatrix"])
def test_folding_sizes_a_node_from_its_inputs_not_the_declared_shape(numpy_plugin, op):
    graph = load_model(_declared_small(op))
    assert graph.spec("w").shape != (N,)  # the model's declared shape survived inference
    before = peak_kb(reset=True)
    folded = numpy_plugin.transform(graph, numpy_plugin.merged_config({}))
    assert peak_kb() - before < 32 << 10  # computed, then dropped as too large: +80-160 MB
    assert op in [n.op_type for n in folded.nodes]  # 80 MB: left to run time
    assert all(a.nbytes < 1 << 20 for a in folded.initializers.values())


def test_a_small_value_sized_node_still_folds(numpy_plugin):
    folded = numpy_plugin.transform(
        load_model(_declared_small("HannWindow", count=16)), numpy_plugin.merged_config({})
    )
    assert [n.op_type for n in folded.nodes] == []  # all of it computed at load time


@pytest.mark.parametrize("op", ["HannWindow", "AffineGrid", "MelWeightMatrix"])
def test_a_value_sized_constant_whose_size_is_unknown_is_refused(op):
    """onnxruntime and openvino fold ``op(Abs(c))`` themselves, without a limit."""
    with pytest.raises(InvalidModel, match=f"\\({op}\\) makes a constant of 80,"):
        check_load_constants(load_model(_declared_small(op)), "ORT")  # Abs(c) computed here
    with pytest.raises(InvalidModel, match=f"\\({op}\\) makes a constant of 80,"):
        check_load_constants(load_model(_declared_small(op, abs_first=False)), "ORT")
    check_load_constants(load_model(_declared_small(op, 64, abs_first=False)), "ORT")


def test_a_window_whose_length_cannot_be_known_before_is_refused():
    """The length a ReduceMax of 2,000 values (not computed here: too many) decides."""
    vi = helper.make_tensor_value_info
    model = _model(
        [
            helper.make_node("Abs", ["c"], ["a"]),
            helper.make_node("ReduceMax", ["a"], ["n"], keepdims=0),
            helper.make_node("HannWindow", ["n"], ["w"]),
            helper.make_node("ReduceMax", ["w"], ["y"], keepdims=0),
        ],
        [],
        [vi("y", TensorProto.FLOAT, [])],
        [_init("c", np.full(2_000, -N, np.int64))],
    )
    model.graph.value_info.append(vi("w", TensorProto.FLOAT, [1]))
    with pytest.raises(InvalidModel, match=r"\(HannWindow\) makes a constant .* values decide"):
        check_load_constants(load_model(model), "ORT")


def test_ordinary_ops_of_computed_constants_are_not_refused():
    vi = helper.make_tensor_value_info
    model = _model(
        [
            helper.make_node("Abs", ["c"], ["a"]),
            helper.make_node("NonZero", ["a"], ["z"]),  # its size is not known: not refused
            helper.make_node("Cast", ["z"], ["f"], to=TensorProto.FLOAT),
            helper.make_node("ReduceSum", ["f"], ["y"], keepdims=0),
        ],
        [],
        [vi("y", TensorProto.FLOAT, [])],
        [_init("c", np.arange(-4, 4, dtype=np.int64))],
    )
    check_load_constants(load_model(model), "ORT")


@pytest.mark.parametrize(("last", "refused"), [(3, False), (10**9, True)])
def test_a_shape_computed_from_constants_sizes_what_reads_it(last, refused):
    """ConstantOfShape(Concat(Constant, Constant)), as exporters write: the small shape is
    computed, so the value it sizes is judged by its real size, not refused as unknown."""
    vi = helper.make_tensor_value_info
    model = _model(
        [
            helper.make_node("Constant", [], ["a"], value=_init("a", np.array([2], np.int64))),
            helper.make_node("Constant", [], ["b"], value=_init("b", np.array([last], np.int64))),
            helper.make_node("Concat", ["a", "b"], ["s"], axis=0),
            helper.make_node("ConstantOfShape", ["s"], ["z"]),
            helper.make_node("ReduceSum", ["z"], ["y"], keepdims=0),
        ],
        [],
        [vi("y", TensorProto.FLOAT, [])],
    )
    if refused:
        with pytest.raises(InvalidModel, match=r"\(ConstantOfShape\) makes a constant of 8,000,"):
            check_load_constants(load_model(model), "ORT")
    else:
        check_load_constants(load_model(model), "ORT")
