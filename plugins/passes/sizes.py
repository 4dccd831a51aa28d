"""How large a value computed at load time will be, known before anything is allocated.

Constant folding runs a node whose inputs are all constants. A 180-byte model can ask for a
2 GB constant (``ConstantOfShape([5e8])``), so the size of a node's outputs is worked out
from shapes and from the (small) values of its shape-like inputs first, and the node is not
folded when it is over the limit. Ops whose output size depends on an input's *values* have a
rule here; for every other op the output size follows from the input shapes, which ONNX shape
inference has already written into the graph.

onnxruntime and openvino fold constants themselves, without a limit: :func:`check_load_constants`
lets their plugins refuse such a model before handing it over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from plugserve.plugins import reading
from plugserve.plugins.api import InvalidModel
from plugserve.plugins.ir import Graph, Node, subgraph_free_names

__all__ = [
    "FOLD_LIMIT_BYTES",
    "NONDETERMINISTIC",
    "check_load_constants",
    "computed",
    "output_bytes",
]

#: Largest value computed at load time: NUMPY leaves larger ones to run time; onnxruntime and
#: openvino, which would fold them anyway, refuse the model.
FOLD_LIMIT_BYTES = 64 << 20

#: Ops never computed at load time: their value is not the same on every run.
NONDETERMINISTIC = frozenset(
    {
        "RandomUniform",
        "RandomNormal",
        "RandomUniformLike",
        "RandomNormalLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",
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


def _itemsize(graph: Graph, name: str) -> int:
    spec = graph.spec(name)
    if spec is None or spec.dtype is None or spec.dtype == object:
        return 8
    return spec.dtype.itemsize


def output_bytes(node: Node, graph: Graph, values: Values) -> int | None:
    """Bytes of ``node``'s outputs if it ran on these input ``values`` (None where an input
    is not known), or None when that cannot be told without running it.

    The larger of the two answers when both exist: the rule, from the values, and the shapes
    shape inference recorded (a model can declare a small shape for a large value).
    """
    if node.domain not in ("", "ai.onnx"):
        return None
    total = 0
    rule = _RULES.get(node.op_type)
    first = rule(node, values) if rule is not None else None
    for index, name in enumerate(node.outputs):
        if not name:
            continue
        spec = graph.spec(name)
        static = None
        shape = spec.shape if spec is not None else None
        if shape is not None and all(isinstance(d, int) and d >= 0 for d in shape):
            static = _count(shape)
        counts = [c for c in (static, first if index == 0 else None) if c is not None]
        if not counts:
            return None
        total += max(counts) * _itemsize(graph, name)
    return total


def computed(node: Node) -> bool:
    """Whether folding ``node`` computes a value the model's bytes do not hold already (a
    Constant's value is on the wire, unless it is sparse)."""
    return node.op_type != "Constant" or "sparse_value" in node.attrs


def check_load_constants(graph: Graph, device: str, limit: int = FOLD_LIMIT_BYTES) -> None:
    """Refuse a model in which a value computable at load time (every input a constant, or
    computed from constants) would exceed ``limit`` bytes, or all of them together the read's
    allowance (``plugins/reading.py``: many nodes each just under ``limit``): backends that
    fold constants themselves would allocate them while compiling. Linear in the graph;
    allocates nothing."""
    known: dict[str, np.ndarray | None] = dict(graph.initializers)
    allowance = reading.allowance(sum(a.nbytes for a in graph.initializers.values()))
    for node in graph.nodes:
        if node.op_type in NONDETERMINISTIC or subgraph_free_names(node):
            continue
        if any(n and n not in known for n in node.inputs):
            continue
        size = output_bytes(node, graph, [known.get(n) if n else None for n in node.inputs])
        if size is not None and size > limit:
            raise InvalidModel(
                f"model {graph.name!r}: node {node.name!r} ({node.op_type}) makes a constant of "
                f"{size:,} bytes while the model is compiled, over {device}'s limit of "
                f"{limit:,} bytes for values computed at load time"
            )
        if size is not None and computed(node):
            allowance.take(size, f"model {graph.name!r}: node {node.name!r} ({node.op_type})")
        value = node.attr("value") if node.op_type == "Constant" else None
        for name in node.outputs:
            if name:  # known at load time; the value itself only for a Constant
                known[name] = value if isinstance(value, np.ndarray) else None
