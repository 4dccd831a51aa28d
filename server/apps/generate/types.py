"""What goes into the generation engine and what comes out of it, shared by its faces (the
OpenAI adapter, the KServe decoupled network) and the engine itself.

A protocol adapter validates its request into a :class:`GenerationRequest` (token ids and
:class:`SamplingParams`), hands it to ``Engine.add`` with a sender, and receives one
:class:`GenerationEvent` per step in which the request's text or tokens advanced, the last with
its ``finish_reason``.

Every parameter's range is written once, here (:data:`RANGES`, read by
:meth:`SamplingParams.check`): each face checks its own fields first from the same entries
(naming them as its protocol does: OpenAI's ``param``, a KServe input), and ``Engine.add``
checks again before the request enters the engine, so a value out of range
is one request's 400, never an engine step that fails for every sequence in it (a seed numpy
cannot take failed every request decoding beside it). The bounds, vLLM's where it has them:

==========================  ===========================================================
``max_tokens``              at least 1
``temperature``             finite, at least 0 (the OpenAI face: at most 2, OpenAI's)
``top_p``                   in (0, 1]
``top_k``                   -1, 0 (no cut) or more
``min_p``                   in [0, 1]
``seed``                    a 64-bit integer, signed or not (:data:`SEED_RANGE`); a negative
                            one seeds as its two's complement, as torch's ``manual_seed``
``stop``                    at most :data:`MAX_STOP` strings of 1 to :data:`MAX_STOP_CHARS`
                            characters (the detokenizer's scan costs each token the longest)
``stop_token_ids``          at most :data:`MAX_TOKEN_LIST` ids, each in the vocabulary
``min_tokens``              at least 0
penalties                   presence and frequency in [-2, 2], repetition finite above 0
``logprobs``                0 to the vocabulary's size (also ``prompt_logprobs``); the
                            OpenAI face bounds them by ``--max-logprobs`` first
``logit_bias``              at most :data:`MAX_TOKEN_LIST` ids in the vocabulary, values in
                            [-100, 100]
==========================  ===========================================================

The field names follow vLLM's ``SamplingParams`` where they mean the same, because the OpenAI
API's extra parameters (``min_p``, ``ignore_eos``, ``repetition_penalty``) are vLLM's names.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import numpy as np

from plugserve.plugins.api import InvalidArgument
from plugserve.plugins.sampling import TokenLogprob

__all__ = [
    "EVENT_BYTES",
    "FINISH_REASONS",
    "MAX_LOGPROBS",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_TOKEN_LIST",
    "RANGES",
    "SEED_RANGE",
    "Constraint",
    "GenerationEvent",
    "GenerationRequest",
    "Range",
    "SamplingParams",
    "TokenLogprob",
    "seeded_generator",
]

#: seeds are 64-bit: vLLM takes a signed one (its protocol's bound), numpy an unsigned one
SEED_RANGE = (-(2**63), 2**64 - 1)
#: stop strings per request, and characters per stop string (OpenAI says 4 strings; clients
#: send more)
MAX_STOP = 16
MAX_STOP_CHARS = 1024
#: token ids in ``stop_token_ids`` and in ``logit_bias``, at most
MAX_TOKEN_LIST = 1024
#: alternatives per token in logprobs: OpenAI's chat bound (its completions' is 5), the
#: default of ``--max-logprobs``
MAX_LOGPROBS = 20


def seeded_generator(seed: int, index: int = 0) -> np.random.Generator:
    """The generator of sequence ``index`` of a request seeded ``seed`` (vLLM's ``seed +
    index``), any 64-bit seed taken modulo 2**64 (a negative one as its two's complement)."""
    return np.random.default_rng((int(seed) + index) % 2**64)


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


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric parameter's range, written once: the engine's check (:meth:`SamplingParams.
    check`) and each face's own field checks (the OpenAI face's ``protocol.SAMPLING``, which
    may narrow one, as OpenAI's temperature at most 2) read the same entry."""

    low: float
    high: float | None = None
    low_open: bool = False
    integer: bool = False
    #: the range in words, for the engine's message
    what: str = ""
    #: None is a value (no seed)
    optional: bool = False

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.integer:
            return _integer(value, int(self.low), None if self.high is None else int(self.high))
        return _number(value, self.low, self.high, self.low_open)


#: the numeric sampling parameters' ranges (the module's table)
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, integer=True, what="an integer, at least 1"),
    "temperature": Range(0.0, what="a finite number, at least 0"),
    "top_p": Range(0.0, 1.0, low_open=True, what="in (0, 1]"),
    "top_k": Range(-1, integer=True, what="-1, 0 (no cut) or more"),
    "min_p": Range(0.0, 1.0, what="in [0, 1]"),
    "seed": Range(*SEED_RANGE, integer=True, what="a 64-bit integer", optional=True),
    "min_tokens": Range(0, integer=True, what="an integer, at least 0"),
    "presence_penalty": Range(-2.0, 2.0, what="in [-2, 2]"),
    "frequency_penalty": Range(-2.0, 2.0, what="in [-2, 2]"),
    "repetition_penalty": Range(0.0, low_open=True, what="a finite number above 0"),
}


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

    def check(self, vocab: int = 0) -> None:
        """InvalidArgument naming the first parameter out of its range (the module's table);
        ``vocab``: the model's vocabulary (0: token ids are not checked against it). Costs the
        lengths of the lists it reads, each bounded before it is read."""
        ranged = ((name, RANGES[name].holds(getattr(self, name)), RANGES[name].what)
                  for name in RANGES)  # fmt: skip
        for name, ok, what in (
            *ranged,
            (
                "logprobs",
                self.logprobs is None or _integer(self.logprobs, 0, vocab or None),
                "0 to the vocabulary's size",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or _integer(self.prompt_logprobs, 0, vocab or None),
                "0 to the vocabulary's size",
            ),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "true or false"),
            (
                "include_stop_str_in_output",
                isinstance(self.include_stop_str_in_output, bool),
                "true or false",
            ),
            (
                "constraint",
                self.constraint is None or isinstance(self.constraint, Constraint),
                "a grammar's matcher",
            ),
        ):
            if not ok:
                raise InvalidArgument(f"{name} must be {what}, not {_shown(getattr(self, name))}")
        if self.min_tokens > self.max_tokens:  # vLLM's rule, on every face (chat's names
            # its own field first: protocol._check_min_tokens)
            raise InvalidArgument(
                f"min_tokens must be at most max_tokens ({self.max_tokens}), not {self.min_tokens}"
            )
        self._check_stop()
        self._check_ids("stop_token_ids", self.stop_token_ids, vocab)
        if not isinstance(self.logit_bias, dict):
            raise InvalidArgument("logit_bias must map token ids to numbers")
        self._check_ids("logit_bias", list(self.logit_bias), vocab)
        for token, value in self.logit_bias.items():
            if not _number(value, -100.0, 100.0):
                raise InvalidArgument(
                    f"logit_bias[{token}] must be a number in [-100, 100], not {_shown(value)}"
                )

    def _check_stop(self) -> None:
        stop = self.stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgument("stop must be a list of strings")
        if len(stop) > MAX_STOP:
            raise InvalidArgument(f"stop holds {len(stop)} strings; at most {MAX_STOP}")
        for i, text in enumerate(stop):
            if not 1 <= len(text) <= MAX_STOP_CHARS:
                raise InvalidArgument(
                    f"stop[{i}] must be 1 to {MAX_STOP_CHARS} characters, not {len(text)}"
                )

    @staticmethod
    def _check_ids(name: str, ids: Any, vocab: int) -> None:
        if not isinstance(ids, list):
            raise InvalidArgument(f"{name} must be a list of token ids")
        if len(ids) > MAX_TOKEN_LIST:
            raise InvalidArgument(f"{name} holds {len(ids)} token ids; at most {MAX_TOKEN_LIST}")
        top = vocab - 1 if vocab > 0 else 2**63 - 1
        for token in ids:
            if not _integer(token, 0, top):
                raise InvalidArgument(
                    f"{name} holds {_shown(token)}; token ids are integers in 0..{top}"
                    + (" (this model's vocabulary)" if vocab > 0 else "")
                )


