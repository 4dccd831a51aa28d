"""An ONNX graph as a program of torch steps, decided at load: each node's converter
(:mod:`.ops`) gives a function of tensors; the program runs them in the graph's order over a
list of slots, freeing each value after its last reader, as NUMPY's plan does.

Values live on the device, but shape values on the host (:mod:`.hostvalues`): the nodes it
keeps there are converted for the CPU and read their inputs' host forms (a constant has a host
copy beside its device one where a step reads it there); a device step gets a host value at a
position it reads on the host (:func:`.hostreads.read_positions`: a Reshape's shape) as it is,
and anywhere else its device form, moved by a step after the node that computes it (the copy
of each value kept and reused: :class:`.hostvalues.Moves`). The nodes over small constants
alone are computed here, at load, into constants (up to
:data:`.hostvalues.FOLDED_ELEMENTS` elements each: a larger one stays a device step; their
device copies are ``Program.device_nbytes``, charged with the weights).

QueryNetwork (:mod:`.query`) runs the same :class:`Converting` on every node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import InferenceError, InvalidModel, PlugserveError, Unsupported
from plugserve.plugins.ir import Graph, Node, attribute_graphs
from plugserve.plugins.torch import hostreads, hostvalues, layout
from plugserve.plugins.torch import ops as _ops  # noqa: F401  (registers the converters)
from plugserve.plugins.torch.ops.bounds import CHECKED_OPS
from plugserve.plugins.torch.ops.registry import (
    VALUE_TYPES,
    NodeContext,
    Refused,
    converters,
    held_dtype,
    schema_version,
    to_numpy,
    to_tensor,
)

__all__ = ["Converting", "Program", "build_program"]


def value_types(graph: Graph) -> dict[str, np.dtype]:
    """The element type of every value ONNX's inference (or the model) types."""
    types: dict[str, np.dtype] = {}
    for spec in [*graph.value_info.values(), *graph.inputs, *graph.outputs]:
        if spec.dtype is not None:
            types[spec.name] = np.dtype(spec.dtype)
    for name, value in graph.initializers.items():
        types[name] = np.asarray(value).dtype
    return types


def _check_types(node: Node, types: dict[str, np.dtype]) -> None:
    for name in [*node.inputs, *node.outputs]:
        if not name:
            continue
        dtype = types.get(name)
        if dtype is None:
            raise Refused(f"the type of {name!r} is unknown (ONNX's inference leaves it open)")
        if dtype.name not in VALUE_TYPES:
            raise Refused(
                f"{name!r} is {dtype} (this device holds {', '.join(sorted(VALUE_TYPES))})"
            )


class Converting:
    """What converting a graph's nodes in order needs: the values known at load so far."""

    def __init__(self, graph: Graph, torch: Any, device: Any, compute: Any) -> None:
        self.graph = graph
        self.torch = torch
        self.device = device
        self.compute = compute
        self.types = value_types(graph)
        self.constants: dict[str, np.ndarray] = dict(graph.initializers)

    def convert(self, node: Node, device: Any = None, compute: Any = None) -> tuple[Any, bool]:
        """The node's step and whether it returns several outputs; on ``device`` (default the
        program's: the host for the nodes :mod:`.hostvalues` keeps there), float32 values held
        in ``compute`` (default the program's; the host's steps keep float32: see
        :mod:`.hostvalues`)."""
        if any(attribute_graphs(a) for a in node.attrs.values()):
            raise Refused(f"op {node.op_type!r} with a subgraph (control flow is not converted)")
        opset = self.graph.node_opset(node)
        entry = converters.lookup(node, opset)
        _check_types(node, self.types)
        if entry.types is not None:  # the op's data: its first input and output
            for name in [*node.inputs[:1], *node.outputs[:1]]:
                if name and self.types[name].name not in entry.types:
                    raise Refused(f"{node.op_type} of {self.types[name]} ({name!r})")
        ctx = NodeContext(
            node,
            self.graph,
            schema_version(node.op_type, opset) or 1,
            self.constants,
            self.torch,
            device if device is not None else self.device,
            compute if compute is not None else self.compute,
            self.types,
        )
        step = entry.convert(ctx)
        if node.op_type == "Constant":  # known at load: later converters may read it
            value = getattr(step, "value", None)
            if value is not None:
                self.constants[node.outputs[0]] = value
        halves = [bool(n) and ctx.rounds_to_f16(self.types[n]) for n in node.outputs]
        if any(halves) and node.op_type != "Constant":
            step = _rounding(step, halves, entry.multi_output, self.torch)
        return step, entry.multi_output


