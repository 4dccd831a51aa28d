"""The pass manager: the seed's TransformNetwork as an ordered list of small passes.

A pass is a function ``(graph, context) -> bool`` that rewrites a :class:`Graph` in place and
says whether it changed anything. Passes never drop an original node name: a node built from
others carries all their ``fused_names``, and a node removed without a successor (folded into a
constant, or dead) has its names kept in ``graph.absorbed`` so QueryNetwork can still map every
original node.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from plugserve.plugins import cancel
from plugserve.plugins.ir import Graph, Node
from plugserve.plugins.passes.sizes import FOLD_LIMIT_BYTES
from plugserve.plugins.reading import Allowance

__all__ = ["Pass", "PassContext", "PassManager"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PassContext:
    """What passes may ask of the device they transform for."""

    #: Whether the device has a kernel for this node (function inlining keeps such nodes).
    supports: Callable[[Node, Graph], bool]
    #: Run one node on constant inputs (constant folding); raises when it cannot.
    evaluate: Callable[[Node, Graph, list[Any]], list[Any]] | None = None
    #: Output (dtype, shape) rules for custom ops: {(domain, op_type): rule}.
    type_rules: dict[tuple[str, str], Callable[..., Any]] = dataclasses.field(default_factory=dict)
    #: Convert float16 computation to float32 (INFERENCE_PRECISION_HINT=f32).
    f16_to_f32: bool = True
    #: Largest constant (bytes) folding may create.
    fold_limit_bytes: int = FOLD_LIMIT_BYTES
    #: What folding may create in all, over every folding pass of one run of the pipeline
    #: (``plugins/reading.py``; made by the first folding pass from the graph's weights).
    allowance: Allowance | None = None


Pass = Callable[[Graph, PassContext], bool]


class PassManager:
    def __init__(self, passes: Sequence[tuple[str, Pass]]) -> None:
        self.passes = list(passes)

    def run(self, graph: Graph, context: PassContext) -> Graph:
        """Apply every pass in order to a copy of ``graph`` (the input is left untouched)."""
        graph = graph.copy()
        for name, apply in self.passes:
            cancel.check(f"graph {graph.name!r}: transforming it")
            if apply(graph, context):
                log.debug("pass %s changed graph %s (%d nodes)", name, graph.name, len(graph.nodes))
        return graph