def _integer(value: Any, low: int, high: int | None = None) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    )


def _number(value: Any, low: float, high: float | None = None, low_open: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if not math.isfinite(value) or (value <= low if low_open else value < low):
        return False
    return high is None or value <= high


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
    #: the span its generation's spans open under when it is traced (``plugins/tracing.py``:
    #: its queue, prompt chunks and decode, ``spans.py``); None: not traced.
    #: :meth:`GenerativeNetwork.generate` sets it from the span under way when it is called
    trace: Any = None
    #: the caller's tenant (``auth.py``: "" without tokens) and its ``cache_salt`` (vLLM's
    #: request field): the prefix cache finds blocks written under the same two only
    #: (:func:`.kvcache.salt`)
    tenant: str = ""
    cache_salt: str = ""


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
        buffer counts it (``server/plane/response_stream.py``)."""
        size = EVENT_BYTES + len(self.text) + 36 * len(self.token_ids)
        for entries in (self.logprobs, self.prompt_logprobs):
            for entry in entries or ():
                size += logprob_entry_bytes(len(entry.top)) if entry is not None else 8
        return size

    @staticmethod
    def largest(request: GenerationRequest) -> int:
        """About the most one of ``request``'s events holds by its logprobs (counted as
        :attr:`nbytes` counts them): a token's entry with its ``logprobs`` alternatives, and
        the first event's prompt entries with their ``prompt_logprobs`` each. The OpenAI face
        charged this memory to the budget before the request started; a stream's bound on
        unread bytes admits it (``limits.stream_bounded``): -1, a whole vocabulary of 150k,
        makes one event of ~17 MB a token."""
        params = request.params
        size = 0
        if params.logprobs is not None:
            size += logprob_entry_bytes(params.logprobs + 1)
        if params.prompt_logprobs is not None:
            top = params.prompt_logprobs + 1
            size += len(request.prompt_token_ids) * logprob_entry_bytes(top)
        return size


#: an event's own size, before its text, ids and logprobs (:attr:`GenerationEvent.nbytes`)
EVENT_BYTES = 320


def logprob_entry_bytes(top: int) -> int:
    """One token's logprob entry with ``top`` alternatives in memory (measured: see
    :attr:`GenerationEvent.nbytes`)."""
    return 280 + 113 * top
