"""Transformer fusions: dense layers into ``Linear``, attention into ``Attention``.

* ``fuse_linear``: ``MatMul(X, W) + B`` with constant float32 ``W`` (2-D) and ``B`` (the
  output width, broadcast along rows) becomes one ``ai.plugserve`` ``Linear``; then, each when
  the Linear's output has that one reader, a residual ``Add`` of a same-shaped tensor, and an
  epilogue: the (fused) erf ``Gelu`` or a ``LayerNormalization`` over the last axis with
  constant scale and bias.
* ``fuse_attention``: ``MatMul(Q, K) [* c] -> Softmax(last axis) -> MatMul(., V)`` [->
  ``Transpose(0, 2, 1, 3)``] becomes one ``Attention``. When Q is a view chain (Reshape,
  Transpose) of a plain Linear read by nothing else, ``c`` is folded into that Linear's
  weights and bias.
* ``merge_linears``: plain Linears reading the same input (Q/K/V projections) become one
  Linear of the concatenated weights with one output per original (column views).

Every intermediate a fusion swallows must be read by the pattern alone and not be a graph
output. The kernels are in :mod:`plugserve.plugins.numpy.kernels.attention`.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, Node
from plugserve.plugins.passes.fusion import FUSED_DOMAIN, merge_names, sole_readers
from plugserve.plugins.passes.manager import PassContext

__all__ = ["fuse_attention", "fuse_linear", "fuse_transformer", "merge_linears"]

_F32 = np.dtype(np.float32)


def fuse_transformer(graph: Graph, context: PassContext) -> bool:
    """The three fusions in the order they build on each other."""
    changed = fuse_linear(graph, context)
    changed |= fuse_attention(graph, context)
    changed |= merge_linears(graph, context)
    return changed


def _is_f32(graph: Graph, name: str) -> bool:
    spec = graph.spec(name)
    return spec is not None and spec.dtype == _F32 and spec.shape is not None


def _add_constant(graph: Graph, base: str, value: np.ndarray) -> str:
    name = graph.unique_name(base)
    graph.initializers[name] = value
    graph.value_info[name] = TensorSpec(name, value.dtype, tuple(value.shape))
    return name


class _Rewrite:
    """Fusions found in one scan of the graph, applied together: each fused node takes the
    place of the last node it swallows (all its inputs exist there), the others go."""

    def __init__(self) -> None:
        self.claimed: set[int] = set()
        self.at: dict[int, Node] = {}

    def free(self, nodes: list[Node]) -> bool:
        return not any(id(n) in self.claimed for n in nodes)

    def add(self, fused: Node, swallowed: list[Node], at: Node) -> None:
        self.claimed.update(id(n) for n in swallowed)
        self.at[id(at)] = fused

    def apply(self, graph: Graph) -> bool:
        if not self.at:
            return False
        nodes = []
        for node in graph.nodes:
            if id(node) in self.at:
                nodes.append(self.at[id(node)])
            elif id(node) not in self.claimed:
                nodes.append(node)
        graph.nodes = nodes
        graph.opsets.setdefault(FUSED_DOMAIN, 1)
        return True


def _bias_of(graph: Graph, add: Node, product: str, width: int) -> str | None:
    """The constant operand of ``add`` when it is a bias over the last axis of ``product``."""
    if add.op_type != "Add" or add.domain or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] == product else add.inputs[0]
    value = graph.initializers.get(other)
    out = graph.spec(product)
    if value is None or value.dtype != _F32 or other == product or out is None:
        return None
    if value.size != width or value.shape[-1:] != (width,) or value.ndim > len(out.shape):
        return None
    return other


def _linear_site(graph: Graph, mm: Node, sole: dict[str, Node]) -> tuple[Node, str] | None:
    if mm.op_type != "MatMul" or mm.domain or len(mm.inputs) != 2:
        return None
    w = graph.initializers.get(mm.inputs[1])
    if w is None or w.ndim != 2 or w.dtype != _F32 or mm.inputs[0] in graph.initializers:
        return None
    if not _is_f32(graph, mm.inputs[0]) or len(graph.spec(mm.inputs[0]).shape) < 2:
        return None
    add = sole.get(mm.outputs[0])
    bias = None if add is None else _bias_of(graph, add, mm.outputs[0], w.shape[1])
    return None if bias is None else (add, bias)


def fuse_linear(graph: Graph, context: PassContext) -> bool:
    sole = sole_readers(graph)
    rewrite = _Rewrite()
    for mm in graph.nodes:
        site = _linear_site(graph, mm, sole)
        if site is None:
            continue
        add, bias = site
        fused = Node("Linear", [mm.inputs[0], mm.inputs[1], bias], list(add.outputs), name=add.name)
        fused.domain = FUSED_DOMAIN
        fused.set_attr("epilogue", "none")
        for node in (mm, add):
            merge_names(fused, node)
        rewrite.add(fused, [mm, add], add)
    changed = rewrite.apply(graph)
    return _grow_linears(graph) or changed


def _grow_linears(graph: Graph) -> bool:
    """Each Linear swallows a residual Add, then an epilogue, where the patterns hold."""
    sole = sole_readers(graph)
    rewrite = _Rewrite()
    for linear in graph.nodes:
        if (
            linear.op_type != "Linear"
            or linear.domain != FUSED_DOMAIN
            or id(linear) in rewrite.claimed
        ):
            continue
        swallowed: list[Node] = []
        out = linear.outputs[0]
        nxt = sole.get(out)
        residual = None
        if nxt is not None and rewrite.free([nxt]):
            residual = _residual_of(graph, nxt, out)
        if residual is not None:
            swallowed.append(nxt)
            out = nxt.outputs[0]
            nxt = sole.get(out)
        epilogue = None
        if nxt is not None and rewrite.free([nxt]):
            width = graph.initializers[linear.inputs[1]].shape[1]
            if nxt.op_type == "Gelu" and residual is None and _exact_gelu(nxt):
                epilogue = "gelu"
            elif _plain_layer_norm(graph, nxt, out, width):
                epilogue = "layernorm"
        if epilogue is not None:
            swallowed.append(nxt)
        if not swallowed:
            continue
        inputs = list(linear.inputs) + ([residual] if residual is not None else [])
        if epilogue == "gelu":
            linear.set_attr("epilogue", "gelu")
        elif epilogue == "layernorm":
            inputs += [""] * (4 - len(inputs)) + list(nxt.inputs[1:3])
            linear.set_attr("epilogue", "layernorm")
            linear.set_attr("epsilon", float(nxt.attr("epsilon", 1e-5)), AttributeProto.FLOAT)
        linear.inputs = inputs
        linear.outputs = [swallowed[-1].outputs[0]]
        for node in swallowed:
            merge_names(linear, node)
        rewrite.add(linear, [linear, *swallowed], swallowed[-1])
    return rewrite.apply(graph)


def _residual_of(graph: Graph, add: Node, out: str) -> str | None:
    """The other operand of ``add`` when it is a same-shaped float32 residual of ``out``."""
    if add.op_type != "Add" or add.domain or len(add.inputs) != 2 or add.inputs[0] == add.inputs[1]:
        return None
    other = add.inputs[1] if add.inputs[0] == out else add.inputs[0]
    spec, mine = graph.spec(other), graph.spec(out)
    if not _is_f32(graph, other) or mine is None or spec.shape != mine.shape:
        return None
    return other


def _exact_gelu(node: Node) -> bool:
    if node.domain == FUSED_DOMAIN:
        return True
    return not node.domain and node.attr("approximate", "none") in ("none", b"none")


def _plain_layer_norm(graph: Graph, node: Node, x: str, width: int) -> bool:
    if node.op_type != "LayerNormalization" or node.domain or node.inputs[0] != x:
        return False
    rank = len(graph.spec(x).shape)
    if node.attr("axis", -1) not in (-1, rank - 1) or node.attr("stash_type", 1) != 1:
        return False
    if any(o for o in node.outputs[1:]):
        return False
    for name in node.inputs[1:3]:
        value = graph.initializers.get(name) if name else None
        if name and (value is None or value.dtype != _F32 or value.size != width):
            return False
    return len(node.inputs) >= 2 and bool(node.inputs[1])


# --------------------------------------------------------------------------- attention


def _scalar(graph: Graph, node: Node, x: str) -> float | None:
    """c when ``node`` is x * c or x / c for a float scalar constant c."""
    if node.domain or len(node.inputs) != 2 or node.op_type not in ("Mul", "Div"):
        return None
    if node.op_type == "Div" and node.inputs[0] != x:
        return None
    other = node.inputs[1] if node.inputs[0] == x else node.inputs[0]
    value = graph.initializers.get(other)
    if value is None or value.size != 1 or value.dtype != _F32 or other == x:
        return None
    c = float(value.reshape(()))
    if node.op_type == "Div":
        return 1 / c if c != 0 else None
    return c


def _softmax_last(graph: Graph, node: Node, x: str) -> bool:
    if node.op_type != "Softmax" or node.domain or node.inputs[0] != x:
        return False
    rank = len(graph.spec(x).shape)
    default = -1 if graph.node_opset(node) >= 13 else 1
    return node.attr("axis", default) in (-1, rank - 1)


def _attention_site(graph: Graph, mm: Node, sole: dict[str, Node]):
    """(swallowed nodes, scale, transposed output) of the attention starting at ``mm``."""
    if mm.op_type != "MatMul" or mm.domain or len(mm.inputs) != 2:
        return None
    if not all(_is_f32(graph, n) for n in mm.inputs + mm.outputs):
        return None
    if len(graph.spec(mm.outputs[0]).shape) < 2:
        return None
    chain = [mm]
    scale = 1.0
    nxt = sole.get(mm.outputs[0])
    c = None if nxt is None else _scalar(graph, nxt, mm.outputs[0])
    if c is not None:
        scale = c
        chain.append(nxt)
        nxt = sole.get(nxt.outputs[0])
    if nxt is None or not _softmax_last(graph, nxt, chain[-1].outputs[0]):
        return None
    chain.append(nxt)
    mm2 = sole.get(nxt.outputs[0])
    if mm2 is None or mm2.op_type != "MatMul" or mm2.domain or mm2.inputs[0] != nxt.outputs[0]:
        return None
    if mm2.inputs[1] == nxt.outputs[0] or not _is_f32(graph, mm2.inputs[1]):
        return None
    chain.append(mm2)
    tail = sole.get(mm2.outputs[0])
    transposed = (
        tail is not None
        and tail.op_type == "Transpose"
        and not tail.domain
        and len(graph.spec(mm2.outputs[0]).shape) == 4
        and list(tail.attr("perm", [])) == [0, 2, 1, 3]
    )
    if transposed:
        chain.append(tail)
    return chain, scale, transposed


def _fold_scale_into_producer(
    graph: Graph, q: str, scale: float, sole: dict[str, Node], producers: dict[str, Node]
) -> bool:
    """Scale the weights of the plain Linear that Q is a view chain of, if nothing else reads
    any value on the way (so no other reader sees the scaled values)."""
    name = q
    while True:
        node = producers.get(name)
        if node is None or sole.get(name) is None:
            return False
        if node.op_type in ("Reshape", "Transpose") and not node.domain:
            name = node.inputs[0]
            continue
        break
    if node.op_type != "Linear" or node.domain != FUSED_DOMAIN or len(node.inputs) != 3:
        return False
    if node.attr("epilogue", "none") != "none" or len(node.outputs) != 1:
        return False
    c = np.float32(scale)
    for i in (1, 2):
        value = graph.initializers[node.inputs[i]]
        node.inputs[i] = _add_constant(graph, f"{node.inputs[i]}__scaled", value * c)
    return True


def fuse_attention(graph: Graph, context: PassContext) -> bool:
    sole, producers = sole_readers(graph), graph.producers()
    rewrite = _Rewrite()
    for mm in graph.nodes:
        site = _attention_site(graph, mm, sole)
        if site is None or not rewrite.free(site[0]):
            continue
        chain, scale, transposed = site
        q, k = chain[0].inputs
        v = chain[-2].inputs[1] if transposed else chain[-1].inputs[1]
        if scale != 1 and _fold_scale_into_producer(graph, q, scale, sole, producers):
            scale = 1.0
        fused = Node("Attention", [q, k, v], list(chain[-1].outputs), name=chain[-1].name)
        fused.domain = FUSED_DOMAIN
        fused.set_attr("scale", scale, AttributeProto.FLOAT)
        fused.set_attr("transpose_output", int(transposed))
        for node in chain:
            merge_names(fused, node)
        rewrite.add(fused, chain, chain[-1])
    return rewrite.apply(graph)


# --------------------------------------------------------------------------- Q/K/V merge


def merge_linears(graph: Graph, context: PassContext) -> bool:
    groups: dict[str, list[Node]] = {}
    for node in graph.nodes:
        if (
            node.op_type == "Linear"
            and node.domain == FUSED_DOMAIN
            and len(node.inputs) == 3
            and len(node.outputs) == 1
            and node.attr("epilogue", "none") == "none"
        ):
            groups.setdefault(node.inputs[0], []).append(node)
    rewrite = _Rewrite()
    for members in groups.values():
        if len(members) < 2:
            continue
        weights = [graph.initializers[m.inputs[1]] for m in members]
        biases = [graph.initializers[m.inputs[2]].reshape(-1) for m in members]
        if len({w.shape[0] for w in weights}) != 1:
            continue
        w_name = _add_constant(graph, f"{members[0].name}__merged_w", np.concatenate(weights, 1))
        b_name = _add_constant(graph, f"{members[0].name}__merged_b", np.concatenate(biases))
        fused = Node(
            "Linear",
            [members[0].inputs[0], w_name, b_name],
            [m.outputs[0] for m in members],
            name=members[0].name,
            domain=FUSED_DOMAIN,
        )
        fused.set_attr("epilogue", "none")
        fused.set_attr("splits", [int(w.shape[1]) for w in weights])
        for node in members:
            merge_names(fused, node)
        rewrite.add(fused, members, members[0])
    return rewrite.apply(graph)
