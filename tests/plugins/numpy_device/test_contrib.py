"""onnxruntime's contrib ops (com.microsoft) on NUMPY, each against onnxruntime running the same
one-node graph, with the inputs onnxruntime's own tools feed them (masks, past states,
per-channel scales, int4 blocks). The same ops in whole models saved by onnxruntime's
transformer optimizer and quantizer are the zoo's ``*_ortopt`` and ``*_qop`` entries."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")

F, I64, I32, U8, I8, I16 = (
    TensorProto.FLOAT,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.UINT8,
    TensorProto.INT8,
    TensorProto.INT16,
)
MS = "com.microsoft"


def _model(node, inputs, outputs, initializers=()):
    graph = helper.make_graph([node], "contrib", inputs, outputs, list(initializers))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 8
    return model


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _out(name, dtype, rank):
    """An output of known rank and unknown dimensions (ONNX's checker wants the rank)."""
    return helper.make_tensor_value_info(name, dtype, [f"{name}{i}" for i in range(rank)])


def _const(name, array):
    return onnx.numpy_helper.from_array(np.asarray(array), name)


def _same(core, model, feeds, atol=1e-5, rtol=1e-4):
    from reference import _copy, unsaturated  # exact integer GEMMs on CPUs without VNNI

    exact = unsaturated(_copy(model)) or model
    session = ort.InferenceSession(exact.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = core.load_network(model, "NUMPY").infer(feeds)
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, (name, got[name].shape, expected.shape)
        np.testing.assert_allclose(
            got[name].astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol,
            err_msg=name,
        )  # fmt: skip


RNG = np.random.default_rng(0)


def test_skip_layer_normalization_with_all_outputs(core):
    x, skip = RNG.normal(size=(2, 5, 16)).astype(np.float32), RNG.normal(size=(2, 5, 16))
    node = helper.make_node(
        "SkipLayerNormalization",
        ["x", "skip", "gamma", "beta", "bias"],
        ["y", "mean", "inv", "sum"],
        domain=MS,
        epsilon=1e-5,
    )
    model = _model(
        node,
        [_vi("x", F, [2, 5, 16]), _vi("skip", F, [2, 5, 16])],
        [_out("y", F, 3), _out("mean", F, 3), _out("inv", F, 3), _out("sum", F, 3)],
        [_const(n, RNG.normal(size=16).astype(np.float32)) for n in ("gamma", "beta", "bias")],
    )
    _same(core, model, {"x": x, "skip": skip.astype(np.float32)})


def test_skip_simplified_layer_normalization(core):
    x, skip = (RNG.normal(size=(1, 4, 8)).astype(np.float32) for _ in range(2))
    gamma = _const("gamma", RNG.normal(size=8).astype(np.float32))
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization",
        ["x", "skip", "gamma"],
        ["y", "", "", "sum"],
        domain=MS,
        epsilon=1e-6,
    )
    outs = [_out("y", F, 3), _out("sum", F, 3)]
    _same(core, _model(node, [_vi("x", F, [1, 4, 8]), _vi("skip", F, [1, 4, 8])], outs, [gamma]),
          {"x": x, "skip": skip})  # fmt: skip


@pytest.mark.parametrize(
    ("op", "inputs"),
    [("Gelu", 1), ("BiasGelu", 2), ("FastGelu", 2), ("FastGelu", 1), ("QuickGelu", 1)],
)
def test_gelu_family(core, op, inputs):
    names = ["x", "bias"][:inputs]
    node = helper.make_node(op, names, ["y"], domain=MS)
    feeds = {"x": RNG.normal(size=(3, 16)).astype(np.float32) * 3}
    consts = [_const("bias", RNG.normal(size=16).astype(np.float32))] if inputs == 2 else []
    _same(core, _model(node, [_vi("x", F, [3, 16])], [_out("y", F, 2)], consts), feeds)


def test_fused_matmul(core):
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain=MS, alpha=0.5, transB=1)
    feeds = {"a": RNG.normal(size=(2, 3, 4)).astype(np.float32)}
    consts = [_const("b", RNG.normal(size=(5, 4)).astype(np.float32))]
    _same(core, _model(node, [_vi("a", F, [2, 3, 4])], [_out("y", F, 3)], consts), feeds)


