"""Warm before ready: a generative model generates before it is listed (and again at each
wake), so the first real request is not the slow one.

What the first step of a shape costs, and what a warm-up pays instead of a client: torch's
lazy initialisation and the allocator's first blocks, oneDNN's (CPU) or cuBLAS's (GPU) kernel
choices per shape, and on a card a CUDA graph captured per decode batch size
(``plugins/torch/decoder.py``: captured on a shape's first use). The warm-up runs,
for each batch size, that many requests at once through the engine itself (so the scheduler,
the sampler and the pipelined steps run as a client's would), each prompt of each length
computed, then a few tokens decoded at that batch size.

The setting (``--generate-warmup``, or a model's ``WARMUP`` config key; vLLM's warm-up
config in spirit):

``default`` (the default)
    a 16-token prompt at batch size 1 on the CPU (the first allocations and kernel choices of
    a step; a batched warm-up left the CPU twin's later streams slower: at 32 streams of
    tests' tiny-llama on TORCH the server's CPU a token read +7 to +12 % after a warm-up at
    batch 32 or 64, none after one at batch 1, cause not found: BENCHMARKS.md "One house's
    cost"); where the decoder captures decode graphs
    (torch on a CUDA card) batch sizes 1, 2, 4, ... up to ``max_num_seqs`` (and it), so each
    graph a decode step pads to is captured. On by default since reloads with it stay flat
    (malloc's arenas capped: docs/operations.md); it adds 0.01 to 0.05 s to a load of the
    suite's tiny models, which CI loads many times (every power of two on the CPU too: up to
    twice that, with no graph to show for it). It leaves out a prompt of a whole step's
    chunk (``max_num_batched_tokens``): on ORT that prompt's buffers held ~30 MiB more after
    each load of a 90 MB decoder and swung the server's RSS over twenty reloads past 10 %
    (+49 MiB of 472); a plan naming ``prompt_lens`` warms long prompts where their first
    one must not be slow;
``off``
    one request of two tokens only (the check that the graph runs on its device, which a
    load always makes);
a JSON object ``{"batch_sizes": [1, 8], "prompt_lens": [16, 512]}``
    every batch size with every prompt length (a batch size over the model's slots, or a
    length over its context, is clipped to it).

The warm-up's requests count in no metric but ``plugserve_generate_warmup_requests`` (and
``plugserve_generate_warmup_seconds``), and leave nothing in the prefix cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any

from plugserve.plugins.api import InvalidArgument, PlugserveError
from plugserve.server.apps.generate.engine.engine import QueueSender
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

__all__ = ["WarmupPlan", "parse", "run"]

log = logging.getLogger(__name__)

#: tokens each warm-up request decodes (its first from the prompt, the rest at its batch size)
DECODE_TOKENS = 4
#: the default plan's short prompt
SHORT_PROMPT = 16
#: the most requests (batch sizes x prompt lengths, rows) one warm-up may run
MAX_REQUESTS = 4096


@dataclasses.dataclass(frozen=True)
class WarmupPlan:
    """Batch sizes and prompt lengths (empty: the default's, from the engine's bounds)."""

    batch_sizes: tuple[int, ...] = ()
    prompt_lens: tuple[int, ...] = ()


def parse(text: str) -> WarmupPlan | None:
    """The setting's plan; None for ``off``; InvalidArgument naming what is wrong."""
    value = text.strip()
    if value.lower() in ("off", "0", "no", "none", "false"):
        return None
    if value.lower() in ("", "default", "on", "1", "yes", "true"):
        return WarmupPlan()
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise InvalidArgument(
            f"warm-up setting {text!r}: expected off, default or a JSON object ({exc})"
        ) from None
    if not isinstance(parsed, dict) or set(parsed) - {"batch_sizes", "prompt_lens"}:
        raise InvalidArgument(
            f"warm-up setting {text!r}: expected a JSON object of batch_sizes and prompt_lens"
        )
    lists = {}
    for key in ("batch_sizes", "prompt_lens"):
        items = parsed.get(key, [])
        if not isinstance(items, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in items
        ):
            raise InvalidArgument(f"warm-up setting: {key} must be a list of positive integers")
        lists[key] = tuple(sorted(set(items)))
    return WarmupPlan(lists["batch_sizes"], lists["prompt_lens"])


