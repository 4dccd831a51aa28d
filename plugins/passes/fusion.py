"""Fusions: Conv+BatchNormalization folding, activation fusion, and the seed's Relu-Relu.

Each fusion needs the producer's output to be read by exactly one node and not to be a graph
output, so no other reader sees a changed value. The fused node carries the original names of
everything it replaced.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import AttributeProto

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, Node
from plugserve.plugins.passes.manager import PassContext

__all__ = [
    "FUSED_DOMAIN",
    "fold_conv_batchnorm",
    "fuse_activations",
    "fuse_conv_pool",
    "fuse_gelu",
    "fuse_relu_relu",
    "merge_names",
    "sole_readers",
]

FUSED_DOMAIN = "ai.plugserve"

#: Activations a Conv/Gemm/MatMul kernel can apply in place, and the attributes they carry.
ACTIVATIONS = {
    "Relu": (),
    "LeakyRelu": (("alpha", 0.01),),
    "Sigmoid": (),
    "Tanh": (),
    "HardSigmoid": (("alpha", 0.2), ("beta", 0.5)),
}


def sole_readers(graph: Graph) -> dict[str, Node]:
    """``{value: the one node reading it}`` for every value with exactly one reader that is
    not a graph output: what a fusion may swallow. Built once per pass, in one scan, so asking
    about every node of the graph stays linear."""
    outputs = graph.output_names()
    return {
        name: readers[0]
        for name, readers in graph.consumers().items()
        if len(readers) == 1 and name not in outputs
    }


def merge_names(into: Node, *removed: Node) -> None:
    """The removed nodes' original names join ``into``'s, once each (one set, not a scan per
    name: a node absorbing a long chain stays linear)."""
    seen = set(into.fused_names)
    for node in removed:
        for name in node.fused_names:
            if name not in seen:
                seen.add(name)
                into.fused_names.append(name)


def fold_conv_batchnorm(graph: Graph, context: PassContext) -> bool:
    sole = sole_readers(graph)
    dropped: set[int] = set()
    for conv in graph.nodes:
        if conv.op_type != "Conv" or conv.domain or len(conv.outputs) != 1:
            continue
        bn = sole.get(conv.outputs[0])
        if bn is None or bn.op_type != "BatchNormalization" or len(bn.outputs) != 1:
            continue
        if bn.attr("training_mode", 0):
            continue
        params = [graph.initializers.get(n) for n in bn.inputs[1:5]]
        weight = graph.initializers.get(conv.inputs[1])
        bias = (
            graph.initializers.get(conv.inputs[2])
            if len(conv.inputs) > 2 and conv.inputs[2]
            else None
        )
        if weight is None or any(p is None for p in params) or weight.dtype.kind != "f":
            continue
        if (len(conv.inputs) > 2 and conv.inputs[2]) and bias is None:
            continue
        scale, shift, mean, var = (np.asarray(p, dtype=np.float64) for p in params)
        factor = scale / np.sqrt(var + bn.attr("epsilon", 1e-5))
        new_w = (weight * factor.reshape((-1,) + (1,) * (weight.ndim - 1))).astype(weight.dtype)
        old_b = np.zeros(weight.shape[0]) if bias is None else bias.astype(np.float64)
        new_b = ((old_b - mean) * factor + shift).astype(weight.dtype)
        w_name = graph.unique_name(f"{conv.name}__folded_weight")
        graph.initializers[w_name] = new_w
        b_name = graph.unique_name(f"{conv.name}__folded_bias")
        graph.initializers[b_name] = new_b
        for name, value in ((w_name, new_w), (b_name, new_b)):
            graph.value_info[name] = TensorSpec(name, value.dtype, tuple(value.shape))
        conv.inputs = [conv.inputs[0], w_name, b_name]
        conv.outputs = list(bn.outputs)
        merge_names(conv, bn)
        dropped.add(id(bn))
    return _drop(graph, dropped)


def fuse_activations(graph: Graph, context: PassContext) -> bool:
    """Conv/Gemm/MatMul followed by an activation become one ``ai.plugserve`` Fused* node."""
    sole = sole_readers(graph)
    dropped: set[int] = set()
    for base in graph.nodes:
        if base.domain or base.op_type not in ("Conv", "Gemm", "MatMul") or len(base.outputs) != 1:
            continue
        act = sole.get(base.outputs[0])
        if act is None or act.domain or act.op_type not in ACTIVATIONS:
            continue
        spec = graph.spec(base.outputs[0])
        if spec is None or spec.dtype is None or spec.dtype.kind != "f":
            continue
        opset = graph.node_opset(base)
        base.metadata["opset"] = str(opset)
        base.metadata["base_op"] = base.op_type
        base.op_type = f"Fused{base.op_type}"
        base.domain = FUSED_DOMAIN
        base.set_attr("activation", act.op_type)
        params = [float(act.attr(name, default)) for name, default in ACTIVATIONS[act.op_type]]
        base.set_attr("activation_params", params, AttributeProto.FLOATS)
        base.outputs = list(act.outputs)
        merge_names(base, act)
        dropped.add(id(act))
    return _drop(graph, dropped, fused=True)


def fuse_conv_pool(graph: Graph, context: PassContext) -> bool:
    """Conv [-> Relu] -> MaxPool (a ResNet stem) becomes one ``FusedConvPool`` node.

    The kernel pools the conv's raw output and applies bias and Relu to the pooled map only
    (exact: both are monotone). Only float32 convs with constant weights and bias, and a
    MaxPool without the Indices output; the pool's attributes move over as ``pool_*``.
    """
    sole = sole_readers(graph)
    dropped: set[int] = set()
    for conv in graph.nodes:
        if len(conv.outputs) != 1:
            continue
        if not conv.domain and conv.op_type == "Conv":
            activation = None
        elif conv.domain == FUSED_DOMAIN and conv.op_type == "FusedConv":
            activation = conv.attr("activation")
            if activation != "Relu":
                continue
        else:
            continue
        pool = sole.get(conv.outputs[0])
        if pool is None or pool.op_type != "MaxPool" or pool.domain:
            continue
        if len(pool.outputs) > 1 and any(pool.outputs[1:]):
            continue
        spec = graph.spec(conv.outputs[0])
        if spec is None or spec.dtype != np.float32 or len(conv.inputs) < 2:
            continue
        if any(name and name not in graph.initializers for name in conv.inputs[1:3]):
            continue
        conv.metadata["opset"] = str(graph.node_opset(conv))
        conv.metadata["base_op"] = "Conv"
        conv.op_type = "FusedConvPool"
        conv.domain = FUSED_DOMAIN
        if activation is None:
            conv.attrs.pop("activation_params", None)
        for name in pool.attrs:
            conv.set_attr(f"pool_{name}", pool.attr(name))
        conv.outputs = [pool.outputs[0]]
        merge_names(conv, pool)
        dropped.add(id(pool))
    return _drop(graph, dropped, fused=True)


def fuse_relu_relu(graph: Graph, context: PassContext) -> bool:
    """Relu(Relu(x)) is Relu(x): the second one goes, its names move to the first.

    One scan with one readers map: taking over the second Relu's outputs leaves the readers
    of every value as they were, so a whole chain collapses in time linear in its length.
    """
    sole = sole_readers(graph)
    dropped: set[int] = set()
    for first in graph.nodes:
        if first.op_type != "Relu" or first.domain or id(first) in dropped:
            continue
        chain: list[Node] = []
        while True:
            second = sole.get(first.outputs[0])
            if second is None or second.op_type != "Relu" or second.domain:
                break
            first.outputs = list(second.outputs)
            chain.append(second)
            dropped.add(id(second))
        if chain:
            merge_names(first, *chain)
    return _drop(graph, dropped)


def _scalar_input(graph: Graph, node: Node, value: float) -> str | None:
    """The other input of a binary ``node`` whose one constant input is the scalar ``value``."""
    if len(node.inputs) != 2 or node.domain:
        return None
    for i in (0, 1):
        const = graph.initializers.get(node.inputs[i])
        if (
            const is not None
            and const.size == 1
            and const.dtype.kind == "f"
            and math.isclose(float(const.reshape(())), value, rel_tol=1e-4)
        ):
            return node.inputs[1 - i]
    return None


def _gelu_input(graph: Graph, scaled: Node) -> str | None:
    """x when ``scaled`` computes x / sqrt(2) (as Div or as Mul by the reciprocal)."""
    if scaled.op_type == "Div" and not scaled.domain and len(scaled.inputs) == 2:
        const = graph.initializers.get(scaled.inputs[1])
        if (
            const is not None
            and const.size == 1
            and const.dtype.kind == "f"
            and math.isclose(float(const.reshape(())), math.sqrt(2), rel_tol=1e-4)
        ):
            return scaled.inputs[0]
        return None
    if scaled.op_type == "Mul":
        return _scalar_input(graph, scaled, 1 / math.sqrt(2))
    return None


def _match_gelu(
    graph: Graph, erf: Node, sole: dict[str, Node], producers: dict[str, Node]
) -> list[Node] | None:
    """The nodes of 0.5 x (1 + erf(x / sqrt 2)) around ``erf``, in graph order, or None.

    Accepted shapes (how PyTorch and hand-written exporters spell it):
    ``Mul(Mul(x, 1 + erf), 0.5)`` and ``Mul(Mul(x, 0.5), 1 + erf)``, operands in any order.
    """
    scaled = producers.get(erf.inputs[0]) if erf.inputs else None
    if scaled is None or sole.get(scaled.outputs[0]) is not erf:
        return None
    x = _gelu_input(graph, scaled)
    add = sole.get(erf.outputs[0])
    if x is None or add is None or add.op_type != "Add":
        return None
    if _scalar_input(graph, add, 1.0) != erf.outputs[0]:
        return None
    mul = sole.get(add.outputs[0])
    if mul is None or mul.op_type != "Mul" or mul.domain or len(mul.inputs) != 2:
        return None
    other = mul.inputs[1] if mul.inputs[0] == add.outputs[0] else mul.inputs[0]
    if other == x:  # Mul(x, 1 + erf) then Mul(., 0.5)
        last = sole.get(mul.outputs[0])
        if last is None or last.op_type != "Mul":
            return None
        if _scalar_input(graph, last, 0.5) != mul.outputs[0]:
            return None
        return [scaled, erf, add, mul, last]
    half = producers.get(other)  # Mul(Mul(x, 0.5), 1 + erf)
    if half is None or half.op_type != "Mul" or _scalar_input(graph, half, 0.5) != x:
        return None
    if sole.get(half.outputs[0]) is not mul:
        return None
    return [scaled, half, erf, add, mul]


def fuse_gelu(graph: Graph, context: PassContext) -> bool:
    """The erf GELU spelled as five ops becomes one ``ai.plugserve`` Gelu node.

    The fused kernel (ONNX Gelu's) works in place on one buffer: one allocation and fewer
    passes over memory instead of five fresh arrays. float inputs only; every intermediate
    must be read by the pattern alone.
    """
    sole = sole_readers(graph)
    producers = graph.producers()
    replaced: dict[int, Node] = {}
    for erf in graph.nodes:
        if erf.op_type != "Erf" or erf.domain or id(erf) in replaced:
            continue
        found = _match_gelu(graph, erf, sole, producers)
        if found is None or any(id(n) in replaced for n in found):
            continue
        x = _gelu_input(graph, found[0])
        spec, result = graph.spec(x), graph.spec(found[-1].outputs[0])
        if spec is None or spec.dtype is None or spec.dtype.kind != "f":
            continue
        # A size-1 constant of higher rank than x would broadcast the result to a larger rank.
        if result is None or spec.shape is None or result.shape != spec.shape:
            continue
        fused = Node(
            "Gelu",
            [x],
            list(found[-1].outputs),
            name=found[-1].name,
            domain=FUSED_DOMAIN,
            metadata={"base_op": "Gelu", "opset": "20"},
        )
        for node in found:
            merge_names(fused, node)
        for node in found:
            replaced[id(node)] = fused
    if not replaced:
        return False
    nodes: list[Node] = []
    for node in graph.nodes:
        sub = replaced.get(id(node))
        if sub is None:
            nodes.append(node)
        elif sub.outputs == node.outputs:  # the pattern's last node: the fused one goes here
            nodes.append(sub)
    graph.nodes = nodes
    graph.opsets.setdefault(FUSED_DOMAIN, 1)
    return True


def _drop(graph: Graph, dropped: set[int], fused: bool = False) -> bool:
    """Remove the nodes a pass absorbed (by id); whether the graph changed. ``fused``: the
    pass wrote nodes of plugserve's own domain, which the graph must then import."""
    if not dropped:
        return False
    graph.nodes = [n for n in graph.nodes if id(n) not in dropped]
    if fused:
        graph.opsets.setdefault(FUSED_DOMAIN, 1)
    return True
