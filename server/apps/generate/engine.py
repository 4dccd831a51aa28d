"""The engine of one generative model: a loop thread that runs the decoder step by step for
every sequence in flight (continuous batching), samples, detokenizes and streams events.

``Engine.add(request, sender)`` queues a :class:`.types.GenerationRequest`; the loop admits it
when the scheduler finds room (:mod:`.scheduler`), computes its prompt (in chunks when long),
then gives it one token per step in the same batched forward as every other decoding
sequence, and sends a :class:`.types.GenerationEvent` per new token through the sender (the
producer side of the request's response stream: ``send(item, final) -> bool``, ``fail``,
``cancelled``, ``on_cancel``). The sequence leaves the batch the step it finishes; its slot is
free for the next request at once.

A step, on the loop thread:

1. take new requests from the inbox; drop the requests whose consumer left or was cancelled
   (deadline, client gone, abort): their slots are free for this step's plan;
2. ask the scheduler for the step's plan (decoding sequences, prompt chunks);
3. decoding sequences moved to rows ``0..B-1`` of the cache (a sequence moves when one before
   it left; a row copy of its written tokens), one batched forward, one batched sampling, and
   their events sent before the prompt chunks run (a chunk does not delay tokens already made);
4. first prompt chunks as one right-padded forward, continuing chunks one per forward; a
   prompt's last chunk gives its first token.

A failure belongs to the requests it comes from. A device failure fails the requests of that
forward (their senders get the error, their slots are freed). What runs per sequence after the
forward (making its sampler state and detokenizer, its logits processing and grammar mask,
its draw, its logprobs, its detokenizing and stop check) fails only the request the sequence
belongs to, with that error (a typed one as it is; anything else as an INTERNAL error naming
the stage, logged with its traceback): every other sequence of the step gets its token. A
request's parameters are checked against their ranges before it enters
(:meth:`.types.SamplingParams.check`), so a value the sampler cannot take is a 400, not a step
failure. ``close`` ends every request with ``finish_reason`` "abort" and stops the thread.

``n`` > 1 is the engine's: the request's sequences share one prompt computation (the leader's
cache is copied into each other sequence's slot when the prompt is done) and each draws with
its own generator (seeded ``seed + index``, vLLM's rule, when the request has a seed).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    Cancelled,
    InferenceError,
    InvalidArgument,
    PlugserveError,
    ResourceExhausted,
)
from plugserve.server.apps.generate.decoder import Decoder
from plugserve.server.apps.generate.kvcache import Slot, SlotTable
from plugserve.server.apps.generate.sampler import Sampler, SamplingState
from plugserve.server.apps.generate.scheduler import (
    DECODE,
    FINISHED,
    FORK,
    PREFILL,
    Plan,
    RequestState,
    Scheduler,
)
from plugserve.server.apps.generate.scheduler import Sequence as Seq
from plugserve.server.apps.generate.stats import GenerationStats
from plugserve.server.apps.generate.types import (
    GenerationEvent,
    GenerationRequest,
    seeded_generator,
)

__all__ = ["Engine", "EngineSettings", "QueueSender"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an operator sets per model (docs/generate.md explains each)."""

    #: sequences holding a cache slot at once (the batch's rows at most)
    max_num_seqs: int = 16
    #: tokens computed in one step: decoding sequences' tokens plus prompt chunks
    max_num_batched_tokens: int = 256
    #: bytes the cache may take (0: max_num_seqs slots of the context, at most a quarter of
    #: the machine's memory)
    kv_cache_bytes: int = 0
    #: the longest sequence, prompt and answer (0: the model's context length)
    max_model_len: int = 0
    #: tokens per prefix-cache block
    block_size: int = 16
    enable_prefix_caching: bool = True
    #: requests waiting for a slot, at most (then ResourceExhausted)
    max_waiting: int = 1024


