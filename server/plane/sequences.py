"""Triton's sequence batcher: requests that carry a sequence's state from one to the next.

A model whose ``config.pbtxt`` has ``sequence_batching`` is served as Triton serves it. Each
request names its sequence (``sequence_id``, a uint64 or a string) and marks its first and last
(``sequence_start``, ``sequence_end``). The batcher, which sits beside the data plane's
request path as Triton's sits beside its dynamic batcher, then:

- feeds the model the control inputs the config names (START, END, READY, CORRID), in the
  config's own encodings;
- keeps each sequence's implicit state (the config's ``state`` pairs: the model's state
  output of one request is its state input of the next, zeros or ``initial_state`` at the
  start) here, in the server, so a client never sends or receives it;
- runs a sequence's requests one at a time and in order (``direct``), or gathers the ready
  requests of many sequences into one batch (``oldest``: up to the largest preferred batch
  size, waiting at most ``max_queue_delay_microseconds`` for more; a batch whose run fails
  runs each of its requests again alone, so that one sequence's bad input fails its own);
- ends a sequence at its END request, or once it has been idle for
  ``max_sequence_idle_microseconds`` (Triton's default: 1 s), and frees its state.

Bounds: a server-wide ``--max-sequences`` and a per-model cap (``oldest``'s
``max_candidate_sequences``) refuse a new sequence beyond them (RESOURCE_EXHAUSTED, where
Triton would hold it in a backlog), and every sequence's state is charged to
``--max-inflight-bytes`` while it is held. One reaper thread serves every model: it ends idle
sequences and fails the queued requests whose deadline passed while they waited their turn
(a slow request held the ones behind it past --max-request-seconds, each a caller's thread).

Tenants (``--auth-tokens``, docs/security.md): a sequence is its tenant's. Ids are looked up
among the caller's tenant's sequences only, so another tenant's id is one never started: it
cannot be read, continued, ended or restarted (a red team's second token had read and changed
another tenant's accumulated state, ended it, and found live ids by their answers). A tenant
holds at most its share of --max-sequences and of a model's own cap (``shares.py``: seven
eighths alone, less as more tenants hold some): no tenant, nor two, can take them all. The
model's CORRID control is the client's id as sent (as Triton's): a model that keeps state of
its own by it sees two tenants' equal ids alike.

A request dropped before it runs (cancelled, late) lets the next of its sequence run; that
chain is a loop on the thread that runs it, never a recursion (1,000 queued late requests had
overflowed the stack and left their sequence busy for good, and its callers waiting).

Messages begin with Triton's own words (triton-inference-server/core:
sequence_batch_scheduler.cc, sequence_utils.h), which clients match on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    InvalidInput,
    PlugserveError,
    ResourceExhausted,
    TensorSpec,
    listing,
)
from plugserve.plugins.threads import Watchlist, start_daemon
from plugserve.server.plane import shares
from plugserve.server.plane.budget import Charge, MemoryBudget
from plugserve.server.plane.sequence_config import (
    SequenceSettings,
    resolved_state,
)

if TYPE_CHECKING:
    from plugserve.server.plane.request import Request

__all__ = ["SequenceBatcher", "Sequences", "Step", "echoed", "sequence_step"]

log = logging.getLogger(__name__)

#: the runs a thread still has to start, while it starts one (see :meth:`SequenceBatcher._run`)
_here = threading.local()
#: a queued request's states (``_Item.state``)
WAITING, STARTED, EXPIRED = 0, 1, 2


class SequenceExists(PlugserveError):
    """OVMS: a START for an id that is in use."""

    code = "ALREADY_EXISTS"


class SequenceMissing(PlugserveError):
    """OVMS: a request for an id that is not in use."""

    code = "NOT_FOUND"


class SequencesFull(PlugserveError):
    """OVMS: max_sequence_number reached."""

    code = "UNAVAILABLE"


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class Step:
    """One request's place in its sequence (KServe's sequence_id / _start / _end)."""

    id: int | str
    start: bool
    end: bool


def sequence_step(parameters: Mapping[str, Any] | None) -> Step | None:
    """The request parameters' sequence, or None when they name none (an id of 0 or "",
    Triton's "no sequence")."""
    if not parameters:
        return None
    ident = parameters.get("sequence_id", 0)
    flags = {}
    for key in ("sequence_start", "sequence_end"):
        value = parameters.get(key, False)
        if not isinstance(value, bool):
            raise InvalidInput(f"request parameter {key!r} must be a boolean, not {value!r}")
        flags[key] = value
    if isinstance(ident, bool) or not isinstance(ident, int | str):
        raise InvalidInput(
            f"request parameter 'sequence_id' must be an unsigned integer or a string, "
            f"not {ident!r}"
        )
    if isinstance(ident, int) and not 0 <= ident < 1 << 64:
        raise InvalidInput(f"request parameter 'sequence_id' {ident} is not a uint64")
    if isinstance(ident, str) and len(ident) > 256:
        raise InvalidInput("request parameter 'sequence_id' is over 256 characters")
    if ident in (0, ""):
        if flags["sequence_start"] or flags["sequence_end"]:
            return Step(ident, flags["sequence_start"], flags["sequence_end"])
        return None
    return Step(ident, flags["sequence_start"], flags["sequence_end"])


