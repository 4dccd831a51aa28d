"""Ensembles: Triton's ``platform: "ensemble"`` models and OVMS's DAG pipelines, whose steps run
other models the server serves, tensors handed from step to step by name.

An ensemble is a network of the ``ENSEMBLE`` device, so the data plane, protocols, deadlines,
statistics and the memory budget treat it as any model. Its steps are a small graph decided at
load (:class:`Graph`): which step writes each tensor, which steps wait on which. A request runs
them as Triton's ensemble scheduler does (``ensemble_scheduler.cc``): a step is sent as soon as
the tensors it reads are there, so steps that do not depend on each other run at once; only the
steps the requested outputs need run (the run's outputs travel in its context); each step is a
request of the data plane to its own model and version (counted there, cancelled with the
ensemble's request), and the tensors between steps are arrays in the server's memory, passed
by reference (never serialized or copied: tests/server/test_ensembles.py checks the answer of
a chain of NUMPY steps shares the request's memory).

Threads, and their bounds: a request runs on one stream of the ensemble's executor (NUM_STREAMS,
default :data:`STREAMS`: at most that many ensemble requests run at once, more wait in its
bounded queue), or inline on the caller's thread when one is idle. That thread runs one ready
step itself (inline, as a unary call does: a chain of steps costs no thread hand-off) and hands
the others to their own models' executors (each bounded by its model's streams and queue); it
then waits for the next step to finish. So one request holds one thread of its own, whatever
its number of steps; what runs beside it runs on threads the step models own anyway.

OVMS's demultiplexers (``ovms_dag.py``) are steps of their own (:class:`Fan`): the nodes after
the splitting node are an ensemble of their own (the fan's region), run once per item of the
split outputs, each branch a request on the region's streams (NUM_STREAMS, default
:data:`STREAMS`, each branch holding one thread while it runs; at most :data:`MAX_BRANCHES`
per request, queued there), its items views of the split outputs; the request's thread waits
for the last branch and stacks what they give.

The request's own parameters (KServe's ``parameters``, in its run context) reach every step, as
Triton hands each step the ensemble request's. Sequences (Triton passes the correlation id and
start/end flags of the ensemble's request to its steps): an ensemble one of whose steps' models
has sequence batching takes sequence requests (:class:`SequenceRelay`), and passes the request's
sequence on to each step that is a sequence model (or an ensemble that passes it on); other
steps run as plain requests.

A step's output it did not produce (Triton's optional outputs: a Python model may leave one
out) leaves its tensor unset: a step reading it runs without that input (its model decides
whether that input is optional), and an ensemble output left unset is missing from the answer.

Decoupled steps (a model that answers a request with zero or many responses, as Triton runs
them in ensembles): an ensemble with one is decoupled itself, streamed like any decoupled model.
Each response of a decoupled step starts the steps that read its outputs once more, on those
outputs (a *context* of the request: Triton's iteration of the step's tensors), and each context
answers the requested outputs made in it as one response of the ensemble's; the final flag
follows when every decoupled step has sent its own and every context has run. Which context a
step runs in is decided at load, as Triton labels the tensors (``ensemble_utils.cc``): the
outputs of a decoupled step start a label of their own, a step's outputs take the label of its
inputs, and a step whose inputs come from two decoupled steps that are not one after the other
is refused ("receives inputs originated from different decoupled models"). Triton refuses a step
that reads an ensemble input beside a decoupled step's output too; here a context also sees the
tensors of the context it came from, so such a step runs in the decoupled step's context, with
the input it shares with every response. Contexts run one after another on the request's
thread, in the order their responses came (the ensemble's responses keep the decoupled step's
order: a token stream stays a token stream), each context's independent steps at once as in any
request; a decoupled step's unread responses are bounded by its own stream (``MAX_ITEMS``,
``MAX_BYTES`` of ``server/plane/response_stream.py``: past them the step is cancelled and the
request
fails, ResourceExhausted). A decoupled step runs with its request's parameters, and is cancelled
with it.

Refused at load, each with what does not connect: a step reading a tensor no step writes and
the ensemble does not take, an ensemble output no step writes, a cycle, a tensor two steps
write, a step of a loaded model mapping a tensor it does not have, a tensor whose element type
differs between the step that writes it and the ensemble or the step that reads it, a step
reading the responses of two decoupled steps neither of which follows the other, a decoupled
step in a demultiplexer's branches, and an ensemble that runs itself through another ensemble.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins import cancel, run_context, tracing
from plugserve.plugins.api import (
    BackendUnavailable,
    CompiledNetwork,
    Configuration,
    InferRequest,
    InvalidInput,
    InvalidModel,
    PerfCount,
    Plugin,
    PlugserveError,
    TensorSpec,
    Unsupported,
)
from plugserve.plugins.responses import Response, ResponseSender
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.streams import Finished
from plugserve.server.apps.pipelines.graph import Graph, Plan
from plugserve.server.control.pipelines import Definition, Fan, Step, read_triton_ensemble
from plugserve.server.plane.request import Request
from plugserve.server.plane.tracing import Stage

__all__ = [
    "DECOUPLED_STREAMS",
    "STREAMS",
    "EnsemblePlugin",
    "Graph",
    "SequenceRelay",
]

#: Ensemble requests one ensemble runs at once by default (its NUM_STREAMS): each holds a
#: thread while its steps run. Triton's ensemble scheduler holds none (it is event driven on
#: its composing models' callbacks); plugserve's devices answer a run synchronously, so the
#: bound is on requests in flight, not on steps.
STREAMS = 16
#: ... and a decoupled one's: its request holds the thread for its whole stream (a stream of
#: tokens lasts seconds, and its thread mostly waits for the next response), so more of them
#: run at once before the next waits in the queue
DECOUPLED_STREAMS = 64


#: branches one demultiplexer runs per request at most (OVMS's schema allows 10000; each
#: branch is a request queued on the region's streams, whose queue holds this many)
MAX_BRANCHES = 1024


class EnsembleConfiguration(Configuration):
    """An ensemble's streams: :data:`STREAMS` requests at once unless NUM_STREAMS says."""

    def streams(self, cores: int | None = None) -> int:
        return int(self.get("NUM_STREAMS") or 0) or STREAMS