class Engine:
    """Continuous batching over one decoder network."""

    def __init__(
        self,
        name: str,
        decoder: Decoder,
        tokenizer: Any,
        settings: EngineSettings,
        rows: int,
        seed: int | None = None,
    ) -> None:
        self.name = name
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.settings = settings
        self.capacity = decoder.layout.capacity
        self.cache = decoder.new_cache(rows)
        self.table = SlotTable(self.cache, settings.block_size, settings.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.table,
            min(settings.max_num_seqs, rows),
            settings.max_num_batched_tokens,
            settings.max_waiting,
            self._copy_prefix,
        )
        self.sampler = Sampler(seed)
        self.stats_ = GenerationStats()
        self.stats_.kv_cache_bytes = self.cache.nbytes
        self.stats_.block_size = settings.block_size
        self.stats_.kv_cache_blocks = self.cache.rows * self.capacity // settings.block_size
        self.eos = frozenset(tokenizer.eos_token_ids)
        self._lock = threading.Condition()
        self._inbox: list[RequestState] = []
        self._aborts: set[str] = set()
        self._woken = False
        self._closing = False
        self._requests: dict[str, RequestState] = {}
        self._thread = threading.Thread(target=self._loop, name=f"generate/{name}", daemon=True)
        self._thread.start()

    # --- the producer's side

    @property
    def max_model_len(self) -> int:
        return self.capacity

    def add(self, request: GenerationRequest, sender: Any) -> None:
        """Queue ``request``; its events go to ``sender``. InvalidArgument when it cannot fit
        the model (an empty or too long prompt, n beyond the slots) or a parameter is out of
        its range; ResourceExhausted when the queue is full."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidArgument("the prompt has no token")
        if len(prompt) >= self.capacity:
            raise InvalidArgument(
                f"the prompt has {len(prompt)} tokens; this model's context holds "
                f"{self.capacity} (max_model_len), prompt and answer together"
            )
        vocab = self.decoder.vocab
        if vocab and (min(prompt) < 0 or max(prompt) >= vocab):
            raise InvalidArgument(f"prompt token ids must be in 0..{vocab - 1}")
        if request.n < 1 or request.n > self.scheduler.max_num_seqs:
            raise InvalidArgument(
                f"n must be 1 to {self.scheduler.max_num_seqs} for this model (max_num_seqs)"
            )
        request.params.check(vocab or 0)
        if request.constraints is not None and len(request.constraints) != request.n:
            raise InvalidArgument(f"{len(request.constraints)} constraints for n={request.n}")
        state = RequestState(request, sender, time.monotonic())
        if request.arrival:
            state.arrival -= max(0.0, time.time() - request.arrival)
        with self._lock:
            if self._closing:
                raise Cancelled(f"model {self.name}: the engine is closing")
            if request.request_id in self._requests:
                raise InvalidArgument(f"request id {request.request_id!r} is already running")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.settings.max_waiting:
                raise ResourceExhausted(
                    f"model {self.name}: {self.settings.max_waiting} requests are waiting "
                    "already (max_waiting); retry later"
                )
            self._requests[request.request_id] = state
            self._inbox.append(state)
            self._woken = True
            self._lock.notify()
        with self.stats_.lock:  # waiting from its arrival on, not from the loop's next turn
            self.stats_.waiting += 1
        sender.on_cancel(lambda: self.abort(request.request_id))

    def abort(self, request_id: str) -> None:
        """End a request at the next step (its slots freed, ``finish_reason`` "abort")."""
        with self._lock:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._woken = True
                self._lock.notify()

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """In-process use: the request's events as they come (blocking)."""
        sender = QueueSender()
        self.add(request, sender)
        try:
            yield from sender
        finally:
            sender.close()

    def stats(self) -> GenerationStats:
        return self.stats_

    def close(self) -> None:
        """End every request (``abort``) and stop the loop thread."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # --- the loop

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._woken and not self._closing and not self._busy():
                    self._lock.wait()
                self._woken = False
                closing = self._closing
                new, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            self.scheduler.waiting.extend(new)
            if closing:
                for state in list(self._requests.values()):
                    self._end(state, "abort")
                return
            self._reap(aborts)
            plan = self.scheduler.schedule()
            self._gauges()
            if plan.empty:
                continue
            try:
                self._step(plan)
            except Exception:  # a bug of ours must not kill the loop: log, fail, go on
                log.exception("model %s: generation step failed", self.name)
                for seq in self._plan_sequences(plan):
                    if seq.request.request_id in self._requests:
                        self._fail(seq.request, RuntimeError("the generation step failed"))
            self._gauges()  # what the step ended (an idle engine's gauges read zero)

    def _busy(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def _reap(self, aborts: set[str]) -> None:
        """End the requests aborted or whose consumer left (checked once a step)."""
        for state in list(self._requests.values()):
            if state.request_id in aborts or _cancelled(state.sender):
                self._end(state, "abort")

    def _gauges(self) -> None:
        stats = self.stats_
        with stats.lock:
            stats.running = self.scheduler.held
            stats.waiting = len(self.scheduler.waiting) + len(self._inbox)
            stats.kv_cache_usage = self.table.held() / max(1, self.cache.rows)

    # --- one step

    def _step(self, plan: Plan) -> None:
        if self.decoder.mixed:
            self._step_mixed(plan)
            return
        if plan.decode:
            self._decode(plan.decode)
        if plan.first:
            self._first(plan.first)
        for seq, count in plan.extend:
            if seq.status != PREFILL:
                continue  # ended by the decode group's events (an abort)
            start = seq.computed
            chunk = seq.tokens[start : start + count]
            try:
                logits = self.decoder.extend(self.cache, seq.slot.index, start, chunk)
            except PlugserveError as exc:
                self._fail(seq.request, exc)
                continue
            self._computed(seq, chunk)
            if seq.pending == 0:
                self._prompt_done(seq, logits[None])

    def _step_mixed(self, plan: Plan) -> None:
        """The whole plan in one forward (a backend whose graph takes decoding rows and
        prompt chunks together: :attr:`.decoder.Decoder.mixed`); the rows stay where they
        are (no arranging), the decoding rows' tokens are sampled first."""
        group = [s for s in plan.decode if s.status == DECODE]
        chunks = [(s, c) for s, c in (*plan.extend, *plan.first) if s.status == PREFILL and c > 0]
        if not group and not chunks:
            return
        tokens = [s.tokens[s.computed] for s in group]
        pieces = [s.tokens[s.computed : s.computed + c] for s, c in chunks]
        try:
            decoded, prompted = self.decoder.step(
                self.cache,
                [s.slot.index for s in group],
                tokens,
                [s.computed for s in group],
                [(s.slot.index, s.computed, p) for (s, _c), p in zip(chunks, pieces)],
            )
        except PlugserveError as exc:
            states = {id(s.request): s.request for s in (*group, *(s for s, _c in chunks))}
            for state in states.values():
                self._fail(state, exc)
            return
        for seq, token in zip(group, tokens):
            self._computed(seq, [token])
        if group:
            self._sample(group, decoded)
        for (seq, _c), piece, row in zip(chunks, pieces, prompted):
            if seq.status != PREFILL:
                continue  # ended by the decoding rows' events (an abort)
            self._computed(seq, piece)
            if seq.pending == 0:
                self._prompt_done(seq, row[None])

    def _decode(self, group: list[Seq]) -> None:
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
            for state in {id(s.request): s.request for s in group}.values():
                self._fail(state, exc)
            return
        for seq, token in zip(group, tokens):
            self._computed(seq, [int(token)])
        self._sample(group, logits)

    def _first(self, chunks: list[tuple[Seq, int]]) -> None:
        """First prompt chunks, right-padded into batches of at most
        ``max_num_batched_tokens`` tokens padding included (a batch's logits are rows x
        longest chunk x vocabulary: a long chunk beside short ones must not multiply them)."""
        chunks = sorted(((s, c) for s, c in chunks if s.status == PREFILL), key=lambda x: x[1])
        budget = self.settings.max_num_batched_tokens
        batch: list[tuple[Seq, int]] = []
        for item in chunks:
            if batch and (len(batch) + 1) * item[1] > budget:
                self._first_batch(batch)
                batch = []
            batch.append(item)
        if batch:
            self._first_batch(batch)

    def _first_batch(self, chunks: list[tuple[Seq, int]]) -> None:
        chunks = sorted(chunks, key=lambda x: x[0].slot.index)
        rows = [s.slot.index for s, _c in chunks]
        pieces = [s.tokens[:c] for s, c in chunks]
        try:
            logits = self.decoder.first(self.cache, rows, pieces)
        except PlugserveError as exc:
            for seq, _c in chunks:
                self._fail(seq.request, exc)
            return
        for (seq, _c), piece, row in zip(chunks, pieces, logits):
            self._computed(seq, piece)
            if seq.pending == 0:
                self._prompt_done(seq, row[None])

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

    def _copy_prefix(self, source: Slot, target: Slot, length: int) -> None:
        self.cache.copy(source.index, target.index, length)

    def _prompt_done(self, leader: Seq, logits: np.ndarray) -> None:
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
        with self.stats_.lock:
            self.stats_.prompt_tokens += state.prompt_len
            self.stats_.cached_prompt_tokens += state.cached
        self._sample(group, np.repeat(logits, len(group), axis=0))

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

    def _sample(self, group: list[Seq], logits: np.ndarray) -> None:
        for seq in group:
            if seq.sampling is None and seq.status != FINISHED:
                try:
                    self._prepare(seq)
                except Exception as exc:
                    self._failed(seq, "preparing its sampler and detokenizer", exc)
        keep = [i for i, seq in enumerate(group) if seq.status != FINISHED]
        if len(keep) < len(group):  # the sequences of requests that failed just now
            group, logits = [group[i] for i in keep], logits[keep]
        if not group:
            return
        failures: dict[int, Exception] = {}
        tokens, logprobs = self.sampler(
            logits, [s.sampling for s in group], [s.generated for s in group], failures
        )
        for row, exc in failures.items():
            self._failed(group[row], "sampling", exc)
        now = time.monotonic()
        finished_states: list[RequestState] = []
        stats = self.stats_
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
        for seq, token, entry in zip(group, tokens, logprobs):
            if seq.status == FINISHED:  # its request failed, or was ended by a sibling's send
                continue
            token = int(token)
            seq.tokens.append(token)
            seq.generated += 1
            try:
                reason = self._stops(seq, token)
                text = seq.detokenizer.take(final=reason is not None)
            except Exception as exc:
                self._failed(seq, "detokenizing and checking for stop strings", exc)
                continue
            state = seq.request
            event = GenerationEvent(
                index=seq.index,
                token_ids=[token],
                text=text,
                logprobs=[entry] if entry is not None else None,
                finish_reason=reason,
                prompt_tokens=state.prompt_len,
                completion_tokens=seq.generated,
                cached_tokens=state.cached,
                stop_reason=seq.stop_reason,
            )
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                state.done += 1
            final = state.finished
            if not _send(state.sender, event, final):
                self._end(state, "abort")
                continue
            if final:
                finished_states.append(state)
        for state in finished_states:
            self._forget(state, now)

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
        self._fail(seq.request, error)

    def _stops(self, seq: Seq, token: int) -> str | None:
        """Why the sequence ends with ``token`` (and its text updated), or None."""
        params = seq.sampling.params
        if token in seq.sampling.stop_set:  # eos (unless ignore_eos) or a stop token id
            seq.stop_reason = token if token in params.stop_token_ids else None
            return "stop"
        if seq.detokenizer.add(token):
            seq.stop_reason = seq.detokenizer.stop_reason
            return "stop"
        constraint = seq.sampling.constraint
        if constraint is not None and constraint.done():
            return "stop"
        if seq.generated >= params.max_tokens or len(seq.tokens) >= self.capacity:
            return "length"
        return None

    def _end(self, state: RequestState, reason: str) -> None:
        """End every unfinished sequence of ``state`` with ``reason`` (an abort: the sender
        is told, in case its consumer still reads)."""
        if state.request_id not in self._requests:
            return
        self.scheduler.drop_waiting(state)
        for seq in state.sequences:
            if seq.status == FINISHED:
                continue
            self.scheduler.finish(seq)
            seq.finish_reason = reason
            state.done += 1
            event = GenerationEvent(
                index=seq.index,
                token_ids=[],
                text="",
                finish_reason=reason,
                prompt_tokens=state.prompt_len,
                completion_tokens=seq.generated,
                cached_tokens=state.cached,
            )
            _send(state.sender, event, state.finished)
        self._forget(state, time.monotonic())

    def _fail(self, state: RequestState, error: Exception) -> None:
        if state.request_id not in self._requests:
            return
        self.scheduler.drop_waiting(state)
        for seq in state.sequences:
            if seq.status != FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
                state.done += 1
        try:
            state.sender.fail(error)
        except Exception:  # a consumer's failure must not stop the loop
            log.exception("model %s: failing a request's stream failed", self.name)
        self._forget(state, time.monotonic())

    def _forget(self, state: RequestState, now: float) -> None:
        with self._lock:
            self._requests.pop(state.request_id, None)
        with self.stats_.lock:
            self.stats_.histograms["e2e_request_latency"].observe(now - state.arrival)
            for seq in state.sequences:
                reason = seq.finish_reason or "abort"
                self.stats_.finished[reason] = self.stats_.finished.get(reason, 0) + 1

    @staticmethod
    def _plan_sequences(plan: Plan) -> list[Seq]:
        return [*plan.decode, *(s for s, _c in plan.first), *(s for s, _c in plan.extend)]


