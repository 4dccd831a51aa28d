"""Which nodes of a converted ONNX graph read a device value on the host when they run (or copy
a host value to the device from pageable memory), and so synchronise their stream: a CUDA
graph cannot capture them (the capture is invalidated, and before torch 2.13 a failed capture
leaves the allocator damaged: :mod:`.capture`). A network with one is marked eager when its
lane starts (counted ``failed`` once), so no doomed capture runs (review finding 11).

The registry mirrors the converters' steps (:mod:`.ops`). For each op that reads on the host it
says which inputs the step reads there (``ints``/``.tolist()``/``.item()``: a shape, axes,
counts, pads), and whether the step reads device values whatever its inputs are (NonZero,
Unique and NonMaxSuppression: their output shapes depend on the data; ScatterND's mul/max/min
walk the indices on the host).

Shape values live on the host (review finding 17, :mod:`.hostvalues`): the load-time constants
a step reads there, ``Shape``/``Size`` (whose steps make their tensors from the input's shape,
on the host, ``ON_HOST``) and the shape arithmetic over them are host tensors, so reading them
costs nothing. An input read on the host is a problem only when it is a device value:
computed from the data (a Reshape to a shape taken from a tensor's values), or a graph input.
So a Shape -> Gather -> Concat -> Reshape chain (every transformer the TorchScript exporter
writes) reads nothing of the device, and its network is captured.
tests/plugins/torch_device/test_torch_capture.py checks the registry against the converters' source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from plugserve.plugins.ir import Graph, Node

__all__ = ["HOST_READS", "ON_HOST", "Reads", "host_reads", "read_positions"]


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a node's step reads on the host: its inputs at ``inputs`` (when the node has them),
    and device values whatever its inputs when ``always`` says so for the node."""

    inputs: tuple[int, ...] = ()
    always: Callable[[Node], bool] | None = None


def _always(node: Node) -> bool:
    return True


def _scatter_nd(node: Node) -> bool:  # mul, max and min walk the indices on the host
    return node.attr("reduction", "none") in ("mul", "max", "min")


_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
           "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")  # fmt: skip

#: ops whose steps make a tensor from host values (``torch.tensor(x.shape)``) and which the
#: program therefore always runs on the host (:mod:`.hostvalues`): they read nothing there
ON_HOST = frozenset({"Shape", "Size"})

#: op -> what a node of it reads on the host (its converter's step, see the docstring)
HOST_READS: dict[str, Reads] = {
    # data-dependent output shapes, or device values read whatever the inputs
    "NonZero": Reads(always=_always),
    "Compress": Reads(always=_always),
    "Unique": Reads(always=_always),
    "NonMaxSuppression": Reads(always=_always),
    "ScatterND": Reads(always=_scatter_nd),
    # run on the host: torch.tensor(dims) of the input's shape, no read of its values
    **{op: Reads() for op in ON_HOST},
    # shapes, axes, counts, sizes and pads taken from an input
    "Range": Reads((0, 1, 2)),
    "ConstantOfShape": Reads((0,)),
    "OneHot": Reads((1,)),  # its depth
    "HannWindow": Reads((0,)),
    "HammingWindow": Reads((0,)),
    "BlackmanWindow": Reads((0,)),
    "Resize": Reads((1, 2, 3)),  # roi, scales, sizes (opset 10: scales at 1)
    "Reshape": Reads((1,)),
    "Expand": Reads((1,)),
    "Tile": Reads((1,)),
    "Split": Reads((1,)),
    "Slice": Reads((1, 2, 3, 4)),
    "Squeeze": Reads((1,)),
    "Unsqueeze": Reads((1,)),
    "Pad": Reads((1, 2, 3)),
    "TopK": Reads((1,)),
    "CumSum": Reads((1,)),
    "CumProd": Reads((1,)),
    "Trilu": Reads((1,)),
    "CenterCropPad": Reads((1,)),
    "Col2Im": Reads((1, 2)),
    "AffineGrid": Reads((1,)),
    "MaxUnpool": Reads((2,)),
    "DFT": Reads((1, 2)),
    **{op: Reads((1,)) for op in _REDUCE},
}


def read_positions(node: Node) -> tuple[int, ...]:
    """The positions of the node's inputs its step reads on the host."""
    spec = HOST_READS.get(node.op_type)
    return spec.inputs if spec is not None else ()


def host_reads(graph: Graph, host: Collection[str] = frozenset()) -> list[str]:
    """The graph's nodes that read device values on the host (``name (op)``), in order;
    empty: capturable as far as its ops go. ``host``: the values held on the host (the
    program passes :func:`.hostvalues.plan`'s ``host``; none: every value on the device)."""
    found = []
    for node in graph.nodes:
        spec = HOST_READS.get(node.op_type)
        if spec is None:
            continue
        if (spec.always is not None and spec.always(node)) or any(
            i < len(node.inputs) and node.inputs[i] and node.inputs[i] not in host
            for i in spec.inputs
        ):
            found.append(f"{node.name or '?'} ({node.op_type})")
    return found
