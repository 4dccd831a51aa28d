"""Dead-node elimination: nodes whose outputs nobody reads are dropped, as are unused constants."""

from __future__ import annotations

from plugserve.plugins.ir import Graph, subgraph_free_names
from plugserve.plugins.passes.manager import PassContext

__all__ = ["eliminate_dead_nodes"]


def eliminate_dead_nodes(graph: Graph, context: PassContext) -> bool:
    needed = graph.output_names()
    kept = []
    removed = False
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs if o):
            kept.append(node)
            needed.update(n for n in node.inputs if n)
            needed.update(subgraph_free_names(node))
        else:
            graph.absorbed.extend(node.fused_names)
            removed = True
    kept.reverse()
    graph.nodes = kept
    inputs = {i.name for i in graph.inputs}
    for name in [n for n in graph.initializers if n not in needed and n not in inputs]:
        del graph.initializers[name]
        removed = True
    return removed
