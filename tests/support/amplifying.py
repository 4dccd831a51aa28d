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


def varint(value: int) -> bytes:
    """``value`` as protobuf writes an unsigned integer: 7 bits a byte, low first (hand-made
    model bytes, where onnx's helpers would build the whole message in memory first)."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


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


# --------------------------------------------- models whose *reading* computes large values
#
# Each is small on the wire (a few KB) and asks a server that reads it (QueryNetwork, open to
# any ``infer`` client, or LoadNetwork) to compute gigabytes before any request runs: onnx's
# shape inference with data propagation keeps the values of shape arithmetic, constant
# folding computes constants, a sparse initializer is held dense. Each value stays under the
# 64 MiB a node may fold; only their sum is large (plugins/reading.py bounds it).


def read_concat_doubling(doublings: int = 18, rank: int = 100) -> onnx.ModelProto:
    """``Shape`` of a rank-``rank`` input, then ``Concat`` of the value with itself
    ``doublings`` times: onnx's data propagation keeps every value, rank x 2^doublings
    elements at the end (1 KB; 3.6 GB and 19 s of onnx, holding the GIL, at the defaults)."""
    nodes = [helper.make_node("Shape", ["x"], ["s0"])]
    for i in range(doublings):
        nodes.append(helper.make_node("Concat", [f"s{i}", f"s{i}"], [f"s{i + 1}"], axis=0))
    return _model(nodes, [_in("x", F, [1] * rank)], [_in(f"s{doublings}", I64, [None])])


def read_constant_doubling(doublings: int = 9, elements: int = 10_000) -> onnx.ModelProto:
    """A ``Constant`` of ``elements`` int64 zeros (one byte each on the wire), doubled by
    ``Concat`` ``doublings`` times, added to an input: data propagation keeps each value as
    onnx dimensions (10 KB; 573 MB for 8 doublings)."""
    zeros = helper.make_tensor("zeros", I64, [elements], [0] * elements)
    nodes = [helper.make_node("Constant", [], ["s0"], value=zeros)]
    for i in range(doublings):
        nodes.append(helper.make_node("Concat", [f"s{i}", f"s{i}"], [f"s{i + 1}"], axis=0))
    nodes.append(helper.make_node("Add", [f"s{doublings}", "x"], ["y"]))
    return _model(nodes, [_in("x", I64, [1])], [_in("y", I64, [None])])


#: elements of each folded value below: 60 MiB of float32, under the 64 MiB a node may fold
FOLDED_ELEMENTS = 15 << 20


def read_folded_chains(count: int = 64, elements: int = FOLDED_ELEMENTS) -> onnx.ModelProto:
    """``count`` values of ``elements`` float32 each, all computable from constants (in turn a
    ConstantOfShape, an Expand, a Tile and a Range), each an output: constant folding
    (plugserve's passes, onnxruntime's, openvino's) would compute them all, 3.8 GB at the
    defaults, from a 9 KB model. (Adding each to an input makes onnx's own data propagation
    take 2.2 GB and 5 s for one of them: :func:`read_broadcast_add`.)"""
    consts = [
        helper.make_tensor("shape", I64, [1], [elements]),
        helper.make_tensor("one", F, [1], [1.0]),
        helper.make_tensor("row", F, [1024], [1.0] * 1024),
        helper.make_tensor("reps", I64, [1], [elements // 1024]),
        helper.make_tensor("start", F, [], [0.0]),
        helper.make_tensor("limit", F, [], [float(elements)]),
        helper.make_tensor("delta", F, [], [1.0]),
    ]
    nodes, outputs = [], []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            value = helper.make_tensor("v", F, [1], [float(i)])
            nodes.append(helper.make_node("ConstantOfShape", ["shape"], [f"c{i}"], value=value))
        elif kind == 1:
            nodes.append(helper.make_node("Expand", ["one", "shape"], [f"c{i}"]))
        elif kind == 2:
            nodes.append(helper.make_node("Tile", ["row", "reps"], [f"c{i}"]))
        else:
            nodes.append(helper.make_node("Range", ["start", "limit", "delta"], [f"c{i}"]))
        outputs.append(_in(f"c{i}", F, [elements]))
    nodes.append(helper.make_node("Identity", ["x"], ["y"]))
    return _model(nodes, [_in("x", F, [1])], [_in("y", F, [1]), *outputs], consts)


def read_broadcast_add(elements: int = FOLDED_ELEMENTS) -> onnx.ModelProto:
    """A ConstantOfShape of ``elements`` float32 added to an input: onnx's data propagation
    of the Add took 2.2 GB and 5 s here (300 bytes)."""
    value = helper.make_tensor("v", F, [1], [1.0])
    return _model(
        [
            helper.make_node("ConstantOfShape", ["shape"], ["c"], value=value),
            helper.make_node("Add", ["c", "x"], ["y"]),
        ],
        [_in("x", F, [1])],
        [_in("y", F, [elements])],
        [helper.make_tensor("shape", I64, [1], [elements])],
    )


def read_sparse(count: int = 4, elements: int = 400_000_000) -> onnx.ModelProto:
    """``count`` sparse initializers of ``elements`` float32 with one value each (1.6 GB
    dense, under ONNX's 2 GB for a tensor), which no node reads (no standard op takes a
    sparse tensor; shape inference passes them by): held dense when read."""
    sparse = []
    for i in range(count):
        values = helper.make_tensor(f"w{i}", F, [1], [1.0])
        indices = helper.make_tensor(f"w{i}_at", I64, [1], [0])
        sparse.append(helper.make_sparse_tensor(values, indices, [elements]))
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    graph = helper.make_graph(nodes, "sparse", [_in("x", F, [1])], [_in("y", F, [1])])
    graph.sparse_initializer.extend(sparse)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def read_wide_shapes(doublings: int = 16, copies: int = 40) -> onnx.ModelProto:
    """A value reshaped to rank 2^``doublings`` (a shape of ones from ``Concat`` doublings),
    copied ``copies`` times: onnx's answer types each copy with every dimension (10.7 MB of
    shapes from 1 KB, 18x that once read back into the server)."""
    nodes = [helper.make_node("Shape", ["x"], ["s0"])]
    for i in range(doublings):
        nodes.append(helper.make_node("Concat", [f"s{i}", f"s{i}"], [f"s{i + 1}"], axis=0))
    nodes.append(helper.make_node("Reshape", ["x", f"s{doublings}"], ["r0"]))
    for j in range(copies):
        nodes.append(helper.make_node("Identity", [f"r{j}"], [f"r{j + 1}"]))
    nodes.append(helper.make_node("ReduceSum", [f"r{copies}"], ["y"], keepdims=0))
    return _model(nodes, [_in("x", F, [1])], [_in("y", F, [])])


def many_dims(count: int = 30_000) -> onnx.ModelProto:
    """A [128, 128] weight declared with ``count`` dims of 2**62 (300 KB): their product is a
    bigint of ``count`` x 62 bits, whose plain multiplication takes seconds holding the GIL
    (onnx's checker refuses the tensor at the second dim, for int64 overflow)."""
    weight = helper.make_tensor("w", F, [128, 128], bytes(128 * 128 * 4), raw=True)
    weight.dims[:] = [2**62] * count
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [_in("x", F, [1, 128])],
        [_in("y", F, [1, 128])],
        [weight],
    )