def _rounding(step: Any, halves: list[bool], multi: bool, torch: Any) -> Any:
    """``step`` with its float16 outputs (held in float32) rounded to float16, as each op of
    the ONNX reference rounds them: float16 arithmetic done in float32 and rounded per node."""
    half = torch.float16

    def rounded(*args: Any) -> Any:
        result = step(*args)
        if not multi:
            return result.to(half).to(result.dtype)
        return tuple(
            r.to(half).to(r.dtype) if h and r is not None else r
            for r, h in zip(result, halves + [False] * (len(result) - len(halves)))
        )

    return rounded


def _converted(converting: Converting, graph: Graph, node: Node, device: Any,
               compute: Any = None) -> tuple[Any, bool]:  # fmt: skip
    try:
        return converting.convert(node, device, compute)
    except Unsupported as exc:
        raise Unsupported(
            f"model {graph.name!r}: node {node.name!r} ({node.op_type}): {exc}"
        ) from None


class _Known(dict):
    """Constants on the host by name: the folded nodes' outputs, and the constants they read
    (copied to the host at their first read)."""

    def __init__(self, converting: Converting, torch: Any, host: Any, compute: Any) -> None:
        super().__init__()
        self.converting, self.torch, self.host, self.compute = converting, torch, host, compute

    def value(self, name: str) -> Any:
        if name not in self:
            self[name] = to_tensor(self.torch, self.converting.constants[name], self.host,
                                   self.compute)  # fmt: skip
        return self[name]


def _folded(graph: Graph, converting: Converting, torch: Any, host: Any, compute: Any
            ) -> tuple[hostvalues.HostPlan, _Known]:  # fmt: skip
    """The graph's host plan and the values of its folded nodes, computed on the host (with
    the constants they read; float32 values held in ``compute``, the host's: float32): a
    node whose output would be over :data:`.hostvalues.FOLDED_ELEMENTS` elements (a sized
    node given large dims: checked before it is computed) is not folded but left to run per
    request on the device (the plan made again without it: at most once per node)."""
    unfolded: set[int] = set()
    while True:
        plan = hostvalues.plan(graph, frozenset(unfolded))
        known = _Known(converting, torch, host, compute)
        for node in graph.nodes:  # the Constant nodes folded ones read: known to converting
            if (node.op_type == "Constant" and node.outputs and node.outputs[0] in plan.small
                    and node.outputs[0] not in converting.constants):  # fmt: skip
                _converted(converting, graph, node, host, compute)
        for index in plan.folded:
            node = graph.nodes[index]
            fn, multi = _converted(converting, graph, node, host, compute)
            args = [known.value(n) if n else None for n in node.inputs]
            size = hostvalues.sized_elements(node.op_type, args)
            if size is not None and size > hostvalues.FOLDED_ELEMENTS:
                break
            try:
                result = fn(*args)
            except Exception as exc:
                raise InvalidModel(
                    f"model {graph.name!r}: node {node.name!r} ({node.op_type}) on constants: {exc}"
                ) from None
            results = [r for r in (result if multi else [result]) if r is not None]
            if any(r.numel() > hostvalues.FOLDED_ELEMENTS for r in results):
                break
            for n, value in zip(node.outputs, result if multi else [result]):
                if n and value is not None:
                    known[n] = value
        else:
            return plan, known
        unfolded.add(index)