class EnsembleNetwork(CompiledNetwork):
    #: each demultiplexer's region (set in ``__init__``; empty if it failed before)
    regions: dict[int, EnsembleNetwork] = {}

    @property
    def precision(self) -> str:
        """None to name: each step's network says its own."""
        return ""

    def __init__(self, plugin: EnsemblePlugin, config: Any, definition: Definition) -> None:
        super().__init__(plugin, definition.name, config)
        self.definition = definition
        self.where = where = definition.where
        self.plane = plugin.plane
        steps = definition.steps
        names = [s if isinstance(s, str) else s.name for s in definition.inputs]
        self.graph = Graph(where, steps, set(names), set(definition.outputs.values()))
        #: each demultiplexer's region, a network of its own (by the fan's step index)
        self.regions: dict[int, EnsembleNetwork] = {}
        try:
            for fan in steps:
                if isinstance(fan, Fan):
                    self.regions[fan.index] = EnsembleNetwork(plugin, config, fan.region)
            self._ask_for_steps()
            self._inputs, self._outputs = self._specs()
        except BaseException:
            self.close()
            raise
        self.answers = dict(definition.outputs)  # output -> tensor
        self._every = frozenset(self.answers.values())
        #: per sequence request under way (its run's token), its place in the sequence
        self.sequence_of: dict[cancel.Token, Any] = {}
        #: each step's context label (0: the request's own), the label its outputs take, and
        #: each context label's parent (set by :meth:`_label`; all 0 with no decoupled step)
        self.labels: dict[int, int] = {}
        self.output_labels: dict[int, int] = {}
        self.tensor_labels: dict[str, int] = {}
        self.parents: dict[int, int] = {0: 0}
        self._check_types()
        self._label()
        self._check_nesting()

    # --- load-time checks

    def _ask_for_steps(self) -> None:
        """Ask for each step's model as a request would, before the checks read them: with
        --model-load-on-demand that loads the ones not loaded (``control/on_demand.py``);
        otherwise a missing one is left to the checks and to readiness."""
        for step in self._model_steps():
            if step.model != self.name:  # (running itself: _check_nesting says so)
                with contextlib.suppress(PlugserveError):
                    self.plane.get(step.model, step.version)

    def step_models(self) -> set[str]:
        """The models its steps run, a demultiplexer's branches' too (the hook's)."""
        return {step.model for step in self._model_steps()}

    def _loaded(self, step: Step) -> Any:
        if isinstance(step, Fan):
            return None  # no model of its own: its region's steps were checked with it
        try:  # (never loading: readiness asks this)
            return self.plane.get(step.model, step.version, load=False)
        except PlugserveError:
            return None  # not loaded yet: its requests say so if it never is

    def _specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The definition's specs; where it gives names only (OVMS), the specs of the step
        tensors they connect to, renamed (their models must be loaded)."""
        d = self.definition
        if d.output_specs is not None and all(not isinstance(s, str) for s in d.inputs):
            return list(d.inputs), list(d.output_specs)  # type: ignore[arg-type]
        found: dict[str, TensorSpec] = {}
        for step in self.graph.ordered:
            if isinstance(step, Fan):  # its region's specs; what it gathers, one dim more
                region = self.regions[step.index]
                for spec in region.inputs:
                    known = found.setdefault(spec.name, spec)
                    if None not in (known.dtype, spec.dtype) and known.dtype != spec.dtype:
                        raise InvalidModel(
                            f"{self.where}: tensor {spec.name!r} is {known.dtype} where "
                            f"{step} takes {spec.dtype}"
                        )
                for spec in region.outputs:
                    batch = None if step.count < 0 else step.count
                    shape = (batch, *spec.shape) if spec.shape is not None else None
                    found.setdefault(spec.name, dataclasses.replace(spec, shape=shape))
                continue
            entry = self._loaded(step)
            if entry is None:
                raise InvalidModel(
                    f"{self.where}: {step} runs model {step.model!r}"
                    + (f" version {step.version}" if step.version else "")
                    + ", which is not loaded (see its own load's error)"
                )
            own = {s.name: s for s in [*entry.inputs, *entry.outputs]}
            for model_tensor, tensor in [*step.inputs.items(), *step.outputs.items()]:
                if model_tensor not in own:
                    raise InvalidModel(
                        f"{self.where}: {step} maps {model_tensor!r}, which model "
                        f"{step.model!r} does not have (it has {', '.join(own)})"
                    )
                found.setdefault(tensor, own[model_tensor])
        inputs = [dataclasses.replace(found[n], name=n) for n in d.inputs if n in found]
        unread = [n for n in d.inputs if n not in found]
        if unread:
            raise InvalidModel(f"{self.where}: input {unread[0]!r} is read by no node")
        outputs = [dataclasses.replace(found[t], name=n) for n, t in d.outputs.items()]
        return inputs, outputs

    def _check_types(self) -> None:
        """Element types along each connection, for the steps whose models are loaded."""
        where = self.where
        types = {s.name: s.dtype for s in self._inputs}
        types.update({self.definition.outputs[s.name]: s.dtype for s in self._outputs})
        for step in self.graph.ordered:
            entry = self._loaded(step)
            if entry is None:
                continue
            specs = {s.name: s for s in [*entry.inputs, *entry.outputs]}
            for model_tensor, tensor in [*step.inputs.items(), *step.outputs.items()]:
                spec = specs.get(model_tensor)
                if spec is None:
                    raise InvalidModel(
                        f"{where}: {step} maps {model_tensor!r}, which model {step.model!r} "
                        f"does not have (it has {', '.join(specs)})"
                    )
                known = types.setdefault(tensor, spec.dtype)
                if spec.dtype is not None and known is not None and known != spec.dtype:
                    raise InvalidModel(
                        f"{where}: tensor {tensor!r} is {known} where {step} takes or gives "
                        f"{spec.dtype} ({model_tensor!r} of model {step.model!r})"
                    )

    def _label(self) -> None:
        """Which context each step runs in (Triton's decouple labels, on the steps' loaded
        models): a decoupled step's outputs start a new label, a step's outputs take its
        inputs' label, and the labels a step reads must lie on one line of descent (Triton:
        all equal); the ensemble is decoupled when any step is."""
        names = [s if isinstance(s, str) else s.name for s in self.definition.inputs]
        tensors = dict.fromkeys(names, 0)
        parents = self.parents
        for step in self.graph.ordered:
            entry = self._loaded(step)
            read = {tensors.get(t, 0) for t in step.inputs.values()}
            here = max(read, key=lambda label: self._depth(label), default=0)
            line = self._line(here)
            strays = sorted(label for label in read if label not in line)
            if strays:
                origins = sorted(
                    {t for t in step.inputs.values() if tensors.get(t, 0) in (here, *strays)}
                )
                raise InvalidModel(
                    f"{self.where}: {step} receives inputs originated from different decoupled "
                    f"models ({', '.join(map(repr, origins))} come from the responses of "
                    "decoupled steps neither of which follows the other)"
                )
            out = here
            if isinstance(step, Fan):
                region = self.regions[step.index]
                if region.decoupled:
                    raise InvalidModel(
                        f"{self.where}: {step}: its branches run a decoupled model, which a "
                        "demultiplexer cannot gather; run it after the gathering node"
                    )
            elif entry is not None and entry.network.decoupled:
                out = len(parents)
                parents[out] = here
                self.decoupled = True
            self.labels[step.index] = here
            self.output_labels[step.index] = out
            for tensor in step.outputs.values():
                tensors[tensor] = out
        self.tensor_labels = tensors
        if self.decoupled and not self.config.get("NUM_STREAMS"):
            self.config = type(self.config)({"NUM_STREAMS": DECOUPLED_STREAMS}, self.config)

    def _depth(self, label: int) -> int:
        return len(self._line(label))

    def _line(self, label: int) -> list[int]:
        """``label`` and the labels it descends from, to the request's own (0)."""
        line = [label]
        while line[-1]:
            line.append(self.parents[line[-1]])
        return line

    def _check_nesting(self) -> None:
        """Refuse an ensemble that would run itself: a step's ensemble whose steps, at any
        depth, name this one (Triton's "circular dependency")."""
        seen: set[str] = set()
        todo = [(s, [str(s)]) for s in self.graph.ordered]
        while todo:
            step, path = todo.pop()
            if step.model == self.name:
                raise InvalidModel(
                    f"{self.where}: it runs itself: {' -> '.join(path)} (a circular dependency)"
                )
            entry = self._loaded(step)
            network = entry.network if entry is not None else None
            if not isinstance(network, EnsembleNetwork) or step.model in seen:
                continue
            inner = network.graph
            seen.add(step.model)
            todo += [(s, [*path, str(s)]) for s in inner.ordered]

    # --- readiness

    def _model_steps(self) -> list[Step]:
        """Every step that runs a model, a demultiplexer's branches' too."""
        steps: list[Step] = []
        for step in self.graph.ordered:
            if isinstance(step, Fan):
                steps += self.regions[step.index]._model_steps()
            else:
                steps.append(step)
        return steps

    def unready_reasons(self) -> list[str]:
        """Why it cannot serve now, one line per step whose model is not loaded (empty: every
        step's is). Cheap (a lookup per step), so the server's readiness asks it every time."""
        missing = []
        for step in self._model_steps():
            if self._loaded(step) is None:
                missing.append(
                    f"{self.where} is not ready: {step} runs model {step.model!r}"
                    + (f" version {step.version}" if step.version else "")
                    + ", which is not loaded"
                )
        return missing

    def ready(self) -> bool:
        """Ready when every step's model is loaded and ready (Triton never reports an
        ensemble ready whose composing model is not); a step that is an ensemble is asked the
        same, once per request of readiness whatever the nesting."""
        return self._ready(set())

    def _ready(self, seen: set[str]) -> bool:
        seen.add(self.name)
        for step in self._model_steps():
            entry = self._loaded(step)
            if entry is None:
                return False
            network = entry.network
            if isinstance(network, EnsembleNetwork):
                if network.name not in seen and not network._ready(seen):
                    return False
            elif not network.ready():
                return False
        return True

    @property
    def slow_readiness(self) -> bool:  # type: ignore[override]
        """Asking is slow when a step's model's readiness is (a Python model's processes)."""
        for step in self._model_steps():
            entry = self._loaded(step)
            if entry is not None and entry.network.slow_readiness:
                return True
        return False

    # --- requests

    def plan_for(self, wanted: list[str] | None) -> Plan:
        if not wanted:
            return self.graph.plan(self._every)
        answers = self.answers
        return self.graph.plan(frozenset(answers[n] for n in wanted if n in answers))

    def scheduling(self) -> list[tuple[str, int, dict[str, str], dict[str, str]]]:
        """Its steps as Triton's ``ensemble_scheduling`` lists them, for the model config it
        reports: ``(model, version (-1: latest), input_map, output_map)``; a demultiplexer's
        branch steps are listed in its place."""
        out = []
        for step in self.graph.ordered:
            if isinstance(step, Fan):
                out += self.regions[step.index].scheduling()
            else:
                out.append((step.model, step.version or -1, step.inputs, step.outputs))
        return out

    def sequences_for(self, admission: Callable[..., Any]) -> SequenceRelay | None:
        """What passes sequence requests on to its steps (model control gives it the
        ensemble's admission): a step whose model keeps sequences gets the request's place in
        its sequence, the others run it as any request, as Triton's ensembles pass a request's
        correlation id and flags to every step and answer with them."""
        return SequenceRelay(self, admission)

    def create_infer_request(self) -> InferRequest:
        return EnsembleInferRequest(self)

    def export(self) -> bytes:
        raise Unsupported(f"{self.where} cannot be exported; serve its configuration")

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        super().close()