def calling_functions(depth: int = 40, circle: bool = False) -> onnx.ModelProto:
    """Local functions f0..f``depth - 1``, each calling the one before twice (f0: a Relu, or,
    with ``circle``, f``depth - 1``), and a graph calling the last (4 KB at 40): their calls
    expand to 2^``depth`` nodes, which onnx's shape inference walked until --max-read-seconds."""
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]

    def function(name, calls):
        nodes, last = [], "a"
        for i, call in enumerate(calls):
            domain = "" if call == "Relu" else "local"
            nodes.append(helper.make_node(call, [last], [f"t{i}"], domain=domain))
            last = f"t{i}"
        nodes.append(helper.make_node("Identity", [last], ["b"]))
        return helper.make_function("local", name, ["a"], ["b"], nodes, opsets)

    first = [f"f{depth - 1}"] if circle else ["Relu"]
    functions = [function("f0", first)]
    functions += [function(f"f{k}", [f"f{k - 1}"] * 2) for k in range(1, depth)]
    graph = helper.make_graph(
        [helper.make_node(f"f{depth - 1}", ["x"], ["y"], domain="local")],
        "calling",
        [helper.make_tensor_value_info("x", F, [1])],
        [helper.make_tensor_value_info("y", F, [1])],
    )
    model = helper.make_model(graph, opset_imports=opsets, functions=functions)
    model.ir_version = 8
    return model


#: every model above whose reading is bounded by --max-read-bytes, by name
READING = {
    "broadcast_add": read_broadcast_add,
    "concat_doubling": read_concat_doubling,
    "constant_doubling": read_constant_doubling,
    "folded_chains": read_folded_chains,
    "sparse": read_sparse,
    "wide_shapes": read_wide_shapes,
}
