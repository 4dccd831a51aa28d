"""How large a value computed at load time will be, known before anything is allocated.

Constant folding runs a node whose inputs are all constants. A 180-byte model can ask for a
2 GB constant (``ConstantOfShape([5e8])``), so the size of a node's outputs is worked out
from shapes and from the (small) values of its shape-like inputs first, and the node is not
folded when it is over the limit. The shapes are ONNX's shape inference of the node alone, given
its inputs' actual shapes and the values of the small ones, never the graph's ``value_info``: a
model may declare ``[1]`` for a value that inference of the whole graph leaves ``[?]``
(``HannWindow(Abs(c))``: 400 MB folded for a declared 4 bytes). Some ops whose output size
depends on an input's *values* have a rule here as well.

onnxruntime and openvino fold constants themselves, without a limit: :func:`check_load_constants`
lets their plugins refuse such a model before handing it over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper

from plugserve.plugins import reading
from plugserve.plugins.api import InvalidModel
from plugserve.plugins.ir import Graph, Node, np_dtype, onnx_dtype, subgraph_free_names

__all__ = [
    "FOLD_LIMIT_BYTES",
    "NONDETERMINISTIC",
    "VALUE_SIZED",
    "check_load_constants",
    "computed",
    "output_bytes",
]

#: Largest value computed at load time: NUMPY leaves larger ones to run time; onnxruntime and
#: openvino, which would fold them anyway, refuse the model.
FOLD_LIMIT_BYTES = 64 << 20

#: Ops never computed at load time: their value is not the same on every run (and one whose
#: cost its size does not tell).
NONDETERMINISTIC = frozenset(
    {
        "RandomUniform",
        "RandomNormal",
        "RandomUniformLike",
        "RandomNormalLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
        # not random, but its cost is not its size: RE2 is linear, yet ~5 us a character for
        # some patterns, and a 10 MB string constant in a QueryNetwork (any infer token's)
        # held the server 53 s in one uninterruptible match; at run time a request's room and
        # deadline bound it
        "RegexFullMatch",
    }
)

Values = Sequence[np.ndarray | None]


def _ints(value: np.ndarray | None) -> list[int] | None:
    if value is None or value.dtype.kind not in "iu" or value.size > 64:
        return None
    return [int(v) for v in value.reshape(-1)]


def _count(dims: Sequence[int]) -> int:
    return math.prod(max(0, int(d)) for d in dims)


def _constant_of_shape(node: Node, values: Values) -> int | None:
    dims = _ints(values[0] if values else None)
    return None if dims is None else _count(dims)


def _expand(node: Node, values: Values) -> int | None:
    dims = _ints(values[1] if len(values) > 1 else None)
    if dims is None or values[0] is None:
        return None
    a, b = list(values[0].shape), dims
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + a, [1] * (rank - len(b)) + b
    return _count(max(x, y) for x, y in zip(a, b))


def _tile(node: Node, values: Values) -> int | None:
    repeats = _ints(values[1] if len(values) > 1 else None)
    if repeats is None or values[0] is None:
        return None
    return values[0].size * _count(repeats)


def _range(node: Node, values: Values) -> int | None:
    if len(values) < 3 or any(v is None or v.size != 1 for v in values[:3]):
        return None
    start, limit, delta = (float(v.reshape(())) for v in values[:3])
    if delta == 0 or not all(map(math.isfinite, (start, limit, delta))):
        return None
    return max(0, math.ceil((limit - start) / delta))


def _resize(node: Node, values: Values) -> int | None:
    """Resize (X, roi, scales, sizes) and Upsample (X, scales): the output is sizes, or the
    input's shape times the scales."""
    x = values[0] if values else None
    if x is None:
        return None
    sizes = values[3] if node.op_type == "Resize" and len(values) > 3 else None
    if sizes is not None and sizes.size:
        dims = _ints(sizes)
        return None if dims is None or len(dims) != x.ndim else _count(dims)
    scales = values[2 if node.op_type == "Resize" else 1] if len(values) > 1 else None
    if scales is None:
        scales = node.attr("scales")  # Upsample-7 keeps them in an attribute
        scales = None if scales is None else np.asarray(scales, dtype=np.float64)
    if scales is None or scales.size > 64:
        return None
    factors = [float(s) for s in np.asarray(scales).reshape(-1)]
    if len(factors) != x.ndim or not all(math.isfinite(f) and f >= 0 for f in factors):
        return None
    return _count(math.floor(d * f) for d, f in zip(x.shape, factors))


def _pad(node: Node, values: Values) -> int | None:
    x = values[0] if values else None
    pads = _ints(values[1] if len(values) > 1 else None)
    if pads is None:
        attr = node.attr("pads")
        pads = None if attr is None else [int(p) for p in attr]
    if x is None or pads is None or len(pads) != 2 * x.ndim:
        return None
    return _count(d + pads[i] + pads[i + x.ndim] for i, d in enumerate(x.shape))


