"""The seed's Divide decomposition: ``x / c`` becomes ``x * (1 / c)`` for a constant ``c``.

Division is slower than multiplication, and with ``c`` known at load time the reciprocal is
computed once. Only floating-point division by a constant is rewritten: integer division
truncates, and a reciprocal of a run-time value would cost a second pass over memory.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, Node
from plugserve.plugins.passes.manager import PassContext

__all__ = ["decompose_divide"]


def decompose_divide(graph: Graph, context: PassContext) -> bool:
    changed = False
    nodes: list[Node] = []
    for node in graph.nodes:
        divisor = graph.initializers.get(node.inputs[1]) if len(node.inputs) == 2 else None
        if (
            node.op_type == "Div"
            and node.domain == ""
            and divisor is not None
            and divisor.dtype.kind == "f"
            and np.all(divisor != 0)
        ):
            name = graph.unique_name(f"{node.inputs[1]}__reciprocal")
            with np.errstate(all="ignore"):
                reciprocal = (1 / divisor).astype(divisor.dtype)
            if not np.all(np.isfinite(reciprocal)):
                nodes.append(node)
                continue
            graph.initializers[name] = reciprocal
            graph.value_info[name] = TensorSpec(name, divisor.dtype, tuple(divisor.shape))
            node.op_type = "Mul"
            node.inputs = [node.inputs[0], name]
            changed = True
        nodes.append(node)
    graph.nodes = nodes
    return changed