def _attention_model(mask_shape, mask_dtype, past: bool, unidirectional: int = 0):
    hidden, heads = 16, 2
    inputs = ["x", "w", "b", "mask" if mask_shape else ""]
    outputs = ["y"]
    graph_inputs = [_vi("x", F, [2, 3, hidden])]
    if mask_shape:
        graph_inputs.append(_vi("mask", mask_dtype, mask_shape))
    if past:
        inputs.append("past")
        graph_inputs.append(_vi("past", F, [2, 2, heads, 4, hidden // heads]))
        outputs.append("present")
    node = helper.make_node(
        "Attention", inputs, outputs, domain=MS, num_heads=heads, unidirectional=unidirectional
    )
    consts = [
        _const("w", RNG.normal(size=(hidden, 3 * hidden)).astype(np.float32) * 0.3),
        _const("b", RNG.normal(size=3 * hidden).astype(np.float32) * 0.1),
    ]
    ranks = {"y": 3, "present": 5}
    return _model(node, graph_inputs, [_out(o, F, ranks[o]) for o in outputs], consts)


@pytest.mark.parametrize(
    ("mask", "past", "causal"),
    [
        (None, False, 0),
        ("2d", False, 0),
        ("lengths", False, 0),
        ("2d", True, 1),
    ],
)
def test_attention(core, mask, past, causal):
    x = RNG.normal(size=(2, 3, 16)).astype(np.float32)
    feeds = {"x": x}
    total = 3 + (4 if past else 0)
    shape, dtype = None, I32
    if mask == "2d":
        shape = [2, total]
        feeds["mask"] = np.ones(shape, np.int32)
        feeds["mask"][1, -1] = 0
    elif mask == "lengths":
        shape = [2]
        feeds["mask"] = np.array([3, 2], np.int32)
    if past:
        feeds["past"] = RNG.normal(size=(2, 2, 2, 4, 8)).astype(np.float32)
    _same(core, _attention_model(shape, dtype, past, causal), feeds, atol=1e-5)


def test_qattention(core):
    hidden, heads = 16, 2
    node = helper.make_node(
        "QAttention",
        ["x", "w", "b", "x_scale", "w_scale", "mask", "x_zp", "w_zp"],
        ["y"],
        domain=MS,
        num_heads=heads,
    )
    consts = [
        _const("w", RNG.integers(-100, 100, size=(hidden, 3 * hidden)).astype(np.int8)),
        _const("b", RNG.normal(size=3 * hidden).astype(np.float32) * 0.1),
        _const("x_scale", np.array(0.02, np.float32)),
        _const("w_scale", np.array(0.01, np.float32)),
        _const("x_zp", np.array(128, np.uint8)),
        _const("w_zp", np.array(0, np.int8)),
    ]
    model = _model(
        node,
        [_vi("x", U8, [2, 3, hidden]), _vi("mask", I32, [2])],
        [_out("y", F, 3)],
        consts,
    )
    feeds = {"x": RNG.integers(0, 255, size=(2, 3, hidden)).astype(np.uint8),
             "mask": np.array([3, 2], np.int32)}  # fmt: skip
    _same(core, model, feeds, atol=1e-4)


def test_embed_layer_normalization(core):
    hidden, vocab = 8, 20
    node = helper.make_node(
        "EmbedLayerNormalization",
        ["ids", "segments", "words", "positions", "segment_table", "gamma", "beta", "mask"],
        ["y", "mask_index"],
        domain=MS,
        epsilon=1e-12,
    )
    consts = [
        _const("words", RNG.normal(size=(vocab, hidden)).astype(np.float32)),
        _const("positions", RNG.normal(size=(16, hidden)).astype(np.float32)),
        _const("segment_table", RNG.normal(size=(2, hidden)).astype(np.float32)),
        _const("gamma", RNG.normal(size=hidden).astype(np.float32)),
        _const("beta", RNG.normal(size=hidden).astype(np.float32)),
    ]
    model = _model(
        node,
        [_vi("ids", I32, [2, 5]), _vi("segments", I32, [2, 5]), _vi("mask", I32, [2, 5])],
        [_out("y", F, 3), _out("mask_index", I32, 1)],
        consts,
    )
    mask = np.ones((2, 5), np.int32)
    mask[1, 3:] = 0
    feeds = {"ids": RNG.integers(0, vocab, (2, 5)).astype(np.int32),
             "segments": RNG.integers(0, 2, (2, 5)).astype(np.int32), "mask": mask}  # fmt: skip
    _same(core, model, feeds)


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_binary(core, op):
    node = helper.make_node(
        op, ["a", "a_s", "a_zp", "b", "b_s", "b_zp", "c_s", "c_zp"], ["c"], domain=MS
    )
    consts = [
        _const("a_s", np.array(0.05, np.float32)), _const("a_zp", np.array(120, np.uint8)),
        _const("b_s", np.array(0.03, np.float32)), _const("b_zp", np.array(130, np.uint8)),
        _const("c_s", np.array(0.08, np.float32)), _const("c_zp", np.array(128, np.uint8)),
    ]  # fmt: skip
    model = _model(node, [_vi("a", U8, [4, 8]), _vi("b", U8, [8])], [_out("c", U8, 2)], consts)
    feeds = {"a": RNG.integers(0, 255, (4, 8)).astype(np.uint8),
             "b": RNG.integers(0, 255, 8).astype(np.uint8)}  # fmt: skip
    _same(core, model, feeds, atol=1)  # onnxruntime's SIMD requantization may round one step


def test_qlinear_pool_concat_sigmoid_leakyrelu(core):
    x = RNG.integers(0, 255, (1, 3, 4, 4)).astype(np.uint8)
    scales = [
        _const("s", np.array(0.05, np.float32)),
        _const("zp", np.array(128, np.uint8)),
        _const("s2", np.array(0.02, np.float32)),
        _const("zp2", np.array(100, np.uint8)),
    ]
    unary = ["x", "s", "zp", "s2", "zp2"]
    for op, inputs, attrs in (
        ("QLinearGlobalAveragePool", unary, {}),
        ("QLinearSigmoid", unary, {}),
        ("QLinearLeakyRelu", unary, {"alpha": 0.1}),
        ("QLinearConcat", ["s2", "zp2", "x", "s", "zp", "x", "s2", "zp2"], {"axis": 1}),
    ):
        node = helper.make_node(op, inputs, ["y"], domain=MS, **attrs)
        model = _model(node, [_vi("x", U8, [1, 3, 4, 4])], [_out("y", U8, 4)], scales)
        _same(core, model, {"x": x}, atol=1)


@pytest.mark.parametrize("quantized_output", [False, True])
def test_qgemm(core, quantized_output):
    inputs = ["a", "a_s", "a_zp", "b", "b_s", "b_zp", "c"]
    consts = [
        _const("a_s", np.array(0.02, np.float32)), _const("a_zp", np.array(128, np.uint8)),
        _const("b", RNG.integers(-100, 100, (6, 8)).astype(np.int8)),
        _const("b_s", RNG.uniform(0.005, 0.02, 6).astype(np.float32)),
        _const("b_zp", np.zeros(6, np.int8)),
        _const("c", RNG.integers(-1000, 1000, 6).astype(np.int32)),
    ]  # fmt: skip
    out_type = F
    if quantized_output:
        inputs += ["y_s", "y_zp"]
        consts += [
            _const("y_s", np.array(0.1, np.float32)),
            _const("y_zp", np.array(128, np.uint8)),
        ]
        out_type = U8
    node = helper.make_node("QGemm", inputs, ["y"], domain=MS, transB=1, alpha=1.0)
    model = _model(node, [_vi("a", U8, [4, 8])], [_out("y", out_type, 2)], consts)
    _same(
        core,
        model,
        {"a": RNG.integers(0, 255, (4, 8)).astype(np.uint8)},
        atol=1e-4 if not quantized_output else 1,
    )


def test_matmul_integer16(core):
    node = helper.make_node("MatMulInteger16", ["a", "b"], ["y"], domain=MS)
    model = _model(node, [_vi("a", I16, [3, 4]), _vi("b", I16, [4, 5])], [_out("y", I32, 2)])
    feeds = {"a": RNG.integers(-3000, 3000, (3, 4)).astype(np.int16),
             "b": RNG.integers(-3000, 3000, (4, 5)).astype(np.int16)}  # fmt: skip
    _same(core, model, feeds, atol=0)


@pytest.mark.parametrize("zero_points", [False, True])
def test_matmul_nbits_int4(core, zero_points):
    """int4 block-quantized weights, as onnxruntime's MatMulNBitsQuantizer and the genai model
    builder write them (quantized here by onnxruntime's own quantizer)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    k, n = 64, 24
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "mm",
        [_vi("a", F, [2, 3, k])],
        [_out("y", F, 3)],
        [_const("w", RNG.normal(size=(k, n)).astype(np.float32))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=not zero_points)
    quantizer.process()
    quantized = quantizer.model.model
    assert {n.op_type for n in quantized.graph.node} == {"MatMulNBits"}
    _same(core, quantized, {"a": RNG.normal(size=(2, 3, k)).astype(np.float32)}, atol=1e-4)