class SequenceRelay:
    """Sequence requests to an ensemble (Triton passes their correlation id and flags on to the
    ensemble's steps): admitted as any request of the ensemble, their place in the sequence
    kept by their run's token for the run to hand on. It holds no state of its own: the step
    models' sequence batchers keep the sequences. It stands where a sequence model's batcher
    stands (``LoadedNetwork.sequences``), so the protocols route sequence requests to it."""

    hidden_outputs: frozenset[str] = frozenset()
    hidden_inputs: frozenset[str] = frozenset()
    active = 0
    state_bytes = 0
    #: a request of no sequence runs as any; answers carry the request's sequence flags back
    relay = True

    def __init__(self, network: EnsembleNetwork, admission: Callable[..., Any]) -> None:
        self.network = network
        self.admission = admission

    def submit(self, request: Any, wanted: list[str]) -> Any:
        step, inputs, token = request.step, request.inputs, request.run
        deadline, holds, after, inline = (
            request.deadline, request.holds, request.after, request.inline
        )  # fmt: skip
        keep = self.network.sequence_of
        if step is not None:
            keep[token] = step
        try:
            future = self.admission(
                inputs, wanted, deadline, inline, token, holds, after, like=request
            )
        except BaseException:
            keep.pop(token, None)
            raise
        future.add_done_callback(lambda _f: keep.pop(token, None))
        return future

    def close(self) -> int:
        return 0