def rounds(
    plan: WarmupPlan, slots: int, capacity: int, graphs: bool = False
) -> list[tuple[int, int]]:
    """``(batch size, prompt length)`` of each round: the plan's, clipped to the engine's
    ``slots`` and its ``capacity`` (room left for the decoded tokens). The default's size is
    1, and where the decoder captures decode ``graphs`` (one per power of two of rows) each
    power of two up to ``slots`` (and it)."""
    longest = max(1, capacity - DECODE_TOKENS - 1)
    if plan.batch_sizes or plan.prompt_lens:
        sizes = plan.batch_sizes or (1,)
        lens = plan.prompt_lens or (SHORT_PROMPT,)
        wanted = [(b, n) for b in sizes for n in lens]
    else:
        sizes, size = [1], 2
        while graphs and size < slots:
            sizes.append(size)
            size *= 2
        wanted = [(b, SHORT_PROMPT) for b in ([*sizes, slots] if graphs else sizes)]
    found: list[tuple[int, int]] = []
    for batch, length in wanted:
        key = (min(batch, slots), min(length, longest))
        if key not in found:
            found.append(key)
    total = sum(b for b, _n in found)
    if total > MAX_REQUESTS:
        raise InvalidArgument(f"warm-up setting: {total} requests, at most {MAX_REQUESTS}")
    return found


def run(engine: Any, plan: WarmupPlan, bos: int) -> dict[str, Any]:
    """Each round's requests at once through ``engine`` (greedy, ``DECODE_TOKENS`` each),
    waited for; the request counters put back and the prompts' prefix cache forgotten. A
    round that fails is logged and skipped: the load's own two-token check decides whether
    the model serves, and a shape a device cannot run (onnxruntime-genai's builder graphs on
    OPENVINO fail batches of several: docs/generate.md) fails its requests alike, not the
    model. What it did, for the log."""
    started = time.monotonic()
    saved = engine.stats_.counters()
    vocab = max(2, engine.decoder.vocab or engine.tokenizer.vocab_size)
    count = 0
    slots = engine.scheduler.max_num_seqs if engine.decoder.batches else 1
    graphs = getattr(engine.decoder, "graphs", None)
    planned = rounds(plan, slots, engine.capacity, graphs is not None)
    ran: list[tuple[int, int]] = []
    try:
        for batch, length in planned:
            try:
                count += _round(engine, batch, length, bos, vocab)
            except PlugserveError as exc:
                log.warning(
                    "model %s: warm-up round of %d prompts of %d tokens failed (%s); the "
                    "model serves on", engine.name, batch, length, exc,
                )  # fmt: skip
            else:
                ran.append((batch, length))
    finally:
        engine.stats_.restore(saved)
        engine.forget_prefixes()
    seconds = time.monotonic() - started
    with engine.stats_.lock:
        engine.stats_.warmup_requests += count
        engine.stats_.warmup_seconds = seconds
    captured = sum(1 for s in graphs.shapes.values() if s.graph is not None) if graphs else 0
    return {"rounds": ran, "requests": count, "seconds": seconds, "graphs": captured}


def _round(engine: Any, batch: int, length: int, bos: int, vocab: int) -> int:
    """``batch`` prompts of ``length`` tokens sent at once and read to their ends; how many."""
    senders = []
    try:
        for row in range(batch):  # each prompt its own ids: no prefix hit skips its compute
            prompt = [bos] + [1 + (row * 131 + i * 7) % (vocab - 1) for i in range(length - 1)]
            request = GenerationRequest(
                f"warm-up-{uuid.uuid4().hex}",
                prompt,
                SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True),
            )
            sender = QueueSender()
            engine.add(request, sender, warm=True)  # all added before any is read
            senders.append(sender)
        for sender in senders:
            for _event in sender:
                pass
    finally:
        for sender in senders:
            sender.close()
    return batch