def _cancelled(sender: Any) -> bool:
    try:
        return bool(sender.cancelled)
    except Exception:  # a broken sender has no consumer left
        return True


def _send(sender: Any, event: GenerationEvent, final: bool) -> bool:
    """``sender.send``; False when its consumer is gone (or the send itself failed)."""
    try:
        return sender.send(event, final) is not False
    except Exception:
        log.exception("sending a generation event failed")
        return False


class QueueSender:
    """The sender of an in-process consumer (``Engine.generate``, the network's blocking
    ``infer``), with plugins/responses.py's ``ResponseSender`` methods: events queue here and
    are read by iterating; the queue is bounded by the request's own tokens. ``close`` (the
    consumer leaving) makes the engine drop the request at its next step."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._cond = threading.Condition()
        self._final = False
        self._error: BaseException | None = None
        self._closed = False
        self._callbacks: list[Any] = []

    def on_cancel(self, callback: Any) -> Any:
        """Call ``callback`` once the consumer leaves (:meth:`close`); returns what
        unregisters it."""
        with self._cond:
            if not self._closed:
                self._callbacks.append(callback)
                return lambda: (
                    self._callbacks.remove(callback) if callback in self._callbacks else None
                )
        callback()
        return lambda: None

    @property
    def cancelled(self) -> bool:
        return self._closed

    def send(self, item: Any, final: bool = False) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._items.append(item)
            self._final = self._final or final
            self._cond.notify()
            return True

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._final = True
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            callbacks, self._callbacks = self._callbacks, []
            self._cond.notify()
        for callback in callbacks:
            callback()

    def __iter__(self) -> Iterator[Any]:
        while True:
            with self._cond:
                while not self._items and not self._final and not self._closed:
                    self._cond.wait()
                items, self._items = self._items, []
                done = self._final or self._closed
                error = self._error
            yield from items
            if error is not None:
                raise error
            if done:
                return
