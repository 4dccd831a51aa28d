"""ONNX models built in code for the tests: small, real, and deterministic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

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


def encoder_block(
    seed: int = 0, d: int = 16, heads: int = 2, ff: int = 32, named: bool = True
) -> onnx.ModelProto:
    """A pre-norm transformer encoder block: LayerNormalization, two-head self-attention
    (MatMul, Reshape, Transpose, Softmax), residual adds and an erf GELU feed-forward."""
    rng = np.random.default_rng(seed)
    f = np.float32
    dh = d // heads

    def w(*shape, scale=None):
        return rng.normal(0, scale or 1 / np.sqrt(shape[0]), shape).astype(f)

    inits = [
        _init("ln1_g", rng.uniform(0.8, 1.2, d).astype(f)),
        _init("ln1_b", rng.normal(0, 0.1, d).astype(f)),
        _init("ln2_g", rng.uniform(0.8, 1.2, d).astype(f)),
        _init("ln2_b", rng.normal(0, 0.1, d).astype(f)),
        *[_init(f"w{n}", w(d, d)) for n in "qkvo"],
        *[_init(f"b{n}", w(d, scale=0.1)) for n in "qkvo"],
        _init("w_ff1", w(d, ff)),
        _init("b_ff1", w(ff, scale=0.1)),
        _init("w_ff2", w(ff, d)),
        _init("b_ff2", w(d, scale=0.1)),
        _init("heads_shape", np.array([0, 0, heads, dh], np.int64)),
        _init("model_shape", np.array([0, 0, d], np.int64)),
        _init("scale", np.array(1 / np.sqrt(dh), f)),
        _init("sqrt2", np.array(np.sqrt(2), f)),
        _init("one", np.array(1, f)),
        _init("half", np.array(0.5, f)),
    ]
    n = helper.make_node
    nodes = [n("LayerNormalization", ["x", "ln1_g", "ln1_b"], ["ln1"], "ln1", epsilon=1e-5)]
    for p in "qkv":
        nodes += [
            n("MatMul", ["ln1", f"w{p}"], [f"{p}_mm"], f"{p}_proj"),
            n("Add", [f"{p}_mm", f"b{p}"], [f"{p}_b"], f"{p}_bias"),
            n("Reshape", [f"{p}_b", "heads_shape"], [f"{p}_h"], f"{p}_split"),
        ]
    nodes += [
        n("Transpose", ["q_h"], ["q_t"], "q_perm", perm=[0, 2, 1, 3]),
        n("Transpose", ["k_h"], ["k_t"], "k_perm", perm=[0, 2, 3, 1]),
        n("Transpose", ["v_h"], ["v_t"], "v_perm", perm=[0, 2, 1, 3]),
        n("MatMul", ["q_t", "k_t"], ["scores"], "qk"),
        n("Mul", ["scores", "scale"], ["scaled"], "scale_scores"),
        n("Softmax", ["scaled"], ["attn"], "attention", axis=-1),
        n("MatMul", ["attn", "v_t"], ["ctx_h"], "attend"),
        n("Transpose", ["ctx_h"], ["ctx_t"], "ctx_perm", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_t", "model_shape"], ["ctx"], "merge_heads"),
        n("MatMul", ["ctx", "wo"], ["o_mm"], "o_proj"),
        n("Add", ["o_mm", "bo"], ["o"], "o_bias"),
        n("Add", ["x", "o"], ["res1"], "residual1"),
        n("LayerNormalization", ["res1", "ln2_g", "ln2_b"], ["ln2"], "ln2", epsilon=1e-5),
        n("MatMul", ["ln2", "w_ff1"], ["ff1_mm"], "ff1"),
        n("Add", ["ff1_mm", "b_ff1"], ["h"], "ff1_bias"),
        n("Div", ["h", "sqrt2"], ["h_s"], "gelu_div"),
        n("Erf", ["h_s"], ["h_erf"], "gelu_erf"),
        n("Add", ["h_erf", "one"], ["h_1"], "gelu_add"),
        n("Mul", ["h", "h_1"], ["h_m"], "gelu_mul"),
        n("Mul", ["h_m", "half"], ["gelu"], "gelu_half"),
        n("MatMul", ["gelu", "w_ff2"], ["ff2_mm"], "ff2"),
        n("Add", ["ff2_mm", "b_ff2"], ["ff"], "ff2_bias"),
        n("Add", ["res1", "ff"], ["y"], "residual2"),
    ]
    if not named:
        for node in nodes:
            node.name = ""
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", d])],
        inits,
        name="encoder_block",
    )


def shape_floats() -> onnx.ModelProto:
    """Float arithmetic over a shape, as exporters write it: ``n = float(x.shape[-1])``;
    ``half = ceil(n * 0.5)`` sizes a ConstantOfShape (the output ``zeros``), ``n / 7`` is an
    output (``ratio``), ``x + Range(0, n, 1)`` is computed on the device (``ramp``, the Range's
    bounds read on the host). Above 2,048 (f16) or 256 (bf16) ``n`` is no longer exact in the
    device's precision: 3,001 is 3,000 in f16 and 3,008 in bf16 (the torch device computes it
    on the host in float32: tests/plugins/torch_device/test_host_values.py,
    tests/gpu/device_check.py)."""
    n = helper.make_node
    return helper.make_model(helper.make_graph(
        [n("Shape", ["x"], ["s"], name="shape", start=-1),
         n("Cast", ["s"], ["n"], name="as_float", to=TensorProto.FLOAT),
         n("Mul", ["n", "half"], ["scaled"], name="scale"),
         n("Ceil", ["scaled"], ["rounded"], name="ceil"),
         n("Cast", ["rounded"], ["dims"], name="as_int", to=TensorProto.INT64),
         n("ConstantOfShape", ["dims"], ["zeros"], name="zeros",
           value=numpy_helper.from_array(np.array([0], np.int64))),
         n("Div", ["n", "seven"], ["ratio"], name="ratio"),
         n("Squeeze", ["n"], ["limit"], name="limit"),
         n("Range", ["zero", "limit", "one"], ["positions"], name="positions"),
         n("Add", ["x", "positions"], ["ramp"], name="ramp")],
        "shape_floats",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
        [helper.make_tensor_value_info("zeros", TensorProto.INT64, ["m"]),
         helper.make_tensor_value_info("ratio", TensorProto.FLOAT, [1]),
         helper.make_tensor_value_info("ramp", TensorProto.FLOAT, [1, "n"])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "half"),
         numpy_helper.from_array(np.array(7.0, np.float32), "seven"),
         numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
         numpy_helper.from_array(np.array(1.0, np.float32), "one")],
    ), opset_imports=[helper.make_opsetid("", 17)])  # fmt: skip


def shaped_encoder(seed: int = 0, vocab: int = 50, d: int = 16, heads: int = 2,
                   positions: int = 32) -> onnx.ModelProto:  # fmt: skip
    """A BERT-like attention block written as the TorchScript exporter writes one: token ids
    to a token embedding (Gather) plus a position embedding read at ``Range(0, seq)`` (the
    sequence's length taken with Shape -> Gather); heads split and merged by Reshapes to shapes
    built by Shape -> Gather -> Unsqueeze -> Concat; scores divided by the Sqrt of the head size
    (Cast of a Shape's Gather: a shape value meeting the data); the padding mask expanded to
    the scores' shape by the exporter's ConstantOfShape -> Mul -> Equal -> Where -> Expand."""
    rng = np.random.default_rng(seed)
    f = np.float32
    dh = d // heads

    def w(*shape):
        return rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(f)

    i64 = np.int64
    inits = [
        _init("tokens", w(vocab, d)), _init("positions", w(positions, d)),
        *[_init(f"w{n}", w(d, d)) for n in "qkvo"],
        _init("zero", np.array(0, i64)), _init("one", np.array(1, i64)),
        _init("i3", np.array(3, i64)), _init("axes0", np.array([0], i64)),
        _init("axes12", np.array([1, 2], i64)), _init("heads", np.array([heads], i64)),
        _init("head_size", np.array([dh], i64)), _init("width", np.array([d], i64)),
        _init("minus1", np.array(-1, i64)), _init("pad", np.array(0, i64)),
        _init("onef", np.array(1, f)), _init("big", np.array(-1e4, f)),
    ]  # fmt: skip
    n = helper.make_node
    nodes = [
        n("Gather", ["tokens", "ids"], ["emb"], "token_embedding"),
        n("Shape", ["ids"], ["ids_shape"], "ids_shape"),
        n("Gather", ["ids_shape", "zero"], ["b"], "batch_size"),
        n("Gather", ["ids_shape", "one"], ["s"], "seq_len"),
        n("Range", ["zero", "s", "one"], ["pos"], "position_ids"),
        n("Unsqueeze", ["pos", "axes0"], ["pos_u"], "position_batch"),
        n("Gather", ["positions", "pos_u"], ["pos_e"], "position_embedding"),
        n("Add", ["emb", "pos_e"], ["x"], "embed"),
        n("Unsqueeze", ["b", "axes0"], ["b_u"], "b_u"),
        n("Unsqueeze", ["s", "axes0"], ["s_u"], "s_u"),
        n("Concat", ["b_u", "s_u", "heads", "head_size"], ["split_shape"], "split_shape", axis=0),
        n("Concat", ["b_u", "s_u", "width"], ["merge_shape"], "merge_shape", axis=0),
    ]  # fmt: skip
    for p, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            n("MatMul", ["x", f"w{p}"], [f"{p}_mm"], f"{p}_proj"),
            n("Reshape", [f"{p}_mm", "split_shape"], [f"{p}_h"], f"{p}_split"),
            n("Transpose", [f"{p}_h"], [f"{p}_t"], f"{p}_perm", perm=perm),
        ]
    nodes += [
        n("MatMul", ["q_t", "k_t"], ["scores"], "qk"),
        n("Shape", ["q_h"], ["q_shape"], "q_shape"),
        n("Gather", ["q_shape", "i3"], ["dh"], "head_dim"),
        n("Cast", ["dh"], ["dh_f"], "head_dim_float", to=TensorProto.FLOAT),
        n("Sqrt", ["dh_f"], ["root"], "root"),
        n("Div", ["scores", "root"], ["scaled"], "scale_scores"),
        n("Equal", ["ids", "pad"], ["is_pad"], "is_pad"),
        n("Not", ["is_pad"], ["keep"], "keep"),
        n("Cast", ["keep"], ["keep_f"], "keep_float", to=TensorProto.FLOAT),
        n("Unsqueeze", ["keep_f", "axes12"], ["keep_u"], "keep_u"),
        n("Shape", ["scores"], ["target"], "target"),
        n("Shape", ["target"], ["rank"], "rank"),
        n("ConstantOfShape", ["rank"], ["ones"], "ones",
          value=numpy_helper.from_array(np.array([1], i64))),
        n("Mul", ["ones", "minus1"], ["neg"], "neg"),
        n("Equal", ["target", "neg"], ["unknown"], "unknown"),
        n("Where", ["unknown", "ones", "target"], ["expand_to"], "expand_to"),
        n("Expand", ["keep_u", "expand_to"], ["keep_e"], "keep_expanded"),
        n("Sub", ["onef", "keep_e"], ["masked"], "masked"),
        n("Mul", ["masked", "big"], ["penalty"], "penalty"),
        n("Add", ["scaled", "penalty"], ["biased"], "biased"),
        n("Softmax", ["biased"], ["attn"], "attention", axis=-1),
        n("MatMul", ["attn", "v_t"], ["ctx_h"], "attend"),
        n("Transpose", ["ctx_h"], ["ctx_t"], "ctx_perm", perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx_t", "merge_shape"], ["ctx"], "merge_heads"),
        n("MatMul", ["ctx", "wo"], ["o"], "o_proj"),
        n("Add", ["x", "o"], ["y"], "residual"),
    ]  # fmt: skip
    return _model(
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", d])],
        inits,
        name="shaped_encoder",
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


def make_model(nodes, inputs, outputs, initializers=(), opsets=(("", 17),)) -> onnx.ModelProto:
    """A checked model from ``(name, element type, shape)`` inputs and outputs."""
    graph = helper.make_graph(
        nodes,
        "real_shapes",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def add_constant(constant: float, shape: list[int | str] | None = None) -> onnx.ModelProto:
    """``y = x + constant``, float32 of ``shape`` (default [4]); IR 9, which every installed
    runtime reads. Tests that change a served model change the constant and see it."""
    shape = [4] if shape is None else shape
    c = helper.make_tensor("c", TensorProto.FLOAT, [1], [constant])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"])],
        "plus",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [c],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


#: A trip count no run would finish: the runaway request of issue 21.
FOREVER = 10**12


def adding_body(addend: str) -> onnx.GraphProto:
    """A Loop body adding the outer scope's ``addend`` to its carried value each trip."""
    return helper.make_graph(
        [
            helper.make_node("Add", ["acc_in", addend], ["acc_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, None),
        ],
    )


def spin_loop(batched: bool = False) -> onnx.ModelProto:
    """``y = x * M`` computed as M additions in a Loop: M comes from the request. Batched:
    M is a [N] vector (its largest entry counts) and x is [N, 4], so BATCH can gather it."""
    body = adding_body("x")
    nodes = [helper.make_node("Mul", ["x", "zero"], ["start"])]
    trips = "M"
    if batched:
        nodes.append(helper.make_node("ReduceMax", ["M"], ["trips"], keepdims=0))
        trips = "trips"
    nodes.append(helper.make_node("Loop", [trips, "", "start"], ["y"], body=body, name="spin"))
    shape = ["N", 4] if batched else [4]
    graph = helper.make_graph(
        nodes,
        "spin",
        [
            helper.make_tensor_value_info("M", TensorProto.INT64, ["N"] if batched else []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def spin_repository(root: Path, streams: int) -> Path:
    """A model repository at ``root`` holding :func:`spin_loop` as ``spin`` on NUMPY with
    ``streams`` streams (its queue: 64 places a stream unless --queue-size says otherwise):
    a model whose requests take as long as their M asks, for tests that need requests to
    wait for one another."""
    folder = root / "spin" / "1"
    folder.mkdir(parents=True)
    onnx.save(spin_loop(), str(folder / "model.onnx"))
    config = {"device": "NUMPY", "config": {"NUM_STREAMS": str(streams)}}
    (root / "spin" / "config.json").write_text(json.dumps(config))
    return root


def outer_read_across_pieces() -> onnx.ModelProto:
    """A Silero-VAD-like export (torch.onnx): a squeeze written as an If whose branches differ
    in rank leaves every value after it without a rank in ONNX's inference, though the Conv
    after it fixes the rank again; the Sigmoid's output is then read only inside the branches
    of ``/model/If`` (an outer-scope name), whose condition comes from other nodes.

    Pinned as :data:`OUTER_READ_PINS`, the Sigmoid and ``/model/If`` land in two NUMPY pieces
    with an OPENVINO piece (``/ReduceMax``, ``/Greater``) between them.
    """
    f = TensorProto.FLOAT
    squeeze = helper.make_graph(
        [helper.make_node("Squeeze", ["/Abs_output_0", "axis1"], ["/decoder/Squeeze_output_0"])],
        "squeeze",
        [],
        [helper.make_tensor_value_info("/decoder/Squeeze_output_0", f, [1, "T"])],
    )
    keep = helper.make_graph(
        [helper.make_node("Identity", ["/Abs_output_0"], ["/decoder/Identity_output_0"])],
        "keep",
        [],
        [helper.make_tensor_value_info("/decoder/Identity_output_0", f, [1, "C", "T"])],
    )
    sig = "/decoder/Sigmoid_output_0"
    then = helper.make_graph(
        [helper.make_node("Mul", [sig, "two"], ["/model/Mul_output_0"])],
        "then",
        [],
        [helper.make_tensor_value_info("/model/Mul_output_0", f, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", [sig], ["/model/Neg_output_0"])],
        "else",
        [],
        [helper.make_tensor_value_info("/model/Neg_output_0", f, None)],
    )
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Abs", ["input"], ["/Abs_output_0"], name="/Abs"),
        helper.make_node(
            "Shape", ["/Abs_output_0"], ["/decoder/Shape_output_0"], name="/decoder/Shape"
        ),
        helper.make_node(
            "Gather",
            ["/decoder/Shape_output_0", "one"],
            ["/decoder/Gather_output_0"],
            name="/decoder/Gather",
        ),
        helper.make_node(
            "Equal",
            ["/decoder/Gather_output_0", "one"],
            ["/decoder/Equal_output_0"],
            name="/decoder/Equal",
        ),
        helper.make_node(
            "If",
            ["/decoder/Equal_output_0"],
            ["/decoder/If_output_0"],
            then_branch=squeeze,
            else_branch=keep,
            name="/decoder/If",
        ),
        helper.make_node(
            "Conv",
            ["/decoder/If_output_0", "conv.weight", "conv.bias"],
            ["/decoder/Conv_output_0"],
            name="/decoder/Conv",
        ),
        helper.make_node("Sigmoid", ["/decoder/Conv_output_0"], [sig], name="/decoder/Sigmoid"),
        helper.make_node(
            "ReduceMax", ["/Abs_output_0"], ["/ReduceMax_output_0"], keepdims=0, name="/ReduceMax"
        ),
        helper.make_node(
            "Greater", ["/ReduceMax_output_0", "threshold"], ["/Greater_output_0"], name="/Greater"
        ),
        helper.make_node(
            "If",
            ["/Greater_output_0"],
            ["output"],
            then_branch=then,
            else_branch=other,
            name="/model/If",
        ),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("input", f, [1, "C", "T"]),
            helper.make_tensor_value_info("threshold", f, []),
        ],
        [helper.make_tensor_value_info("output", f, [1, 2, "T"])],
        [
            _init("one", np.array(1, np.int64)),
            _init("axis1", np.array([1], np.int64)),
            _init("two", np.array(2.0, np.float32)),
            _init("conv.weight", rng.normal(0, 0.5, (2, 3, 1)).astype(np.float32)),
            _init("conv.bias", rng.normal(0, 0.1, 2).astype(np.float32)),
        ],
        name="outer_read",
    )


#: ``HETERO:OPENVINO,NUMPY`` placement of :func:`outer_read_across_pieces`: the condition on
#: OPENVINO, between the piece that makes the Sigmoid's output and the If that reads it.
OUTER_READ_PINS = {
    "/Abs": "NUMPY",
    "/decoder/Shape": "NUMPY",
    "/decoder/Gather": "NUMPY",
    "/decoder/Equal": "NUMPY",
    "/decoder/If": "NUMPY",
    "/decoder/Conv": "NUMPY",
    "/decoder/Sigmoid": "NUMPY",
    "/ReduceMax": "OPENVINO",
    "/Greater": "OPENVINO",
    "/model/If": "NUMPY",
}


def add_sub(dtype=TensorProto.FLOAT, shape=(4,)) -> onnx.ModelProto:
    """Triton's add_sub as an ONNX graph: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    value = list(shape)
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
            helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
        ],
        "add_sub",
        [helper.make_tensor_value_info(n, dtype, value) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, dtype, value) for n in ("OUTPUT0", "OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
