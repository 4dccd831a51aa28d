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
  exporter's ``Unsqueeze`` of a constant, or a small ``ConstantOfShape`` of a constant shape,
  costs no request anything);
- but a :data:`SIZED` node (ConstantOfShape, Range, Expand, Tile: outputs as large as the
  values they are given) only when what it computes is read on the host and nowhere else; the
  Range of BERT's position ids feeds an embedding's Gather, so it runs on the device
  (``torch.arange`` with the bounds read on the host: no synchronisation).

Such a value depends on the inputs' shapes alone, never on their data, and a CUDA graph is
captured per input shape (:mod:`.graphs`): computed once at the capture, it is exactly the
value every replay would compute. The steps are the device's, on CPU tensors (integer
arithmetic is exact, and the float ops allowed here are the correctly rounded ones: +, -, *,
/, sqrt, floor, ceil, casts), with one difference: float32 values are held in float32 here
whatever the device's precision (``Program.host_compute``; issue 49). At f16 a length of
3,001 cast to FLOAT was 3,000 (f16 is exact to 2,048, bf16 to 256), so a ConstantOfShape or
Range sized from ``ceil(n / 2)`` came out wrong; the host's few scalar ops cost nothing more
in f32, which is exact to 2**24. A value moved to the device is cast to the dtype its type is
held in there as it is moved (:func:`held_as`): rounded once.

