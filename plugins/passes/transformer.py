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
output. The kernels are in :mod:`plugserve.plugins.numpy.transformer`.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, Node
from plugserve.plugins.passes.fusion import FUSED_DOMAIN, _merge, _sole_reader
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


def _replace(graph: Graph, fused: Node, removed: list[Node], at: Node) -> None:
    """Put ``fused`` where ``at`` was and drop ``removed`` (``at`` among them or not)."""
    gone = {id(n) for n in removed}
    nodes: list[Node] = []
    for node in graph.nodes:
        if node is at:
            nodes.append(fused)
        if id(node) not in gone and node is not at:
            nodes.append(node)
    graph.nodes = nodes
    graph.opsets.setdefault(FUSED_DOMAIN, 1)


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


def _linear_site(graph: Graph, users) -> tuple[Node, Node, str] | None:
    for mm in graph.nodes:
        if mm.op_type != "MatMul" or mm.domain or len(mm.inputs) != 2:
            continue
        w = graph.initializers.get(mm.inputs[1])
        if w is None or w.ndim != 2 or w.dtype != _F32 or mm.inputs[0] in graph.initializers:
            continue
        if not _is_f32(graph, mm.inputs[0]) or len(graph.spec(mm.inputs[0]).shape) < 2:
            continue
        add = _sole_reader(graph, mm.outputs[0], users)
        bias = None if add is None else _bias_of(graph, add, mm.outputs[0], w.shape[1])
        if bias is not None:
            return mm, add, bias
    return None


def fuse_linear(graph: Graph, context: PassContext) -> bool:
    changed = False
    while True:
        users = graph.consumers()
        site = _linear_site(graph, users)
        if site is None:
            break
        mm, add, bias = site
        fused = Node(
            "Linear",
            [mm.inputs[0], mm.inputs[1], bias],
            list(add.outputs),
            name=add.name,
            domain=FUSED_DOMAIN,
        )
        fused.set_attr("epilogue", "none")
        for node in (mm, add):
            _merge(fused, node)
        _replace(graph, fused, [mm, add], add)
        changed = True
    for node in list(graph.nodes):
        if node.op_type == "Linear" and node.domain == FUSED_DOMAIN:
            _grow_linear(graph, node)
    return changed


def _grow_linear(graph: Graph, linear: Node) -> None:
    """Swallow a residual Add, then an epilogue, into ``linear`` while the patterns hold."""
    users = graph.consumers()
    out = linear.outputs[0]
    nxt = _sole_reader(graph, out, users)
    if (
        nxt is not None
        and nxt.op_type == "Add"
        and not nxt.domain
        and len(nxt.inputs) == 2
        and nxt.inputs[0] != nxt.inputs[1]
    ):
        other = nxt.inputs[1] if nxt.inputs[0] == out else nxt.inputs[0]
        spec, mine = graph.spec(other), graph.spec(out)
        if _is_f32(graph, other) and mine is not None and spec.shape == mine.shape:
            linear.inputs.append(other)
            linear.outputs = list(nxt.outputs)
            _merge(linear, nxt)
            _replace(graph, linear, [nxt], linear)
            users = graph.consumers()
            out = linear.outputs[0]
            nxt = _sole_reader(graph, out, users)
    if nxt is None:
        return
    if nxt.op_type == "Gelu" and len(linear.inputs) == 3 and _exact_gelu(nxt):
        linear.set_attr("epilogue", "gelu")
    elif _plain_layer_norm(graph, nxt, out, graph.initializers[linear.inputs[1]].shape[1]):
        while len(linear.inputs) < 4:
            linear.inputs.append("")
        linear.inputs.extend(nxt.inputs[1:3])
        linear.set_attr("epilogue", "layernorm")
        linear.set_attr("epsilon", float(nxt.attr("epsilon", 1e-5)), AttributeProto.FLOAT)
    else:
        return
    linear.outputs = [nxt.outputs[0]]
    _merge(linear, nxt)
    _replace(graph, linear, [nxt], linear)


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


def _attention_site(graph: Graph, users):
    for mm in graph.nodes:
        if mm.op_type != "MatMul" or mm.domain or len(mm.inputs) != 2:
            continue
        if not all(_is_f32(graph, n) for n in mm.inputs + mm.outputs):
            continue
        if len(graph.spec(mm.outputs[0]).shape) < 2:
            continue
        chain = [mm]
        scale = 1.0
        nxt = _sole_reader(graph, mm.outputs[0], users)
        c = None if nxt is None else _scalar(graph, nxt, mm.outputs[0])
        if c is not None:
            scale = c
            chain.append(nxt)
            nxt = _sole_reader(graph, nxt.outputs[0], users)
        if nxt is None or not _softmax_last(graph, nxt, chain[-1].outputs[0]):
            continue
        chain.append(nxt)
        mm2 = _sole_reader(graph, nxt.outputs[0], users)
        if mm2 is None or mm2.op_type != "MatMul" or mm2.domain or mm2.inputs[0] != nxt.outputs[0]:
            continue
        if mm2.inputs[1] == nxt.outputs[0] or not _is_f32(graph, mm2.inputs[1]):
            continue
        chain.append(mm2)
        tail = _sole_reader(graph, mm2.outputs[0], users)
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
    return None


def _fold_scale_into_producer(graph: Graph, q: str, scale: float, users) -> bool:
    """Scale the weights of the plain Linear that Q is a view chain of, if nothing else reads
    any value on the way (so no other reader sees the scaled values)."""
    producers = graph.producers()
    name = q
    while True:
        node = producers.get(name)
        if node is None or _sole_reader(graph, name, users) is None:
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
    changed = False
    while True:
        users = graph.consumers()
        site = _attention_site(graph, users)
        if site is None:
            return changed
        chain, scale, transposed = site
        q, k = chain[0].inputs
        v = chain[-2].inputs[1] if transposed else chain[-1].inputs[1]
        if scale != 1 and _fold_scale_into_producer(graph, q, scale, users):
            scale = 1.0
        fused = Node(
            "Attention",
            [q, k, v],
            list(chain[-1].outputs),
            name=chain[-1].name,
            domain=FUSED_DOMAIN,
        )
        fused.set_attr("scale", scale, AttributeProto.FLOAT)
        fused.set_attr("transpose_output", int(transposed))
        for node in chain:
            _merge(fused, node)
        _replace(graph, fused, chain, chain[-1])
        changed = True


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
    changed = False
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
            _merge(fused, node)
        _replace(graph, fused, members, members[0])
        changed = True
    return changed