def echoed(entry_sequences: Any, step: Step | None) -> dict[str, Any] | None:
    """The parameters an answer carries back for a request of a sequence: Triton's ensembles
    answer each with its ``sequence_id``, ``sequence_start`` and ``sequence_end`` (a relay's,
    :attr:`SequenceRelay.relay`); a sequence model's answers carry none, as Triton's."""
    if step is None or entry_sequences is None or not entry_sequences.relay:
        return None
    return {"sequence_id": step.id, "sequence_start": step.start, "sequence_end": step.end}


class _Item:
    """One admitted request of a sequence, waiting for its turn or running; ``checked``: its
    inputs were checked against the network's specs already (a protocol's plain lane)."""

    __slots__ = (
        "after", "checked", "deadline", "future", "holds", "inputs", "like", "state", "step",
        "token", "wanted",
    )  # fmt: skip

    def __init__(self, step, inputs, wanted, deadline, token, holds, after, checked, like) -> None:
        self.step, self.inputs, self.wanted = step, inputs, wanted
        self.deadline, self.token, self.holds, self.after = deadline, token, holds, after
        self.checked = checked
        #: the request it is (its id, parameters, sequence... for the run made of it alone)
        self.like = like
        self.future: Future = Future()
        #: WAITING, then STARTED (its run taken) or EXPIRED (answered late by the reaper),
        #: decided under the batcher's lock: only one of the two touches its future
        self.state = WAITING


class _Sequence:
    __slots__ = ("busy", "charge", "ended", "id", "last", "nbytes", "pending", "states", "tenant")

    def __init__(self, ident: int | str, charge: Charge, tenant: str = "") -> None:
        self.id = ident
        self.tenant = tenant
        self.states: dict[str, np.ndarray] | None = None  # None: the initial ones
        self.pending: collections.deque[_Item] = collections.deque()
        self.busy = False
        self.last = time.monotonic()
        self.ended = False
        self.charge = charge
        self.nbytes = 0  # of its states, whether or not the budget counts them


#: ``submit(feed, outputs, deadline, inline, token, holds, ..., like=None, tenant="") -> Future``:
#: the data plane's plain admission of one run (its queue, deadline, budget and statistics);
#: ``like``: the request the run is for, whose description its device is told
#: (``Request(like=...)``); ``tenant``: a run of several rows' (one tenant's).
Submit = Callable[..., Any]


