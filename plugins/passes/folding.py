"""Constant folding and shape-subgraph folding.

A node whose inputs are all known at load time is computed once, here, by the device's own
kernels (``context.evaluate``), and replaced by an initializer. ``Shape`` and ``Size`` of a value
whose shape is fully static become constants first, so the arithmetic that models do on shapes
(Gather, Concat, Unsqueeze on shape vectors) folds away too. Random ops are never folded.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins import reading
from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, Node, subgraph_free_names
from plugserve.plugins.passes.manager import PassContext
from plugserve.plugins.passes.sizes import NONDETERMINISTIC, computed, output_bytes

__all__ = ["fold_constants", "fold_shapes"]


def _static_shape(graph: Graph, name: str) -> tuple[int, ...] | None:
    spec = graph.spec(name)
    if name in graph.initializers:
        return tuple(graph.initializers[name].shape)
    if spec is None or spec.shape is None:
        return None
    if all(isinstance(d, int) and d >= 0 for d in spec.shape):
        return tuple(int(d) for d in spec.shape)
    return None


def fold_shapes(graph: Graph, context: PassContext) -> bool:
    changed = False
    users = graph.consumers()
    kept: list[Node] = []
    for node in graph.nodes:
        if node.domain == "" and node.op_type in ("Shape", "Size") and len(node.outputs) == 1:
            shape = _static_shape(graph, node.inputs[0])
            if shape is not None:
                if node.op_type == "Size":
                    value = np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
                else:
                    start, end = node.attr("start", 0), node.attr("end", None)
                    value = np.array(shape[slice(start, end)], dtype=np.int64)
                _replace_with_constant(graph, node, [value], users)
                changed = True
                continue
        kept.append(node)
    graph.nodes = kept
    return changed


def fold_constants(graph: Graph, context: PassContext) -> bool:
    """Each value at most ``context.fold_limit_bytes``, all of them within the read's
    allowance (``plugins/reading.py``): a model of many nodes each folding 60 MiB would
    otherwise hold gigabytes after a QueryNetwork any client may send. Over either, the node
    is left to run time, where a request's room bounds it."""
    if context.evaluate is None:
        return False
    if context.allowance is None:
        weights = sum(a.nbytes for a in graph.initializers.values())
        context.allowance = reading.allowance(weights)
    allowance = context.allowance
    changed = False
    users = graph.consumers()
    kept: list[Node] = []
    for node in graph.nodes:
        if _foldable(node, graph):
            inputs = [graph.initializers[n] if n else None for n in node.inputs]
            size = output_bytes(node, graph, inputs)
            counted = computed(node)
            if (
                size is None
                or size > context.fold_limit_bytes
                or (counted and not allowance.fits(size))
            ):
                kept.append(node)  # too large (or not knowable) before running it: run time
                continue
            try:
                outputs = context.evaluate(node, graph, inputs)
            except Exception:  # the kernel refuses these values: leave it to run time
                outputs = None
            if outputs is not None and _acceptable(outputs, node, context):
                if counted:
                    allowance.add(sum(np.asarray(v).nbytes for v in outputs[: len(node.outputs)]))
                _replace_with_constant(graph, node, outputs, users)
                changed = True
                continue
        kept.append(node)
    graph.nodes = kept
    return changed


def _foldable(node: Node, graph: Graph) -> bool:
    if node.op_type in NONDETERMINISTIC or subgraph_free_names(node):
        return False
    if any(n and n not in graph.initializers for n in node.inputs):
        return False
    return all(o for o in node.outputs) and bool(node.outputs)


def _acceptable(outputs: list, node: Node, context: PassContext) -> bool:
    if len(outputs) < len(node.outputs):
        return False
    total = 0
    for value in outputs[: len(node.outputs)]:
        if not isinstance(value, np.ndarray | np.generic):
            return False  # sequences and optionals stay nodes
        total += np.asarray(value).nbytes
    return total <= context.fold_limit_bytes


def _replace_with_constant(
    graph: Graph, node: Node, outputs: list, users: dict[str, list[Node]]
) -> None:
    """``users``: the readers map from the start of the pass (still right: folding a node does
    not change who reads its outputs; an heir folded later hands the names on in turn)."""
    for name, value in zip(node.outputs, outputs):
        array = np.asarray(value)
        graph.initializers[name] = array
        graph.value_info[name] = TensorSpec(name, array.dtype, tuple(array.shape))
    heir = next((users[o][0] for o in node.outputs if users.get(o)), None)
    if heir is not None:
        heir.fused_names.extend(n for n in node.fused_names if n not in heir.fused_names)
    else:
        graph.absorbed.extend(node.fused_names)
