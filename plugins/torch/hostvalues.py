"""Which values of a converted ONNX graph are held on the host, as CPU tensors (review finding
17): the shape values. Decided at load, per graph; :class:`~.program.Program` follows it.

Why: a step that reads a shape, axes or counts from an input (``ints``: Reshape, Expand,
Slice, Unsqueeze...) synchronises its stream when that input is on the device, and a CUDA graph
cannot capture a synchronisation (:mod:`.hostreads`). Exporters compute shapes in the graph:
TorchScript's BERT, ViT, T5 or Whisper encoder has Shape -> Gather -> Unsqueeze -> Concat ->
Reshape chains (the zoo's bert_script: 19 Shape nodes feeding its 15 Reshapes, 3 Expands and
3 Ranges), so with every value on the device no transformer the TorchScript exporter writes
was ever captured.

What is held on the host:

- the output of every ``Shape`` and ``Size`` node (the input's shape, no read of its values);
- a load-time constant (initializer or Constant) of at most :data:`SMALL` elements, as well as
  its device copy, and any constant where a step reads it on the host (a Reshape's shape);
- the output of a node of :data:`HOST_OPS` (the shape arithmetic exporters write: Gather,
  Concat, Unsqueeze, Slice, Cast, Add, Mul, Div, Equal, Where...) whose inputs are all held on
  the host, computed there by the same step on CPU tensors; when its inputs are all small
  constants it is computed once, at load (``folded``), and is a constant from then on (an
  exporter's ``Unsqueeze`` of a constant, or a ``ConstantOfShape`` of a constant shape,
  costs no request anything);
- but a :data:`SIZED` node (ConstantOfShape, Range, Expand, Tile: outputs as large as the
  values they are given) only when what it computes is read on the host and nowhere else; the
  Range of BERT's position ids feeds an embedding's Gather, so it runs on the device
  (``torch.arange`` with the bounds read on the host: no synchronisation).

Such a value depends on the inputs' shapes alone, never on their data, and a CUDA graph is
captured per input shape (:mod:`.graphs`): computed once at the capture, it is exactly the
value every replay would compute. The steps are today's, on CPU tensors: the values are
today's (integer arithmetic is exact, and the float ops allowed here are the correctly
rounded ones: +, -, *, /, sqrt, floor, ceil, casts; only a float reduction over several
elements could round in another order than the card's, and shape values are integers).

Where a host value is data to a device step (``Cast(Shape) -> Sqrt -> Div`` of attention
scores; BERT's token-type ids sliced from a small buffer; a graph output), the program moves
it with :func:`to_device`: the first time a value is met (the eager warm-up run before a
capture) it is copied, and that device copy is kept and reused, so the capture and every
later run find it there with no copy at all (a kernel reading it is what the graph records).
Were a capture ever to meet a value not seen, it is made by fill kernels whose values are
baked into their launches (capturable; :func:`filled`), and past :data:`FILLS` elements
copied, which syncs and fails that capture (the shape then runs eagerly): the plan keeps the
sized ops off the host, so host values stay small. (One case is left to that fallback: a
sized node folded at load into a large constant, then mixed with a shape at run time; values
stay right, only that capture is lost. The zoo's 23 capturable exports move 3 values at most.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from plugserve.plugins.ir import Graph, Node, attribute_graphs
from plugserve.plugins.torch.hostreads import ON_HOST, read_positions

__all__ = [
    "FILLS", "HOST_OPS", "KEPT", "SIZED", "SMALL", "HostPlan", "Moves", "capturing", "filled",
    "plan", "to_device",
]  # fmt: skip

#: the largest constant (elements) held on the host for shape arithmetic
SMALL = 64
#: the largest host value moved to the device by fill kernels (larger ones are copied)
FILLS = 64
#: device copies of moved host values a program keeps, and the largest (elements) it keeps
KEPT = 1024
KEPT_ELEMENTS = 4096

#: ops whose outputs are as large as the values they are given (on the host only when read there)
SIZED = frozenset({"ConstantOfShape", "Range", "Expand", "Tile"})

#: the ops computed on the host when every input is held there
HOST_OPS = frozenset({
    "Identity", "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Reshape", "Flatten",
    "Transpose", "Split", "Cast", "CastLike", "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs",
    "Sign", "Floor", "Ceil", "Sqrt", "Max", "Min", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "Not", "And", "Or", "Xor", "Where", "ReduceProd", "ReduceSum", "ReduceMax",
    "ReduceMin", *SIZED,
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """Where a graph's values live (see the module docstring)."""

    #: indices (in the graph's order) of the nodes whose steps run on the host per request
    nodes: frozenset[int]
    #: the nodes computed once at load, on the host (their inputs are all small constants)
    folded: tuple[int, ...]
    #: the outputs of those nodes
    computed: frozenset[str]
    #: load-time constants (initializers, Constant outputs and the folded nodes' outputs):
    #: a host copy where needed
    constants: frozenset[str]
    #: the constants host nodes may read (at most SMALL elements, or folded)
    small: frozenset[str]
    #: computed host values a device step takes as data (or graph outputs): moved there
    to_device: frozenset[str]

    @property
    def host(self) -> frozenset[str]:
        """Every value a step may read on the host without a synchronisation."""
        return self.computed | self.constants


