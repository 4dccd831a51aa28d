"""What a device is told about the request it runs: one frozen :class:`RunContext`.

A run's request used to ride on its cancellation token (12 of the token's 16 fields described
the request), written in three places (the adapter, the data plane at dispatch, an ensemble's
step) and read by devices through the token's context variable, so that a virtual device's
pieces saw whatever the thread's token held and a run handed to another thread (a BATCH of
several requests) lost what it did not copy by hand. Now the request's description is one
value, built by its owner when the run starts and handed to the device as an argument
(``InferRequest.infer_checked(arrays, run)``, ``infer_into``, ``infer_decoupled``); the token
(``plugins/cancel.py``) is cancellation only, and it travels inside the context
(:attr:`RunContext.token`).

Frozen, so a device cannot change what its caller or a sibling piece sees: a virtual device
that runs pieces hands each one its own with :func:`dataclasses.replace` (HETERO: the outputs
a piece sends to the answer, :func:`for_piece`); one that runs several requests as one run
makes one for them together (BATCH: :func:`for_batch`).

The context is also the run's one trace channel: :attr:`RunContext.trace` is the span the
device opens its own under (the data plane's run span; a HETERO piece's, a MULTI device's, a
BATCH wait's for what runs under them); there is no context variable of spans.

One context variable remains, :func:`current`: the run under way on this thread, set by the
base ``InferRequest`` from the argument for the span of the device's run, and read only where
no argument reaches: NUMPY's kernels, bound once at load as ``kernel(*values)`` and shared by
concurrent runs, read the bounds of an output whose size the request's values decide there
(``plugins/numpy/engine.py``'s ``_bounded`` and the Loop kernel, which hand it to
``plugins/amplify.py``). Every other device, virtual devices and the server read the context
they are given and pass it on.

One is built per request, when it starts to run (``Request.context``): a frozen dataclass sets
its fifteen fields through ``object.__setattr__``, about six times what making a ``Token``
costs (measured here under load: 10 us against 1.7 us), which the data plane pays once.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from plugserve.plugins import cancel
from plugserve.plugins.cancel import Token
from plugserve.plugins.tracing import Span, Trace

__all__ = [
    "RunContext",
    "current",
    "enter",
    "for_batch",
    "for_branch",
    "for_piece",
    "from_wire",
    "leave",
    "to_wire",
    "untold",
]


@dataclasses.dataclass(frozen=True, slots=True)
class RunContext:
    """One run's request, as a device sees it (every field but :attr:`token` describes it).

    The field names are those the token's fields had, so a device that read ``run.trace`` or
    ``run.room`` from its argument reads the same here.
    """

    #: the run's cancellation (``plugins/cancel.py``): its checkpoints and callbacks answer to
    #: it; a fresh one when the caller gave none (nobody cancels it but ``InferRequest.cancel``)
    token: Token = dataclasses.field(default_factory=Token)
    #: the name of the network the run is for, for the messages of refusals made deep in a
    #: device (``plugins/amplify.py``); "": unnamed
    network: str = ""
    #: the outputs the caller asked for (None: every one): a network that can skip work for
    #: outputs nobody wants reads it (an ensemble's steps), and the answer's bound applies
    #: only to these
    outputs: tuple[str, ...] | None = None
    #: bytes one output of the run may hold at most (0: no bound): what the server's memory
    #: budget had free when the run started; outputs whose size the request's values decide
    #: are checked against it before they are allocated (``plugins/amplify.py``)
    room: int = 0
    #: bytes the run's answer may carry at most (0: no bound): an output the request asked
    #: for that its values size past it could never be sent (--max-message-bytes), so it is
    #: refused before it is computed, whatever the room
    answer: int = 0
    #: the request's own parameters (KServe's ``parameters`` but those the server acts on:
    #: sequence ids, timeout, ...), for a network that hands them to its model (Triton's
    #: ``request.parameters()`` in a Python model); None: none. Not copied: read it only
    parameters: Mapping[str, Any] | None = None
    #: outputs the model does not produce may be missing from the answer (Triton's ensemble
    #: steps: an output a step leaves out leaves the ensemble's out); otherwise a model that
    #: leaves out an output the request wants fails it, naming the output
    partial_outputs: bool = False
    #: the client's id for the request (KServe's ``id``), for a network that hands it to its
    #: model (a Python model's ``request_id()``); "": none
    request_id: str = ""
    #: the request's sequence as ``(sequence id, flags)`` (flags: 1 its start, 2 its end,
    #: Triton's), for a network that hands them to its model (a Python model's
    #: ``correlation_id()`` and ``flags()``); None: none
    sequence: tuple[int | str, int] | None = None
    #: the span the run's stages open theirs under (``plugins/tracing.py``); None: not traced
    trace: Span | None = None
    #: the request's ``priority`` and ``timeout`` parameters (Triton's: a level, 0 none;
    #: seconds, None none), for a network that hands them on (an ensemble's steps, a Python
    #: model's ``timeout()``)
    priority: int = 0
    timeout: float | None = None
    #: outputs the caller wants in a client's GPU memory (``plugins/cuda_array.py``), by name:
    #: a device that makes one on that GPU copies it there device to device and answers
    #: ``cuda_array.written``; one that does not answers the output as usual (the server then
    #: writes it through the host). None: none. Never passed to a piece or a batch (its
    #: outputs are not the request's answer)
    cuda_outputs: Mapping[str, Any] | None = None
    #: a warm-up run at load (Triton's ``model_warmup``, ``server/control/warmup.py``), before
    #: the network serves: a device may prepare for the shape at once (TORCH and GPU capture
    #: its CUDA graph now, not at the shape's second sight, so the first client request of it
    #: replays)
    warmup: bool = False
    #: the caller's tenant, as the server's auth established it from its token ("": the one
    #: tenant of a server without tokens): a device's caches that could tell one caller about
    #: another's data (a generative network's prefix cache) are partitioned by it
    tenant: str = ""


def for_piece(run: RunContext, sends: Iterable[str], answered: Collection[str]) -> RunContext:
    """``run`` as one piece of a network sees it (a HETERO subgraph): the piece's outputs
    ``sends`` that the request wants in its answer (``answered``: the network's outputs,
    when the request named none), and no other, are what the answer's bound applies to; a
    tensor a piece hands to the next one is never sent. Everything else as the request's."""
    wanted = answered if run.outputs is None else run.outputs
    return dataclasses.replace(
        run, outputs=tuple(name for name in sends if name in wanted), cuda_outputs=None
    )