class Sequences:
    """What every model's batcher shares: --max-sequences, the state budget, one reaper."""

    def __init__(self, max_sequences: int, budget: MemoryBudget) -> None:
        self.max_sequences = max_sequences
        self.budget = budget
        self.active = 0
        #: tenant -> its active sequences (tenants of the token file only: "" is not bounded)
        self._tenants: dict[str, int] = {}
        self._lock = threading.Lock()
        #: the batchers whose idle sequences the reaper ends
        self.batchers: Watchlist[SequenceBatcher] = Watchlist("sequence-reaper", self._reap)
        self._stop = threading.Event()

    def take(self, model: str, tenant: str = "") -> None:
        """One more active sequence of ``tenant``, within --max-sequences and, with tokens,
        the tenant's share of it (the refusals say no count of the others')."""
        with self._lock:
            if self.max_sequences and self.active >= self.max_sequences:
                raise ResourceExhausted(
                    f"model '{model}': this server's sequences (--max-sequences "
                    f"{self.max_sequences}) are all active; end one (sequence_end) or retry "
                    "once an idle one has timed out"
                )
            tenant = shares.key(tenant)
            held = self._tenants.get(tenant, 0)
            if (
                tenant
                and self.max_sequences
                and not shares.may_take(self._tenants, tenant, self.max_sequences)
            ):
                raise ResourceExhausted(
                    f"model '{model}': this tenant has {held} sequences active, its share of "
                    f"this server's --max-sequences {self.max_sequences} (docs/security.md); "
                    "end one (sequence_end) or retry once an idle one has timed out"
                )
            self.active += 1
            if tenant:
                self._tenants[tenant] = held + 1

    def give_back(self, tenant: str = "") -> None:
        tenant = shares.key(tenant)
        with self._lock:
            self.active -= 1
            if tenant:
                left = self._tenants.get(tenant, 1) - 1
                if left:
                    self._tenants[tenant] = left
                else:
                    self._tenants.pop(tenant, None)

    def _reap(self) -> None:
        while not self._stop.wait(0.05):
            batchers = self.batchers.items()
            now = time.monotonic()
            for batcher in batchers:
                batcher.reap(now)

    def close(self) -> None:
        self._stop.set()


