"""Output processing of the engine's steps: each forward's logits into tokens, stop checks,
text, and events to the requests' senders (vLLM v1's output processor and the sampling its
model runner applies, on the engine's loop thread).

For each :class:`.runner.Forward` the engine hands it, :meth:`OutputProcessor.process`:

1. makes each sequence's sampler state and detokenizer when it first chooses a token
   (:meth:`~OutputProcessor._prepare`: its generator, seeded ``seed + index`` as vLLM when the
   request has a seed; its stop ids; its grammar's matcher);
2. chooses every row's token in one batched call of the decoder's sampler
   (``plugins/sampling.py``);
3. per sequence, appends the token, checks why it would stop (a stop token or the model's
   end-of-sequence unless ``ignore_eos``, a stop string found by the detokenizer, the grammar
   done, ``max_tokens`` or the context: :meth:`~OutputProcessor._stops`), takes the text that
   may be sent, and sends one :class:`.types.GenerationEvent` through the request's sender
   (``send(event, final) -> bool``; False: its consumer left, and the request ends "abort");
   a sequence that stops leaves the scheduler at once (its slot is free for the next step).

With the engine's ``stream_interval`` N above 1 (``--stream-interval``, config key
``STREAM_INTERVAL``; vLLM's name and rule) a sequence's events are joined before they are sent:
its first token goes at once (the time to first token is unchanged), then one event per N
tokens (their ``token_ids``, ``text`` and ``logprobs`` joined in order, the counts the last's),
and the event that finishes it at once with all it held. Each send is what costs the host per
token past the forward (the stream's lock and wake-up, the HTTP thread's chunk and write(2):
BENCHMARKS.md), so N trades the stream's smoothness for the host's CPU; the answer is the
same. An abort's event carries what its sequence held; a failure sends what was held, then
fails. A request asking for many logprob alternatives joins fewer tokens an event
(:data:`HELD_BYTES`, and a quarter of its stream's bound on unread bytes). With N = 1 a step
decides once that nothing is held.

A failure belongs to the requests it comes from: a forward's error fails its requests; what
runs per sequence (its sampler state and detokenizer, its logits processing and grammar mask,
its draw, its logprobs, its detokenizing and stop check) fails only that sequence's request,
with that error (a typed one as it is; anything else as an INTERNAL error naming the stage,
logged with its traceback): every other sequence of the step gets its token.
:meth:`OutputProcessor.end` ends a request's unfinished sequences with a reason (an abort: the
sender is told, in case its consumer still reads), :meth:`OutputProcessor.fail` fails it; both
happen once per request. The numbers for /metrics (time to first token, inter-token latency,
tokens, finish reasons) are counted here, as tokens come out.

A traced request's decode span gets one event per step that gave it tokens, and its spans end
before its last event is sent (:mod:`.spans`): sending the last event ends the request's trace.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from plugserve.plugins.api import InferenceError, PlugserveError
from plugserve.plugins.decoding import StepSampler
from plugserve.plugins.sampling import SamplingState
from plugserve.server.apps.generate.engine.runner import Forward
from plugserve.server.apps.generate.engine.scheduler import FINISHED, RequestState, Scheduler
from plugserve.server.apps.generate.engine.scheduler import Sequence as Seq
from plugserve.server.apps.generate.engine.stats import GenerationStats
from plugserve.server.apps.generate.text.detokenizer import byte_pieces
from plugserve.server.apps.generate.types import (
    EVENT_BYTES,
    GenerationEvent,
    logprob_entry_bytes,
    seeded_generator,
)
from plugserve.server.plane.errors import forget_frames

__all__ = ["OutputProcessor", "cancelled", "send"]

log = logging.getLogger(__name__)

#: the most bytes one joined event holds (64 KiB: 24 tokens' logprobs of 20 alternatives; a
#: plain token's ~48 bytes never reach it): a request asking for more alternatives joins fewer
#: tokens an event, down to one (a whole vocabulary's are MBs a token)
HELD_BYTES = 64 << 10


@dataclasses.dataclass(eq=False)
class OutputProcessor:
    """Tokens, text and events of one engine's requests (see the module's docstring).

    ``forget(state)`` is the engine's: the request is over (its registry lets it go)."""

    name: str
    tokenizer: Any
    capacity: int
    scheduler: Scheduler
    sampler: StepSampler
    stats: GenerationStats
    forget: Callable[[RequestState], None]
    #: tokens a sequence's stream sends in one event (the engine's ``stream_interval``)
    interval: int = 1

    def __post_init__(self) -> None:
        self.eos = frozenset(self.tokenizer.eos_token_ids)
        if getattr(self.tokenizer, "backend", None) is not None:
            # the detokenizers' byte table (a pass over the vocabulary: tenths of a second for
            # 150k ids) made with the engine, not in the first request's step
            byte_pieces(self.tokenizer)

    def process(self, forward: Forward) -> None:
        """One forward's outcome: its requests failed, or its rows' tokens chosen and sent."""
        if forward.error is not None:
            for state in forward.failed:
                self.fail(state, forward.error)
            return
        if forward.prompt is not None:
            self._prompt_done(forward.prompt)
        self.sample(forward.group, forward.logits)

    def _prompt_done(self, state: RequestState) -> None:
        with self.stats.lock:
            self.stats.prompt_tokens += state.prompt_len
            self.stats.cached_prompt_tokens += state.cached
        if state.spans is not None:
            state.spans.decoding(state.cached)

    # --- choosing and sending

    def _prepare(self, seq: Seq) -> None:
        """The sequence's sampler state and detokenizer, made when it first samples."""
        request = seq.request.request
        params = request.params
        generator = None
        if params.seed is not None:
            generator = seeded_generator(params.seed, seq.index)
        constraint = request.constraints[seq.index] if request.constraints else params.constraint
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos))
        seq.sampling = SamplingState(params, request.prompt_token_ids, stops, generator, constraint)
        seq.detokenizer = self.tokenizer.detokenizer(request.prompt_token_ids, params)
        seq.hold, seq.hold_bytes = self._hold(params, seq.request.sender)

    def _hold(self, params: Any, sender: Any) -> tuple[int, int]:
        """The tokens a sequence of ``params`` sends in one event, and the bytes it may hold
        meanwhile: the interval, fewer when the joined event would hold more than
        :data:`HELD_BYTES` or a quarter of what its stream may leave unread (``max_bytes``:
        ``limits.stream_bounded`` admits one token's logprobs beyond
        ``--max-stream-unread-bytes``, not N tokens'). The count is estimated from a plain
        token's size; the bytes are the bound (:func:`_held` sends what it holds once the
        joined event reaches them, whatever its tokens' text: long tokens, a released
        stop-string tail)."""
        interval = self.interval
        most = HELD_BYTES
        if interval > 1:
            per_token = 48  # an id and its text (GenerationEvent.nbytes)
            if params.logprobs is not None:
                per_token += logprob_entry_bytes(params.logprobs + 1)
            room = getattr(sender, "max_bytes", None)
            if isinstance(room, int):
                most = min(most, room // 4)
            interval = max(1, min(interval, most // per_token))
        return interval, most

    def _prepared(self, group: list[Seq], logits: np.ndarray) -> tuple[list[Seq], np.ndarray]:
        """``group`` with each sequence's state made, less the sequences whose requests have
        failed (now, or earlier in the step), and their logits' rows."""
        for seq in group:
            if seq.sampling is None and seq.status != FINISHED:
                try:
                    self._prepare(seq)
                except Exception as exc:
                    self._failed(seq, "preparing its sampler and detokenizer", exc)
        keep = [i for i, seq in enumerate(group) if seq.status != FINISHED]
        if len(keep) < len(group):
            group, logits = [group[i] for i in keep], logits[keep]
        return group, logits

    def _timed(self, group: list[Seq], now: float) -> None:
        """Each sequence's time to first token or since its last one, and the tokens."""
        stats = self.stats
        with stats.lock:
            for seq in group:
                if seq.status == FINISHED:
                    continue
                if seq.generated == 0:
                    seq.first_at = now
                    stats.histograms["time_to_first_token"].observe(now - seq.request.arrival)
                else:
                    stats.histograms["inter_token_latency"].observe(now - seq.last_at)
                seq.last_at = now
                stats.generation_tokens += 1

    def sample(self, group: list[Seq], logits: np.ndarray) -> None:
        """Each sequence of ``group`` chooses its token from its row of ``logits``, and its
        event is sent."""
        group, logits = self._prepared(group, logits)
        if not group:
            return
        failures: dict[int, Exception] = {}
        tokens, logprobs = self.sampler(
            logits, [s.sampling for s in group], [s.generated for s in group], failures
        )
        self.emit(group, tokens, logprobs, failures)

    def emit(
        self,
        group: list[Seq],
        tokens: np.ndarray,
        logprobs: list[Any],
        failures: dict[int, Exception],
    ) -> None:
        """The chosen ``tokens`` of ``group`` (row ``i`` failed when in ``failures``): each
        sequence's stop checks, text and event. A sequence already finished (its request
        ended meanwhile: a pipelined step's wasted row, :mod:`.overlap`) is skipped."""
        for row, exc in failures.items():
            self._failed(group[row], "sampling", exc)
        now = time.monotonic()
        self._timed(group, now)
        finished_states: list[RequestState] = []
        traced: list[RequestState] | None = None
        rows = len(group)
        stops = self._stops
        hold = self.interval > 1  # decided once a step: an interval of 1 holds nothing
        # the rows' ids as Python ints at once (not an int() of a numpy scalar per row)
        for seq, token, entry in zip(group, tokens.tolist(), logprobs):
            if seq.status == FINISHED:  # its request failed, or was ended by a sibling's send
                continue
            seq.tokens.append(token)
            seq.generated += 1
            try:
                reason = stops(seq, token)
                text = seq.detokenizer.take(reason is not None)
            except Exception as exc:
                self._failed(seq, "detokenizing and checking for stop strings", exc)
                continue
            state = seq.request
            event = GenerationEvent(
                seq.index,
                [token],
                text,
                [entry] if entry is not None else None,
                reason,
                state.prompt_len,
                seq.generated,
                state.cached,
                seq.stop_reason,
                state.prompt_logprobs,
            )  # positional (the fields' order): a tenth of the row's cost with keywords
            if state.prompt_logprobs is not None:
                state.prompt_logprobs = None  # sent once, with the request's first event
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                state.done += 1
            final = state.done == len(state.sequences)  # state.finished
            spans = state.spans
            if spans is not None and spans.token(rows, final, state):
                traced = [*(traced or ()), state]
            if hold:
                event = _held(seq, event)
                if event is None:
                    continue
            if not send(state.sender, event, final):
                self.end(state, "abort")
                continue
            if final:
                finished_states.append(state)
        for state in traced or ():
            state.spans.flush(state)
        for state in finished_states:
            self._forget(state, now)

    def _stops(self, seq: Seq, token: int) -> str | None:
        """Why the sequence ends with ``token`` (and its text updated), or None."""
        sampling = seq.sampling
        if token in sampling.stop_set:  # eos (unless ignore_eos) or a stop token id
            seq.stop_reason = token if token in sampling.params.stop_token_ids else None
            return "stop"
        detokenizer = seq.detokenizer
        if detokenizer.add(token):
            seq.stop_reason = detokenizer.stop_reason
            return "stop"
        constraint = sampling.constraint
        if constraint is not None and constraint.done():
            return "stop"
        if seq.generated >= sampling.params.max_tokens or len(seq.tokens) >= self.capacity:
            return "length"
        return None

    # --- ending requests

    def _failed(self, seq: Seq, stage: str, exc: Exception) -> None:
        """``seq`` failed at ``stage`` of a step: its request fails with that error (a typed
        one as it is, anything else as an INTERNAL error saying where, logged whole); the
        step's other sequences go on."""
        if isinstance(exc, PlugserveError):
            error: Exception = exc
        else:
            log.error(
                "model %s: request %s failed while %s; the other sequences of the step go on",
                self.name, seq.request.request_id, stage, exc_info=exc,
            )  # fmt: skip
            error = InferenceError(
                f"model {self.name}: generation failed while {stage} for this request "
                f"({type(exc).__name__}: {exc})"
            )
        # logged: its frames would only keep the step's locals (the sampler's copy of the
        # logits, rows x vocab) in a reference cycle until the collector runs
        forget_frames(exc)
        self.fail(seq.request, error)

    def end(self, state: RequestState, reason: str) -> None:
        """End every unfinished sequence of ``state`` with ``reason`` (an abort: the sender
        is told, in case its consumer still reads)."""
        if state.ended:
            return
        self.scheduler.drop_waiting(state)
        ended = [seq for seq in state.sequences if seq.status != FINISHED]
        for seq in ended:
            self.scheduler.finish(seq)
            seq.finish_reason = reason
            state.done += 1
        if state.spans is not None:
            state.spans.finished(state)
        for i, seq in enumerate(ended):
            held, seq.held = seq.held, None  # its tokens not sent yet go with the end
            event = GenerationEvent(
                index=seq.index,
                token_ids=held.token_ids if held is not None else [],
                text=held.text if held is not None else "",
                logprobs=held.logprobs if held is not None else None,
                finish_reason=reason,
                prompt_tokens=state.prompt_len,
                completion_tokens=seq.generated,
                cached_tokens=state.cached,
            )
            send(state.sender, event, i == len(ended) - 1)
        self._forget(state, time.monotonic())

    def fail(self, state: RequestState, error: Exception) -> None:
        """``state`` fails with ``error``: its sequences leave, its sender fails."""
        if state.ended:
            return
        self.scheduler.drop_waiting(state)
        for seq in state.sequences:
            if seq.status != FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
                state.done += 1
        if state.spans is not None:
            state.spans.finished(state, error)
        for seq in state.sequences:  # the tokens held, sent before the failure as they came
            held, seq.held = seq.held, None
            if held is not None:
                send(state.sender, held, False)
        try:
            state.sender.fail(error)
        except Exception:  # a consumer's failure must not stop the loop
            log.exception("model %s: failing a request's stream failed", self.name)
        self._forget(state, time.monotonic())

    def _forget(self, state: RequestState, now: float) -> None:
        state.ended = True
        self.forget(state)
        with self.stats.lock:
            self.stats.histograms["e2e_request_latency"].observe(now - state.arrival)
            for seq in state.sequences:
                reason = seq.finish_reason or "abort"
                self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1


def _held(seq: Seq, event: GenerationEvent) -> GenerationEvent | None:
    """What of ``seq``'s tokens to send with ``event`` (its stream_interval above 1): None
    while it holds them, else one event of every token held (``token_ids``, ``text`` and
    ``logprobs`` joined in order; counts, finish and stop reason the last's). Its first token
    goes at once (the time to first token is the interval's 1), and its last with all held."""
    held = seq.held
    if held is None:
        if event.finish_reason is not None or seq.generated == 1 or seq.hold == 1:
            return event
        seq.held = event  # (the engine's own event: joined into, never sent meanwhile)
        seq.held_bytes = event.nbytes
        return None
    held.token_ids.extend(event.token_ids)
    held.text += event.text
    if event.logprobs:
        if held.logprobs is None:
            held.logprobs = list(event.logprobs)
        else:
            held.logprobs.extend(event.logprobs)
    held.finish_reason = event.finish_reason
    held.completion_tokens = event.completion_tokens
    held.cached_tokens = event.cached_tokens
    held.stop_reason = event.stop_reason
    # the joined event's size (GenerationEvent.nbytes) kept as it grows: it goes once at the
    # bound, so it holds at most the bound and this last token's part
    seq.held_bytes += event.nbytes - EVENT_BYTES
    if (
        event.finish_reason is None
        and len(held.token_ids) < seq.hold
        and seq.held_bytes < seq.hold_bytes
    ):
        return None
    seq.held = None
    return held


def cancelled(sender: Any) -> bool:
    """Whether ``sender``'s consumer left (a broken sender has none left)."""
    try:
        return bool(sender.cancelled)
    except Exception:
        return True


def send(sender: Any, event: GenerationEvent, final: bool) -> bool:
    """``sender.send``; False when its consumer is gone (or the send itself failed)."""
    try:
        return sender.send(event, final) is not False
    except Exception:
        log.exception("sending a generation event failed")
        return False