def _one_hot(node: Node, values: Values) -> int | None:
    if len(values) < 2 or values[0] is None or values[1] is None or values[1].size != 1:
        return None
    return values[0].size * max(0, int(values[1].reshape(())))


#: Ops whose output size depends on input values: elements of the (first) output.
_RULES: dict[str, Callable[[Node, Values], int | None]] = {
    "ConstantOfShape": _constant_of_shape,
    "Expand": _expand,
    "Tile": _tile,
    "Range": _range,
    "Resize": _resize,
    "Upsample": _resize,
    "Pad": _pad,
    "OneHot": _one_hot,
}


#: Ops whose output size an input's *values* decide (not only the inputs' shapes): computed at
#: load time, one whose size cannot be told beforehand is refused by :func:`check_load_constants`
#: (a window of ``Abs(c)`` points, ``c`` -5e7, folded by onnxruntime at +384 MB).
VALUE_SIZED = frozenset(
    {
        *_RULES,
        "HannWindow",
        "HammingWindow",
        "BlackmanWindow",
        "MelWeightMatrix",
        "AffineGrid",
        "ImageDecoder",
        "STFT",
        "DFT",
        "CenterCropPad",
        "MaxUnpool",
        "Col2Im",
    }
)

#: Inputs of at most this many elements are handed to shape inference with their values (the
#: shape-like ones: a window's length, a Reshape's shape); larger ones by their type only.
_DATA_ELEMENTS = 1024


def _light(attr: AttributeProto) -> AttributeProto:
    """A tensor attribute without its data: inference reads its type and dims only (a
    Constant's value may be megabytes)."""
    if attr.type != AttributeProto.TENSOR:
        return attr
    light = AttributeProto()
    light.name, light.type = attr.name, attr.type
    light.t.data_type = attr.t.data_type
    light.t.dims.extend(attr.t.dims)
    return light


def _tensor_type(array: np.ndarray) -> onnx.TypeProto:
    return onnx.helper.make_tensor_type_proto(onnx_dtype(array.dtype), array.shape)


def _inferred(
    node: Node, graph: Graph, values: Values, types: dict[str, onnx.TypeProto]
) -> dict[str, onnx.TypeProto]:
    """ONNX's shape inference of ``node`` alone from its inputs: the arrays in ``values``
    (their shapes, and their values when small), else the types in ``types``; {} when it
    cannot be run."""
    try:
        schema = onnx.defs.get_schema(node.op_type, graph.node_opset(node), node.domain)
        given: dict[str, onnx.TypeProto] = {}
        data: dict[str, TensorProto] = {}
        for name, value in zip(node.inputs, values):
            if not name:
                continue
            if value is None:
                if name not in types:
                    return {}
                given[name] = types[name]
                continue
            given[name] = _tensor_type(value)
            if value.size <= _DATA_ELEMENTS and value.dtype.kind != "O":
                data[name] = numpy_helper.from_array(value, name)
        proto = onnx.helper.make_node(node.op_type, node.inputs, node.outputs, domain=node.domain)
        proto.attribute.extend(_light(a) for a in node.attrs.values())
        opsets = [onnx.helper.make_opsetid(d, v) for d, v in graph.opsets.items()]
        return onnx.shape_inference.infer_node_outputs(schema, proto, given, data, None, opsets)
    except Exception:  # no schema, or values inference refuses: not known before running
        return {}


def _static(kind: onnx.TypeProto | None) -> tuple[tuple[int, ...] | None, int]:
    """A tensor type's shape when every dim is known, and its item size (8 when not known)."""
    if kind is None or not kind.HasField("tensor_type"):
        return None, 8
    dtype = np_dtype(kind.tensor_type.elem_type)
    itemsize = 8 if dtype is None or dtype.kind == "O" else dtype.itemsize
    dims = kind.tensor_type.shape.dim
    if not kind.tensor_type.HasField("shape") or not all(
        d.HasField("dim_value") and d.dim_value >= 0 for d in dims
    ):
        return None, itemsize
    return tuple(d.dim_value for d in dims), itemsize


def output_bytes(
    node: Node, graph: Graph, values: Values, types: dict[str, onnx.TypeProto] | None = None
) -> int | None:
    """Bytes of ``node``'s outputs if it ran on these input ``values`` (None where an input
    is not known: then its type in ``types``, if there), or None when that cannot be told
    without running it. ``types`` also receives the node's inferred output types.

    The larger of the two answers when both exist: the rule, from the values, and ONNX's
    inference of this node from its actual inputs. Never the graph's ``value_info``: a model
    can declare a small shape for a large value.
    """
    if node.domain not in ("", "ai.onnx"):
        return None
    types = {} if types is None else types
    inferred = _inferred(node, graph, values, types)
    types.update(inferred)
    total = 0
    rule = _RULES.get(node.op_type)
    first = rule(node, values) if rule is not None else None
    for index, name in enumerate(node.outputs):
        if not name:
            continue
        shape, itemsize = _static(inferred.get(name))
        counts = [_count(shape)] if shape is not None else []
        if index == 0 and first is not None:
            counts.append(first)
        if not counts:
            return None
        total += max(counts) * itemsize
    return total


