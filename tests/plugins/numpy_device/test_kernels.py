"""NUMPY kernels against onnxruntime on random inputs: one-node models, many shapes and types."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from reference import ort_run

F32, I64, I32, F64, U8, BOOL = (
    TensorProto.FLOAT,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.DOUBLE,
    TensorProto.UINT8,
    TensorProto.BOOL,
)
NP = {F32: np.float32, I64: np.int64, I32: np.int32, F64: np.float64, U8: np.uint8, BOOL: np.bool_}


def _random(rng, shape, elem):
    dtype = NP[elem]
    if dtype is np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(1, 9, size=shape).astype(dtype)
    return rng.normal(size=shape).astype(dtype)


# (id, op, attrs, [(shape, elem) per input], {input index: constant array}, opset)
CASES = [
    ("add_broadcast", "Add", {}, [((2, 3, 4), F32), ((4,), F32)], {}, 17),
    ("sub_int", "Sub", {}, [((3, 4), I64), ((3, 1), I64)], {}, 17),
    ("mul_f64", "Mul", {}, [((5,), F64), ((5,), F64)], {}, 17),
    ("div_int_truncates", "Div", {}, [((6,), I32), ((6,), I32)], {}, 17),
    ("pow", "Pow", {}, [((4,), F32), ((4,), F32)], {}, 17),
    ("relu", "Relu", {}, [((2, 8), F32)], {}, 17),
    ("leaky_relu", "LeakyRelu", {"alpha": 0.2}, [((2, 8), F32)], {}, 17),
    ("sigmoid", "Sigmoid", {}, [((3, 5), F32)], {}, 17),
    ("tanh", "Tanh", {}, [((3, 5), F32)], {}, 17),
    ("erf", "Erf", {}, [((3, 5), F32)], {}, 17),
    ("gelu_tanh", "Gelu", {"approximate": "tanh"}, [((3, 5), F32)], {}, 20),
    ("clip", "Clip", {}, [((10,), F32)], {1: np.float32(-0.5), 2: np.float32(0.5)}, 17),
    ("where", "Where", {}, [((4,), BOOL), ((4,), F32), ((1,), F32)], {}, 17),
    ("cast_f_to_i", "Cast", {"to": I32}, [((6,), F32)], {}, 17),
    ("equal", "Equal", {}, [((6,), I64), ((6,), I64)], {}, 17),
    (
        "reduce_sum_keep",
        "ReduceSum",
        {"keepdims": 1},
        [((3, 4, 5), F32)],
        {1: np.array([1], np.int64)},
        17,
    ),
    ("reduce_mean", "ReduceMean", {"axes": [0, 2], "keepdims": 0}, [((3, 4, 5), F32)], {}, 17),
    ("reduce_max_neg", "ReduceMax", {"axes": [-1]}, [((3, 4), F32)], {}, 17),
    ("argmax", "ArgMax", {"axis": 1, "keepdims": 0}, [((3, 7), F32)], {}, 17),
    ("softmax", "Softmax", {"axis": -1}, [((2, 3, 9), F32)], {}, 17),
    ("log_softmax", "LogSoftmax", {"axis": 1}, [((2, 9), F32)], {}, 17),
    (
        "layer_norm",
        "LayerNormalization",
        {"axis": -1, "epsilon": 1e-5},
        [((2, 5, 16), F32), ((16,), F32), ((16,), F32)],
        {},
        17,
    ),
    (
        "batch_norm",
        "BatchNormalization",
        {},
        [((2, 4, 3, 3), F32), ((4,), F32), ((4,), F32), ((4,), F32)],
        {4: np.array([0.5, 1.0, 1.5, 2.0], np.float32)},
        15,
    ),
    ("matmul_batched", "MatMul", {}, [((2, 3, 4, 5), F32), ((5, 6), F32)], {}, 17),
    (
        "gemm_trans",
        "Gemm",
        {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0},
        [((4, 3), F32), ((5, 4), F32), ((5,), F32)],
        {},
        17,
    ),
    (
        "conv_pad_stride",
        "Conv",
        {"pads": [1, 1, 1, 1], "strides": [2, 2]},
        [((2, 3, 9, 9), F32), ((4, 3, 3, 3), F32), ((4,), F32)],
        {},
        17,
    ),
    ("conv_1x1", "Conv", {}, [((1, 8, 5, 5), F32), ((6, 8, 1, 1), F32)], {}, 17),
    (
        "conv_depthwise",
        "Conv",
        {"group": 4, "pads": [1, 1, 1, 1]},
        [((1, 4, 7, 7), F32), ((4, 1, 3, 3), F32)],
        {},
        17,
    ),
    (
        "conv_dilated",
        "Conv",
        {"dilations": [2, 2], "pads": [2, 1, 2, 1]},
        [((1, 2, 8, 8), F32), ((3, 2, 3, 3), F32)],
        {},
        17,
    ),
    ("conv1d", "Conv", {"pads": [2, 2]}, [((2, 3, 11), F32), ((5, 3, 5), F32)], {}, 17),
    (
        "conv_transpose",
        "ConvTranspose",
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
        [((1, 3, 5, 5), F32), ((3, 2, 3, 3), F32)],
        {},
        17,
    ),
    (
        "maxpool_ceil",
        "MaxPool",
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
        [((1, 2, 8, 8), F32)],
        {},
        17,
    ),
    (
        "avgpool_pad",
        "AveragePool",
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 0},
        [((1, 2, 6, 6), F32)],
        {},
        17,
    ),
    ("global_avg", "GlobalAveragePool", {}, [((2, 3, 5, 5), F32)], {}, 17),
    ("transpose", "Transpose", {"perm": [2, 0, 1]}, [((2, 3, 4), F32)], {}, 17),
    ("concat", "Concat", {"axis": 1}, [((2, 3), F32), ((2, 5), F32)], {}, 17),
    (
        "slice_neg_step",
        "Slice",
        {},
        [((10, 4), F32)],
        {1: np.array([8, 0]), 2: np.array([1, 4]), 3: np.array([0, 1]), 4: np.array([-2, 1])},
        17,
    ),
    (
        "gather_axis1",
        "Gather",
        {"axis": 1},
        [((3, 5), F32)],
        {1: np.array([[0, 4], [2, -1]], np.int64)},
        17,
    ),
    (
        "gather_elements",
        "GatherElements",
        {"axis": 1},
        [((3, 4), F32)],
        {1: np.array([[0, 3], [1, 1], [2, 0]], np.int64)},
        17,
    ),
    (
        "scatter_nd_add",
        "ScatterND",
        {"reduction": "add"},
        [((4, 3), F32), ((2, 3), F32)],
        {1: np.array([[1], [1]], np.int64)},
        18,
    ),
    ("reshape", "Reshape", {}, [((2, 3, 4), F32)], {1: np.array([0, -1], np.int64)}, 17),
    (
        "pad_reflect",
        "Pad",
        {"mode": "reflect"},
        [((3, 4), F32)],
        {1: np.array([1, 2, 1, 2], np.int64)},
        17,
    ),
    ("expand", "Expand", {}, [((3, 1), F32)], {1: np.array([2, 3, 4], np.int64)}, 17),
    ("tile", "Tile", {}, [((2, 3), F32)], {1: np.array([2, 2], np.int64)}, 17),
    # Tile is one broadcast copy into the new array, Range counts in pieces (numpy's repeat
    # and arange keep the GIL): ranks that differ from the repeats', zero repeats, strings
    ("tile_rank3", "Tile", {}, [((2, 1, 3), F32)], {1: np.array([1, 3, 2], np.int64)}, 17),
    ("tile_zero", "Tile", {}, [((2, 3), F32)], {1: np.array([0, 2], np.int64)}, 17),
    ("tile_ints", "Tile", {}, [((4,), TensorProto.INT64)], {1: np.array([5], np.int64)}, 13),
    (
        "range_pieces",
        "Range",
        {},
        [],
        {
            0: np.array(1.5, np.float32),
            1: np.array(3.5e6, np.float32),
            2: np.array(1.25, np.float32),
        },
        11,
    ),
    (
        "range_ints",
        "Range",
        {},
        [],
        {0: np.array(-7, np.int64), 1: np.array(5_000_000, np.int64), 2: np.array(3, np.int64)},
        11,
    ),
    ("split", "Split", {"axis": 1}, [((2, 6), F32)], {1: np.array([2, 4], np.int64)}, 17),
    ("topk", "TopK", {"axis": -1}, [((3, 10), F32)], {1: np.array([4], np.int64)}, 17),
    ("cumsum_reverse", "CumSum", {"reverse": 1}, [((3, 4), F32)], {1: np.array(1)}, 17),
    (
        "resize_linear",
        "Resize",
        {"mode": "linear"},
        [((1, 2, 4, 4), F32)],
        {1: np.array([], np.float32), 2: np.array([1, 1, 2, 2], np.float32)},
        17,
    ),
    (
        "resize_nearest",
        "Resize",
        {"mode": "nearest"},
        [((1, 2, 3, 3), F32)],
        {1: np.array([], np.float32), 2: np.array([1, 1, 2, 3], np.float32)},
        17,
    ),
    (
        "einsum",
        "Einsum",
        {"equation": "bij,bjk->bik"},
        [((2, 3, 4), F32), ((2, 4, 5), F32)],
        {},
        17,
    ),
    (
        "instance_norm",
        "InstanceNormalization",
        {},
        [((2, 3, 4, 4), F32), ((3,), F32), ((3,), F32)],
        {},
        17,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_onnxruntime(numpy_plugin, case):
    _, op, attrs, inputs, constants, opset = case
    rng = np.random.default_rng(abs(hash(case[0])) % 2**32)
    names = [f"in{i}" for i in range(len(inputs) + len(constants))]
    graph_inputs, feeds, initializers = [], {}, []
    total = len(inputs) + len(constants)
    feed_iter = iter(inputs)
    for i in range(total):
        if i in constants:
            initializers.append(numpy_helper.from_array(np.asarray(constants[i]), names[i]))
            continue
        shape, elem = next(feed_iter)
        graph_inputs.append(helper.make_tensor_value_info(names[i], elem, list(shape)))
        feeds[names[i]] = _random(rng, shape, elem)
    if op == "BatchNormalization":  # variance must be positive
        initializers[-1] = numpy_helper.from_array(np.abs(constants[4]), names[4])
    n_outputs = {"TopK": 2, "Split": 2}.get(op, 1)
    outputs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outputs, name="node", **attrs)
    graph = helper.make_graph(
        [node],
        op,
        graph_inputs,
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    del model.graph.output[:]
    model.graph.output.extend(inferred[o] for o in outputs)
    expected = ort_run(model, feeds)
    for transformations in ("NO", "YES"):
        net = numpy_plugin.load_network(model, {"DISABLE_TRANSFORMATIONS": transformations})
        got = net.infer(feeds)
        for name, want in zip(outputs, expected):
            assert got[name].dtype == want.dtype, name
            assert got[name].shape == want.shape, name
            np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("elem", "zero_point"), [(TensorProto.INT8, 5), (U8, 128)])
@pytest.mark.parametrize("scale", [np.inf, 1.0])
def test_quantize_linear_of_nan_and_inf_as_onnxruntime(numpy_plugin, elem, zero_point, scale):
    """x / scale is NaN for -inf / inf (onnxruntime's static quantizer gives an attention mask's
    -inf the scale inf) and for a NaN input: onnxruntime saturates NaN to the type's minimum,
    whatever the zero point; infinities saturate to their end of the range."""
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["y"])],
        "quantize",
        [helper.make_tensor_value_info("x", F32, [7])],
        [helper.make_tensor_value_info("y", elem, [7])],
        initializer=[
            numpy_helper.from_array(np.array(scale, np.float32), "scale"),
            helper.make_tensor("zero", elem, [], [zero_point]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    x = np.array([np.nan, np.inf, -np.inf, 0, 1e30, -1e30, 3.5], np.float32)
    (want,) = ort_run(model, {"x": x})
    got = numpy_plugin.load_network(model).infer({"x": x})["y"]
    np.testing.assert_array_equal(got, want)
