"""Output types for custom ops: an extension's type rule fills what ONNX inference cannot."""

from __future__ import annotations

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph
from plugserve.plugins.passes.manager import PassContext

__all__ = ["infer_extension_types"]


def infer_extension_types(graph: Graph, context: PassContext) -> bool:
    if not context.type_rules:
        return False
    changed = False
    for node in graph.nodes:
        rule = context.type_rules.get((node.domain, node.op_type))
        if rule is None:
            continue
        specs = [graph.spec(n) if n else None for n in node.inputs]
        results = rule(*[(s.dtype, s.shape) if s is not None else (None, None) for s in specs])
        if isinstance(results, tuple) and len(results) == 2 and not isinstance(results[0], tuple):
            results = [results]
        for name, (dtype, shape) in zip(node.outputs, results):
            old = graph.spec(name)
            if name and (old is None or old.dtype is None):
                graph.value_info[name] = TensorSpec(
                    name, dtype, None if shape is None else tuple(shape)
                )
                changed = True
    if changed:
        graph.refresh_types()
    return changed