def computed(node: Node) -> bool:
    """Whether folding ``node`` computes a value the model's bytes do not hold already (a
    Constant's value is on the wire, unless it is sparse)."""
    return node.op_type != "Constant" or "sparse_value" in node.attrs


def check_load_constants(graph: Graph, device: str, limit: int = FOLD_LIMIT_BYTES) -> None:
    """Refuse a model in which a value computable at load time (every input a constant, or
    computed from constants) would exceed ``limit`` bytes, or all of them together the read's
    allowance (``plugins/reading.py``: many nodes each just under ``limit``): backends that
    fold constants themselves would allocate them while compiling. An op whose output size
    its inputs' values decide (:data:`VALUE_SIZED`) is refused, too, when that size cannot be
    told (a value computed from constants: its shape is inferred, its value unknown; small
    values of small ones are computed here, :func:`_small_value`, as a shape from a Concat of
    Constants). Linear in the graph; allocates nothing large."""
    known: dict[str, np.ndarray | None] = dict(graph.initializers)
    types: dict[str, onnx.TypeProto] = {}  # the inferred types of the values computed
    allowance = reading.allowance(sum(a.nbytes for a in graph.initializers.values()))
    for node in graph.nodes:
        if node.op_type in NONDETERMINISTIC or subgraph_free_names(node):
            continue
        if any(n and n not in known for n in node.inputs):
            continue
        values = [known.get(n) if n else None for n in node.inputs]
        size = output_bytes(node, graph, values, types)
        if size is None and node.op_type in VALUE_SIZED:
            raise InvalidModel(
                f"model {graph.name!r}: node {node.name!r} ({node.op_type}) makes a constant "
                f"while the model is compiled whose size its inputs' values decide, and they "
                f"are not known before: {device} would compute it without a limit (its limit "
                f"for values computed at load time is {limit:,} bytes)"
            )
        if size is not None and size > limit:
            raise InvalidModel(
                f"model {graph.name!r}: node {node.name!r} ({node.op_type}) makes a constant of "
                f"{size:,} bytes while the model is compiled, over {device}'s limit of "
                f"{limit:,} bytes for values computed at load time"
            )
        if size is not None and computed(node):
            allowance.take(size, f"model {graph.name!r}: node {node.name!r} ({node.op_type})")
        if node.op_type == "Constant":
            made = [node.attr("value")]
        else:
            made = _small_value(node, graph, values, size)
        for index, name in enumerate(node.outputs):
            if name:  # known at load time; the value itself for a Constant and small ones
                value = made[index] if index < len(made) else None
                known[name] = value if isinstance(value, np.ndarray) else None


#: The ops :func:`_small_value` computes: the arithmetic exporters do on shapes, on numbers
#: only. Never an op of strings or of code-like attributes: this runs in the server on a
#: client's model (an infer token's QueryNetwork on TORCH), and onnx's reference
#: RegexFullMatch is Python's ``re``, whose backtracking on a pattern the model names could
#: hold the GIL for minutes.
_SHAPE_ARITHMETIC = frozenset(
    {
        "Abs", "Add", "Cast", "Ceil", "Concat", "Div", "Equal", "Floor", "Gather",
        "Greater", "Identity", "Less", "Max", "Min", "Mod", "Mul", "Neg", "Not",
        "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSum", "Reshape", "Shape", "Size",
        "Slice", "Sqrt", "Squeeze", "Sub", "Transpose", "Unsqueeze", "Where",
    }
)  # fmt: skip


def _small_value(node: Node, graph: Graph, values: Values, size: int | None) -> list:
    """The outputs of ``node`` computed by onnx's reference implementation when it is shape
    arithmetic (:data:`_SHAPE_ARITHMETIC`) on small numeric inputs to small outputs (~0.4 ms
    a node), else []: what a value-sized op reading them needs to be sized."""
    if size is None or size > 8 * _DATA_ELEMENTS:
        return []
    if node.op_type not in _SHAPE_ARITHMETIC or node.domain not in ("", "ai.onnx"):
        return []
    given = [v for n, v in zip(node.inputs, values) if n]
    if any(v is None or v.size > _DATA_ELEMENTS or v.dtype.kind not in "biuf" for v in given):
        return []
    try:
        from onnx.reference import ReferenceEvaluator

        proto = onnx.helper.make_node(node.op_type, node.inputs, node.outputs, domain=node.domain)
        proto.attribute.extend(node.attrs.values())
        evaluator = ReferenceEvaluator(proto, opsets={"": graph.node_opset(node)})
        feeds = {n: v for n, v in zip(node.inputs, values) if n}
        return list(evaluator.run(None, feeds))
    except Exception:  # an op the reference does not have, or refuses: its value unknown
        return []