Where a host value is data to a device step (``Cast(Shape) -> Sqrt -> Div`` of attention
scores; BERT's token-type ids sliced from a small buffer; a graph output), the program moves
it with :func:`to_device` (:class:`Moves`), and never waits on the host for it (review2
finding 1: a blocking copy from pageable memory is ``cudaMemcpyAsync`` plus
``cudaStreamSynchronize``, which a decoder with past paid at every step, as each step has a
new past length). The first time a value is met (the eager warm-up run before a capture is
one) it is copied with no host synchronisation: fill kernels whose values are baked into
their launches up to :data:`FILLS` elements (:func:`filled`), a pinned ``non_blocking`` copy
past that; an event is recorded after the copy, and the copy is kept with it (at most
:data:`KEPT` values, :data:`KEPT_BYTES` bytes, :data:`KEPT_ELEMENTS` elements each; never
evicted, as a live CUDA graph reads its kept copies at every replay; past the bounds a value
is copied the same way each time it is met). A later run on any stream makes its stream wait
for that event on the GPU, and finds the copy with no copy at all (a kernel reading it is
what a graph records). Inside a capture nothing waits for an event (one recorded outside a
capture may not be waited on in it): a kept copy is used where the capturing stream issued
it or waited for it before (the warm-up on that stream meets the same values, and the lane
synchronises the stream before it captures); any other value is filled, or, past
:data:`FILLS`, refused with a RuntimeError before any CUDA call (review2 finding 2: a copy
from the host would invalidate the capture, and torch <= 2.12 leaks a graph whose
``capture_end`` fails): the capture stays valid and ends, :mod:`.graphs` counts it failed,
and that shape runs eagerly (not captured again: :class:`.capture.RetryPolicy`).

Device memory (review2 finding 3): a node computed at load (``folded``) outputs at most
:data:`FOLDED_ELEMENTS` elements (a sized node over constants is checked before it is
computed: :func:`sized_elements`); a larger one (a ``[1, 1, 2048, 2048]`` mask) is left to
run per request on the device, as it did before host values. The folded constants' device
copies and the bound of the kept copies (only where the plan moves values) are the
program's ``device_nbytes``, charged to the device's budget with the weights at load and
released with them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from plugserve.plugins.ir import Graph, Node, attribute_graphs
from plugserve.plugins.torch.hostreads import ON_HOST, read_positions

__all__ = [
    "FILLS", "FOLDED_ELEMENTS", "HOST_OPS", "KEPT", "KEPT_BYTES", "SIZED", "SMALL", "HostPlan",
    "Moves", "capturing", "filled", "held_as", "plan", "refuse_in_capture", "sized_elements",
    "to_device",
]  # fmt: skip

#: the largest constant (elements) held on the host for shape arithmetic
SMALL = 64
#: the largest host value moved to the device by fill kernels (larger ones are copied)
FILLS = 64
#: device copies of moved host values a program keeps, and the largest (elements) it keeps
KEPT = 1024
KEPT_ELEMENTS = 4096
#: the device bytes a program's kept copies may hold (charged to the device's budget)
KEPT_BYTES = 8 << 20
#: the CUDA caching allocator's smallest block: what a kept copy of a few bytes holds
BLOCK = 512
#: the most elements a node computed at load (folded) may output: a larger sized node
#: (a ``[1, 1, 2048, 2048]`` mask) runs per request on the device instead of being held there
FOLDED_ELEMENTS = 1 << 16

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


def plan(graph: Graph, unfolded: frozenset[int] = frozenset()) -> HostPlan:
    """Which nodes run on the host and which values are held there (see the docstring);
    the nodes ``unfolded`` (their outputs over :data:`FOLDED_ELEMENTS`: the program finds
    them at load) are neither folded nor run on the host: device steps, per request."""
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
        if (node.op_type in HOST_OPS and present and _convertible(node) and i not in unfolded
                and all(n in small for n in present)):  # fmt: skip
            folded.append(i)
            small.update(n for n in node.outputs if n)
    constants = frozenset(sizes) | {n for i in folded for n in nodes[i].outputs if n}
    outputs = {spec.name for spec in getattr(graph, "outputs", [])}
    demoted = set(folded) | set(unfolded)
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


def sized_elements(op_type: str, inputs: list[Any]) -> int | None:
    """The elements a :data:`SIZED` node outputs, from its inputs (host tensors) before it is
    computed (a folded ``ConstantOfShape`` of ``[65536, 65536]`` is refused no memory);
    None for another op, or inputs it cannot read (the step's own error then says why)."""
    try:
        if op_type == "ConstantOfShape":
            return int(np.prod(inputs[0].tolist(), dtype=np.float64))
        if op_type == "Expand":
            return int(
                np.prod(
                    np.broadcast_shapes(tuple(inputs[0].shape), tuple(inputs[1].tolist())),
                    dtype=np.float64,
                )
            )
        if op_type == "Tile":
            return int(inputs[0].numel() * np.prod(inputs[1].tolist(), dtype=np.float64))
        if op_type == "Range":
            start, limit, delta = (float(t.item()) for t in inputs[:3])
            return max(0, int(np.ceil((limit - start) / delta)))
    except Exception:
        return None
    return None


def capturing(torch: Any, device: Any) -> bool:
    """Whether this thread's stream is being captured into a CUDA graph."""
    return device.type == "cuda" and bool(torch.cuda.is_current_stream_capturing())


def refuse_in_capture(value: Any) -> None:
    """Raised inside a capture for a value over :data:`FILLS` elements with no device copy
    ready for the capturing stream (review2 finding 2): before any CUDA call, so the capture
    stays valid, ``capture_end`` succeeds and no graph is leaked; :mod:`.graphs` counts the
    capture failed and runs that shape eagerly (a failure that is no lack of memory is not
    retried: :class:`.capture.RetryPolicy`)."""
    raise RuntimeError(
        f"a host value of {value.numel()} elements was not moved to the device before the "
        f"capture (over {FILLS} elements it would be copied from the host, which a CUDA graph "
        "cannot capture): this shape runs eagerly"
    )


def _block(nbytes: int) -> int:
    """The device bytes a copy of ``nbytes`` holds (the caching allocator's 512-byte blocks)."""
    return max(BLOCK, -(-nbytes // BLOCK) * BLOCK)


class _Kept:
    """A kept device copy, the event recorded after the copy was issued (None off CUDA), and
    the streams (by handle) known ordered after it: the one that issued it, those that waited."""

    __slots__ = ("copy", "event", "streams")

    def __init__(self, copy: Any, event: Any, stream: Any) -> None:
        self.copy = copy
        self.event = event
        self.streams = {stream}


class Moves:
    """A program's step that moves host values to its device (see the module docstring).

    It never waits on the host. Outside a capture a value not kept is copied without a host
    synchronisation (:meth:`copy`), an event is recorded on the current stream after it, and
    the copy is kept with that event while :data:`KEPT` copies and :data:`KEPT_BYTES` bytes are
    not reached (each of at most :data:`KEPT_ELEMENTS` elements); past those bounds it is
    copied the same way each time, for the current stream only. A hit outside a capture makes
    the current stream wait for the event (a GPU-side wait, free once the copy is done), so a
    lane on another stream never reads a copy still under way. Inside a capture a hit waits
    for nothing (CUDA takes a wait on an event recorded outside the capture only as an
    external wait, ``cudaEventWaitExternal``, which torch's ``wait_event`` does not ask for):
    it is used only where the capturing stream is known ordered after the copy (it issued it,
    or waited for it, in the warm-up, which meets the same values as the capture;
    ``Lane._capture`` synchronises the stream between the two);
    otherwise, and for a value not kept, a value of at most :data:`FILLS` elements is made by
    fill kernels (capturable) and a larger one is refused (:func:`refuse_in_capture`).

    Nothing kept is evicted: a captured graph reads its kept copies at every replay, so one
    freed while a graph lives would be read after its free. Kept copies live as long as the
    program; their bound, :data:`KEPT_BYTES`, is charged to the device's memory budget with
    the weights (``Program.device_nbytes``)."""

    def __init__(self, torch: Any, device: Any, kept: int = KEPT,
                 kept_bytes: int = KEPT_BYTES) -> None:  # fmt: skip
        self.torch = torch
        self.device = device
        self.kept = int(kept)
        self.kept_bytes = int(kept_bytes)
        #: the device bytes the kept copies hold (allocator blocks)
        self.nbytes = 0
        self._cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._kept: dict[tuple[Any, ...], _Kept] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def _stream(self) -> Any:
        """The current stream's handle (None off CUDA: one order for everything)."""
        return self.torch.cuda.current_stream(self.device).cuda_stream if self._cuda else None

    def __call__(self, value: Any) -> Any:
        flat = value.reshape(-1).contiguous()
        bits = flat.view(self.torch.uint8).numpy().tobytes()  # by bits: -0.0 and NaN too
        key = (value.dtype, tuple(value.shape), bits)
        kept = self._kept.get(key)
        if capturing(self.torch, self.device):
            if kept is not None and self._stream() in kept.streams:
                return kept.copy  # ordered before the capture: a kernel reading it is recorded
            if value.numel() <= FILLS:
                return filled(self.torch, value, self.device)
            refuse_in_capture(value)
        if kept is not None:
            return self._hit(kept)
        copy = self.copy(value)
        if value.numel() > KEPT_ELEMENTS:
            return copy
        nbytes = _block(value.numel() * value.element_size())
        with self._lock:
            kept = self._kept.get(key)
            if kept is None:
                if len(self._kept) >= self.kept or self.nbytes + nbytes > self.kept_bytes:
                    return copy  # full: this stream's copy, not kept
                event = None
                if self._cuda:
                    event = self.torch.cuda.Event()
                    event.record(self.torch.cuda.current_stream(self.device))
                self._kept[key] = _Kept(copy, event, self._stream())
                self.nbytes += nbytes
                return copy
        # a racing thread kept its copy first: that one, waited for (so this stream is known
        # ordered after it at a capture that follows)
        return self._hit(kept)

    def _hit(self, kept: _Kept) -> Any:
        """A kept copy outside a capture: the current stream made to wait for its event."""
        if kept.event is not None:
            stream = self.torch.cuda.current_stream(self.device)
            stream.wait_event(kept.event)  # on the GPU: the host goes on
            kept.streams.add(stream.cuda_stream)
        return kept.copy

    def copy(self, value: Any) -> Any:
        """``value`` on the device with no host synchronisation, ordered on the current stream:
        at most :data:`FILLS` elements by fill kernels (:func:`filled`); more, from a pinned
        copy with ``non_blocking`` (a copy from pageable memory would synchronise). The pinned
        block comes from torch's caching host allocator, and a ``non_blocking`` copy out of it
        records an event on the stream in that allocator (``Copy.cu``), which hands the block
        out again only once that event is done: dropping the pinned tensor at once is safe.
        Off CUDA (the meta device standing for a card in the tests) a plain ``to``."""
        if value.numel() <= FILLS:
            return filled(self.torch, value, self.device)
        if not self._cuda:
            return value.to(self.device)
        return value.pin_memory().to(self.device, non_blocking=True)


def to_device(torch: Any, device: Any) -> Callable[[Any], Any]:
    """The step that moves a host value to ``device`` (:class:`Moves`); on the CPU the value
    itself."""
    if device.type == "cpu":
        return lambda value: value
    return Moves(torch, device)


def held_as(move: Callable[[Any], Any], held: Any) -> Callable[[Any], Any]:
    """``move`` of a host value cast first, on the host, to ``held``: the dtype its type is
    held in on the device (a float32 shape value, computed on the host in float32, is moved
    in the device's precision, f16 or bf16, as any value there is: rounded once, there). The
    cast is a CPU op on a few elements: nothing a CUDA graph sees, and the kept copies are
    keyed by the cast value."""

    def moved(value: Any) -> Any:
        return move(value.to(held) if value.dtype != held else value)

    return moved


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
