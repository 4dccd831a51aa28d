"""Which nodes of a converted ONNX graph read a device value on the host when they run (or copy
a host value to the device from pageable memory), and so synchronise their stream: a CUDA
graph cannot capture them (the capture is invalidated, and before torch 2.13 a failed capture
leaves the allocator damaged: :mod:`.capture`). A network with one is marked eager when its
lane starts (counted ``failed`` once), so no doomed capture runs (review finding 11).

The registry mirrors the converters' steps (:mod:`.ops`): a node is listed when its step calls
``ints``/``.tolist()``/``.item()`` on an input, makes a tensor from host values
(``torch.tensor``, ``new_tensor``), or has a data-dependent output shape (NonZero, Unique).
Today every value a step sees is on the device, load-time constants too (the program's
template holds initializers there), so an input read on the host syncs whether or not it is
known at load: a Reshape to a constant shape syncs. When shape values move to the host (review
finding 17), the input-indexed entries narrow to inputs not known at load.
tests/plugins/torch/test_torch_capture.py checks the registry against the converters' source.
"""

from __future__ import annotations

from collections.abc import Callable

from plugserve.plugins.ir import Graph, Node

__all__ = ["HOST_READS", "host_reads"]


def _always(node: Node) -> bool:
    return True


def _inputs(*indices: int) -> Callable[[Node], bool]:
    """The step reads these inputs on the host, when the node has them."""

    def reads(node: Node) -> bool:
        return any(i < len(node.inputs) and bool(node.inputs[i]) for i in indices)

    return reads


def _scatter_nd(node: Node) -> bool:  # mul, max and min walk the indices on the host
    return node.attr("reduction", "none") in ("mul", "max", "min")


_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
           "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")  # fmt: skip

#: op -> whether a node of it reads on the host (its converter's step, see the docstring)
HOST_READS: dict[str, Callable[[Node], bool]] = {
    # data-dependent output shapes, or values made from the host
    "NonZero": _always,
    "Compress": _always,
    "Unique": _always,
    "NonMaxSuppression": _always,
    "DynamicQuantizeLinear": _always,  # float(scale)
    "Shape": _always,  # torch.tensor(dims, device=...)
    "Size": _always,
    "GatherND": _always,  # new_tensor(shape): negative indices
    "Attention": _always,  # its scale's root copied to the device
    "Range": _always,
    "ConstantOfShape": _always,
    "OneHot": _always,
    "HannWindow": _always,
    "HammingWindow": _always,
    "BlackmanWindow": _always,
    "Resize": _always,  # its scales or sizes
    "ScatterND": _scatter_nd,
    # shapes, axes, counts and pads taken from an input
    "Reshape": _inputs(1),
    "Expand": _inputs(1),
    "Tile": _inputs(1),
    "Split": _inputs(1),
    "Slice": _inputs(1, 2, 3, 4),
    "Squeeze": _inputs(1),
    "Unsqueeze": _inputs(1),
    "Pad": _inputs(1, 2, 3),
    "TopK": _inputs(1),
    "CumSum": _inputs(1),
    "CumProd": _inputs(1),
    "Trilu": _inputs(1),
    "CenterCropPad": _inputs(1),
    "Col2Im": _inputs(1, 2),
    "AffineGrid": _inputs(1),
    "MaxUnpool": _inputs(2),
    "DFT": _inputs(1, 2),
    **{op: _inputs(1) for op in _REDUCE},
}


def host_reads(graph: Graph) -> list[str]:
    """The graph's nodes that read on the host (``name (op)``), in order; empty: capturable
    as far as its ops go."""
    found = []
    for node in graph.nodes:
        reads = HOST_READS.get(node.op_type)
        if reads is not None and reads(node):
            found.append(f"{node.name or '?'} ({node.op_type})")
    return found