@dataclasses.dataclass(slots=True, eq=False)
class _Run:
    """One request's steps: ready ones are sent, finished ones fill the tensors and free the
    steps waiting on them. Everything but :meth:`_hand_in` and :meth:`_stop` runs on the
    request's thread."""

    network: EnsembleNetwork
    tensors: dict[str, Any]
    plan: Plan
    #: the ensemble request's run (what its device was told, with its token), which each
    #: step's request answers to and takes its parameters, priority and timeout from
    parent: RunContext | None
    #: a decoupled ensemble's request: where a decoupled step's responses go
    flow: _Flow | None = None
    #: what each step's span opens under (None: the request is not traced; _traced_under)
    span: tracing.Span | None = None
    #: the spans of the steps under way, by step index
    spans: dict[int, tracing.Span] = dataclasses.field(default_factory=dict, init=False)
    sequence: Any = dataclasses.field(default=None, init=False)
    running: dict[int, cancel.Token] = dataclasses.field(default_factory=dict, init=False)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False)
    #: finished steps handed in by other threads (None: the request was cancelled)
    done: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue, init=False)

    def __post_init__(self) -> None:
        if self.parent:
            self.sequence = self.network.sequence_of.get(self.parent.token)

    def go(self) -> None:
        plan = self.plan
        waits = dict(plan.waits)
        ready = list(reversed(plan.first))  # popped from the end: the plan's order
        parent = self.parent
        unhook = parent.token.on_cancel(self._stop) if parent is not None else None
        try:
            left = len(plan.steps)
            while left:
                while len(ready) > 1:  # the others on their own models' streams
                    self._send(ready.pop(), inline=False)
                if ready:  # one on this thread, when its model has a stream idle
                    step = ready.pop()
                    outcome = self._send(step, inline=True)
                    if outcome is None:
                        continue  # queued: it comes back through self.done
                else:
                    item = self.done.get()
                    if item is None:
                        raise parent.token.failure()  # type: ignore[union-attr]
                    step, outcome = item
                left -= 1
                self._finish(step, outcome)
                for after in plan.then[step.index]:
                    waits[after.index] -= 1
                    if not waits[after.index]:
                        ready.append(after)
        except BaseException as exc:
            self._stop()  # the steps still running are of no use now
            for span in list(self.spans.values()):  # their spans end with the request's error
                _close(span, exc)
            raise
        finally:
            if unhook is not None:
                unhook()

    def _step_span(self, step: Step) -> tracing.Span | None:
        """``step``'s span (its label: Triton's "step N", an OVMS node's name), when the
        request is traced: the step's request opens its own spans under it."""
        if self.span is None:
            return None
        attributes: dict[str, Any] = {"plugserve.step": step.index}
        if step.model:
            attributes["plugserve.step_model"] = step.model
        if step.version:
            attributes["plugserve.step_version"] = step.version
        return self.span.span(step.label, attributes)

    def _send(self, step: Step, inline: bool) -> Finished | None:
        """Submit ``step``; its outcome when it ran on this thread, else None (it is handed
        in when done)."""
        span = self._step_span(step)
        if isinstance(step, Fan):
            self._keep(step, span)
            self._fan(step, span)
            return None
        network = self.network
        plane = network.plane
        try:
            entry = plane.get(step.model, step.version)
        except PlugserveError as exc:  # not loaded, or unloaded since: not ready, not unknown
            error = BackendUnavailable(
                f"{network.where} is not ready: {step}: {exc}; retry when "
                f"/v2/models/{network.name}/ready says it is"
            )
            _close(span, error)
            raise error from None
        tensors = self.tensors
        inputs = {m: tensors[t] for m, t in step.inputs.items() if t in tensors}
        token = cancel.Token()
        parent = self.parent
        told: dict[str, Any] = {
            "partial_outputs": True,  # an output a step leaves out is left unset
            "trace": span,  # the step's request opens its spans under the step's
        }
        if parent is not None:
            told["parameters"] = parent.parameters  # Triton hands each step the request's
            told["priority"], told["timeout"] = parent.priority, parent.timeout  # as Triton's
            told["tenant"] = parent.tenant  # a generative step's prefix cache is the caller's
            if parent.token.error is not None:
                token.cancel(parent.token.failure())
        if entry.network.decoupled:
            if self.flow is None or network.output_labels[step.index] == 0:
                error = Unsupported(
                    f"{network.where}: {step}: model {step.model!r} is decoupled, and was not "
                    "when the ensemble loaded; load the ensemble again to stream it"
                )
                _close(span, error)
                raise error
            return self.flow.open(step, entry, inputs, token, self.tensors, span, told)
        self._keep(step, span)
        with self.lock:
            self.running[step.index] = token
        sequence = self.sequence if entry.sequences is not None else None
        request = Request(
            entry, inputs, outputs=step.asked, run=token, step=sequence, inline=inline,
            protocol="ensemble", **told,
        )  # fmt: skip
        future = plane.infer(request)
        if type(future) is Finished:
            return future
        future.add_done_callback(lambda f, s=step: self.done.put((s, f)))
        return None

    def _keep(self, step: Step, span: tracing.Span | None) -> None:
        """Keep ``step``'s span until :meth:`_finish` ends it (or the request's failure)."""
        if span is not None:
            self.spans[step.index] = span

    def _finish(self, step: Step, outcome: Any) -> None:
        with self.lock:
            self.running.pop(step.index, None)  # a decoupled step's stream is the flow's
        if self.spans:
            span = self.spans.pop(step.index, None)
            if span is not None:
                _close(span, outcome.exception())
        outputs = outcome.result()  # a step's error is the request's
        if isinstance(step, Fan):
            outputs = _gather(step, outputs)
        tensors = self.tensors
        for model_output, tensor in step.outputs.items():
            value = outputs.get(model_output)
            if value is not None:  # not produced: left unset (Triton's optional outputs)
                tensors[tensor] = value

    def _fan(self, fan: Fan, span: tracing.Span | None) -> None:
        """Send one request of ``fan``'s region per branch; the list of their outputs is
        handed in once all are done, or the first error at once (the others are cancelled).
        A traced request's branches each have a span under the fan's (``span``), which the
        region's steps open theirs under."""
        tensors = self.tensors
        parts = {t: tensors[t] for t in fan.split if t in tensors}
        count = _branches(fan, parts)
        region = self.network.regions[fan.index]
        token = cancel.Token()  # the fan's: cancelling it cancels every branch
        with self.lock:
            self.running[fan.index] = token
        parent = self.parent
        if parent is not None and parent.token.error is not None:
            token.cancel(parent.token.failure())
        results: list[Any] = [None] * count
        left = [count]
        lock = threading.Lock()
        done = self.done

        def finished(index: int, future: Any, branch_span: tracing.Span | None) -> None:
            error = future.exception()
            _close(branch_span, error)
            with lock:
                if left[0] <= 0:
                    return  # an error was handed in already
                if error is not None:
                    left[0] = 0
                else:
                    results[index] = future.result()
                    left[0] -= 1
                last = left[0] == 0
            if error is not None:
                token.cancel(error if isinstance(error, PlugserveError) else None)
                done.put((fan, Finished(exception=error)))
            elif last:
                done.put((fan, Finished(results)))

        wanted = tuple(s.name for s in region.outputs)
        names = [s.name for s in region.inputs]
        if span is not None:
            span.set("plugserve.branches", count)
        for index in range(count):
            arrays = [parts[n][index] if n in parts else tensors[n] for n in names]
            branch = cancel.Token()
            trace = None if span is None else span.span(f"branch {index}")
            told = run_context.for_branch(parent, branch, wanted, trace)
            token.on_cancel(lambda b=branch: b.cancel(token.failure()))
            try:
                future = region.executor.submit(
                    functools.partial(_run_branch, arrays, told), token=branch
                )
            except PlugserveError as exc:  # its queue is full: the branches sent stop
                _close(told.trace, exc)
                token.cancel(exc)
                raise
            future.add_done_callback(functools.partial(finished, index, branch_span=told.trace))

    def _stop(self) -> None:
        """Cancel the steps under way (the request was cancelled, or failed)."""
        parent = self.parent
        error = _failure_of(parent)
        with self.lock:
            tokens = list(self.running.values())
        for token in tokens:
            token.cancel(error)
        if error is not None:
            self.done.put(None)