def for_branch(
    run: RunContext | None, token: Token, outputs: tuple[str, ...], trace: Span | None
) -> RunContext:
    """One branch of a demultiplexing pipeline's fan (OVMS's ``demultiply_count``), under its
    own ``token``, computing the fan's ``outputs``: the request's parameters, priority,
    timeout, tenant and id, as an ensemble's step is told them (Triton hands each step the
    request's), so the branch's steps queue at the request's priority and a generative step
    reuses its caller's prefixes only. No answer's bound, room or CUDA outputs: the branches'
    outputs are gathered into the answer, which the request's own run is bounded by.
    ``run``: the request's (None: an in-process call told nothing)."""
    if run is None:
        return RunContext(token=token, outputs=outputs, trace=trace)
    return RunContext(
        token=token, network=run.network, outputs=outputs, parameters=run.parameters,
        request_id=run.request_id, trace=trace, priority=run.priority, timeout=run.timeout,
        tenant=run.tenant,
    )  # fmt: skip


def for_batch(runs: Sequence[RunContext], token: Token) -> RunContext:
    """One run serving several requests (a BATCH of them), under ``token``: its answer is
    theirs together, bounded by their bounds' sum (none if one has none); it computes the
    outputs any of them asked for (every one if one asked for all); an output may take the
    largest room one of them had (the same budget's free bytes, read when each started: the
    largest is the latest, as one request's own room is); it is for their network."""
    if len(runs) == 1:
        return dataclasses.replace(runs[0], token=token, cuda_outputs=None)
    answers = [r.answer for r in runs]
    rooms = [r.room for r in runs]
    asked = [r.outputs for r in runs]
    outputs = None
    if all(a is not None for a in asked):
        outputs = tuple(sorted({name for a in asked for name in a or ()}))
    return RunContext(
        token=token,
        network=runs[0].network,
        outputs=outputs,
        room=max(rooms) if all(rooms) else 0,
        answer=sum(answers) if all(answers) else 0,
    )


