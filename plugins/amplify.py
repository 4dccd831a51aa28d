"""Outputs whose size a request's values decide, bounded before they are allocated.

A 100-byte request can ask ``ConstantOfShape`` for a [100000, 100000] tensor, ``Expand``,
``Tile``, ``Pad``, ``Resize`` or ``OneHot`` to grow a small input by factors it sends, ``Range``
for 10^12 steps, or a ``Loop`` for 10^9 iterations each keeping a scan output: gigabytes from
nothing, on any device, before any check after the run could refuse the answer. So each such
output's size is worked out from the node's input *values* before the node runs and compared
with what the run may still allocate, its room (:func:`room`): the server sets it in the run's
context (``plugins/run_context.py``) from its memory budget (``--max-inflight-bytes``: what the
budget has free when the request is admitted, at most), and a node asking for more is refused with
:class:`ResourceExhausted` naming the node, the op and the sizes; nothing else is harmed.

Where each device asks:

* NUMPY, from the node's real inputs, just before its kernel (:func:`check_node`; the engine
  wraps only the nodes :func:`amplifies` picks at load, so other networks pay nothing);
* ORT and OPENVINO run a graph whole, so the values that decide these sizes are computed
  first by a small model of their own (:func:`probe`: the nodes those values depend on, when
  they are cheap shape arithmetic on the inputs; built once at load), on the device's own
  backend, and the same rules (:data:`OUTPUT_BYTES`) judge them before the real run starts.
  A deciding value that needs the network's real work (a Conv's output) cannot be known
  before the run; those nodes are left to the answer's own limit after it.

The rules are a registry of small functions, one per op: what the node's outputs hold, in
bytes, from its input arrays (``None`` where an input is unknown).

An output that could never be sent is refused the same way, before it is computed, whatever
the budget has free: the answer's bound (the run context's ``answer``, --max-message-bytes,
set by the server) caps a node whose output *is* an output the request asked for, or reaches
one through ops that keep its size or grow it (:data:`KEEPS`: an Expand followed by an Add,
a ConstantOfShape then a Relu; :func:`sent_as`, worked out once at load). A 6.4 GB
ConstantOfShape under the default budget (half the machine's memory) was computed first and
refused after, NUMPY's peak memory 6.1 GB higher; it is now refused with nothing allocated.

What holds, per device: NUMPY checks every such node from its real inputs, as it runs; ORT
and OPENVINO check before the run those whose deciding values are cheap shape arithmetic on
the inputs (the probe), and a size that needs the network's real work is known only after
the run (then the answer's own bound refuses it before it is encoded); HETERO hands each piece
the request's context with the outputs it sends to the answer (``run_context.for_piece``: a
tensor one piece hands the next is never sent, so only the room bounds it); MULTI and AUTO
run one device's network under the request's context; BATCH runs a batch of one request
under its context, and a batch of several under one whose answer bound is the sum of theirs
and whose room is the largest of theirs (``run_context.for_batch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from plugserve.plugins.errors import ResourceExhausted
from plugserve.plugins.run_context import RunContext

__all__ = [
    "OUTPUT_BYTES",
    "Probe",
    "amplifies",
    "check_bytes",
    "check_node",
    "probe",
    "room",
]

Sizer = Callable[[Any, Sequence[Any]], int]
#: op -> (bytes its outputs hold, from (node, inputs)); the inputs whose values decide it
OUTPUT_BYTES: dict[str, tuple[Sizer, tuple[int, ...]]] = {}


def rule(op: str, deciding: tuple[int, ...]) -> Callable[[Sizer], Sizer]:
    def register(fn: Sizer) -> Sizer:
        OUTPUT_BYTES[op] = (fn, deciding)
        return fn

    return register


def _ints(value: Any) -> list[int]:
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _itemsize(value: Any, default: int = 4) -> int:
    dtype = getattr(value, "dtype", None)
    return default if dtype is None else max(np.dtype(dtype).itemsize, 1)


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(getattr(value, "shape", ()))


def _attr(node: Any, name: str, default: Any = None) -> Any:
    attrs = getattr(node, "attrs", None)
    if attrs is not None:  # plugserve's IR node
        value = attrs.get(name)
        return default if value is None else helper.get_attribute_value(value)
    for attribute in node.attribute:  # an onnx.NodeProto
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


@rule("ConstantOfShape", (0,))
def _constant_of_shape(node: Any, ins: Sequence[Any]) -> int:
    value = _attr(node, "value")
    itemsize = (
        4 if value is None else np.dtype(helper.tensor_dtype_to_np_dtype(value.data_type)).itemsize
    )
    return math.prod(max(d, 0) for d in _ints(ins[0])) * itemsize


@rule("Expand", (1,))
def _expand(node: Any, ins: Sequence[Any]) -> int:
    target = _ints(ins[1])
    shape = _shape(ins[0])
    rank = max(len(target), len(shape))
    a = (1,) * (rank - len(shape)) + shape
    b = (1,) * (rank - len(target)) + tuple(target)
    return math.prod(max(x, y, 0) if 1 in (x, y) else max(x, 0) for x, y in zip(a, b)) * (
        _itemsize(ins[0])
    )


@rule("Tile", (1,))
def _tile(node: Any, ins: Sequence[Any]) -> int:
    reps = _ints(ins[1])
    shape = _shape(ins[0]) or (1,) * len(reps)
    return math.prod(max(n, 1) * max(r, 0) for n, r in zip(shape, reps)) * _itemsize(ins[0])


@rule("Range", (0, 1, 2))
def _range(node: Any, ins: Sequence[Any]) -> int:
    start, limit, delta = (float(np.asarray(v).reshape(-1)[0]) for v in ins[:3])
    if delta == 0 or not all(map(math.isfinite, (start, limit, delta))):
        return 0  # refused by the op itself
    return max(math.ceil((limit - start) / delta), 0) * _itemsize(ins[0], 8)


@rule("Pad", (1,))
def _pad(node: Any, ins: Sequence[Any]) -> int:
    pads = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else _ints(_attr(node, "pads", []))
    shape = list(_shape(ins[0]))
    axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(range(len(shape)))
    half = len(pads) // 2
    for i, axis in enumerate(axes[:half]):
        if -len(shape) <= axis < len(shape):
            shape[axis] = max(shape[axis] + pads[i] + pads[i + half], 0)
    return math.prod(shape) * _itemsize(ins[0])


@rule("Resize", (1, 2, 3))
def _resize(node: Any, ins: Sequence[Any]) -> int:
    shape = _shape(ins[0])
    sizes = ins[3] if len(ins) > 3 else None
    if sizes is not None and np.asarray(sizes).size:
        out = _ints(sizes)
        if len(out) == len(shape):
            return math.prod(max(d, 0) for d in out) * _itemsize(ins[0])
        shape = tuple(shape)  # with axes: the named axes only; bound by the largest
        return math.prod(shape) * max(max(out), 1) * _itemsize(ins[0])
    scales = ins[2] if len(ins) > 2 else (ins[1] if len(ins) > 1 else None)
    if scales is None or not np.asarray(scales).size:
        return 0
    factors = [float(s) for s in np.asarray(scales).reshape(-1)]
    if len(factors) != len(shape):
        factors = factors + [1.0] * (len(shape) - len(factors))
    return math.prod(math.floor(max(n, 0) * max(f, 0.0)) for n, f in zip(shape, factors)) * (
        _itemsize(ins[0])
    )


OUTPUT_BYTES["Upsample"] = (lambda node, ins: _resize(node, [ins[0], ins[1]]), (1,))


@rule("OneHot", (1,))
def _one_hot(node: Any, ins: Sequence[Any]) -> int:
    depth = int(np.asarray(ins[1]).reshape(-1)[0])
    values = ins[2] if len(ins) > 2 else None
    return math.prod(_shape(ins[0])) * max(depth, 0) * _itemsize(values)


@rule("Loop", (0,))
def _loop(node: Any, ins: Sequence[Any]) -> int:
    """A Loop's trip count times what one iteration's scan outputs hold, as its body declares
    them (unknown dimensions counted as 1): a lower bound, which an iteration's real outputs
    refine on NUMPY (its kernel checks the scans as they grow)."""
    if ins[0] is None or not np.asarray(ins[0]).size:
        return 0
    trips = int(np.asarray(ins[0]).reshape(-1)[0])
    body = _attr(node, "body")
    if body is None or trips <= 0:
        return 0
    carried = max(len(list(getattr(node, "inputs", None) or node.input)) - 2, 0)
    per_trip = 0
    for output in list(body.output)[1 + carried :]:
        tensor = output.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor.shape.dim]
        try:
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type)).itemsize
        except Exception:
            itemsize = 1
        per_trip += math.prod(max(d, 1) for d in dims) * itemsize
    return trips * per_trip


def room(run: RunContext | None) -> int:
    """What the run may still allocate at once, in bytes (0: no bound; ``run`` None: a run
    told nothing)."""
    return 0 if run is None else run.room


#: ops whose first output holds at least as many bytes as each input it is computed from (the
#: same element type, and as many elements or more): an amplified tensor that reaches a
#: network output through them makes that output at least as large
KEEPS = frozenset(
    {"Identity", "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "Tanh",
     "Softplus", "Softsign", "Gelu", "Erf", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs",
     "Sign", "Floor", "Ceil", "Round", "Sin", "Cos", "Tan", "Clip", "Add", "Sub", "Mul", "Div",
     "Pow", "Max", "Min", "Sum", "Mean", "Mod", "PRelu", "Where", "Reshape", "Flatten",
     "Squeeze", "Unsqueeze", "Transpose", "Expand", "Tile", "Concat", "Softmax", "LogSoftmax",
     "Dropout"}
)  # fmt: skip


def sent_as(nodes: Sequence[Any], outputs: Sequence[str]) -> dict[str, frozenset[str]]:
    """For each tensor of a graph (``nodes`` in order, plugserve's IR or onnx's), the graph
    ``outputs`` it is, or reaches through :data:`KEEPS` ops: each of those is at least as large
    as it. (Where's condition is a bool, one byte an element: a lower bound still.)"""
    reach: dict[str, set[str]] = {name: {name} for name in outputs}
    for node in reversed(list(nodes)):
        if node.op_type not in KEEPS or getattr(node, "domain", "") not in ("", "ai.onnx"):
            continue
        names = list(getattr(node, "outputs", None) or node.output)
        found = reach.get(names[0]) if names else None
        if not found:
            continue
        data = list(getattr(node, "inputs", None) or node.input)
        if node.op_type in ("Reshape", "Expand", "Tile"):
            data = data[:1]  # the shape and repeats inputs are not the data
        for name in data:
            if name:
                reach.setdefault(name, set()).update(found)
    return {name: frozenset(found) for name, found in reach.items()}


def check_bytes(nbytes: int, what: str, run: RunContext | None) -> None:
    """Refuse ``nbytes`` of one output over the room of ``run``, before it is allocated."""
    bound = room(run)
    if bound and nbytes > bound:
        # (how much is free is not said: it is what every other request holds, other
        # tenants' too, which a client could read off refusals it asks for)
        raise ResourceExhausted(
            f"{what} would allocate {nbytes:,} bytes, more than this request may hold (what "
            "is free now of the server's --max-inflight-bytes); send smaller sizes, or raise "
            "--max-inflight-bytes"
        )


def check_node(
    node: Any, inputs: Sequence[Any], sent: frozenset[str], run: RunContext | None
) -> None:
    """Before ``node`` runs on its ``inputs``: its outputs' bytes within the run's room, and,
    where its output is (or reaches unreduced) one of the network outputs ``sent`` and the
    request asked for it, within what the answer may carry. ``run``: the run's context, as
    its device has it (the probe's argument; NUMPY's kernels read theirs from
    ``run_context.current()``, where no argument reaches); None: no bound."""
    entry = OUTPUT_BYTES.get(node.op_type)
    if entry is None or run is None or not (run.room or (sent and run.answer)):
        return
    try:
        nbytes = entry[0](node, inputs)
    except (TypeError, ValueError, IndexError, OverflowError):
        return  # inputs the op itself refuses: its kernel says why
    what = f"node {node.name!r} ({node.op_type})"
    if run.network:
        what = f"network {run.network!r}: {what}"
    check_bytes(nbytes, what, run)
    most = run.answer
    if sent and most and nbytes > most:
        wanted = run.outputs
        asked = sorted(sent if wanted is None else sent.intersection(wanted))
        if asked:
            raise ResourceExhausted(
                f"{what} would make output {asked[0]!r} at least {nbytes:,} bytes, more than "
                f"the largest answer this server sends ({most:,} bytes, --max-message-bytes / "
                "PLUGSERVE_MAX_MESSAGE_BYTES): refused before it is computed; send smaller "
                "sizes, or ask for other outputs"
            )


def amplifies(node: Any, constant: Callable[[str], bool]) -> bool:
    """Whether ``node``'s output size depends on a value a request decides: one of its
    deciding inputs is not a constant (``constant(name)``) of the model's."""
    entry = OUTPUT_BYTES.get(node.op_type)
    if entry is None or getattr(node, "domain", "") not in ("", "ai.onnx"):
        return False
    names = list(getattr(node, "inputs", None) or node.input)
    return any(i < len(names) and names[i] and not constant(names[i]) for i in entry[1])


# ------------------------------------------------------------------ the probe (ORT, OPENVINO)

#: ops a probe may run: shape arithmetic on small tensors, whose cost is nothing beside the run
CHEAP = frozenset(
    {"Shape", "Size", "Gather", "GatherElements", "Concat", "Unsqueeze", "Squeeze", "Reshape",
     "Cast", "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Max", "Min", "Floor", "Ceil",
     "Round", "Slice", "Identity", "Constant", "ReduceProd", "ReduceSum", "ReduceMax",
     "ReduceMin", "Equal", "Less", "Greater", "Not", "And", "Or", "Where", "Range", "Sqrt",
     "Clip", "Flatten", "Transpose"}
)  # fmt: skip


class Probe:
    """What a device runs before each request of a network with amplifying nodes: ``model``
    computes each such node's deciding inputs and the shape of its data input; ``judge``
    applies the rules to one run of it."""

    def __init__(
        self,
        model: onnx.ModelProto,
        plan: list[tuple[onnx.NodeProto, list[str], frozenset[str]]],
        constants: dict[str, np.ndarray],
    ) -> None:
        self.model = model
        #: the network inputs the probe reads, and the values it returns, by name
        self.inputs = [i.name for i in model.graph.input]
        self.outputs = [o.name for o in model.graph.output]
        self._plan = plan
        self._constants = constants
        self._wanted = frozenset(self.inputs)
        self._evaluator: Any = None  # made on first use, on the thread that needs it

    def check(self, inputs: Sequence[Any], arrays: Sequence[Any], run: RunContext) -> None:
        """Before a run of checked ``arrays`` (the network's ``inputs``' specs, in order): the
        probe computes the deciding values (onnx's reference evaluator: a few small nodes),
        and :meth:`judge` refuses what outgrows the room of ``run``."""
        feeds = {s.name: a for s, a in zip(inputs, arrays) if s.name in self._wanted}
        if self._evaluator is None:
            from onnx.reference import ReferenceEvaluator

            self._evaluator = ReferenceEvaluator(self.model)
        try:
            values = self._evaluator.run(None, feeds)
        except Exception:  # inputs the network itself will refuse: its run says why
            return
        self.judge(dict(zip(self.outputs, values)), run)

    def judge(self, values: dict[str, Any], run: RunContext) -> None:
        """Refuse the request when an amplifying node would outgrow the room of ``run``
        (``values``: the probe's outputs by name)."""
        for node, names, sent in self._plan:
            inputs: list[Any] = []
            for name in names:
                if name.startswith(_SHAPE):
                    shape = values.get(name)
                    inputs.append(None if shape is None else _Shaped(_ints(shape)))
                elif name:
                    inputs.append(values.get(name, self._constants.get(name)))
                else:
                    inputs.append(None)
            check_node(node, inputs, sent, run)


_SHAPE = "plugserve_amplify_shape_of/"


class _Shaped:
    """An input known only by its shape (the rules read ``shape`` and ``dtype``)."""

    __slots__ = ("dtype", "shape")

    def __init__(self, shape: list[int], dtype: Any = np.float32) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)