@dataclasses.dataclass(slots=True, eq=False)
class _Flow:
    """One request of a decoupled ensemble: its decoupled steps' streams, and the contexts
    their responses start (module docstring). The streams' listeners only queue a wake-up;
    everything else runs on the request's thread."""

    network: EnsembleNetwork
    plan: Plan
    sender: ResponseSender
    #: the ensemble outputs the request asked for
    wanted: list[str]
    parent: RunContext | None
    #: what the steps' spans open under (None: not traced)
    span: tracing.Span | None = None
    #: (step, stream, the tensors of the context it ran in); None: the request was cancelled
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue, init=False)
    #: the decoupled steps' streams not yet final, and their tokens
    streaming: int = dataclasses.field(default=0, init=False)
    tokens: list[cancel.Token] = dataclasses.field(default_factory=list, init=False)

    def open(
        self,
        step: Step,
        entry: Any,
        inputs: dict[str, Any],
        token: Any,
        tensors: dict,
        span: tracing.Span | None = None,
        told: dict[str, Any] | None = None,
    ) -> Finished:
        """Start decoupled ``step`` (on the request's thread): its responses wake the request's
        thread as they come. Done at once for the context it runs in (what it makes starts
        contexts of its own). ``span``: the step's, which ends with its stream; ``told``: what
        the step's request says of the ensemble's (``Request``'s keywords)."""
        request = Request(
            entry, inputs, outputs=step.asked, run=token, protocol="ensemble", **(told or {})
        )
        try:
            stream = self.network.plane.stream(request)
        except BaseException as exc:
            _close(span, exc)
            raise
        if span is not None:
            stream.when_ended(functools.partial(_close, span))
        self.tokens.append(token)
        self.streaming += 1
        events = self.events
        stream.add_listener(lambda: events.put((step, stream, tensors)))
        return Finished({})

    def run(self, tensors: dict[str, Any]) -> None:
        """The request's own context, then each response's, in the order they come; the
        final flag once every stream is final."""
        network, plan, parent = self.network, self.plan, self.parent
        unhook = (
            parent.token.on_cancel(lambda: self.events.put(None)) if parent is not None else None
        )
        try:
            _Run(network, tensors, plan.part(0, network.labels), parent, self, self.span).go()
            if not self._answer(tensors, 0):
                return
            while self.streaming:
                event = self.events.get()
                if event is None:
                    raise parent.token.failure()  # type: ignore[union-attr]
                step, stream, base = event
                try:
                    items = stream.take()
                except PlugserveError as exc:
                    raise type(exc)(f"{network.where}: {step}: {exc}") from None
                for item, final in items:
                    self.streaming -= final
                    if item is None:
                        continue
                    if item.error is not None:
                        error = item.error
                        kind = type(error) if isinstance(error, PlugserveError) else InvalidInput
                        raise kind(f"{network.where}: {step}: {error}") from None
                    if not self._context(step, item, base):
                        return
            self.sender.send(None, final=True)
        finally:
            if unhook is not None:
                unhook()
            self._stop()

    def _context(self, step: Step, response: Response, base: dict[str, Any]) -> bool:
        """The steps that read ``step``'s outputs, run on ``response``'s; False once the
        client no longer reads."""
        network = self.network
        label = network.output_labels[step.index]
        tensors = dict(base)  # the context it came from, as that context ended
        for model_output, tensor in step.outputs.items():
            value = response.outputs.get(model_output)
            if value is not None:
                tensors[tensor] = value
        part = self.plan.part(label, network.labels)
        _Run(network, tensors, part, self.parent, self, self.span).go()
        return self._answer(tensors, label)

    def _answer(self, tensors: dict[str, Any], label: int) -> bool:
        """The requested outputs made in a context of ``label``, as one response (none when
        it made none); False once the client no longer reads."""
        network = self.network
        answers, labels = network.answers, network.tensor_labels
        outputs = {}
        for name in self.wanted:
            tensor = answers.get(name)
            if tensor in tensors and labels.get(tensor, 0) == label:
                outputs[name] = tensors[tensor]
        return not outputs or self.sender.send(Response(outputs))

    def _stop(self) -> None:
        """Cancel the decoupled steps still streaming (the request ended: done, failed,
        cancelled, or its client gone)."""
        if not self.streaming:
            return
        parent = self.parent
        error = _failure_of(parent)
        for token in self.tokens:
            token.cancel(error)