class SequenceBatcher:
    """One model version's sequences (see the module's docstring). ``submit`` is the data
    plane's admission of one plain run; ``name`` the model's."""

    #: it keeps the sequences itself (an ensemble's relay passes them on: ``relay`` True, and
    #: a request of no sequence is then an ordinary one)
    relay = False

    def __init__(
        self,
        name: str,
        settings: SequenceSettings,
        max_batch_size: int,
        specs: list[TensorSpec],
        outputs: list[str],
        submit: Submit,
        shared: Sequences,
        joined: Callable[[int, BaseException | None], None] = lambda requests, error: None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.max_batch_size = max_batch_size
        self._submit = submit
        self._shared = shared
        self._joined = joined
        inputs = [spec.name for spec in specs]
        #: the network's inputs in its order (a checked run's arrays are passed so)
        self._order = inputs
        missing = [
            n
            for n in [c.name for c in settings.controls] + [s.input for s in settings.states]
            if n not in inputs
        ] + [s.output for s in settings.states if s.output not in outputs]
        if missing:
            raise InvalidArgument(
                f"model '{name}': sequence_batching names {listing(missing)}, which the model "
                f"does not have (its inputs {listing(inputs)}, outputs {listing(outputs)})"
            )
        #: what a client sends and may ask for: the rest is the batcher's
        self.hidden_inputs = frozenset(
            [c.name for c in settings.controls] + [s.input for s in settings.states]
        )
        self.hidden_outputs = frozenset(s.output for s in settings.states)
        self._state_outputs = [s.output for s in settings.states]
        if any(s.initial is None for s in settings.states):
            by_name = {spec.name: spec for spec in specs}
            resolved = tuple(
                resolved_state(s, by_name[s.input], max_batch_size) for s in settings.states
            )
            settings = self.settings = dataclasses.replace(settings, states=resolved)
        self._ovms = settings.style == "ovms"
        #: OVMS: the next id handed to a START without one, per tenant
        self._next_ids: dict[str, int] = {}
        #: a new sequence's state, charged before it starts (a growing one is charged again
        #: as it grows, once the run that grew it is done)
        self._initial_bytes = sum(s.initial.nbytes for s in settings.states)
        self._lock = threading.Lock()
        #: by (tenant, id): a tenant's ids name its own sequences only
        self._sequences: dict[tuple[str, int | str], _Sequence] = {}
        #: ended sequences whose requests are still queued or running (the reaper answers
        #: their late ones too)
        self._draining: set[_Sequence] = set()
        self.state_bytes = 0
        self._ready: collections.deque[_Sequence] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._batching = settings.strategy == "oldest" and max_batch_size > 0
        if self._batching:
            start_daemon(f"{name}-oldest", self._gather)
        shared.batchers.add(self)

    @property
    def active(self) -> int:
        return len(self._sequences)

    def tenants(self) -> set[str]:
        """The tenants with a sequence open here (what on-demand loading reads: a model a
        tenant's sequences hold may still go when that tenant holds more than its share of
        --models-max, ``control/on_demand.py``)."""
        with self._lock:
            return {tenant for tenant, _ in self._sequences}

    # --- admission

    def submit(self, request: Request, wanted: list[str]) -> Future:
        """Admit one request of a sequence; its future holds the outputs ``wanted``.
        ``request.inline``: the caller waits for it (a unary call), so when it can run at once
        it runs on the caller's thread. ``request.checked``: its inputs (by name in
        ``request.inputs``) passed the network's checks already, so its run (one row) is
        admitted without checking them again."""
        step, inputs, inline = request.step, request.inputs, request.inline
        checked = request.checked is not None
        deadline, token, holds, after = request.deadline, request.run, request.holds, request.after
        if self._ovms:
            inputs, step = self._ovms_step(inputs, step)
        elif step is None or step.id in (0, ""):
            raise InvalidInput(
                f"inference request to model '{self.name}' must specify a non-zero or non-empty "
                "correlation ID"
            )
        self._check(step, inputs)
        item = _Item(step, inputs, wanted, deadline, token, holds, after, checked, request)
        with self._lock:
            if self._closed:
                raise ResourceExhausted(
                    f"model '{self.name}' is unloading; start the sequence again"
                )
            tenant = request.tenant
            if self._ovms and step.start and step.id == 0:
                step = item.step = self._free_id(step, tenant)
            sequence = self._sequences.get((tenant, step.id))
            if self._ovms:
                self._ovms_check(step, sequence, tenant)
            if step.start:
                if sequence is not None:
                    log.warning(
                        "sequence %r for model '%s' has a conflict. The previous sequence did "
                        "not end before this sequence start. Previous sequence will be "
                        "terminated early.",
                        step.id,
                        self.name,
                    )
                    self._end(sequence)
                sequence = self._open(step.id, tenant)
            elif sequence is None:
                raise InvalidInput(
                    f"inference request for sequence {step.id} to model '{self.name}' must "
                    "specify the START flag on the first request of the sequence"
                )
            sequence.last = time.monotonic()
            sequence.pending.append(item)
            if step.end:
                self._end(sequence)
            rows = None if sequence.busy else self._make_ready(sequence)
        if rows:
            self._run(rows, inline)
        return item.future

    def _ovms_step(
        self, inputs: Mapping[str, Any], step: Step | None
    ) -> tuple[dict[str, Any], Step]:
        """OVMS: the sequence from the ``sequence_id`` (uint64) and ``sequence_control_input``
        (uint32: 0 none, 1 start, 2 end) inputs, one element each, taken out of ``inputs``."""
        inputs = dict(inputs)
        values = {}
        for key, dtype in (("sequence_id", np.uint64), ("sequence_control_input", np.uint32)):
            value = inputs.pop(key, None)
            if value is None:
                values[key] = 0
                continue
            array = np.asarray(value)
            if array.size != 1 or array.dtype != dtype:
                raise InvalidInput(
                    f"model '{self.name}': special input {key!r} must be one {np.dtype(dtype)} "
                    f"value (shape [1]), not {array.dtype} of shape {list(array.shape)}"
                )
            values[key] = int(array.reshape(-1)[0])
        control = values["sequence_control_input"]
        if control not in (0, 1, 2):
            raise InvalidInput(
                f"model '{self.name}': unexpected value of sequence_control_input {control}: "
                "0 (none), 1 (SEQUENCE_START) or 2 (SEQUENCE_END)"
            )
        if step is not None:
            raise InvalidInput(
                f"model '{self.name}' is an OVMS stateful model: name its sequence with the "
                "sequence_id and sequence_control_input inputs, not request parameters"
            )
        ident = values["sequence_id"]
        if ident == 0 and control != 1:
            raise InvalidInput(
                f"model '{self.name}': sequence id has not been provided in request inputs "
                "(sequence_id is needed unless sequence_control_input is 1, SEQUENCE_START)"
            )
        return inputs, Step(ident, control == 1, control == 2)

    def _free_id(self, step: Step, tenant: str) -> Step:
        """(lock held) OVMS hands out an id for a START without one."""
        ident = self._next_ids.get(tenant, 1)  # (a counter per tenant: the ids handed out
        while (tenant, ident) in self._sequences:  # tell nothing of other tenants' starts)
            ident += 1
        self._next_ids[tenant] = ident + 1
        if len(self._next_ids) > 1024:  # (calls of tenants of their own: Inflight.tenant_of)
            holding = {held for held, _ in self._sequences}
            self._next_ids = {t: n for t, n in self._next_ids.items() if t in holding}
        return Step(ident, step.start, step.end)

    def _tenant_full(self, tenant: str, cap: int) -> bool:
        """(lock held) Whether ``tenant`` (a token's: "" is not bounded) holds its share of
        the model's ``cap`` sequences (``shares.py``), as of the server's --max-sequences."""
        if not tenant:
            return False
        held = collections.Counter(shares.key(owner) for owner, _ in self._sequences if owner)
        return not shares.may_take(held, shares.key(tenant), cap)

    def _ovms_check(self, step: Step, sequence: _Sequence | None, tenant: str) -> None:
        """(lock held) OVMS's refusals: a START for an id in use, a request for one not."""
        if step.start and sequence is not None:
            raise SequenceExists(
                f"model '{self.name}': sequence with provided ID already exists ({step.id}); "
                "end it first (sequence_control_input 2) or start another id"
            )
        if not step.start and sequence is None:
            raise SequenceMissing(
                f"model '{self.name}': sequence with provided ID does not exist ({step.id}); "
                "start it with sequence_control_input 1"
            )
        cap = self.settings.max_sequences
        if step.start and (len(self._sequences) >= cap or self._tenant_full(tenant, cap)):
            raise SequencesFull(
                f"model '{self.name}': max sequence number has been reached "
                f"({self.settings.max_sequences}, max_sequence_number); could not create a new "
                "sequence: end one, or retry once an idle one is cleaned up"
            )

    def _check(self, step: Step, inputs: Mapping[str, Any]) -> None:
        corrid = self.settings.corrid
        if corrid is not None:
            string = corrid.dtype == np.dtype(object)
            if isinstance(step.id, str) != string:
                given = "BYTES" if isinstance(step.id, str) else "UINT64"
                wants = "BYTES" if string else str(corrid.dtype).upper()
                raise InvalidInput(
                    f"sequence batching control '{corrid.name}' data-type is '{given}', but "
                    f"model '{self.name}' expects '{wants}'"
                )
        sent = sorted(self.hidden_inputs.intersection(inputs))
        if sent:
            raise InvalidInput(
                f"model '{self.name}': {listing(sent)} are the sequence batcher's (control or "
                "state inputs); send only the model's other inputs"
            )
        if self.max_batch_size > 0:
            for name, value in inputs.items():
                shape = np.shape(value)
                if not shape or shape[0] != 1:
                    raise InvalidInput(
                        f"inference request to model '{self.name}' must specify batch-size 1 "
                        f"due to requirements of sequence batcher (input {name!r} has shape "
                        f"{list(shape)})"
                    )

    def _open(self, ident: int | str, tenant: str) -> _Sequence:
        """A new sequence, within the model's and the server's bounds (lock held)."""
        cap = self.settings.max_sequences
        if cap and len(self._sequences) >= cap:
            raise ResourceExhausted(
                f"model '{self.name}': its {cap} sequence slots are taken "
                "(sequence_batching max_candidate_sequences); end a sequence or retry once an "
                "idle one has timed out"
            )
        if cap and self._tenant_full(tenant, cap):
            raise ResourceExhausted(
                f"model '{self.name}': this tenant holds its share of the model's {cap} "
                "sequence slots (max_candidate_sequences); end one of its "
                "sequences or retry once an idle one has timed out"
            )
        nbytes = self._initial_bytes
        charge = self._shared.budget.charge(
            nbytes, f"a new sequence of model '{self.name}' (its initial state)"
        )
        try:
            self._shared.take(self.name, tenant)
        except ResourceExhausted:
            charge.release()
            raise
        sequence = _Sequence(ident, charge, tenant)
        sequence.nbytes = nbytes
        self.state_bytes += nbytes
        self._sequences[(tenant, ident)] = sequence
        return sequence

    def _end(self, sequence: _Sequence) -> None:
        """No request may join ``sequence`` any more; its state goes once its own are done
        (lock held)."""
        key = (sequence.tenant, sequence.id)
        if self._sequences.get(key) is sequence:
            del self._sequences[key]
            self._shared.give_back(sequence.tenant)
        sequence.ended = True
        if not sequence.busy and not sequence.pending:
            self._free(sequence)
        else:
            self._draining.add(sequence)

    def _free(self, sequence: _Sequence) -> None:
        self._draining.discard(sequence)
        self.state_bytes -= sequence.nbytes
        sequence.nbytes = 0
        sequence.charge.release()
        sequence.states = None

    # --- running

    def _make_ready(self, sequence: _Sequence) -> list[tuple[_Sequence, _Item]] | None:
        """(lock held) ``sequence``'s next request may run now: queued for the ``oldest``
        gatherer, or returned for the caller to run once it has let go of the lock (a run may
        finish, and call back here, before it returns)."""
        if not sequence.pending:
            return None
        sequence.busy = True
        if self._batching:
            self._ready.append(sequence)
            self._wake.notify()
            return None
        return [(sequence, sequence.pending.popleft())]

    def _gather(self) -> None:
        """``oldest``: the ready sequences' next requests, the longest waiting first, in
        batches of up to ``batch_size`` rows, waiting at most ``queue_delay`` for a full one."""
        size, delay = self.settings.batch_size, self.settings.queue_delay
        while True:
            with self._lock:
                while not self._ready and not self._closed:
                    self._wake.wait()
                if self._closed and not self._ready:
                    return
                end = time.monotonic() + delay
                while len(self._ready) < size and not self._closed:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(left)
                batch = []
                while self._ready and len(batch) < size:
                    sequence = self._ready.popleft()
                    batch.append((sequence, sequence.pending.popleft()))
            self._run_batches(batch)

    def _run_batches(self, batch: list[tuple[_Sequence, _Item]]) -> None:
        """Rows whose tensors differ in shape (a growing state) cannot share a run: each group
        of equal shapes runs as one. Nor do two tenants' rows: a run is one tenant's, which
        its model's own calls are made for (a Python model's BLS calls reach that tenant's
        sequences and prefix cache). Before, a run of several rows was the server's own
        tenant's, so two tenants' calls through a Python sequence model shared a sequence."""
        groups: dict[tuple, list[tuple[_Sequence, _Item]]] = {}
        for sequence, item in batch:
            key = (sequence.tenant, *self._signature(sequence, item))
            groups.setdefault(key, []).append((sequence, item))
        for rows in groups.values():
            self._run(rows)

    def _signature(self, sequence: _Sequence, item: _Item) -> tuple:
        states = sequence.states or {}
        return tuple((k, np.shape(v)[1:]) for k, v in sorted(item.inputs.items())) + tuple(
            (s.input, np.shape(states.get(s.input, s.initial))) for s in self.settings.states
        )

    def _feed(self, sequence: _Sequence, item: _Item) -> dict[str, Any]:
        """One request's inputs with its controls and its sequence's states (batch dim 1)."""
        batched = self.max_batch_size > 0
        feed = dict(item.inputs)
        for control in self.settings.controls:
            if control.kind == "CORRID":
                value: Any = item.step.id
            else:
                on = {"START": item.step.start, "END": item.step.end, "READY": True}[control.kind]
                value = control.values[on]
            array = np.array([value], dtype=control.dtype)
            feed[control.name] = array[None] if batched else array
        states = sequence.states
        for state in self.settings.states:
            value = states[state.input] if states is not None else state.initial
            feed[state.input] = value[None] if batched else value
        return feed

    def _run(self, rows: list[tuple[_Sequence, _Item]], inline: bool = False) -> None:
        """One run of ``rows`` (``inline``: on this thread when a stream is idle; a unary
        call's own thread, which waits for the answer anyway). Runs that become ready while
        this thread starts one (a dropped request lets the next of its sequence run; a run
        that finished at once lets the next run) are started here, one after another, never
        by a call inside this one: 1,000 queued late requests had recursed past the stack."""
        later = getattr(_here, "runs", None)
        if later is not None:  # below a run this thread is starting: the loop takes it
            later.append((self, rows))
            return
        _here.runs = later = collections.deque([(self, rows)])
        try:
            while later:
                batcher, rows = later.popleft()
                try:
                    batcher._start(rows, inline)
                except Exception:  # (its rows are answered; the others must still start)
                    log.exception("model '%s': starting a sequence run failed", batcher.name)
                inline = False
        finally:
            _here.runs = None

    def _start(self, rows: list[tuple[_Sequence, _Item]], inline: bool) -> None:
        """Submit one run of ``rows``. A request whose caller gave up (its stream ended) or
        whose deadline passed while it waited is dropped here, its sequence's state
        untouched. Several rows run under the latest of their deadlines (none if one has none):
        one row's tight deadline must not fail the others' run. Whatever fails before the run
        is submitted answers its rows with the error (their sequences go on)."""
        live = []
        now = time.monotonic()
        with self._lock:
            expired = []
            for _, item in rows:
                expired.append(item.state == EXPIRED)
                item.state = STARTED
        for (sequence, item), gone in zip(rows, expired):
            if gone:  # the reaper answers it: only its sequence moves on
                self._done(sequence, item, None, None, answer=False)
            elif not item.future.set_running_or_notify_cancel():
                self._done(sequence, item, None, Cancelled("the request was cancelled"))
            elif item.deadline is not None and now >= item.deadline:
                self._done(sequence, item, None, self._late())
            else:
                live.append((sequence, item))
        if live:
            self._launch(live, inline)

    def _launch(self, rows: list[tuple[_Sequence, _Item]], inline: bool) -> None:
        """Submit one run of ``rows``, started (their futures running)."""
        forget: Callable[[], None] = lambda: None  # noqa: E731
        try:
            feeds = [self._feed(s, i) for s, i in rows]
            if len(rows) == 1:
                feed = feeds[0]
            else:
                feed = {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}
            wanted = list(
                dict.fromkeys([w for _, i in rows for w in i.wanted] + self._state_outputs)
            )
            deadlines = [i.deadline for _, i in rows if i.deadline is not None]
            token, forget = cancel.every(
                [i.token for _, i in rows],
                lambda: Cancelled("every request of the batch was cancelled"),
            )
            # an inline run is the model's on this thread, whose own calls (a Python model's
            # BLS call to a sequence) must start theirs at once, not after it: no loop here
            outer, _here.runs = getattr(_here, "runs", None), None
            try:
                future = self._submit(
                    feed,
                    wanted,
                    max(deadlines) if len(deadlines) == len(rows) else None,
                    inline,
                    token,
                    sum(i.holds for _, i in rows),
                    checked=self._checked(rows, feed),
                    like=rows[0][1].like if len(rows) == 1 else None,  # several: its own run
                    tenant=rows[0][0].tenant,  # (one tenant's rows: _run_batches)
                )
            finally:
                _here.runs = outer
        except BaseException as exc:
            forget()
            for sequence, item in rows:
                self._done(sequence, item, None, exc)
            return
        future.add_done_callback(lambda f: (forget(), self._finish(rows, f)))

    def _late(self) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"network {self.name!r}: the request's deadline passed while it waited for its "
            "turn in the sequence batcher"
        )

    def _checked(self, rows: list[tuple[_Sequence, _Item]], feed: dict[str, Any]) -> list | None:
        """One row whose inputs a protocol's lane checked: the run's arrays in the network's
        order (the rest are the batcher's own), which its admission takes as checked."""
        if len(rows) == 1 and rows[0][1].checked:
            return [feed[n] for n in self._order]
        return None

    def _finish(self, rows: list[tuple[_Sequence, _Item]], future: Any) -> None:
        exc = future.exception()
        if exc is not None and len(rows) > 1 and not isinstance(exc, Cancelled):
            # each row's own run: one sequence's bad input (another tenant's, with tokens)
            # failed every row of the batch with an error holding its values; the failed
            # run left every state as it was
            for row in rows:
                self._launch([row], inline=False)
            return
        outputs = None if exc is not None else future.result()
        if len(rows) > 1:  # the run was counted once, as its first row
            self._joined(len(rows) - 1, exc)
        for index, (sequence, item) in enumerate(rows):
            if exc is not None:
                self._done(sequence, item, None, exc)
                continue
            if len(rows) > 1:
                row = {k: v[index : index + 1] for k, v in outputs.items()}
            else:
                row = outputs
            self._done(sequence, item, row, None)

    def _done(
        self,
        sequence: _Sequence,
        item: _Item,
        outputs: dict[str, np.ndarray] | None,
        exc: BaseException | None,
        answer: bool = True,
    ) -> None:
        """One request answered: its sequence's states move on (a failed run leaves them as
        they were), and its next request may run. A state that no longer fits the memory
        budget ends the sequence, failing its queued requests too. ``answer`` False: another
        answers it (the reaper), only its sequence moves on."""
        reply = states = None
        lost = False
        if outputs is not None:
            try:
                states = self._states(outputs)
                self._hold(sequence, states)
            except ResourceExhausted as error:
                exc, states, lost = error, None, True
            except BaseException as error:
                exc, states = error, None
        if states is not None:
            try:
                reply = {k: outputs[k] for k in item.wanted}
                if self._ovms:  # OVMS appends the sequence's id to every answer
                    reply["sequence_id"] = np.array([item.step.id], np.uint64)
                if item.after is not None:
                    reply = item.after(reply)
            except BaseException as error:
                exc, reply = error, None
        rows, failed = None, []
        with self._lock:
            if states is not None:
                sequence.states = states
            sequence.busy = False
            sequence.last = time.monotonic()
            # a START that failed before the sequence ever ran: it did not start (a red team's
            # START of a wrong shape, refused, held a --max-sequences slot until the idle
            # timeout, and the next request of its id ran as if it had started)
            unstarted = exc is not None and item.step.start and sequence.states is None and not lost
            if lost or unstarted:  # (those the reaper answered already are not answered again)
                failed = [q for q in sequence.pending if q.state == WAITING]
                for queued in failed:
                    queued.state = STARTED
                sequence.pending.clear()
                self._end(sequence)
            elif sequence.pending:
                rows = self._make_ready(sequence)
            elif sequence.ended:
                self._free(sequence)
        try:
            # (a future dropped before it ran is done: nobody waits for it)
            if answer and not item.future.done():
                with contextlib.suppress(InvalidStateError):  # (cancelled meanwhile)
                    if exc is not None:
                        item.future.set_exception(exc)
                    else:
                        item.future.set_result(reply)
            for queued in failed:
                if queued.future.set_running_or_notify_cancel():
                    queued.future.set_exception(
                        ResourceExhausted(
                            f"sequence {sequence.id} of model '{self.name}' ended: {exc}"
                        )
                        if lost
                        else InvalidInput(
                            f"sequence {sequence.id!r} of model '{self.name}' did not start: "
                            f"its START request failed ({exc}); start it again"
                        )
                    )
        finally:  # its sequence goes on whatever an answer's callbacks did
            if rows:
                self._run(rows)

    def _states(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        states = {}
        for state in self.settings.states:
            value = np.asarray(outputs[state.output], dtype=state.dtype)
            if self.max_batch_size > 0:
                value = value[0]
            # a row of a batch, or a view of a device's buffer, is copied: a state must own
            # what it holds (a whole batch's memory, or a buffer the device reuses, would not do)
            if value.base is not None or not value.flags.c_contiguous:
                value = value.copy()
            states[state.input] = value
        return states

    def _hold(self, sequence: _Sequence, states: dict[str, np.ndarray]) -> None:
        """Charge the budget for the sequence's new states; the old ones' charge goes once the
        new is taken (both exist until then)."""
        nbytes = sum(v.nbytes for v in states.values())
        if nbytes != sequence.nbytes:
            charge = self._shared.budget.charge(
                nbytes, f"sequence {sequence.id} of model '{self.name}' (its state)"
            )
            sequence.charge.release()
            sequence.charge = charge
        with self._lock:
            self.state_bytes += nbytes - sequence.nbytes
            sequence.nbytes = nbytes

    # --- ends

    def reap(self, now: float) -> None:
        """End the sequences idle for longer than max_sequence_idle_microseconds, and answer
        the queued requests whose deadline passed while they waited (each keeps its place,
        dropped when its turn comes, so that the sequence's order and state are untouched)."""
        idle = self.settings.idle_seconds
        expired = []
        with self._lock:
            for sequence in [*self._sequences.values(), *self._draining]:
                for item in sequence.pending:
                    due = item.deadline
                    if due is not None and now >= due and item.state == WAITING:
                        item.state = EXPIRED
                        item.inputs, item.like = {}, None  # (its memory: answered, uncharged)
                        expired.append(item)
            late = [
                s for s in self._sequences.values()
                if idle and not s.busy and not s.pending and now - s.last > idle
            ]  # fmt: skip
            for sequence in late:
                log.info(
                    "model '%s': sequence %r idle for over %g s: ended, its state freed",
                    self.name,
                    sequence.id,
                    idle,
                )
                self._end(sequence)
        for item in expired:
            with contextlib.suppress(InvalidStateError):  # (its caller cancelled it)
                item.future.set_exception(self._late())

    def close(self) -> int:
        """Unload: every sequence ends (a reload does not carry them: their clients start
        again); returns how many were active."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            ended = list(self._sequences.values())
            for sequence in ended:
                self._end(sequence)
        self._shared.batchers.discard(self)
        return len(ended)
