"""Which sequences run in the next step, and how many prompt tokens each computes.

One decision per step (iteration-level scheduling, as Orca and vLLM): requests join between
steps and leave as soon as they finish. The step's work is bounded by ``max_num_batched_tokens``
(the tokens computed in one step: each decoding sequence's one token, plus prompt tokens):

1. every decoding sequence gets its token (a running stream is never starved by prompts);
2. sequences whose prompt is partly computed continue, first come first served, each taking
   what is left of the budget (a long prompt is split into chunks across steps: chunked
   prefill, so it never stalls the streams already decoding for more than one chunk);
3. waiting requests are admitted, oldest first, while the budget has tokens, a request's
   ``n`` sequences fit under ``max_num_seqs`` and the cache has a free slot for each; the
   first blocked request stops admission (no overtaking: a large ``n`` is not starved).

Admission looks the prompt up in the prefix cache (:class:`.kvcache.SlotTable`) under its
tenant's and ``cache_salt``'s salt: its cached blocks are not computed again, and another
tenant's are never found; the blocks after them that the host tier keeps
(:mod:`.kv_host_tier`) are restored into its slot. A request's sequences share the prompt: the
first computes it and the others copy its cache into their own slots when it is done (``n`` > 1
costs one prompt's compute).

Held, not preempted: a sequence's slot holds the whole context (see :mod:`.kvcache`), so a
running sequence never needs more cache than it has; when the slots are all held, requests
wait in the queue (never an out-of-memory, never a preemption that recomputes work). The
queue is bounded (``max_waiting``): beyond it ``add`` refuses with ResourceExhausted.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

from plugserve.server.apps.generate.engine.kvcache import Slot, SlotTable, salt

__all__ = ["Plan", "RequestState", "Scheduler", "Sequence"]

WAITING, PREFILL, FORK, DECODE, FINISHED = "waiting", "prefill", "fork", "decode", "finished"


class Sequence:
    """One sequence of a request: its tokens (prompt then generated), how many are in its
    slot (``computed``), and its state."""

    __slots__ = (
        "computed",
        "detokenizer",
        "finish_reason",
        "first_at",
        "generated",
        "held",
        "held_bytes",
        "hold",
        "hold_bytes",
        "index",
        "last_at",
        "request",
        "sampling",
        "slot",
        "status",
        "stop_reason",
        "tokens",
    )

    def __init__(self, request: RequestState, index: int, prompt: list[int]) -> None:
        self.request = request
        self.index = index
        self.tokens = list(prompt)
        self.computed = 0
        self.generated = 0
        self.slot: Slot | None = None
        self.status = WAITING
        self.sampling: Any = None
        self.detokenizer: Any = None
        self.first_at = 0.0
        self.last_at = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        #: tokens its stream sends together (the engine's stream_interval, :mod:`.output`),
        #: the bytes it may hold meanwhile, the event holding those not sent yet and its bytes
        self.hold = 1
        self.hold_bytes = 0
        self.held: Any = None
        self.held_bytes = 0

    @property
    def pending(self) -> int:
        """Tokens to compute before the next one can be chosen."""
        return len(self.tokens) - self.computed

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request.request_id}#{self.index}, {self.status}, "
            f"{self.computed}/{len(self.tokens)})"
        )


class RequestState:
    """A request in the engine: its sequences, its consumer, its timings."""

    __slots__ = (
        "arrival",
        "cached",
        "done",
        "ended",
        "prompt_len",
        "prompt_logprobs",
        "request",
        "request_id",
        "salt",
        "sender",
        "sequences",
        "spans",
        "staging",
        "started",
        "tag",
    )

    def __init__(self, request: Any, sender: Any, arrival: float) -> None:
        self.request = request
        self.request_id = request.request_id
        self.sender = sender
        self.arrival = arrival
        self.prompt_len = len(request.prompt_token_ids)
        self.sequences = [
            Sequence(self, i, request.prompt_token_ids) for i in range(max(1, request.n))
        ]
        self.cached = 0  # prompt tokens taken from the prefix cache
        #: where its prompt's chain of block hashes starts: its tenant's and cache_salt's
        #: (:func:`.kvcache.salt`), so it finds only their blocks in the prefix cache
        self.salt = salt(request.tenant, request.cache_salt)
        self.done = 0  # sequences finished
        self.started = 0.0  # when it was admitted (monotonic)
        #: its place in the waiting queue among its tenant's and the others' (:meth:`Scheduler.
        #: enqueue`)
        self.tag = 0
        #: its prompt's blocks the disk tier reads ahead while it waits
        #: (:class:`.kv_disk_tier.Staging`), or None
        self.staging: Any = None
        #: the engine is done with it (its consumer told, its slots free): once
        self.ended = False
        #: its spans when it is traced (:class:`.spans.RequestSpans`), else None
        self.spans: Any = None
        #: the prompt tokens' logprobs as its prefill scores them (the first token has none),
        #: when the request asks for them (``prompt_logprobs``), else None; sent with its
        #: first event. Such a request computes its whole prompt: no prefix cache
        self.prompt_logprobs: list[Any] | None = (
            [None] if request.params.prompt_logprobs is not None else None
        )

    @property
    def finished(self) -> bool:
        return self.done == len(self.sequences)


@dataclasses.dataclass
class Plan:
    """One step's work: decoding sequences (one token each), first prompt chunks (nothing in
    their slot yet: one batch) and continuing chunks (``(sequence, count)``)."""

    decode: list[Sequence] = dataclasses.field(default_factory=list)
    first: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    extend: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.first or self.extend)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(c for _s, c in self.first) + sum(c for _s, c in self.extend)


@dataclasses.dataclass(eq=False)
class Scheduler:
    """The waiting queue, the running sequences, and each step's plan."""

    table: SlotTable
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    copy_prefix: Callable[[Slot, Slot, int], None]
    #: ``(prompt, salt, staging) -> restore``, called before a slot is taken, and
    #: ``restore(slot, hit) -> hit`` after: the prompt's blocks after the slot's ``hit``
    #: restored from the host tier (:mod:`.kv_host_tier`) and from what the disk tier read
    #: ahead for it (``staging``), the longer hit (``ModelRunner.restore_prefix``); None: no
    #: tier
    restore_prefix: Callable[[list[int], int, Any], Callable[[Slot, int], int]] | None = None
    waiting: collections.deque[RequestState] = dataclasses.field(
        default_factory=collections.deque, init=False
    )
    #: sequences holding a slot, in admission order
    running: list[Sequence] = dataclasses.field(default_factory=list, init=False)
    #: the fair queue's clock: the tag of the last request admitted; and each tenant's last tag
    _clock: int = dataclasses.field(default=0, init=False)
    _last_tag: dict[str, int] = dataclasses.field(default_factory=dict, init=False)
    #: requests waiting, by tenant
    _waiting_by: collections.Counter[str] = dataclasses.field(
        default_factory=collections.Counter, init=False
    )

    def enqueue(self, states: list[RequestState]) -> None:
        """``states`` into the waiting queue, fairly among tenants (start-time fair queuing):
        each is tagged one past the later of the queue's clock and its tenant's last tag, and
        waits behind every request of a tag not greater. One tenant's requests keep their
        order, and a tenant with a thousand waiting delays another's next request by one
        request a tenant, not by the thousand (a red team's 17 gRPC streams of 64 requests
        kept every other tenant's chat waiting 140 s). Without tokens there is one tenant and
        this is first come, first served, as before."""
        for state in states:
            tenant = state.request.tenant or ""
            # a tenant with nothing waiting starts from the clock: its requests that left
            # unadmitted (cancelled, timed out) cost it no turns
            last = self._last_tag.get(tenant, 0) if self._waiting_by.get(tenant) else 0
            state.tag = max(self._clock, last) + 1
            self._last_tag[tenant] = state.tag
            self._waiting_by[tenant] += 1
            if not self.waiting or self.waiting[-1].tag <= state.tag:
                self.waiting.append(state)
                continue
            place = next(i for i, other in enumerate(self.waiting) if other.tag > state.tag)
            self.waiting.insert(place, state)

    def waiting_of(self, tenant: str) -> int:
        """Requests of ``tenant`` in the waiting queue."""
        return self._waiting_by.get(tenant, 0)

    def waiting_tenants(self) -> dict[str, int]:
        """Requests in the waiting queue, by tenant (those with some)."""
        return dict(self._waiting_by)

    def _left(self, state: RequestState) -> None:
        """``state`` left the waiting queue."""
        tenant = state.request.tenant or ""
        left = self._waiting_by.pop(tenant, 0) - 1
        if left > 0:
            self._waiting_by[tenant] = left
        else:  # (read only while it has requests waiting: tenants come and go)
            self._last_tag.pop(tenant, None)

    @property
    def held(self) -> int:
        return len(self.running)

    def schedule(self) -> Plan:
        plan = Plan()
        budget = self.max_num_batched_tokens
        for seq in self.running:
            if seq.status == DECODE:
                plan.decode.append(seq)
        budget -= len(plan.decode)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status == PREFILL and seq.computed > 0:
                count = min(seq.pending, budget)
                plan.extend.append((seq, count))
                budget -= count
        for seq in self.running:  # admitted earlier with no token computed yet
            if budget <= 0:
                break
            if seq.status == PREFILL and seq.computed == 0:
                count = min(seq.pending, budget)
                plan.first.append((seq, count))
                budget -= count
        self._look_ahead()
        for state in self.admissible(time.monotonic())[0]:
            if budget <= 0:
                break
            self.waiting.remove(state)
            self._left(state)
            self._clock = max(self._clock, state.tag)
            if len(self._last_tag) > 1024:  # tenants with nothing waiting weigh nothing
                self._last_tag = {t: v for t, v in self._last_tag.items() if v > self._clock}
            leader = self._admit(state)
            count = min(leader.pending, budget)
            if leader.computed == 0:
                plan.first.append((leader, count))
            else:
                plan.extend.append((leader, count))
            budget -= count
        return plan

    def _look_ahead(self) -> None:
        """The free slots the next requests to be admitted will reuse, so that those admitted
        before them in this step evict other slots first (six prompts cycling through four
        slots otherwise evicted each prompt's blocks just before its next request came)."""
        table = self.table
        table.wanted = set()
        if not table.prefix_caching or not self.waiting:
            return
        for state in itertools.islice(self.waiting, table.free_count):
            if state.prompt_logprobs is not None:
                continue
            slot, _hit = table.lookup(state.sequences[0].tokens, count=False, salt=state.salt)
            if slot is not None and slot.owner is None:
                table.wanted.add(slot.index)

    def _admit(self, state: RequestState) -> Sequence:
        """Slots for every sequence of ``state``; the leader's prompt prefix from the cache."""
        leader = state.sequences[0]
        prompt = leader.tokens
        restore = None
        if self.restore_prefix is not None and state.prompt_logprobs is None:
            restore = self.restore_prefix(prompt, state.salt, state.staging)
        if state.prompt_logprobs is None:
            source, hit = self.table.lookup(prompt, salt=state.salt)
        else:  # its prompt is scored as it is computed: all of it
            source, hit = None, 0
        if source is not None and source.owner is None:
            leader.slot = self.table.take(leader, prefer=source, salt=state.salt)
            self.table.truncate(leader.slot, hit, evict=True)
        else:
            leader.slot = self.table.take(leader, salt=state.salt)
            if source is not None:
                self.table.truncate(leader.slot, 0)
                self.copy_prefix(source, leader.slot, hit)
                self.table.written(leader.slot, prompt[:hit])
        if restore is not None:
            hit = restore(leader.slot, hit)
        release_staging(state)
        leader.computed = hit
        state.cached = hit
        leader.status = PREFILL
        self.running.append(leader)
        for seq in state.sequences[1:]:
            seq.slot = self.table.take(seq, salt=state.salt)
            seq.status = FORK
            self.running.append(seq)
        return leader

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended: its slot is free (its tokens stay as a prefix cache)."""
        if seq.slot is not None:
            self.table.release(seq.slot)
            seq.slot = None
        if seq.status != WAITING:
            with contextlib.suppress(ValueError):
                self.running.remove(seq)
        seq.status = FINISHED

    def drop_waiting(self, state: RequestState) -> bool:
        release_staging(state)
        try:
            self.waiting.remove(state)
        except ValueError:
            return False
        self._left(state)
        return True

    def admissible(self, now: float) -> tuple[list[RequestState], float | None]:
        """The waiting requests that may be admitted now, in order, and the seconds until the
        next one set aside may be (None: none is).

        In queue order, as far as the slots left go (the first that does not fit ends it). A
        request whose blocks the disk tier is still reading (at most ``STAGE_WAIT_S``) is set
        aside with its slots kept for it, and those behind it that fit in the rest go first, as
        vLLM sets aside a request whose KV is on its way: a slow disk delays only the request
        it reads for, and the one set aside never waits for a slot a later one took."""
        taken = 0
        ready: list[RequestState] = []
        wait: float | None = None
        for state in self.waiting:
            need = len(state.sequences)
            if self.held + taken + need > self.max_num_seqs:
                break
            if self.table.free_count - taken < need:
                break
            taken += need
            left = 0.0 if state.staging is None else state.staging.left(now)
            if left > 0:
                wait = left if wait is None else min(wait, left)
            else:
                ready.append(state)
        return ready, wait

    def ready_in(self) -> float | None:
        """Seconds until a waiting request may be admitted (0: now; None: none waits that the
        slots left hold)."""
        ready, wait = self.admissible(time.monotonic())
        return 0.0 if ready else wait


def release_staging(state: RequestState) -> None:
    """What the disk tier read ahead for ``state`` given back (admitted, or gone)."""
    staging, state.staging = state.staging, None
    if staging is not None:
        staging.release()
