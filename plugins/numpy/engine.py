"""The execution plan: a graph compiled into a flat list of bound kernels over value slots.

Compilation decides everything once: which kernel runs each node (bound to its attributes),
which slot holds each value, and after which step a value is dead and its slot released so
memory does not grow with depth. A run is then one loop of ``slot = kernel(*slots)``; nothing
is looked up by name or re-decided per request but whether the run was cancelled, asked
before each step (``cancel.py``; a Loop's body is a plan too, so each iteration asks).
Control-flow ops compile their subgraphs into plans of their own through the same function,
with the outer-scope values they read passed in as extra inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import AttributeProto

from plugserve.plugins import amplify, cancel, run_context
from plugserve.plugins.api import InferenceError, PerfCount, PlugserveError, TensorSpec, Unsupported
from plugserve.plugins.ir import Graph, Node, graph_from_proto, subgraph_free_names
from plugserve.plugins.numpy.kernels.registry import KernelContext, Registry, build_kernel

__all__ = ["Plan", "Subgraph", "compile_plan"]

_NONE = 0  # slot 0 always holds None: the value of an absent optional input

try:  # numpy 2 keeps errstate in a context variable: a run sets it in two C calls
    from numpy._core._ufunc_config import _extobj_contextvar
    from numpy._core.umath import _make_extobj

    _QUIET: Any = _make_extobj(all="ignore")
except ImportError:  # numpy 1
    _extobj_contextvar = None


class Step:
    __slots__ = ("fn", "free", "inputs", "node", "outputs", "single")

    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        single: bool,
        node: Node,
    ) -> None:
        self.fn = fn
        self.inputs = inputs
        self.outputs = outputs
        self.single = single
        self.node = node
        self.free: tuple[int, ...] = ()


class Plan:
    """A compiled graph. ``run(inputs)`` takes arrays in input order, returns outputs in order."""

    def __init__(
        self,
        graph: Graph,
        steps: list[Step],
        template: list[Any],
        input_slots: list[int],
        output_slots: list[int],
    ) -> None:
        self.graph = graph
        self.steps = steps
        self._template = template
        self._input_slots = input_slots
        self._output_slots = output_slots
        self._flat = [
            (s.fn, s.inputs, s.outputs[0] if s.single else -1, s.outputs, s.free) for s in steps
        ]

    def run(self, inputs: Sequence[Any], profile: list[PerfCount] | None = None) -> list[Any]:
        """ONNX computes in IEEE arithmetic: log(0) is -inf, 0/0 is nan, a cast of inf to an
        integer is what the hardware gives (as onnxruntime). Those are results, not faults, so
        numpy's floating-point warnings are off for the run (else a served model writes a
        RuntimeWarning to the log for a value the model then masks, as T5's position buckets
        do). Set as ``np.errstate(all="ignore")`` sets it, without its object and two
        Python-level calls per run (a tenth of a tiny network's run) where numpy allows."""
        if _extobj_contextvar is None:
            with np.errstate(all="ignore"):
                return self._run(inputs, profile)
        quiet = _extobj_contextvar.set(_QUIET)
        try:
            return self._run(inputs, profile)
        finally:
            _extobj_contextvar.reset(quiet)

    def _run(self, inputs: Sequence[Any], profile: list[PerfCount] | None) -> list[Any]:
        vals = self._template.copy()
        for slot, value in zip(self._input_slots, inputs):
            vals[slot] = value
        token = cancel.current()
        if profile is not None:
            return self._run_profiled(vals, profile, token)
        index = 0
        try:
            for index, (fn, ins, out, outs, free) in enumerate(self._flat):  # noqa: B007
                if token is not None and token.error is not None:
                    raise token.failure()
                if out >= 0:
                    vals[out] = fn(*[vals[i] for i in ins])
                else:
                    for slot, value in zip(outs, fn(*[vals[i] for i in ins])):
                        vals[slot] = value
                for slot in free:
                    vals[slot] = None
        except PlugserveError:
            raise
        except Exception as exc:
            raise self._failure(index, exc) from exc
        return [_output(vals[s]) for s in self._output_slots]

    def _run_profiled(
        self, vals: list[Any], profile: list[PerfCount], token: cancel.Token | None
    ) -> list[Any]:
        clock = time.perf_counter
        for index, (fn, ins, out, outs, free) in enumerate(self._flat):
            if token is not None:
                token.raise_if_cancelled()
            start = clock()
            try:
                if out >= 0:
                    vals[out] = fn(*[vals[i] for i in ins])
                else:
                    for slot, value in zip(outs, fn(*[vals[i] for i in ins])):
                        vals[slot] = value
            except PlugserveError:
                raise
            except Exception as exc:
                raise self._failure(index, exc) from exc
            elapsed = clock() - start
            node = self.steps[index].node
            profile.append(
                PerfCount(
                    node.name,
                    node.op_type,
                    "EXECUTED",
                    _exec_type(node),
                    elapsed,
                    "NUMPY",
                    tuple(node.fused_names),
                )
            )
            for slot in free:
                vals[slot] = None
        return [_output(vals[s]) for s in self._output_slots]

    def _failure(self, index: int, exc: Exception) -> InferenceError:
        node = self.steps[index].node
        origin = f" (from {', '.join(node.fused_names)})" if node.fused_names != [node.name] else ""
        return InferenceError(
            f"graph {self.graph.name!r}: node {node.name!r} ({node.op_type}){origin} failed: "
            f"{type(exc).__name__}: {exc}"
        )


def _exec_type(node: Node) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain else node.op_type


def _output(value: Any) -> Any:
    """A network output as callers expect arrays: C-ordered (a channel-last conv's result is a
    transposed view, see kernels/conv_nhwc.py) and the caller's own to write."""
    if isinstance(value, np.ndarray):
        if value.flags.c_contiguous and value.flags.writeable:
            return value
        return np.ascontiguousarray(value) if value.flags.writeable else value.copy()
    if value is None or isinstance(value, list):
        return value
    return np.asarray(value)


class Subgraph:
    """A control-flow body: a plan plus which of the node's captured values it reads."""

    def __init__(self, plan: Plan, formal: int, captured_index: list[int]) -> None:
        self.plan = plan
        self.num_inputs = formal
        self._captured_index = captured_index
        self.input_names = [s.name for s in plan.graph.inputs[:formal]]
        self.output_names = [s.name for s in plan.graph.outputs]

    def run(self, inputs: Sequence[Any], captured: Sequence[Any] = ()) -> list[Any]:
        args = list(inputs)
        args.extend(captured[i] for i in self._captured_index)
        return self.plan._run(args, None)  # inside its node's plan: warnings are already off


def compile_plan(
    graph: Graph,
    registry: Registry,
    outer_specs: dict[str, TensorSpec] | None = None,
    unsupported: dict[str, str] | None = None,
    tuner: Any = None,
) -> Plan:
    """Bind a kernel to every node; a node without one raises :class:`Unsupported`, named.

    With an ``unsupported`` dict (QueryNetwork) nothing raises: each node that cannot be
    compiled is recorded there with the reason, and the plan returned is not runnable.
    ``tuner`` (``tuning.Tuner``) gives kernels with several candidates their timing sites.
    """
    slots: dict[str, int] = {"": _NONE}
    template: list[Any] = [None]

    def slot_of(name: str) -> int:
        if name not in slots:
            slots[name] = len(template)
            template.append(None)
        return slots[name]

    for name, value in graph.initializers.items():
        if isinstance(value, np.ndarray) and value.flags.writeable:
            value = value.view()
            value.setflags(write=False)
        template[slot_of(name)] = value
    input_slots = [slot_of(spec.name) for spec in graph.inputs]
    specs = dict(outer_specs or {})
    specs.update(graph.value_info)
    constants = dict(graph.initializers)
    sent: dict[str, frozenset[str]] | None = None  # what reaches an output (made if needed)

    steps: list[Step] = []
    tick = cancel.checking(f"graph {graph.name!r}: binding its kernels")
    for index, node in enumerate(graph.nodes):
        tick(index)
        captured = subgraph_free_names(node)
        opset = graph.node_opset(node)
        entry = registry.lookup(node.domain, node.op_type, opset)
        try:
            if entry is None:
                raise Unsupported(
                    f"node {node.name!r}: "
                    + registry.why_unsupported(node.domain, node.op_type, opset)
                )
            fn = _build(entry, node, graph, registry, specs, constants, captured, tuner)
            if amplify.amplifies(node, constants.__contains__):
                if sent is None:
                    sent = amplify.sent_as(graph.nodes, [spec.name for spec in graph.outputs])
                reaches = sent.get(node.outputs[0], frozenset()) if node.outputs else frozenset()
                fn = _bounded(fn, node, reaches)  # its output's size: the request's values
        except Unsupported as exc:
            if unsupported is None:
                raise
            unsupported[node.name] = str(exc)
            continue
        ins = tuple(slot_of(n) if n else _NONE for n in list(node.inputs) + captured)
        outs = tuple(
            slot_of(n) if n else slot_of(f"\0unused:{node.name}:{i}")
            for i, n in enumerate(node.outputs)
        )
        steps.append(Step(fn, ins, outs, not entry.multi_output and len(outs) == 1, node))

    output_slots = [slot_of(spec.name) for spec in graph.outputs]
    _plan_lifetimes(steps, set(output_slots) | set(input_slots))
    return Plan(graph, steps, template, input_slots, output_slots)


def _bounded(
    fn: Callable[..., Any], node: Node, sent: frozenset[str] = frozenset()
) -> Callable[..., Any]:
    """``fn``, refusing first an output over the run's room, or over the answer's bound where
    it reaches the network outputs ``sent`` (``plugins/amplify.py``). The kernel is bound once
    at load as ``fn(*values)`` and shared by concurrent runs, so no argument reaches it: the
    run's context is read here from the run under way on this thread
    (``run_context.current()``, set by the base ``InferRequest`` from its argument), one of
    the two places it is read (the Loop kernel's scans are the other)."""

    def run(*args: Any) -> Any:
        amplify.check_node(node, args, sent, run_context.current())
        return fn(*args)

    return run


def _build(
    entry: Any,
    node: Node,
    graph: Graph,
    registry: Registry,
    specs: dict[str, TensorSpec],
    constants: dict[str, np.ndarray],
    captured: list[str],
    tuner: Any = None,
) -> Callable[..., Any]:
    if not entry.multi_output and len(node.outputs) != 1:
        raise Unsupported(
            f"node {node.name!r} ({node.op_type}): {len(node.outputs)} outputs requested, "
            "the kernel computes one"
        )
    ctx = KernelContext(
        node,
        graph.node_opset(node),
        [specs.get(name) if name else None for name in node.inputs],
        [specs.get(name) if name else None for name in node.outputs],
        constants,
        _subgraph_factory(node, graph, registry, specs, captured),
        tuner,
    )
    try:
        return build_kernel(entry, ctx)
    except PlugserveError:
        raise
    except Exception as exc:
        raise Unsupported(f"node {node.name!r} ({node.op_type}) cannot be compiled: {exc}") from exc


def _plan_lifetimes(steps: list[Step], keep: set[int]) -> None:
    """Release each intermediate value right after its last reader."""
    last_use: dict[int, int] = {}
    for index, step in enumerate(steps):
        for slot in step.inputs:
            last_use[slot] = index
        for slot in step.outputs:
            last_use.setdefault(slot, index)
    frees: dict[int, list[int]] = {}
    for slot, index in last_use.items():
        if slot != _NONE and slot not in keep:
            frees.setdefault(index, []).append(slot)
    for index, step in enumerate(steps):
        step.free = tuple(frees.get(index, ()))


def _subgraph_factory(
    node: Node, graph: Graph, registry: Registry, specs: dict[str, TensorSpec], captured: list[str]
) -> Callable[[str], Subgraph]:
    def build(attr_name: str) -> Subgraph:
        attr = node.attrs.get(attr_name)
        if attr is None or attr.type != AttributeProto.GRAPH:
            raise Unsupported(f"node {node.name!r}: graph attribute {attr_name!r} is missing")
        body = graph_from_proto(
            attr.g, None, f"{graph.name}/{node.name}/{attr_name}", outer_scope=True
        )
        body.opsets = dict(graph.opsets)
        formal = len(body.inputs)
        local = {i.name for i in body.inputs} | set(body.initializers)
        free = [n for n in _body_free_names(body) if n not in local]
        body.inputs = list(body.inputs) + [specs.get(n) or TensorSpec(n, None, None) for n in free]
        plan = compile_plan(body, registry, specs)
        return Subgraph(plan, formal, [captured.index(n) for n in free])

    return build


def _body_free_names(body: Graph) -> list[str]:
    defined = {i.name for i in body.inputs} | set(body.initializers)
    free: list[str] = []
    for node in body.nodes:
        for name in list(node.inputs) + subgraph_free_names(node):
            if name and name not in defined and name not in free:
                free.append(name)
        defined.update(node.outputs)
    for out in body.outputs:
        if out.name not in defined and out.name not in free:
            free.append(out.name)
    return free