def untold() -> RunContext:
    """The context of a run its caller told nothing (an in-process call with no ``run``): its
    cancellation only, the token of the run under way on this thread (the cancellation
    channel, ``plugins/cancel.py``) or a fresh one, so that ``InferRequest.cancel`` stops it
    either way."""
    token = cancel.current()
    return RunContext() if token is None else RunContext(token=token)


def to_wire(run: RunContext, cancel_id: str) -> dict[str, Any]:
    """What of ``run`` crosses a process boundary (the RAY device's call to its actor on
    another node), as plain values: every field that describes the request (its network's
    name, the outputs it computes, the room and the answer's bound, its parameters, id,
    sequence, priority, timeout, tenant, warm-up, partial outputs), its cancellation as
    ``cancel_id`` (the caller cancels the run on the other side by it, ``RayInferRequest``)
    and its trace as the W3C ``traceparent`` naming the run's span. Not its token (the
    caller's, local) nor :attr:`RunContext.cuda_outputs` (pointers into this machine's GPU
    memory, never another's)."""
    return {
        "cancel": cancel_id,
        "network": run.network,
        "outputs": None if run.outputs is None else list(run.outputs),
        "room": run.room,
        "answer": run.answer,
        "parameters": None if run.parameters is None else dict(run.parameters),
        "partial_outputs": run.partial_outputs,
        "request_id": run.request_id,
        "sequence": None if run.sequence is None else list(run.sequence),
        "traceparent": None if run.trace is None else run.trace.traceparent(),
        "priority": run.priority,
        "timeout": run.timeout,
        "warmup": run.warmup,
        "tenant": run.tenant,
    }


def from_wire(wire: Mapping[str, Any], token: Token) -> RunContext:
    """The run :func:`to_wire` sent, rebuilt on the other side under ``token`` (the one its
    ``cancel`` id cancels there). A traced run's ``trace`` is a :class:`Trace` continuing the
    caller's (its trace id, the caller's run span as its parent), for what a device opens
    there; a node has no exporter of its own, so its spans are not exported (yet): the ids
    are what crosses."""
    trace = None
    parent = wire.get("traceparent")
    if parent:
        _version, trace_id, span_id, _flags = parent.split("-")[:4]
        trace = Trace(_unexported, (int(trace_id, 16), int(span_id, 16)), name="remote")
    outputs, sequence = wire.get("outputs"), wire.get("sequence")
    return RunContext(
        token=token,
        network=wire.get("network", ""),
        outputs=None if outputs is None else tuple(outputs),
        room=wire.get("room", 0),
        answer=wire.get("answer", 0),
        parameters=wire.get("parameters"),
        partial_outputs=wire.get("partial_outputs", False),
        request_id=wire.get("request_id", ""),
        sequence=None if sequence is None else (sequence[0], sequence[1]),
        trace=trace,
        priority=wire.get("priority", 0),
        timeout=wire.get("timeout"),
        warmup=wire.get("warmup", False),
        tenant=wire.get("tenant", ""),
    )


def _unexported(_trace: Trace) -> None:
    """A remote trace's sink: the node exports nothing of its own."""


_run: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar(
    "plugserve_run_context", default=None
)

#: The context of the device run under way on this thread (None outside one): for NUMPY's
#: kernels, which no argument reaches, never for passing a run on.
current: Callable[[], RunContext | None] = _run.get
#: ``entered = enter(run)`` ... ``leave(entered)``: the base ``InferRequest`` around a run
enter: Callable[[RunContext], contextvars.Token] = _run.set
leave: Callable[[contextvars.Token], None] = _run.reset
