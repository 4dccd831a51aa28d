"""The model run of one engine step: a scheduler's plan turned into the decoder's forwards, and
the cache arranged for them (vLLM v1's model runner, without its sampling: that is the output
processor's, :mod:`.output`).

:meth:`ModelRunner.execute` yields one :class:`Forward` per forward as soon as it is done, and
the engine's loop hands each to the output processor before the next runs, in this order:

1. the decoding sequences, moved to rows ``0..B-1`` of the cache (a sequence moves when one
   before it left: a row copy of its written tokens, :meth:`ModelRunner._arrange`), one
   batched forward: their tokens are chosen and sent before any prompt chunk runs (a chunk
   never delays tokens already made);
2. first prompt chunks, right-padded into batches of at most ``max_num_batched_tokens``
   tokens, padding included (a batch's logits are rows x longest chunk x vocabulary: a long
   chunk beside short ones must not multiply them);
3. continuing chunks, one per forward.

A backend whose graph takes decoding rows and prompt chunks together
(:attr:`.decoder.Decoder.mixed`: OpenVINO's paged attention) runs the whole plan as one
forward and needs no arranging. A sequence the output processor ended meanwhile (its consumer
left while an earlier forward's tokens were sent) is skipped, since each forward reads the
sequences' status when it starts. A prompt's last chunk gives its first token: the request's
other sequences (``n`` > 1) copy the leader's cache into their own slots then (the prompt is
computed once) and all choose from the prompt's last logits.

A pipelined decode step (:mod:`.overlap`) is launched instead (:meth:`ModelRunner.launch`):
its forward and the sampler's choice run on the device stream, and the engine fetches the
ids later; launched behind the step in flight, its input ids are that step's, on the device.

A forward that raises a typed error fails the requests whose sequences it ran
(:attr:`Forward.error`); nothing is kept between steps here (the plan, the sequences and the
cache are the engine's), and nothing is allocated per step but the forward's own inputs.
A traced request's prompt chunks are spans (:mod:`.spans`), opened and ended around the
forward that computes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import InferenceError, PlugserveError
from plugserve.plugins.decoding import Decoder, StepSampler
from plugserve.plugins.sampling import log_softmax, logprob_entry
from plugserve.server.apps.generate.engine.kv_disk_tier import Staging
from plugserve.server.apps.generate.engine.kv_host_tier import HostTier
from plugserve.server.apps.generate.engine.kvcache import KVCache, Slot, SlotTable
from plugserve.server.apps.generate.engine.overlap import DeviceStream, Launched
from plugserve.server.apps.generate.engine.scheduler import (
    DECODE,
    FORK,
    PREFILL,
    Plan,
    RequestState,
)
from plugserve.server.apps.generate.engine.scheduler import Sequence as Seq
from plugserve.server.apps.generate.engine.spans import RequestSpans

__all__ = ["Forward", "ModelRunner"]


@dataclasses.dataclass(slots=True)
class Forward:
    """What one forward gave: the sequences that choose their next token now, one row of
    ``logits`` each; or the ``error`` it raised and the requests it fails. ``prompt``: the
    request whose prompt it finished (``group`` is then that request's sequences)."""

    group: list[Seq]
    logits: np.ndarray | None = None
    error: PlugserveError | None = None
    failed: list[RequestState] = dataclasses.field(default_factory=list)
    prompt: RequestState | None = None

    @classmethod
    def failure(cls, sequences: Sequence[Seq], error: PlugserveError) -> Forward:
        """The requests of ``sequences`` (each once, in order) fail with ``error``."""
        states = {id(s.request): s.request for s in sequences}
        return cls([], error=error, failed=list(states.values()))


@dataclasses.dataclass(eq=False)
class ModelRunner:
    """Runs a plan's forwards on the decoder over the engine's cache."""

    decoder: Decoder
    cache: KVCache
    table: SlotTable
    max_num_batched_tokens: int
    #: the host tier of evicted blocks (None: off)
    tier: HostTier | None = None

    def __post_init__(self) -> None:
        if self.tier is not None:
            self.table.evicting = self.tier.offload

    def execute(self, plan: Plan) -> Iterator[Forward]:
        """The plan's forwards in order (the module's docstring), each yielded when done."""
        if self.decoder.mixed:
            yield from self._mixed(plan)
            return
        if plan.decode:
            yield from self._decode(plan.decode)
        if plan.first:
            yield from self._first(plan.first)
        for seq, count in plan.extend:
            if seq.status != PREFILL:
                continue  # ended by the decode group's events (an abort)
            yield from self._extend(seq, count)

    def launch(
        self,
        group: list[Seq],
        sampler: StepSampler,
        stream: DeviceStream,
        prev: Launched | None = None,
    ) -> Launched:
        """A decode step of ``group`` launched on the device stream and its tokens drawn
        there, not waited for (:mod:`.overlap`; a :attr:`.decoder.Decoder.pipelined`
        decoder and its sampler). Its input ids are the sequences' last tokens, or, with
        ``prev`` (the step in flight, whose rows ``group`` is a subset of), ``prev``'s
        sampled ids on the device: each such sequence's new position is counted now, its
        token written to the slot's record when the host has it (the engine's settling of
        ``prev``)."""
        decoder = self.decoder
        cache = self.cache
        rows = [s.slot.index for s in group]
        lens = [s.computed for s in group]
        states = [s.sampling for s in group]
        ids: np.ndarray | None = None
        picks: list[int] | None = None
        if prev is None:
            generated = [s.generated for s in group]
            ids = np.fromiter((s.tokens[s.computed] for s in group), np.int64, len(group))
            for seq, token in zip(group, ids):
                self._computed(seq, [int(token)])
        else:  # the token in flight is each row's, so one more generated when this one's chosen
            generated = [s.generated + 1 for s in group]
            for seq in group:
                seq.computed += 1
            where = {id(s): i for i, s in enumerate(prev.group)}
            picks = [where[id(s)] for s in group]
            if picks == list(range(len(prev.group))):
                picks = None

        def step() -> Any:
            # done: the stream runs in order; raises its failure
            previous = prev.future.result() if prev is not None else None
            return decoder.launch(
                cache, rows, lens, ids, sampler, states, generated, previous, picks
            )

        return Launched(group, stream.submit(step), chained=prev is not None)

    def copy_prefix(self, source: Slot, target: Slot, length: int) -> None:
        """A cached prompt prefix from ``source`` into ``target`` (the scheduler's admission)."""
        self.cache.copy(source.index, target.index, length)

    def stage(self, prompt: list[int], salt: int, woken: Callable[[], None]) -> Staging | None:
        """The tiers made ready for ``prompt`` as it joins the waiting queue: its host-tier
        blocks touched (used now: the slots the requests ahead of it take evict other
        blocks into the host tier, whose drops then take older blocks than its own, and a
        block dropped after this would not be among the disk tier's reads), and the disk
        tier's blocks read ahead for it while it waits (the Staging; None: no disk tier, or
        nothing to read; ``woken`` is called once read)."""
        tier = self.tier
        if tier is None:
            return None
        tier.touch(prompt, salt)
        return tier.disk.stage(prompt, salt, woken) if tier.disk is not None else None

    def restore_prefix(
        self, prompt: list[int], salt: int, staging: Staging | None = None
    ) -> Callable[[Slot, int], int]:
        """What the tiers hold of ``prompt``, captured before its admission takes a slot (the
        host tier's blocks and their bytes, and ``staging``: what the disk tier's reader read
        ahead, :meth:`stage`): taking a slot may evict another slot's blocks into the host
        tier, which then drops its least recently used ones, this prompt's among them.

        The function returned restores into ``slot``, after the ``hit`` tokens it holds, the
        host tier's blocks when at least :attr:`.kv_host_tier.HostTier.min_blocks` of them
        follow (fewer are computed), then the disk tier's that follow those (at least its own
        ``min_blocks``); it returns the prompt tokens the slot holds then."""
        tier = self.tier
        assert tier is not None
        size = self.table.block_size
        blocks = tier.match(prompt, salt)
        data = [block.data for block in blocks]

        def restore(slot: Slot, hit: int) -> int:
            start = hit // size
            if len(blocks) - start >= tier.min_blocks:
                tier.restore(slot.index, blocks[start:], start, data[start:])
                end = len(blocks) * size
                self.table.written(slot, prompt[hit:end])
                hit = end
            count = tier.restore_disk(slot.index, staging, hit // size)
            if count:
                end = (hit // size + count) * size
                self.table.written(slot, prompt[hit:end])
                hit = end
            return hit

        return restore

    # --- the forwards

    def _decode(self, group: list[Seq]) -> Iterator[Forward]:
        group = [s for s in group if s.status == DECODE]
        if not group:
            return
        self._arrange(group)
        rows = len(group)
        tokens = np.fromiter((s.tokens[s.computed] for s in group), np.int64, rows)
        lens = np.fromiter((s.computed for s in group), np.int64, rows)
        try:
            logits = self.decoder.decode(self.cache, rows, tokens, lens)
        except PlugserveError as exc:
            yield Forward.failure(group, exc)
            return
        for seq, token in zip(group, tokens):
            self._computed(seq, [int(token)])
        yield Forward(group, logits)

    def _first(self, chunks: list[tuple[Seq, int]]) -> Iterator[Forward]:
        """First prompt chunks in batches of at most ``max_num_batched_tokens`` padded
        tokens, shortest first."""
        chunks = sorted(((s, c) for s, c in chunks if s.status == PREFILL), key=lambda x: x[1])
        budget = self.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        for item in chunks:
            if batch and (len(batch) + 1) * item[1] > budget:
                yield from self._first_batch(batch)
                batch = []
            batch.append(item)
        if batch:
            yield from self._first_batch(batch)

    def _first_batch(self, chunks: list[tuple[Seq, int]]) -> Iterator[Forward]:
        chunks = sorted(chunks, key=lambda x: x[0].slot.index)
        rows = [s.slot.index for s, _c in chunks]
        pieces = [s.tokens[:c] for s, c in chunks]
        traced = _chunks_start(chunks, len(rows))
        scored = any(s.request.prompt_logprobs is not None for s, _c in chunks)
        try:
            if scored:
                full = self.decoder.first(self.cache, rows, pieces, all_positions=True)
                _check_positions(full, max(len(p) for p in pieces))
                logits = full[np.arange(len(pieces)), [len(p) - 1 for p in pieces]]
            else:
                logits = self.decoder.first(self.cache, rows, pieces)
        except PlugserveError as exc:
            _chunks_end(traced, exc)
            yield Forward.failure([s for s, _c in chunks], exc)
            return
        _chunks_end(traced)
        for i, ((seq, _c), piece, row) in enumerate(zip(chunks, pieces, logits)):
            if scored and seq.request.prompt_logprobs is not None:
                _score_prompt(seq, 0, full[i, : len(piece)])
            self._computed(seq, piece)
            if seq.pending == 0:
                yield self._prompt_done(seq, row[None])

    def _extend(self, seq: Seq, count: int) -> Iterator[Forward]:
        """A prompt's next chunk, after the ones already in its slot."""
        start = seq.computed
        chunk = seq.tokens[start : start + count]
        traced = _chunks_start([(seq, count)], 1)
        scored = seq.request.prompt_logprobs is not None
        try:
            if scored:
                full = self.decoder.extend(
                    self.cache, seq.slot.index, start, chunk, all_positions=True
                )
                _check_positions(full[None], len(chunk))
                logits = full[-1]
            else:
                logits = self.decoder.extend(self.cache, seq.slot.index, start, chunk)
        except PlugserveError as exc:
            _chunks_end(traced, exc)
            yield Forward.failure([seq], exc)
            return
        _chunks_end(traced)
        if scored:
            _score_prompt(seq, start, full)
        self._computed(seq, chunk)
        if seq.pending == 0:
            yield self._prompt_done(seq, logits[None])

    def _mixed(self, plan: Plan) -> Iterator[Forward]:
        """The whole plan in one forward (:attr:`.decoder.Decoder.mixed`); the rows stay
        where they are (no arranging), the decoding rows' tokens are chosen first."""
        group = [s for s in plan.decode if s.status == DECODE]
        chunks = [(s, c) for s, c in (*plan.extend, *plan.first) if s.status == PREFILL and c > 0]
        if not group and not chunks:
            return
        tokens = [s.tokens[s.computed] for s in group]
        pieces = [s.tokens[s.computed : s.computed + c] for s, c in chunks]
        traced = _chunks_start(chunks, len(group) + len(chunks))
        try:
            decoded, prompted = self.decoder.step(
                self.cache,
                [s.slot.index for s in group],
                tokens,
                [s.computed for s in group],
                [(s.slot.index, s.computed, p) for (s, _c), p in zip(chunks, pieces)],
            )
        except PlugserveError as exc:
            _chunks_end(traced, exc)
            yield Forward.failure([*group, *(s for s, _c in chunks)], exc)
            return
        _chunks_end(traced)
        for seq, token in zip(group, tokens):
            self._computed(seq, [token])
        if group:
            yield Forward(group, decoded)
        if not chunks:  # zip would still iterate ``prompted``: a torch unbind a decode step
            return
        for (seq, _c), piece, row in zip(chunks, pieces, prompted):
            if seq.status != PREFILL:
                continue  # ended by the decoding rows' events (an abort)
            self._computed(seq, piece)
            if seq.pending == 0:
                yield self._prompt_done(seq, row[None])

    # --- the cache's arrangement

    def _arrange(self, group: list[Seq]) -> None:
        """Decoding sequences into rows 0..B-1 in order (the batch is one view of the
        cache); a sequence in a higher row trades rows with what holds its place."""
        group.sort(key=lambda s: s.slot.index)
        for row, seq in enumerate(group):
            if seq.slot.index != row:
                self.table.swap(seq.slot, self.table.slots[row])

    def _computed(self, seq: Seq, tokens: Sequence[int]) -> None:
        self.table.written(seq.slot, tokens)
        seq.computed += len(tokens)

    def _prompt_done(self, leader: Seq, logits: np.ndarray) -> Forward:
        """The leader's prompt is in its slot: its forks copy it, then each chooses its
        first token from the prompt's last logits."""
        state = leader.request
        group = [leader]
        for seq in state.sequences[1:]:
            if seq.status == FORK:
                self.cache.copy(leader.slot.index, seq.slot.index, leader.computed)
                self.table.truncate(seq.slot, 0)
                self.table.written(seq.slot, leader.tokens[: leader.computed])
                seq.computed = leader.computed
                group.append(seq)
        for seq in group:
            seq.status = DECODE
        # row 0 once per sequence (indexing: numpy's logits, or a torch decoder's on its device)
        return Forward(group, logits[[0] * len(group)], prompt=state)


def _check_positions(logits: np.ndarray, width: int) -> None:
    """InferenceError unless the graph gave logits for each of a chunk's ``width`` positions
    (a graph may give only the last one's: then it cannot score a prompt)."""
    if logits.ndim != 3 or logits.shape[1] < width:
        raise InferenceError(
            f"the decoder graph gives logits of shape {list(logits.shape)} for a chunk of "
            f"{width} tokens, not one row per position: it cannot score the prompt "
            "(prompt_logprobs, echo with logprobs)"
        )


def _score_prompt(seq: Seq, start: int, logits: np.ndarray) -> None:
    """The logprobs of the prompt tokens that ``logits`` (one row per position of the chunk
    written at ``start``) predict: position ``j`` predicts token ``j + 1``, up to the prompt's
    last (the chunk's last position predicts the next chunk's first token, or the first
    generated one, which the sampler scores). Raw logits, as vLLM's prompt logprobs."""
    state = seq.request
    prompt = seq.tokens[: state.prompt_len]
    targets = prompt[start + 1 : start + 1 + logits.shape[0]]
    if not targets:
        return
    entries = state.prompt_logprobs
    assert entries is not None
    rows = log_softmax(logits[: len(targets)].astype(np.float32, copy=False))
    top = state.request.params.prompt_logprobs or 0
    for row, token in zip(rows, targets):
        entry = logprob_entry(row, int(token), top)
        entry.rank = int(np.count_nonzero(row > row[token])) + 1
        entries.append(entry)


def _chunks_start(chunks: Sequence[tuple[Seq, int]], rows: int) -> list[RequestSpans] | None:
    """The traced requests' ``prefill`` spans of these chunks, started (None: none traced)."""
    traced = None
    for seq, count in chunks:
        spans = seq.request.spans
        if spans is not None:
            spans.chunk(seq.computed, count, rows)
            traced = [*(traced or ()), spans]
    return traced


def _chunks_end(traced: list[RequestSpans] | None, error: BaseException | None = None) -> None:
    for spans in traced or ():
        spans.chunked(error)