def _branches(fan: Fan, parts: dict[str, Any]) -> int:
    """How many branches ``fan`` splits its tensors into: their first dimension, the same for
    each, at least 2 dimensions each (OVMS's rules), demultiply_count unless that is -1."""
    counts = set()
    for tensor, value in parts.items():
        shape = getattr(value, "shape", ())
        if len(shape) < 2:
            raise InvalidInput(
                f"{fan}: output {tensor!r} has shape {list(shape)}; a demultiplexer's outputs "
                "need at least 2 dimensions (the first is split into branches)"
            )
        counts.add(int(shape[0]))
    if len(counts) != 1:
        raise InvalidInput(
            f"{fan}: its outputs' first dimensions differ ({sorted(counts)}); each must hold "
            "one item per branch"
        )
    (count,) = counts
    if fan.count >= 0 and count != fan.count:
        raise InvalidInput(
            f"{fan}: demultiply_count is {fan.count} but its outputs hold {count} items; send "
            f"inputs that make {fan.count}, or set demultiply_count -1"
        )
    if not 0 < count <= MAX_BRANCHES:
        raise InvalidInput(
            f"{fan}: its outputs hold {count} items; a demultiplexer runs 1 to {MAX_BRANCHES} "
            "branches per request"
        )
    return count


def _traced_under(run: RunContext | None) -> tracing.Span | None:
    """The span a traced ensemble request's steps open theirs under (None: it is not traced):
    the ensemble's model span, the parent of the run's span the data plane put in its
    context (``server/plane/tracing.py``'s ``Stage``, whose ``compute`` it is), as Triton nests
    a composing model's spans under its ensemble's; for a demultiplexer's branch, which its
    region runs without the data plane, the branch's span its fan put in its context."""
    here = None if run is None else run.trace
    if here is None:
        return None
    model = here.parent
    return model if isinstance(model, Stage) and model.compute is here else here


