"""Types for the values ONNX's shape inference leaves untyped, so that HETERO can cut there.

Every piece HETERO hands to a device is an ONNX model, and ONNX's checker (which every device
runs on what it loads) wants each graph input and output to carry an element type and a rank;
an unknown rank cannot be written in a valid model. ONNX's inference leaves some values
without one: outputs of ``ai.onnx.ml`` ops at several opsets (Scaler, Normalizer,
LinearRegressor, SVMClassifier's scores ...), outputs of Loop and Scan, typed but not
shaped, and strings from onnxruntime's contrib ops (com.microsoft Tokenizer). Each rule
here says what the op's specification says of its outputs: element type, rank, and the
dimensions it keeps from its inputs. That is what the op gives at run time; a dimension left
unknown is read from the arrays that cross.

A value still untyped after these rules (a custom op no device gives a type rule for, say)
makes the load fail naming it, its producer and what to do (see :func:`untyped_boundary`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import AttributeProto

from plugserve.plugins.api import TensorSpec, Unsupported
from plugserve.plugins.ir import Graph, Node, np_dtype, value_spec

__all__ = ["type_untyped_values", "untyped_boundary"]

Shape = tuple[int | str | None, ...]
#: dtype and shape of one output (None for a dimension it cannot tell), or None
Typed = tuple[np.dtype | None, Shape] | None
Rule = Callable[[Node, Graph], list[Typed]]

_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)
_STR = np.dtype(object)
_ML = "ai.onnx.ml"
_RULES: dict[tuple[str, str], Rule] = {}


def _rule(domain: str, *ops: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        for op in ops:
            _RULES[domain, op] = rule
        return rule

    return register


def _input(node: Node, graph: Graph, index: int = 0) -> TensorSpec | None:
    name = node.inputs[index] if len(node.inputs) > index else ""
    spec = graph.spec(name) if name else None
    return spec if spec is not None and spec.dtype is not None and spec.shape is not None else None


def _like_input(dtype: np.dtype | None) -> Rule:
    def rule(node: Node, graph: Graph) -> list[Typed]:
        x = _input(node, graph)
        return [None if x is None else (dtype or x.dtype, tuple(x.shape or ()))]

    return rule


_rule(_ML, "Scaler", "Normalizer")(_like_input(_F32))
_rule(_ML, "Binarizer", "Imputer")(_like_input(None))


@_rule(_ML, "ArrayFeatureExtractor")
def _array_feature_extractor(node: Node, graph: Graph) -> list[Typed]:
    """The selected last-axis entries: X's leading dims (a 1-d X counts as one row) and one
    column per index, however the indices are shaped (onnxruntime's behaviour)."""
    x, y = _input(node, graph), _input(node, graph, 1)
    if x is None:
        return [None]
    count: int | None = None
    if y is not None and all(isinstance(d, int) and d >= 0 for d in y.shape or ()):
        count = int(np.prod(y.shape or (), dtype=np.int64))
    leading = tuple(x.shape[:-1]) if len(x.shape or ()) > 1 else (1,)
    return [(x.dtype, (*leading, count))]


@_rule(_ML, "LinearRegressor", "SVMRegressor", "TreeEnsembleRegressor", "FeatureVectorizer")
def _scores(node: Node, graph: Graph) -> list[Typed]:
    return [(_F32, (_rows(node, graph), None))]


def _rows(node: Node, graph: Graph) -> int | str | None:
    x = _input(node, graph)
    return x.shape[0] if x is not None and x.shape else None


@_rule(_ML, "TreeEnsemble")
def _tree_ensemble(node: Node, graph: Graph) -> list[Typed]:
    x = _input(node, graph)
    return [(x.dtype if x is not None else None, (_rows(node, graph), None))]


@_rule(_ML, "LinearClassifier", "SVMClassifier", "TreeEnsembleClassifier")
def _classifier(node: Node, graph: Graph) -> list[Typed]:
    strings = "classlabels_strings" in node.attrs
    rows = _rows(node, graph)
    return [(_STR if strings else _I64, (rows,)), (_F32, (rows, None))]


@_rule(_ML, "OneHotEncoder")
def _one_hot(node: Node, graph: Graph) -> list[Typed]:
    x = _input(node, graph)
    return [None if x is None else (_F32, (*(x.shape or ()), None))]


@_rule(_ML, "LabelEncoder")
def _label_encoder(node: Node, graph: Graph) -> list[Typed]:
    x = _input(node, graph)
    if x is None:
        return [None]
    dtype = None
    for attr, kind in (("values_strings", _STR), ("values_int64s", _I64), ("values_floats", _F32)):
        if attr in node.attrs:
            dtype = kind
    tensor = node.attrs.get("values_tensor")
    if tensor is not None:
        dtype = np_dtype(tensor.t.data_type) if hasattr(tensor, "t") else np.asarray(tensor).dtype
    return [None if dtype is None else (dtype, tuple(x.shape or ()))]


@_rule(_ML, "CategoryMapper")
def _category_mapper(node: Node, graph: Graph) -> list[Typed]:
    x = _input(node, graph)
    if x is None:
        return [None]
    return [(_I64 if x.dtype == _STR else _STR, tuple(x.shape or ()))]


@_rule("com.microsoft", "Tokenizer")
def _tokenizer(node: Node, graph: Graph) -> list[Typed]:
    """onnxruntime's Tokenizer: strings, one more axis than its input (the tokens)."""
    x = _input(node, graph)
    return [None if x is None else (_STR, (*(x.shape or ()), None))]


def _body(node: Node, name: str) -> list[TensorSpec | None]:
    """The declared outputs of a subgraph attribute, as specs (None where untyped)."""
    attr = node.attrs.get(name)
    if attr is None or getattr(attr, "type", None) != AttributeProto.GRAPH:
        return []
    specs = [value_spec(vi) for vi in attr.g.output]
    return [s if s.dtype is not None and s.shape is not None else None for s in specs]


@_rule("", "If")
def _if(node: Node, graph: Graph) -> list[Typed]:
    then, other = _body(node, "then_branch"), _body(node, "else_branch")
    typed: list[Typed] = []
    for index in range(len(node.outputs)):
        known = [b[index] for b in (then, other) if index < len(b) and b[index] is not None]
        shapes = [tuple(s.shape or ()) for s in known]
        if not shapes or len({len(shape) for shape in shapes}) != 1:
            typed.append(None)  # the branches disagree on the rank, or say nothing
            continue
        dims = tuple(d if all(o[i] == d for o in shapes) else None for i, d in enumerate(shapes[0]))
        typed.append((known[0].dtype, dims))
    return typed


@_rule("", "Loop", "Scan")
def _loop(node: Node, graph: Graph) -> list[Typed]:
    """Loop-carried (and Scan state) outputs are typed as their initial values; scan outputs
    are the body's per-iteration output stacked on a new first axis."""
    body = _body(node, "body")
    first_state = 2 if node.op_type == "Loop" else 0
    if node.op_type == "Scan":
        states = len(node.inputs) - int(node.attrs["num_scan_inputs"].i)
        body_offset = 0
    else:
        states = len(node.inputs) - first_state
        body_offset = 1  # the body's first output is the loop condition
    typed: list[Typed] = []
    for index in range(len(node.outputs)):
        if index < states:
            x = _input(node, graph, first_state + index)
            typed.append(None if x is None else (x.dtype, tuple(x.shape or ())))
            continue
        position = body_offset + index
        inner = body[position] if position < len(body) else None
        typed.append(None if inner is None else (inner.dtype, (None, *(inner.shape or ()))))
    return typed


def _untyped(graph: Graph, name: str) -> bool:
    spec = graph.spec(name)
    return spec is None or spec.dtype is None or spec.shape is None


def type_untyped_values(graph: Graph) -> None:
    """Give each value ONNX left untyped the type its producer's rule says, then let ONNX's
    inference carry it on to the nodes downstream; repeat while that types more."""
    for _ in range(len(graph.nodes) + 1):
        changed = False
        for node in graph.nodes:
            rule = _RULES.get((node.domain, node.op_type))
            if rule is None or not any(o and _untyped(graph, o) for o in node.outputs):
                continue
            for name, typed in zip(node.outputs, rule(node, graph)):
                if name and typed is not None and typed[0] is not None and _untyped(graph, name):
                    graph.value_info[name] = TensorSpec(name, typed[0], typed[1])
                    changed = True
        if not changed:
            return
        graph.refresh_types()


def untyped_boundary(
    graph: Graph, name: str, source: str, target: str, readers: list[str]
) -> Unsupported:
    """The error for a value on a cut that no rule could type: what to pin where."""
    producer = graph.producers().get(name)
    made_by = f"{producer.op_type} node {producer.name!r}" if producer else "the graph"
    shown = ", ".join(repr(r) for r in readers)
    return Unsupported(
        f"model {graph.name!r}: HETERO cannot hand value {name!r} (made by {made_by} on "
        f"{source}) to node(s) {shown} on {target}: neither ONNX's shape inference nor the "
        f"devices can tell its element type and rank; pin node(s) {shown} to {source} "
        "with AFFINITY"
    )
