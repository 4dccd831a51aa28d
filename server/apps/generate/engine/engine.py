"""The engine of one generative model: a loop thread that steps every sequence in flight
(continuous batching), split as vLLM v1 splits its engine core.

``Engine.add(request, sender)`` queues a :class:`.types.GenerationRequest`; the loop admits it
when the scheduler finds room, computes its prompt (in chunks when long), then gives it one
token per step in the same batched forward as every other decoding sequence, and sends a
:class:`.types.GenerationEvent` per new token through the sender (the producer side of the
request's response stream: ``send(item, final) -> bool``, ``fail``, ``cancelled``,
``on_cancel``). The sequence leaves the batch the step it finishes; its slot is free for the
next request at once.

One job per module, over plain data objects (the scheduler's :class:`.scheduler.RequestState`,
:class:`.scheduler.Sequence` and :class:`.scheduler.Plan`, the runner's
:class:`.runner.Forward`), as vLLM's ``EngineCore.step`` (schedule, execute, update):

==================  ==========================================================================
this module         the loop: the inbox of new requests and aborts, each step's order, the
                    requests in flight, the gauges
:mod:`.scheduler`   which sequences run in the step, and how many prompt tokens each computes
:mod:`.runner`      the model run: the plan's forwards (decode batch, prompt chunks) and the
                    cache's arrangement for them
:mod:`.output`      output processing: sampling applied, stop checks, detokenizing, events to
                    the senders, requests ended or failed
:mod:`.kvcache`     the cache's slots and the prefix cache; :mod:`.detokenizer`
:mod:`.kv_host_tier` the blocks evicted from the slots, kept in host memory and restored
:mod:`.kv_disk_tier` the blocks the host tier drops, kept in files and restored
:mod:`.spans`       a traced request's spans: queue, prefill chunks, decode
==================  ==========================================================================

A step, on the loop thread:

1. take new requests from the inbox; end the requests whose consumer left or was cancelled
   (deadline, client gone, abort): their slots are free for this step's plan;
2. ask the scheduler for the step's plan (decoding sequences, prompt chunks);
3. run it (:meth:`.runner.ModelRunner.execute`), handing each forward's outcome to the output
   processor as soon as it is done: the decoding sequences' tokens are sent before the prompt
   chunks run (a chunk does not delay tokens already made), and a prompt's last chunk gives
   its first token.

Pipelined decode steps (:mod:`.overlap`): on a decoder that can (the torch one) and with
``async_scheduling`` on, a decode-only step whose rows may be is launched on the device
stream instead (2. and 3. above become: launch the step behind the one in flight, its ids
taken on the device, then process the one in flight while it runs); a request that could be
admitted, a prompt chunk, or a row whose sampling needs host state (a grammar, penalties)
drains the pipeline back to the synchronous step.

A failure belongs to the requests it comes from (:mod:`.output` says how): a device failure
fails the requests of that forward, a sequence's own failure its request only, and a bug of
ours in a step fails the requests of that step's plan, logged, while the loop goes on. A
request's parameters are checked against their ranges before it enters
(:meth:`.types.SamplingParams.check`), so a value the sampler cannot take is a 400, not a step
failure. ``close`` ends every request with ``finish_reason`` "abort" and stops the thread.

Sleep and wake (vLLM's sleep mode, :meth:`Engine.sleep`, :meth:`Engine.wake_up`): run on the
loop thread between steps, as a command the caller waits for. Sleeping ends every request in
flight or waiting (``finish_reason`` "abort"), forgets the prefix cache, frees the cache's
memory and lets the decoder release its weights as the level says (1: offloaded to the host
where they live on a card, 2: dropped, read again at wake); requests while asleep are refused
:class:`Asleep` (UNAVAILABLE: 503 with Retry-After). Waking reallocates the cache (and the
decoder its weights); the answers are the ones before, token for token.

``n`` > 1 is the engine's: the request's sequences share one prompt computation (the leader's
cache is copied into each other sequence's slot when the prompt is done) and each draws with
its own generator (seeded ``seed + index``, vLLM's rule, when the request has a seed).

A request whose :attr:`.types.GenerationRequest.trace` names a span is traced
(:class:`.spans.RequestSpans`, made here when it is queued); one that does not costs the
engine a None check per request and per step.

Bounds: ``max_waiting`` requests queued (then ResourceExhausted), ``max_num_seqs`` sequences
holding a slot, ``max_num_batched_tokens`` tokens computed a step; one thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    Cancelled,
    InvalidArgument,
    PlugserveError,
    ResourceExhausted,
    Unsupported,
)
from plugserve.plugins.decoding import Decoder
from plugserve.plugins.threads import start_daemon
from plugserve.server.apps.generate import limits
from plugserve.server.apps.generate.engine.kv_disk_tier import DiskTier
from plugserve.server.apps.generate.engine.kv_host_tier import HostTier, supports
from plugserve.server.apps.generate.engine.kvcache import SlotTable
from plugserve.server.apps.generate.engine.kvevents import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    BlockEvents,
    Publisher,
)
from plugserve.server.apps.generate.engine.output import OutputProcessor, cancelled
from plugserve.server.apps.generate.engine.overlap import (
    DeviceStream,
    Launched,
    continues,
    pipelinable,
)
from plugserve.server.apps.generate.engine.runner import Forward, ModelRunner
from plugserve.server.apps.generate.engine.scheduler import FINISHED, Plan, RequestState, Scheduler
from plugserve.server.apps.generate.engine.scheduler import Sequence as Seq
from plugserve.server.apps.generate.engine.spans import RequestSpans
from plugserve.server.apps.generate.engine.stats import GenerationStats
from plugserve.server.apps.generate.types import GenerationEvent, GenerationRequest
from plugserve.server.control.allocator import give_back_freed_memory
from plugserve.server.plane import shares

__all__ = ["Asleep", "Engine", "EngineSettings", "QueueSender"]

log = logging.getLogger(__name__)

#: sleep levels (vLLM's): 1 the cache freed and the weights offloaded to the host (kept),
#: 2 the cache and the weights dropped (read again from the folder at wake)
SLEEP_LEVELS = (1, 2)


class Asleep(PlugserveError):
    """A request to a model put to sleep (``POST /sleep``): UNAVAILABLE (REST 503 with
    Retry-After) until an operator wakes it (``POST /wake_up``)."""

    code = "UNAVAILABLE"


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What an operator sets per model (docs/generate.md explains each)."""

    #: sequences holding a cache slot at once (the batch's rows at most)
    max_num_seqs: int = 16
    #: tokens computed in one step: decoding sequences' tokens plus prompt chunks (0: the
    #: decoder's own, :attr:`~plugserve.plugins.decoding.Decoder.step_tokens`)
    max_num_batched_tokens: int = 0
    #: bytes the cache may take (0: max_num_seqs slots of the context, at most a quarter of
    #: the machine's memory)
    kv_cache_bytes: int = 0
    #: GiB of host memory keeping the blocks evicted from the cache's slots, restored
    #: instead of computed again (vLLM's ``--kv-offloading-size``; 0: off; :mod:`.kv_host_tier`)
    kv_offloading_size: float = 0.0
    #: the directory and GiB of the disk tier beneath the host tier: the blocks the host tier
    #: drops, kept in files (LMCache's ``local_disk``; "" or 0: off; :mod:`.kv_disk_tier`)
    kv_disk_path: str = ""
    kv_disk_size: float = 0.0
    #: the longest sequence, prompt and answer (0: the model's context length)
    max_model_len: int = 0
    #: tokens per prefix-cache block
    block_size: int = 16
    enable_prefix_caching: bool = True
    #: requests waiting for a slot, at most (then ResourceExhausted)
    max_waiting: int = 1024
    #: steady decode steps pipelined on a decoder that can (the torch one): the next step
    #: launched with this one's ids on the device before this one's tokens are sent
    #: (:mod:`.overlap`); False: every step synchronous
    async_scheduling: bool = True
    #: tokens a sequence's stream sends in one event (vLLM's ``stream_interval``): its first
    #: at once, then one event per this many, its last with what is left (:mod:`.output`)
    stream_interval: int = 1
    #: the warm-up before the model is ready (:mod:`.warmup`): "off", "default", or a JSON
    #: object of ``batch_sizes`` and ``prompt_lens`` (the server's ``--generate-warmup``
    #: default: a load made in process warms as a server's does)
    warmup: str = "default"
    #: the server's KV-events publisher (``--kv-events-config``, :mod:`.kvevents`); None: off.
    #: The server's, not a model's config key
    kv_events: Publisher | None = dataclasses.field(default=None, compare=False, repr=False)


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
        identity: tuple[str, bytes] = ("", b""),
    ) -> None:
        """``identity``: the disk tier's folder for this model under ``kv_disk_path`` ("": its
        name) and what tells its files from another's (:func:`.network.identity`), to which
        the cache's layout is added."""
        self.name = name
        self.decoder = decoder
        self.tokenizer = tokenizer
        if not settings.max_num_batched_tokens:  # the decoder's own
            settings = dataclasses.replace(settings, max_num_batched_tokens=decoder.step_tokens)
        self.settings = settings
        self.capacity = decoder.layout.capacity
        self.cache = decoder.new_cache(rows)
        settings = self.settings = _tier_block_size(name, self.cache, settings)
        self.events = (
            # the engine's own cache is "GPU" on any device, as vLLM's block pool names its
            # own (MEDIUM_GPU); its host tier's blocks are "CPU"
            BlockEvents(settings.kv_events, settings.block_size, MEDIUM_GPU)
            if settings.kv_events is not None and settings.enable_prefix_caching
            else None
        )
        self.table = SlotTable(
            self.cache, settings.block_size, settings.enable_prefix_caching, self.events
        )
        self.tier = self._host_tier(name, settings)
        if self.tier is not None:
            self.tier.disk = _disk_tier(name, self.tier, settings, identity)
        if self.tier is not None and self.events is not None:
            _announce_tier(self.events, self.tier)
        self.runner = ModelRunner(
            decoder, self.cache, self.table, settings.max_num_batched_tokens, self.tier
        )
        self.scheduler = Scheduler(
            self.table,
            min(settings.max_num_seqs, rows),
            settings.max_num_batched_tokens,
            settings.max_waiting,
            self.runner.copy_prefix,
            self.runner.restore_prefix if self.tier is not None else None,
        )
        self.sampler = decoder.new_sampler(seed)
        self.stats_ = GenerationStats()
        self.stats_.kv_cache_bytes = self.cache.nbytes
        self.stats_.block_size = settings.block_size
        self.stats_.kv_cache_blocks = self.cache.rows * self.capacity // settings.block_size
        self.output = OutputProcessor(
            name, tokenizer, self.capacity, self.scheduler, self.sampler, self.stats_,
            self._forget, settings.stream_interval,
        )  # fmt: skip
        self._lock = threading.Condition()
        self._inbox: list[RequestState] = []
        self._aborts: set[str] = set()
        self._woken = False
        self._closing = False
        #: the sleep level (0: awake); set when a sleep is asked, cleared once awake again
        self.sleeping = 0
        #: commands for the loop thread (sleep, wake) and the futures their callers wait on
        self._commands: list[tuple[Any, futures.Future]] = []
        self._requests: dict[str, RequestState] = {}
        #: the slot table's prefix-cache queries and hits at the last gauges' reading
        self._looked_up = (0, 0)
        #: the device stream pipelined steps run on (None: every step synchronous)
        self.stream = (
            DeviceStream(name, decoder.bind_thread)
            if settings.async_scheduling and decoder.pipelined
            else None
        )
        self._thread = start_daemon(f"generate/{name}", self._loop)

    def _host_tier(self, name: str, settings: EngineSettings) -> HostTier | None:
        """The host tier ``kv_offloading_size`` asks for, where this cache can have one
        (:func:`.kv_host_tier.supports`: it copies its blocks to host memory and back),
        charged to the server's memory budget; None when off, or logged and None where it
        cannot be."""
        size = int(settings.kv_offloading_size * (1 << 30))
        if size <= 0:
            if settings.kv_disk_path and settings.kv_disk_size > 0:
                log.warning(
                    "model %s: kv_disk_path is ignored: the disk tier keeps the blocks the host "
                    "tier drops, and kv_offloading_size is 0", name,
                )  # fmt: skip
            return None
        why = None
        if not settings.enable_prefix_caching:
            why = "prefix caching is off"
        elif not supports(self.cache):
            why = f"{type(self.cache).__name__} copies no blocks to host memory (HostBlocks)"
        else:
            try:
                tier = HostTier(self.cache, settings.block_size, size, limits.memory_budget())
            except Unsupported as error:
                why = str(error)
        if why is not None:
            log.warning(
                "model %s: kv_offloading_size %s GiB is ignored: %s",
                name, settings.kv_offloading_size, why,
            )  # fmt: skip
            return None
        if tier.capacity < 1:
            log.warning(
                "model %s: kv_offloading_size %s GiB holds no block of %d bytes: off",
                name, settings.kv_offloading_size, tier.block_bytes,
            )  # fmt: skip
            return None
        return tier

    @property
    def eos(self) -> frozenset[int]:
        """The model's end-of-sequence ids."""
        return self.output.eos

    # --- the producer's side

    @property
    def max_model_len(self) -> int:
        return self.capacity

    def add(self, request: GenerationRequest, sender: Any, *, warm: bool = False) -> None:
        """Queue ``request``; its events go to ``sender``. InvalidArgument when it cannot fit
        the model (an empty or too long prompt, n beyond the slots) or a parameter is out of
        its range; ResourceExhausted when the queue is full; :class:`Asleep` while asleep
        (``warm``: the wake's own warm-up, which runs before the model is awake again)."""
        self._check(request)
        state = RequestState(request, sender, time.monotonic())
        if request.arrival:
            state.arrival -= max(0.0, time.time() - request.arrival)
        with self._lock:
            if self._closing:
                raise Cancelled(f"model {self.name}: the engine is closing")
            if self.sleeping and not warm:
                raise Asleep(
                    f"model {self.name} is asleep (level {self.sleeping}); an operator wakes "
                    "it with POST /wake_up"
                )
            if request.request_id in self._requests:
                raise InvalidArgument(f"request id {request.request_id!r} is already running")
            if len(self.scheduler.waiting) + len(self._inbox) >= self.settings.max_waiting:
                raise ResourceExhausted(
                    f"model {self.name}: {self.settings.max_waiting} requests are waiting "
                    "already (max_waiting); retry later"
                )
            if request.tenant and not self._may_wait(request.tenant):
                raise ResourceExhausted(
                    f"model {self.name}: this tenant has {self._waiting_of(request.tenant)} "
                    "requests waiting already, its share of the queue (of max_waiting); "
                    "retry later"
                )
            if request.trace is not None:  # its wait in the queue starts now
                state.spans = RequestSpans(request.trace, state.prompt_len)
            self._requests[request.request_id] = state
            self._inbox.append(state)
            self._woken = True
            self._lock.notify()
        with self.stats_.lock:  # waiting from its arrival on, not from the loop's next turn
            self.stats_.waiting += 1
        sender.on_cancel(lambda: self.abort(request.request_id))

    def _may_wait(self, tenant: str) -> bool:
        """Whether one more request of ``tenant`` may wait (call with the lock held): within
        its share of the queue (``plane/shares.py``), as a token's of the REST port, so
        that another tenant always finds room in it."""
        waiting: collections.Counter[str] = collections.Counter()
        for name, count in self.scheduler.waiting_tenants().items():
            waiting[shares.key(name)] += count
        for state in self._inbox:
            waiting[shares.key(state.request.tenant or "")] += 1
        waiting.pop("", None)
        return shares.may_take(waiting, shares.key(tenant), self.settings.max_waiting)

    def _waiting_of(self, tenant: str) -> int:
        """``tenant``'s requests waiting (call with the lock held): in the queue, and in the
        inbox the loop has not moved there yet."""
        return self.scheduler.waiting_of(tenant) + sum(
            1 for state in self._inbox if state.request.tenant == tenant
        )

    def _check(self, request: GenerationRequest) -> None:
        """InvalidArgument unless ``request`` fits the model and its parameters their ranges."""
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
        if request.params.prompt_logprobs is not None and not self.decoder.prompt_logits:
            raise InvalidArgument(
                f"model {self.name}: its decoder ({type(self.decoder).__name__}) gives the "
                "logits of each chunk's last position only, so it cannot score the prompt "
                "(prompt_logprobs, echo with logprobs)"
            )
        if request.constraints is not None and len(request.constraints) != request.n:
            raise InvalidArgument(f"{len(request.constraints)} constraints for n={request.n}")

    def abort(self, request_id: str) -> None:
        """End a request at the next step (its slots freed, ``finish_reason`` "abort")."""
        with self._lock:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._woken = True
                self._lock.notify()

    def generate(
        self, request: GenerationRequest, *, warm: bool = False
    ) -> Iterator[GenerationEvent]:
        """In-process use: the request's events as they come (blocking)."""
        sender = QueueSender()
        self.add(request, sender, warm=warm)
        try:
            yield from sender
        finally:
            sender.close()

    def stats(self) -> GenerationStats:
        return self.stats_

    # --- sleep and wake (the module's docstring)

    def sleep(self, level: int) -> None:
        """Sleep at ``level`` (:data:`SLEEP_LEVELS`): every request ended, the cache freed,
        the weights offloaded (1) or dropped (2); returns once done. Asleep already: the
        deeper level is taken (vLLM's, which sleeps again)."""
        if level not in SLEEP_LEVELS:
            raise InvalidArgument(f"sleep level must be 1 or 2, got {level}")
        with self._lock:  # refused from now on, not from the loop's next turn
            was, self.sleeping = self.sleeping, max(self.sleeping, level)
        if was >= level:
            return
        self._command(lambda: self._sleep(level, was))

    def wake_up(self) -> None:
        """The cache and the weights back; returns once done. Requests are still refused
        until :meth:`resume` (the network warms the model up in between)."""
        if self.sleeping:
            self._command(self._wake)

    def resume(self) -> None:
        """Serve requests again (awake)."""
        with self._lock:
            self.sleeping = 0
        log.info("model %s awake", self.name)

    def forget_prefixes(self) -> None:
        """The prefix cache of the slots no sequence holds forgotten (a warm-up's prompts)."""

        def forget() -> None:
            self.table.forget([s for s in self.table.slots if s.owner is None])
            if self.tier is not None:
                self.tier.clear()

        self._command(forget)

    def _command(self, fn: Any) -> None:
        done: futures.Future = futures.Future()
        with self._lock:
            if self._closing:
                raise Cancelled(f"model {self.name}: the engine is closing")
            self._commands.append((fn, done))
            self._woken = True
            self._lock.notify()
        done.result()

    def _sleep(self, level: int, was: int) -> None:
        for state in list(self._requests.values()):
            self.output.end(state, "abort")
        self.table.forget(self.table.slots)  # the prefix cache's index names rows about to go
        if self.tier is not None:  # the host tier's too (its memory given back)
            self.tier.clear()
        if not was:
            self.decoder.release_cache(self.cache)
        self.decoder.sleep(level)
        with self.stats_.lock:
            self.stats_.kv_cache_bytes = 0
        give_back_freed_memory()  # the heaps' freed pages back to the system (the host's RSS)
        log.info("model %s asleep (level %d)", self.name, level)

    def _wake(self) -> None:
        self.decoder.wake_up()
        self.decoder.restore_cache(self.cache)
        with self.stats_.lock:
            self.stats_.kv_cache_bytes = self.cache.nbytes

    def _run_commands(self, commands: list[tuple[Any, futures.Future]]) -> None:
        """Each command run, on the loop thread between steps."""
        for fn, done in commands:
            try:
                fn()
            except BaseException as exc:  # the caller's to answer
                done.set_exception(exc)
            else:
                done.set_result(None)

    def close(self) -> None:
        """End every request (``abort``) and stop the loop thread."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # --- the loop

    def _loop(self) -> None:
        flight: Launched | None = None  # the pipelined step launched, not yet processed
        while True:
            with self._lock:
                while flight is None and not self._woken and not self._closing and not self._busy():
                    self._lock.wait(self.scheduler.ready_in())
                self._woken = False
                closing = self._closing
                new, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
                commands, self._commands = self._commands, []
            self._queue(new)
            if commands and not closing:
                if flight is not None:  # its tokens first: the pipeline is empty for them
                    flight = self._pipelined_last(flight)
                self._run_commands(commands)
                self._gauges()
                continue
            if closing:
                for _fn, done in commands:
                    done.set_exception(Cancelled(f"model {self.name}: the engine is closing"))
                _drain(flight)
                for state in list(self._requests.values()):
                    self.output.end(state, "abort")
                if self.stream is not None:
                    self.stream.close()
                if self.tier is not None:  # its charges back to the memory budget
                    self.tier.clear()
                    if self.tier.disk is not None:  # the blocks queued for it written
                        self.tier.disk.close()
                return
            self._reap(aborts)
            if flight is not None:
                flight = self._pipelined(flight)
                self._gauges()
                continue
            try:
                plan = self.scheduler.schedule()
            except Exception:  # as a step's: the loop goes on, what it held fails (500)
                log.exception("model %s: scheduling failed", self.name)
                for state in list(self._requests.values()):
                    self.output.fail(state, RuntimeError("the generation step failed"))
                self._gauges()
                continue
            self._gauges()
            if plan.empty:
                continue
            try:
                if self._launchable(plan):
                    flight = self.runner.launch(plan.decode, self.sampler, self.stream)
                else:
                    self._step(plan)
            except Exception:  # a bug of ours must not kill the loop: log, fail, go on
                log.exception("model %s: generation step failed", self.name)
                self._failed(_plan_sequences(plan))
            self._gauges()  # what the step ended (an idle engine's gauges read zero)

    def _queue(self, new: list[RequestState]) -> None:
        """``new`` into the waiting queue, each one's host-tier blocks touched and the disk
        tier's reader reading ahead its blocks there (:meth:`.runner.ModelRunner.stage`), so
        that the requests ahead of it do not evict them and admitting it reads no file."""
        if self.tier is not None:
            for state in new:
                if state.prompt_logprobs is None:
                    prompt = state.sequences[0].tokens
                    state.staging = self.runner.stage(prompt, state.salt, self._read_ahead)
        self.scheduler.enqueue(new)

    def _read_ahead(self) -> None:
        """The loop's next turn now: a waiting request's disk reads are done (the reader)."""
        with self._lock:
            self._woken = True
            self._lock.notify()

    def _step(self, plan: Plan) -> None:
        """Execute the plan and update from each forward as it is done (the module's 3.)."""
        process = self.output.process
        for forward in self.runner.execute(plan):
            process(forward)

    # --- pipelined decode steps (:mod:`.overlap`)

    def _launchable(self, plan: Plan) -> bool:
        """Whether ``plan`` runs as a launched step: decode-only, every running sequence in
        it and pipelinable, no request waiting that could be admitted now."""
        return (
            self.stream is not None
            and not plan.first
            and not plan.extend
            and len(plan.decode) == len(self.scheduler.running)
            and all(pipelinable(s) for s in plan.decode)
            and not self._admissible()
        )

    def _pipelined(self, flight: Launched) -> Launched | None:
        """The step behind ``flight`` launched when nothing asks for the synchronous step,
        then ``flight``'s tokens processed (while the one behind runs); the one behind."""
        behind = None
        try:
            if not self._admissible() and all(pipelinable(s) for s in self.scheduler.running):
                group = [s for s in flight.group if continues(s, self.capacity)]
                if group:
                    behind = self.runner.launch(group, self.sampler, self.stream, flight)
                    with self.stats_.lock:
                        self.stats_.pipelined_steps += 1
            self._settle(flight, behind)
        except Exception:  # a bug of ours: as the synchronous step's
            log.exception("model %s: generation step failed", self.name)
            self._failed([*flight.group, *(behind.group if behind is not None else ())])
            _drain(behind)  # its rows' slots are free only once it is done
            return None
        return behind

    def _pipelined_last(self, flight: Launched) -> None:
        """``flight``'s tokens processed with nothing launched behind it."""
        try:
            self._settle(flight, None)
        except Exception:
            log.exception("model %s: generation step failed", self.name)
            self._failed(list(flight.group))

    def _settle(self, flight: Launched, behind: Launched | None) -> None:
        """``flight``'s tokens on the host: written to the slots' records of the sequences
        the step ``behind`` computes them for, then sent (a row whose sequence finished
        meanwhile is dropped)."""
        group = flight.group
        try:
            drawn = flight.future.result()
        except PlugserveError as exc:  # the device's failure: its requests fail
            self.output.process(Forward.failure(group, exc))
            return
        failures: dict[int, Exception] = {}
        tokens, logprobs = self.decoder.fetch(self.sampler, drawn, failures)
        if behind is not None:
            written = self.table.written
            going = {id(s) for s in behind.group}
            for seq, token in zip(group, tokens):
                if id(seq) in going and token >= 0 and seq.slot is not None:
                    written(seq.slot, [token])
        if failures:  # a finished sequence's wasted row fails nothing
            failures = {i: e for i, e in failures.items() if group[i].status != FINISHED}
        self.output.emit(group, tokens, logprobs, failures)

    def _admissible(self) -> bool:
        """Whether a waiting request could be admitted now (the scheduler's test)."""
        return self.scheduler.ready_in() == 0

    def _failed(self, sequences: list[Seq]) -> None:
        for seq in sequences:
            self.output.fail(seq.request, RuntimeError("the generation step failed"))

    def _busy(self) -> bool:
        """Work for the loop now: a sequence running, or a request that may be admitted (those
        whose disk reads are under way are waited for: ``Scheduler.ready_in``)."""
        return bool(self.scheduler.running) or self._admissible()

    def _reap(self, aborts: set[str]) -> None:
        """End the requests aborted or whose consumer left (checked once a step)."""
        for state in list(self._requests.values()):
            if state.request_id in aborts or cancelled(state.sender):
                self.output.end(state, "abort")

    def _gauges(self) -> None:
        """The gauges after a step or command, and the step's KV events published."""
        stats = self.stats_
        with stats.lock:
            stats.running = self.scheduler.held
            stats.waiting = len(self.scheduler.waiting) + len(self._inbox)
            stats.kv_cache_usage = self.table.held() / max(1, self.cache.rows)
            # the table's lookups since the last reading (added, so that a warm-up's, which
            # the stats put back, stay uncounted)
            table, (queries, hits) = self.table, self._looked_up
            stats.prefix_cache_queries += table.queries - queries
            stats.prefix_cache_hits += table.hits - hits
            self._looked_up = (table.queries, table.hits)
            if self.tier is not None:
                stats.kv_offload_bytes = self.tier.nbytes
                stats.kv_offload_restored_tokens = self.tier.restored_tokens
                if self.tier.disk is not None:
                    stats.kv_disk_bytes = self.tier.disk.nbytes
                    stats.kv_disk_restored_tokens = self.tier.disk.restored_tokens
        if self.events is not None:
            self.events.flush()

    def _forget(self, state: RequestState) -> None:
        """``state`` is over (the output processor ended or failed it): its id is free."""
        with self._lock:
            if self._requests.get(state.request_id) is state:
                del self._requests[state.request_id]


def _disk_tier(
    name: str, tier: HostTier, settings: EngineSettings, identity: tuple[str, bytes]
) -> DiskTier | None:
    """The disk tier ``kv_disk_path`` and ``kv_disk_size`` ask for beneath ``tier``, in the
    model's own folder under the path (``identity``'s); None when off (logged where it holds
    no block). InvalidArgument when the directory cannot be made or has less room than the
    size."""
    size = int(settings.kv_disk_size * (1 << 30))
    if not settings.kv_disk_path or size <= 0:
        return None
    shape = tier.disk_shape
    if shape is None:
        log.warning(
            "model %s: kv_disk_path is ignored: %s's blocks of %d bytes are no whole number "
            "of bytes a token", name, type(tier.cache).__name__, tier.block_bytes,
        )  # fmt: skip
        return None
    folder, digest = identity
    layout = repr(getattr(getattr(tier.cache, "layout", None), "entries", None)).encode()
    model = b"|".join([digest, type(tier.cache).__name__.encode(), layout, repr(shape).encode()])
    path = Path(settings.kv_disk_path) / (folder or name)
    disk = DiskTier(path, size, model, shape, np.uint8)
    if disk.capacity < 1:
        log.warning(
            "model %s: kv_disk_size %s GiB holds no block file of %d bytes: off",
            name, settings.kv_disk_size, disk.file_bytes,
        )  # fmt: skip
        disk.close()
        return None
    disk.budget = tier.budget  # what its reader reads ahead is charged as the host tier's blocks
    disk.staged.limit = tier.max_bytes  # and is at most what the host tier may hold
    return disk


def _tier_block_size(name: str, cache: Any, settings: EngineSettings) -> EngineSettings:
    """``settings`` with the block size a host tier needs of ``cache``: one whose host copies
    take whole blocks of its own (OpenVINO's u8 paged cache: scales and zero points per block
    of 32 positions) makes the engine's blocks a multiple of them when the tier is on, logged;
    a cache without ``host_block_size`` copies any."""
    fit = getattr(cache, "host_block_size", None)
    if fit is None or settings.kv_offloading_size <= 0 or not settings.enable_prefix_caching:
        return settings
    size = fit(settings.block_size)
    if size == settings.block_size:
        return settings
    log.info(
        "model %s: block_size %d -> %d: the cache's host copies take whole blocks of its own "
        "(scales and zero points per block), for the host tier (kv_offloading_size)",
        name, settings.block_size, size,
    )  # fmt: skip
    return dataclasses.replace(settings, block_size=size)


def _announce_tier(events: BlockEvents, tier: HostTier) -> None:
    """The host tier's blocks announced as vLLM's offloading announces them: stored and
    removed with medium ``"CPU"``, beside the engine's own cache's ``"GPU"``; the disk tier's
    with ``"DISK"`` (LMCache's and vLLM's name)."""

    def stored(block: Any) -> None:
        parent = None if block.parent is None else block.parent.key
        events.stored([block.key], parent, block.tokens, medium=MEDIUM_CPU)

    tier.on_stored.append(stored)
    tier.on_dropped.append(lambda block: events.removed([block.key], medium=MEDIUM_CPU))
    disk = tier.disk
    if disk is not None:
        disk.on_stored.append(
            lambda e: events.stored([e.key], e.parent, e.tokens, medium=MEDIUM_DISK)
        )
        disk.on_dropped.append(lambda e: events.removed([e.key], medium=MEDIUM_DISK))


def _drain(flight: Launched | None) -> None:
    """Wait until ``flight`` is done on the device stream (its outcome dropped)."""
    if flight is not None:
        futures.wait([flight.future])


def _plan_sequences(plan: Plan) -> list[Seq]:
    return [*plan.decode, *(s for s, _c in plan.first), *(s for s, _c in plan.extend)]


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