def _failure_of(parent: RunContext | None) -> PlugserveError | None:
    """The ensemble request's error once it was cancelled (None: it was not)."""
    if parent is None or parent.token.error is None:
        return None
    return parent.token.failure()


def _close(span: tracing.Span | None, error: BaseException | None = None) -> None:
    """End a step's (or branch's) span, with the error that ended the step."""
    if span is not None:
        if error is not None:
            span.fail(error)
        span.end()


def _run_branch(arrays: list[Any], run: RunContext, request: InferRequest) -> Any:
    """One branch of a fan, on a stream of its region's network (``request``: the stream's)."""
    return request.infer_checked(arrays, run)


def _gather(fan: Fan, branches: list[dict[str, Any]]) -> dict[str, Any]:
    """The branches' outputs stacked along a new first dimension, in branch order (an output
    a branch left unset is left unset)."""
    out = {}
    for tensor in fan.outputs:
        values = [b.get(tensor) for b in branches]
        if all(v is not None for v in values):
            out[tensor] = np.stack(values)
    return out


class EnsembleInferRequest(InferRequest):
    network: EnsembleNetwork

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        network = self.network
        tensors: dict[str, Any] = {s.name: a for s, a in zip(network.inputs, arrays)}
        wanted = None if run.outputs is None else list(run.outputs)
        _Run(network, tensors, network.plan_for(wanted), run, span=_traced_under(run)).go()
        answers = network.answers
        names = wanted or [s.name for s in network.outputs]
        return {n: tensors[answers[n]] for n in names if answers.get(n) in tensors}

    def infer_decoupled(
        self, arrays: list[Any], sender: ResponseSender, run: RunContext | None = None
    ) -> None:
        """A decoupled ensemble's request (one with a decoupled step): a response per context
        that makes requested outputs, then the final flag (:class:`_Flow`); an ensemble
        without one answers once, final."""
        network = self.network
        if not network.decoupled:
            super().infer_decoupled(arrays, sender, run)
            return
        tensors: dict[str, Any] = {s.name: a for s, a in zip(network.inputs, arrays)}
        parent = run if run is not None else run_context.untold()
        wanted = list((parent.outputs if parent is not None else None) or ()) or [
            s.name for s in network.outputs
        ]
        plan = network.plan_for(wanted)
        _Flow(network, plan, sender, wanted, parent, _traced_under(parent)).run(tensors)

    def get_performance_counts(self) -> list[PerfCount]:
        return []


