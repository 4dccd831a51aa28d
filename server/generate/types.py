"""What goes into the generation engine and what comes out of it, shared by its faces (the
OpenAI adapter, the KServe decoupled network) and the engine itself.

A protocol adapter validates its request into a :class:`GenerationRequest` (token ids and
:class:`SamplingParams`, every value already in range: the engine refuses nothing a face
checked), hands it to ``Engine.add`` with a sender, and receives one :class:`GenerationEvent`
per step in which the request's text or tokens advanced, the last with its ``finish_reason``.

The field names follow vLLM's ``SamplingParams`` where they mean the same, because the OpenAI
API's extra parameters (``min_p``, ``ignore_eos``, ``repetition_penalty``) are vLLM's names.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "FINISH_REASONS",
    "Constraint",
    "GenerationEvent",
    "GenerationRequest",
    "SamplingParams",
    "TokenLogprob",
]

#: why a sequence ended: a stop token or string ("stop"), max_tokens or the context length
#: ("length"), or it was aborted (client gone, cancelled, deadline, engine closing: "abort")
FINISH_REASONS = ("stop", "length", "abort")


@runtime_checkable
class Constraint(Protocol):
    """Constrained decoding for one sequence (a grammar matcher: the openai face makes one per
    sequence from ``response_format``). The engine asks :meth:`mask` before each token it
    samples for the sequence, tells :meth:`accept` the token it chose, and ends the sequence
    ("stop") once :meth:`done` is true."""

    def mask(self, vocab_size: int) -> np.ndarray:
        """Booleans, one per token id: True where the token is allowed next."""
        ...

    def accept(self, token_id: int) -> None: ...

    def done(self) -> bool: ...


@dataclasses.dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    ``temperature`` 0 is greedy (the highest logit; ties to the lowest id, as argmax). Penalties
    are applied to the logits before temperature, in vLLM's order: ``logit_bias``, the
    constraint's mask, ``min_tokens`` (stop tokens masked), repetition, frequency and presence
    penalties; then temperature, ``top_k``, ``top_p``, ``min_p``.
    """

    #: most tokens generated (the engine also stops at the model's context length: "length")
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 (or -1, as vLLM): no top-k cut
    top_k: int = 0
    min_p: float = 0.0
    #: a seed makes this request's draws its own (numpy's PCG64 seeded with it), whatever
    #: other requests share its batches; None: drawn from the engine's generator
    seed: int | None = None
    #: strings that end the text (not included in it); held back while a stream could still
    #: be one of them
    stop: list[str] = dataclasses.field(default_factory=list)
    #: token ids that end the sequence besides the model's end-of-sequence ids
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    #: keep generating past the model's end-of-sequence ids (vLLM's; benchmarks use it)
    ignore_eos: bool = False
    #: stop tokens are masked until this many tokens were generated
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: > 1 discourages tokens of the prompt and the output (CTRL's, as transformers applies it)
    repetition_penalty: float = 1.0
    #: None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens'
    logprobs: int | None = None
    #: also the prompt tokens' logprobs (the ``echo`` of completions with logprobs)
    prompt_logprobs: int | None = None
    #: added to the logits of these token ids before sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    #: constrained decoding for this sequence (see :class:`Constraint`); with ``n`` > 1 the
    #: face makes one per choice and passes them as ``constraints``
    constraint: Constraint | None = None
    #: special tokens are left out of the text (they still count as tokens)
    skip_special_tokens: bool = True
    #: the stop string that ended the text is kept in it (vLLM's)
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class GenerationRequest:
    """One prompt, generated ``n`` times (``n`` sequences: the engine computes the prompt
    once and each sequence continues from it; events carry the sequence's ``index``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    n: int = 1
    #: per-sequence constraints when ``n`` > 1 (else ``params.constraint``)
    constraints: list[Constraint] | None = None
    #: seconds since the epoch when the request arrived (its time to first token counts from
    #: here); 0: when the engine receives it
    arrival: float = 0.0


@dataclasses.dataclass
class TokenLogprob:
    """One generated (or prompt) token's log probability, and the ``top`` most likely tokens
    at that position as ``(token_id, logprob)``, most likely first: the log-softmax of the
    model's raw logits, before penalties and temperature (vLLM's default ``raw_logprobs``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GenerationEvent:
    """What one step added to one sequence of a request.

    ``text`` is the new text since the last event (stop strings and incomplete characters held
    back; the final event flushes what is left). ``token_ids`` are the new tokens (a held-back
    token is reported with the event that releases its text only when ``text`` needs it: token
    ids are always reported as generated). Counts are totals so far for this sequence;
    ``prompt_tokens`` and ``cached_tokens`` (prompt tokens whose cache was reused) are the
    request's.
    """

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: the stop string or token id that ended the sequence (vLLM's ``stop_reason``)
    stop_reason: str | int | None = None
    #: the prompt tokens' logprobs, on the first event of a request that asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def nbytes(self) -> int:
        """About what the event holds in memory (Python objects: measured 315 bytes without
        logprobs, 590 with the chosen token's, 2.9 KB with 20 alternatives), as a stream's
        buffer counts it (``server/response_stream.py``)."""
        size = 320 + len(self.text) + 36 * len(self.token_ids)
        for entries in (self.logprobs, self.prompt_logprobs):
            for entry in entries or ():
                size += 280 + 113 * len(entry.top) if entry is not None else 8
        return size
