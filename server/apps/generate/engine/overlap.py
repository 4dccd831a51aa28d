"""Steady decode steps pipelined: step N+1 launched before step N's tokens are processed on
the host (issue 51's "the host prepares the next step while the card runs this one"; vLLM
v1's async scheduling, its model runner's ``prev_sampled_token_ids``).

The synchronous engine's step is: launch the forward, wait for the ids, detokenize, check
stops and send, schedule the next step. On a card that step's host work (tens to hundreds of
microseconds a token: tests/benchmarks/bench_stream_cost.py) leaves the card idle. Pipelined,
when a step is decode-only and every row may be, the engine's loop (:mod:`.engine`):

1. launches step N+1 (:meth:`.runner.ModelRunner.launch`) on the :class:`DeviceStream`, its
   input ids step N's sampled ids, taken on the device (no host round trip), its rows step
   N's less those already finished or sure to finish at N (``max_tokens``, the context);
2. then processes step N on the host: waits for its ids only (on a card: an event recorded
   after their copy to pinned memory, ``plugins/torch/sampler.py``'s ``Drawn``), writes them to the
   prefix cache's tokens, and sends them (:meth:`.output.OutputProcessor.emit`) while N+1
   runs.

A sequence that finishes at N (a stop token, a stop string) has a wasted row in N+1: its
result is discarded (the sequence is finished when N+1 is processed), and the key it wrote
lies past its slot's recorded tokens (never read). Its slot is free only to admissions,
which happen in the synchronous step, after the pipeline is drained.

What makes the engine fall back to the synchronous step (the pipeline drains: the step in
flight is processed, nothing launched behind it): a request waiting that could be admitted
now (new prompts, the batch's change), a sequence not decoding (a prompt chunk to compute),
a row whose sampling reads host state its last token changes (:func:`pipelinable`: a
grammar's mask, repetition / frequency / presence penalties over its history; ``logit_bias``
and ``min_tokens`` are fine, their state is known ahead), the engine closing, or the setting
off (``async_scheduling``, :class:`.engine.EngineSettings`; config key ``ASYNC_SCHEDULING``).

The same tokens as the synchronous engine: the rows' inputs are the same ids, each sampled
row draws its uniform number from its own generator at launch, in step order (the stream
runs the steps one after the other), and ``min_tokens`` reads the count the row will have.

Failures: a launched step's forward that raises fails the requests of its rows (as the
synchronous step), and the step launched behind it, whose input it was, fails with it (its
requests have failed already: nothing more is sent). A row whose sampling failed gives -1,
which the next step reads as 0 (clamped; its request has failed: the row is wasted).

The :class:`DeviceStream` is one worker thread that runs the launched steps in order: on the
CPU (TORCH) the forward and the sampling run there while the loop thread does the host's
work (torch's CPU ops release the GIL, so they overlap); on a card it enqueues the step's
kernels (the decode graph's replay, the sampler's) on the device, records the event, and is
done; the host waits on the event only when it needs the ids. Sampled rows (temperature,
top-k, top-p, min-p, seeds, ``logit_bias``, logprobs) pipeline as greedy ones do: the
sampler's half run at launch (``plugins/torch/sampler.py``'s ``draw``) sends its parameters
and uniform numbers in one ``non_blocking`` copy from pinned memory and reads nothing back,
so the stream's thread queues the sampler's kernels behind the forward without waiting for
it (tests/generate/test_sampler_torch_syncs.py). Grammars and penalties fall back for the
reason above (the host state their next step reads), not for a copy.

Measured on the CPU only (no GPU in this session): tests' tiny-llama safetensors folder on
TORCH (0.4 M parameters, one torch thread), 2 shared cores under a load average of 7-8
(other work on the machine). tests/benchmarks/bench_stream_cost.py, OpenAI streaming
clients, median of 3 rounds, pipelined against ``ASYNC_SCHEDULING=NO`` in the same run,
tok/s at 1 / 8 / 32 streams: 289/278, 950/830, 1,163/784 (first run, 128 tokens);
149/293, 715/808, 857/924 (second run); 248/214, 804/622 (third, 96 tokens, 1 and 8
streams). The server's CPU per token 0.9-1.07x. The runs disagree in sign: on this machine
the difference is within the noise, and no CPU gain can be claimed. In process
(bench_engine_step.py, 4 rounds): wall per token 1.16x at 1 stream, equal medians at 8;
process CPU equal; the loop thread's own CPU falls to 0.13-0.17x, the forward having moved
to the stream's thread. On 2 cores the stream's thread and the loop share the cores the
forward needs, and each step costs two thread wake-ups; on a card the forward leaves the
host, which is where the overlap is meant to pay (tests/gpu/gpu_check.py's ``gen.serve``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from plugserve.server.apps.generate.engine.scheduler import DECODE
from plugserve.server.apps.generate.engine.scheduler import Sequence as Seq

__all__ = ["DeviceStream", "Launched", "continues", "pipelinable"]


class DeviceStream:
    """The one thread launched steps run on, in the order launched (the device's stream).
    ``bind`` runs first on that thread (the decoder's :meth:`~plugserve.plugins.decoding.
    Decoder.bind_thread`: on a card, ``GPU.1``'s events and streams are ``cuda:1``'s, not
    the default card's)."""

    def __init__(self, name: str, bind: Callable[[], None] | None = None) -> None:
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix=f"generate/{name}/stream", initializer=bind
        )

    def submit(self, job: Any) -> Future:
        return self._pool.submit(job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclasses.dataclass(slots=True, eq=False)
class Launched:
    """A decode step on the device stream: its rows' sequences, in row order, and the future
    of its ``plugins/torch/sampler.py``'s ``Drawn`` (the ids still on the device until fetched);
    ``chained``: its input ids were the step before's, on the device."""

    group: list[Seq]
    future: Future
    chained: bool = False


def pipelinable(seq: Seq) -> bool:
    """Whether ``seq``'s next token can be chosen before its last one reaches the host: its
    sampling reads no host state that token changes (a grammar, penalties over history)."""
    sampling = seq.sampling
    return (
        seq.status == DECODE
        and sampling is not None
        and sampling.constraint is None
        and sampling.counts is None
    )


def continues(seq: Seq, capacity: int) -> bool:
    """Whether ``seq``, decoding in the step in flight, gets a row in the step launched
    behind it: not finished already, and not sure to finish with the token in flight
    (``max_tokens`` reached, or the context full)."""
    if seq.status != DECODE:
        return False
    return seq.generated + 1 < seq.sampling.params.max_tokens and len(seq.tokens) + 1 < capacity