def _with_frees(
    steps: list[tuple[Any, list[int], list[int], str]], keep: set[int], template: list[Any]
) -> list[tuple[Any, list[int], list[int], str, list[int]]]:
    """Each step with the slots it reads last: freed after it runs (not the inputs, outputs
    or template's values), so a run holds only the values still to be read."""
    last: dict[int, int] = {}
    for index, (_fn, ins, _outs, _what) in enumerate(steps):
        for i in ins:
            if i >= 0:
                last[i] = index
    return [
        (fn, ins, outs, what, [i for i in set(ins) if i >= 0 and last.get(i) == index
                               and i not in keep and template[i] is None])
        for index, (fn, ins, outs, what) in enumerate(steps)
    ]  # fmt: skip


class Program:
    """The steps of one graph, run over slots; values in and out as numpy arrays."""

    #: runs on the static buffers before a CUDA graph captures them (:mod:`.graphs`)
    capture_warmups = 1

    def __init__(self, graph: Graph, torch: Any, device: Any, compute: Any) -> None:
        self.torch = torch
        self.device = device
        self.compute = compute
        self.name = graph.name
        converting = Converting(graph, torch, device, compute)
        host = torch.device("cpu")
        #: the precision float32 values are held in on the host: float32 whatever the
        #: device's (shape arithmetic over a Cast(Shape) is exact to 2**24 there, where f16
        #: is to 2,048 and bf16 to 256; the host's few scalar ops cost nothing more in f32)
        self.host_compute = host_compute = torch.float32
        with torch.inference_mode():
            #: where the values live: shape values on the host (:mod:`.hostvalues`); constants
            #: on the host: the folded nodes' outputs (computed here), the constants they read
            self.plan, known = _folded(graph, converting, torch, host, host_compute)
        plan = self.plan
        #: nodes whose steps read device values on the host: no CUDA graph captures them
        self.host_reads = hostreads.host_reads(graph, plan.host)
        slots: dict[str, int] = {}

        def slot(name: str) -> int:
            if name not in slots:
                slots[name] = len(slots)
            return slots[name]

        #: constants' host copies (the template's device copies keep their own slots)
        host_copies: dict[str, int] = {}

        def on_host(name: str) -> int:  # the slot of the value's host form, when it has one
            if name in plan.constants and name not in plan.computed:
                if name not in host_copies:
                    host_copies[name] = slot("\0host " + name)
                return host_copies[name]
            return slot(name)  # computed there; or a device value (a host read, listed)

        def on_device(name: str) -> int:  # the slot of the value's device form
            return slot("\0device " + name) if name in plan.computed else slot(name)

        self.input_slots = [slot(s.name) for s in graph.inputs]
        self.input_types = [
            np.dtype(s.dtype) if s.dtype is not None else None for s in graph.inputs
        ]
        steps: list[tuple[Any, list[int], list[int], str]] = []
        with torch.inference_mode():
            move = hostvalues.to_device(torch, device)
            #: the device bytes held beside the weights: the folded constants' device copies
            #: and the bound of the moved values' kept copies (charged with the weights)
            self.device_nbytes = (
                move.kept_bytes if isinstance(move, hostvalues.Moves) and plan.to_device else 0
            )
            folded = set(plan.folded)

            for index, node in enumerate(graph.nodes):
                if index in folded:  # computed by _folded: its outputs are constants
                    continue
                hosted = index in plan.nodes
                fn, multi = (_converted(converting, graph, node, host, host_compute) if hosted
                             else _converted(converting, graph, node, None))  # fmt: skip
                reads = () if hosted else hostreads.read_positions(node)
                ins = [
                    -1 if not n else on_host(n) if hosted or p in reads else on_device(n)
                    for p, n in enumerate(node.inputs)
                ]  # fmt: skip
                outs = [slot(n) if n else -1 for n in node.outputs]
                if not multi:  # one result: a list of one slot; several: a tuple to spread
                    outs = outs[:1]
                elif len(outs) == 1:
                    outs = [*outs, -1]
                what = f"{node.name} ({node.op_type})"
                steps.append((fn, ins, outs, what))
                for n in node.outputs:  # host values a device step takes as data: moved once
                    if n in plan.to_device:  # (in the device's precision: cast on the host)
                        held = held_dtype(torch, converting.types[n], compute)
                        moved = move if held == held_dtype(
                            torch, converting.types[n], host_compute
                        ) else hostvalues.held_as(move, held)  # fmt: skip
                        steps.append((moved, [slot(n)], [on_device(n)], what))
            #: (a host value the graph outputs is moved: its device form)
            self.output_slots = [on_device(s.name) for s in graph.outputs]
            self.template = self._template(graph, converting, slots, host_copies, known)
        #: whether a node indexes with data (ops/bounds.py): its requests read a bounds flag
        self.checks_bounds = any(node.op_type in CHECKED_OPS for node in graph.nodes)
        self.output_types = [converting.types.get(s.name) for s in graph.outputs]
        keep = set(self.output_slots) | set(self.input_slots)
        self.steps = _with_frees(steps, keep, self.template)

    def _template(
        self,
        graph: Graph,
        converting: Converting,
        slots: dict[str, int],
        host_copies: dict[str, int],
        known: Any,
    ) -> list[Any]:
        """The slots' values before a run: the weights on the device (in its precision, NHWC
        where it convolves so), the constants' host copies and the folded nodes' device forms
        (their bytes added to :attr:`device_nbytes`)."""
        torch, device, compute = self.torch, self.device, self.compute
        template: list[Any] = [None] * len(slots)
        for name, value in graph.initializers.items():
            if name in slots:
                template[slots[name]] = to_tensor(torch, value, device, compute)
        for name, at in host_copies.items():
            template[at] = known.value(name)
        for index in self.plan.folded:  # their device forms, where device steps read them
            for n in graph.nodes[index].outputs:
                if n in slots and n in known:
                    held = held_dtype(torch, converting.types[n], compute)
                    form = template[slots[n]] = known[n].to(held).to(device)
                    if device.type != "cpu":
                        self.device_nbytes += form.numel() * form.element_size()
        if layout.wanted(torch, device, compute):  # f16/bf16 on CUDA: NHWC convolutions
            layout.weights_channels_last(torch, graph, slots, template)
            layout.benchmark(torch, graph)
        if device.type == "cuda":
            # the weights' casts (to_tensor's ``.to(held)``) are kernels on this thread's
            # stream; requests read them on their lanes' streams, which do not wait for
            # it: done before any request can start
            torch.cuda.current_stream(device).synchronize()
        return template

    def held(self, np_type: np.dtype) -> Any:
        """The torch dtype an input of ``np_type`` is held in on the device (:mod:`.graphs`
        stages inputs so)."""
        return held_dtype(self.torch, np_type, self.compute)

    def run(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        torch = self.torch
        with torch.inference_mode():
            tensors = [to_tensor(torch, np.asarray(a), self.device, self.compute) for a in arrays]
            return [
                to_numpy(torch, t, ty if ty is not None else np.dtype(np.float32))
                for t, ty in zip(self.compute_tensors(tensors), self.output_types)
            ]

    def compute_tensors(self, tensors: Sequence[Any]) -> list[Any]:
        """The steps over the inputs as tensors on the device, in the dtypes they are held in;
        the outputs as tensors there (what :mod:`.graphs` captures and replays)."""
        vals = list(self.template)
        for slot, tensor in zip(self.input_slots, tensors):
            vals[slot] = tensor
        token = cancel.current()
        what = ""
        try:
            for fn, ins, outs, what, free in self.steps:  # noqa: B007 (named in the error)
                if token is not None and token.error is not None:
                    raise token.failure()
                result = fn(*[vals[i] if i >= 0 else None for i in ins])
                if len(outs) == 1:
                    vals[outs[0]] = result
                else:
                    for slot, value in zip(outs, result):
                        if slot >= 0:
                            vals[slot] = value
                for i in free:
                    vals[i] = None
            return [vals[s] for s in self.output_slots]
        except PlugserveError:
            raise
        except Exception as exc:
            raise InferenceError(f"network {self.name!r}: node {what}: {exc}") from exc


def build_program(graph: Graph, torch: Any, device: Any, compute: Any) -> Program:
    return Program(graph, torch, device, compute)