class EnsemblePlugin(Plugin):
    """Ensembles as a device of the server (its data plane runs their steps)."""

    name = "ENSEMBLE"
    config_class = EnsembleConfiguration
    cancellation = "at once: its running steps are cancelled, each stopping as its device can"

    def __init__(self) -> None:
        super().__init__()
        #: the server's data plane, set when the server is made
        self.plane: Any = None

    def device_name(self) -> str:
        return "Triton ensembles and OVMS pipelines (steps run through the server's data plane)"

    def load_network(self, model: Any, config: Any = None) -> CompiledNetwork:
        if self.plane is None:
            raise InvalidModel("an ensemble runs its steps through a server: serve it")
        if isinstance(model, Definition):
            definition = model
        elif not isinstance(model, str | Path):  # (a client's bytes: a TypeError, INTERNAL)
            raise InvalidModel(
                "ENSEMBLE loads a repository's ensembles, not model bytes: put its "
                'config.pbtxt (platform: "ensemble") in the model repository'
            )
        else:
            path = Path(model)
            if not (path.parent / "config.pbtxt").is_file():
                raise InvalidModel(
                    "an ensemble is a repository entry whose config.pbtxt says platform: "
                    '"ensemble", or a pipeline of an OVMS config.json'
                )
            definition = read_triton_ensemble(path)
        return EnsembleNetwork(self, self.merged_config(config, strict=False), definition)

    def query_network(self, model: Any, config: Any = None) -> dict[str, str]:
        return {}

    def import_network(self, blob: bytes, config: Any = None) -> CompiledNetwork:
        raise Unsupported("ensembles are not exported; serve their configuration")
