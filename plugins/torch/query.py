"""QueryNetwork for TORCH and GPU: exact per node. A node is claimed only when its converter
builds a step for it: its op and schema version are registered, every input and output has a
type this device holds, and the converter accepts its attributes and the inputs it needs known
at load (``ops/registry.py``). The reason of every refusal is kept for ``plugserve query``."""

from __future__ import annotations

import logging
from typing import Any

from plugserve.plugins.api import Unsupported
from plugserve.plugins.ir import Graph, keep_constants_with_readers
from plugserve.plugins.torch.program import Converting

__all__ = ["supported_nodes", "unsupported_nodes"]

log = logging.getLogger(__name__)


def unsupported_nodes(graph: Graph, torch: Any, device: Any, compute: Any) -> dict[str, str]:
    """``{node name: why}`` for every node the converters refuse."""
    converting = Converting(graph, torch, device, compute)
    refused: dict[str, str] = {}
    with torch.inference_mode():
        for node in graph.nodes:
            try:
                converting.convert(node)
            except Unsupported as exc:
                refused[node.name] = str(exc)
            except Exception as exc:  # a converter's own failure refuses, never breaks a query
                log.debug("converting %s failed", node.name, exc_info=True)
                refused[node.name] = f"{node.op_type}: {type(exc).__name__}: {exc}"
    return refused


def supported_nodes(graph: Graph, refused: dict[str, str]) -> set[str]:
    """The claimed names: every node not refused, a Constant going with its first reader (the
    seed's housekeeping, as NUMPY's)."""
    supported = {n.name for n in graph.nodes if n.name not in refused}
    keep_constants_with_readers(graph, supported)
    return supported