def probe(model: onnx.ModelProto) -> Probe | None:
    """The probe of ``model`` (None when no node's size depends on a request's values, or no
    such node's deciding values are cheap to compute before the run)."""
    graph = model.graph
    constants = {i.name for i in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    producers = {o: n for n in graph.node for o in n.output if o}
    graph_inputs = {i.name for i in graph.input if i.name not in constants}

    def cheap_closure(name: str, seen: dict[str, bool]) -> bool:
        if name in seen:
            return seen[name]
        seen[name] = True  # a cycle cannot happen in ONNX; this guards recursion
        if not name or name in constants or name in graph_inputs:
            return True
        node = producers.get(name)
        ok = (
            node is not None
            and node.domain in ("", "ai.onnx")
            and node.op_type in CHEAP
            and all(cheap_closure(i, seen) for i in node.input if i)
        )
        seen[name] = ok
        return ok

    def shape_known(name: str) -> bool:
        """Whether Shape(name) is cheap: its producer chain is cheap, or it is an input."""
        return name in graph_inputs or name in constants or cheap_closure(name, seen)

    seen: dict[str, bool] = {}
    plan: list[tuple[onnx.NodeProto, list[str], frozenset[str]]] = []
    sent = sent_as(graph.node, [o.name for o in graph.output])
    wanted: list[str] = []
    extra: list[onnx.NodeProto] = []
    for position, node in enumerate(graph.node):
        if not amplifies(node, lambda n: n in constants):
            continue
        if not node.name:  # named as plugserve's IR names it, for the refusal's message
            named = onnx.NodeProto()
            named.CopyFrom(node)
            named.name = f"{node.op_type}_{position}"
            node = named
        deciding = OUTPUT_BYTES[node.op_type][1]
        names: list[str] = []
        usable = True
        for index, name in enumerate(node.input):
            if index in deciding or not name:
                if name and not cheap_closure(name, seen):
                    usable = False
                names.append(name)
                if name and name not in constants:
                    wanted.append(name)
            elif index == 0 or node.op_type == "OneHot":
                if shape_known(name):
                    shape_name = f"{_SHAPE}{name}"
                    extra.append(helper.make_node("Shape", [name], [shape_name]))
                    wanted.append(shape_name)
                    names.append(shape_name)
                else:
                    names.append("")  # unknown: the rules count nothing for it
            else:
                names.append(name if name in constants else "")
        if usable:
            plan.append((node, names, sent.get(node.output[0], frozenset())))
    if not plan:
        return None
    wanted = list(dict.fromkeys(wanted))
    keep: list[onnx.NodeProto] = []
    needed = set(wanted)
    for node in reversed(list(graph.node) + extra):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    kept_inputs = [i for i in graph.input if i.name in needed and i.name not in constants]
    initializers = [t for t in graph.initializer if t.name in needed]
    outputs = [helper.make_empty_tensor_value_info(name) for name in wanted]
    sub = helper.make_graph(keep, f"{graph.name}-probe", kept_inputs, outputs, initializers)
    made = helper.make_model(sub, opset_imports=list(model.opset_import))
    made.ir_version = model.ir_version
    constant_values = {
        t.name: onnx.numpy_helper.to_array(t)
        for t in graph.initializer
        if any(t.name in names for _, names, _ in plan)
    }
    return Probe(made, plan, constant_values)