def _constant(node: Node) -> np.ndarray | None:
    """A Constant node's value (None for strings or sparse values, which stay refused)."""
    for name, cast in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):  # fmt: skip
        if name in node.attrs:
            try:
                value = np.asarray(node.attr(name), dtype=cast)
            except Exception:
                return None
            return value if value.dtype.kind not in "OUS" else None
    return None


def _convertible(node: Node) -> bool:
    return node.domain in ("", "ai.onnx") and not any(
        attribute_graphs(a) for a in node.attrs.values()
    )


def plan(graph: Graph) -> HostPlan:
    """Which nodes run on the host and which values are held there (see the docstring)."""
    nodes: list[Node] = list(graph.nodes)
    fed = {spec.name for spec in getattr(graph, "inputs", [])}  # an input's default is no constant
    sizes = {
        name: int(np.asarray(v).size)
        for name, v in getattr(graph, "initializers", {}).items()
        if name not in fed
    }
    for node in nodes:
        if node.op_type == "Constant" and node.outputs and _convertible(node):
            value = _constant(node)
            if value is not None:
                sizes[node.outputs[0]] = int(value.size)
    small = {name for name, size in sizes.items() if size <= SMALL}
    folded: list[int] = []  # shape arithmetic over constants alone: computed once, at load
    for i, node in enumerate(nodes):
        present = [n for n in node.inputs if n]
        if (node.op_type in HOST_OPS and present and _convertible(node)
                and all(n in small for n in present)):  # fmt: skip
            folded.append(i)
            small.update(n for n in node.outputs if n)
    constants = frozenset(sizes) | {n for i in folded for n in nodes[i].outputs if n}
    outputs = {spec.name for spec in getattr(graph, "outputs", [])}
    demoted = set(folded)
    while True:
        on_host, computed = _forward(nodes, frozenset(small), demoted)
        to_device = _data(nodes, on_host, computed, outputs)
        reaches = _reaching(nodes, on_host, to_device)
        sized = {i for i in on_host if nodes[i].op_type in SIZED and reaches[i]}
        if not sized:
            break
        demoted |= sized  # each pass demotes at least one node: bounded by the graph's size
    return HostPlan(frozenset(on_host), tuple(folded), frozenset(computed), constants,
                    frozenset(small), frozenset(to_device))  # fmt: skip


def _forward(nodes: list[Node], small: frozenset[str], skipped: set[int]
             ) -> tuple[set[int], set[str]]:  # fmt: skip
    on_host: set[int] = set()
    computed: set[str] = set()
    for i, node in enumerate(nodes):
        if node.op_type == "Constant" or i in skipped or not _convertible(node):
            continue
        present = [n for n in node.inputs if n]
        if node.op_type in ON_HOST or (
            node.op_type in HOST_OPS and present
            and all(n in small or n in computed for n in present)
        ):  # fmt: skip
            on_host.add(i)
            computed.update(n for n in node.outputs if n)
    return on_host, computed


def _data(nodes: list[Node], on_host: set[int], computed: set[str], outputs: set[str]
          ) -> set[str]:  # fmt: skip
    """The computed host values a device step takes as data (not at a position it reads on
    the host), and those the graph outputs."""
    wanted = computed & outputs
    for i, node in enumerate(nodes):
        if i in on_host:
            continue
        reads = read_positions(node)
        wanted.update(n for p, n in enumerate(node.inputs) if n in computed and p not in reads)
    return wanted


def _reaching(nodes: list[Node], on_host: set[int], to_device: set[str]) -> dict[int, bool]:
    """For each host node: whether a value it computes reaches a device step as data, through
    host nodes or at once (nodes are in topological order: readers come later)."""
    readers: dict[str, list[int]] = {}
    for i in on_host:
        for name in nodes[i].inputs:
            if name:
                readers.setdefault(name, []).append(i)
    reaches: dict[int, bool] = {}
    for i in sorted(on_host, reverse=True):  # a sized reader stops it: it is judged itself
        reaches[i] = any(
            name in to_device
            or any(reaches[r] for r in readers.get(name, ()) if nodes[r].op_type not in SIZED)
            for name in nodes[i].outputs if name
        )  # fmt: skip
    return reaches


def capturing(torch: Any, device: Any) -> bool:
    """Whether this thread's stream is being captured into a CUDA graph."""
    return device.type == "cuda" and bool(torch.cuda.is_current_stream_capturing())


class Moves:
    """A program's step that moves host values to its device (see the docstring): a value
    seen before is its device copy, kept (a graph captured with it reads it at every replay,
    so it is never dropped while the program lives: at most :data:`KEPT` of them, each of at
    most :data:`KEPT_ELEMENTS` elements; past those it is copied or filled each time). Outside
    a capture a new value is copied (the warm-up run before each capture copies the values
    the capture will meet); inside one, a value somehow not seen is filled (or copied, past
    :data:`FILLS`, which fails the capture: that shape runs eagerly)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self._kept: dict[tuple[Any, ...], Any] = {}

    def __call__(self, value: Any) -> Any:
        flat = value.reshape(-1).contiguous()
        bits = flat.view(self.torch.uint8).numpy().tobytes()  # by bits: -0.0 and NaN too
        key = (value.dtype, tuple(value.shape), bits)
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        if capturing(self.torch, self.device):
            return filled(self.torch, value, self.device) if value.numel() <= FILLS else (
                value.to(self.device))  # fmt: skip
        copy = value.to(self.device)  # a synchronising copy, outside a capture
        if len(self._kept) < KEPT and value.numel() <= KEPT_ELEMENTS:
            copy = self._kept.setdefault(key, copy)  # a racing thread's copy: the one kept
        return copy


def to_device(torch: Any, device: Any) -> Callable[[Any], Any]:
    """The step that moves a host value to ``device`` (:class:`Moves`); on the CPU the value
    itself."""
    if device.type == "cpu":
        return lambda value: value
    return Moves(torch, device)


def filled(torch: Any, value: Any, device: Any) -> Any:
    """A host tensor's copy on ``device`` made by fill kernels: one of its first element,
    then one per element that differs from it (-0.0 and NaN kept as they are)."""
    flat = value.reshape(-1).tolist()  # a CPU tensor: no synchronisation
    first = flat[0] if flat else 0
    out = torch.full((len(flat),), first, dtype=value.dtype, device=device)
    for i, v in enumerate(flat):
        if not (v == first and str(v) == str(first)):
            out[i].fill_(v)
    return out.reshape(value.shape)
