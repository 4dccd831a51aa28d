"""Choosing each sequence's next token from one step's logits, for the whole batch at once.

Part of the Plugin API beside the decoder (``plugins/decoding.py``): these are the rules and
numbers every decoder's sampler keeps, the host's on numpy logits here, and a device's on its
own tensors (``plugins/torch/sampler.py``) the same tokens for the same logits and seeds.

One call per step takes the ``[rows, vocab]`` logits of every sequence that produces a token
this step and returns one token per row. What most requests use runs over the batch as one
numpy operation (greedy rows: one ``argmax``; sampled rows: temperature, softmax, cumulative
sums and the draws' positions together); what only some rows ask for (penalties, bias,
top-k, top-p, min-p, a grammar's mask) is applied to those rows alone.

Order, vLLM's: ``logit_bias``, the constraint's mask, ``min_tokens`` (stop tokens masked),
repetition penalty (prompt and output tokens, as transformers' ``RepetitionPenaltyLogitsProcessor``:
positive logits divided, negative multiplied), frequency and presence penalties (output tokens,
OpenAI's formula); then greedy rows take the argmax, sampled rows divide by the temperature
and cut by top-k, top-p (the smallest set whose probability reaches p) and min-p (below
``min_p`` times the most likely token's probability) before drawing.

Log probabilities are those of the model's own distribution (log-softmax of the raw logits,
before any processing: vLLM's default ``raw_logprobs``), so they compare with the model's
f32 answer whatever sampling asked.

Each row draws from its own generator when its request has a seed (numpy's PCG64 seeded with
it, one uniform number per token), so a seeded request's tokens do not depend on what else
shares its batches; rows without a seed draw from the engine's generator.

A row's failure is its own: what one row asks for (its processing, a grammar's mask or its
``accept``, its logprobs entry) runs in a ``try`` of its own, and if the batched choice
itself raises, each row is chosen again alone, so only the rows that fail alone fail. The
uniform numbers are drawn before the choice, once per row, so a seeded row draws the same
numbers whether or not another row's failure made its choice run again. The engine passes
``failures`` and fails those rows' requests; the others in the batch get their tokens.

The torch decoder's logits stay on its device and are sampled there by
:class:`plugserve.plugins.torch.sampler.TorchSampler`: these rules and numbers, the same
tokens for the same logits and seeds (tests/generate/test_sampler_torch.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "Sampler",
    "SamplingState",
    "TokenLogprob",
    "log_softmax",
    "logprob_entry",
    "plain",
    "together_else_alone",
]


@dataclasses.dataclass
class TokenLogprob:
    """One generated (or prompt) token's log probability, and the ``top`` most likely tokens
    at that position as ``(token_id, logprob)``, most likely first: the log-softmax of the
    model's raw logits, before penalties and temperature (vLLM's default ``raw_logprobs``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    #: the token's place among the vocabulary, 1 the most likely (prompt tokens' only: vLLM's
    #: prompt_logprobs give it); None where not computed
    rank: int | None = None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float32 (the max subtracted first)."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class SamplingState:
    """What the sampler keeps for one sequence: its parameters, its generator, the stop ids
    ``min_tokens`` masks, and the tokens its penalties look at."""

    __slots__ = (
        "constraint",
        "counts",
        "generator",
        "params",
        "plain",
        "processed",
        "prompt_ids",
        "stop_ids",
        "stop_set",
    )

    def __init__(
        self,
        params: Any,
        prompt_ids: Sequence[int],
        stop_ids: Sequence[int],
        generator: np.random.Generator | None = None,
        constraint: Any = None,
    ) -> None:
        self.params = params
        self.generator = generator
        self.constraint = constraint
        self.stop_ids = np.asarray(sorted(set(stop_ids)), dtype=np.int64)
        #: the same ids, for the engine's check of each chosen token
        self.stop_set = frozenset(int(i) for i in stop_ids)
        p = params
        #: whether its logits are changed before choosing (else they are used as they are)
        self.processed = bool(
            p.logit_bias
            or constraint is not None
            or (p.min_tokens > 0 and len(self.stop_ids))
            or p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
        )
        self.prompt_ids = (
            np.unique(np.asarray(prompt_ids, dtype=np.int64))
            if p.repetition_penalty != 1.0
            else None
        )
        #: output token id -> times generated (only kept when a penalty needs it)
        self.counts: dict[int, int] | None = (
            {}
            if (
                p.repetition_penalty != 1.0
                or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0
            )
            else None
        )
        #: greedy, nothing processed, no logprobs asked: its token is its row's argmax and
        #: :meth:`accepted` has nothing to record. A batch of such rows only (the common
        #: case, decided once per step by :func:`plain`) is one argmax and nothing per row
        self.plain = bool(
            not self.processed
            and p.temperature == 0.0
            and p.logprobs is None
            and self.counts is None
            and constraint is None
        )

    def accepted(self, token_id: int) -> None:
        """Record the token chosen for this sequence."""
        if self.counts is not None:
            self.counts[token_id] = self.counts.get(token_id, 0) + 1
        if self.constraint is not None:
            self.constraint.accept(token_id)


class Sampler:
    """The batch's next tokens. ``seed``: the engine's generator, for unseeded requests."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = np.random.default_rng(seed)

    def __call__(
        self,
        logits: np.ndarray,
        rows: Sequence[SamplingState],
        generated: Sequence[int],
        failures: dict[int, Exception] | None = None,
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """``logits``: float32 ``[len(rows), vocab]``; ``generated``: how many tokens each row's
        sequence has generated so far (for ``min_tokens``). Returns the tokens (int64) and, per
        row, its logprob entry (None where not asked). ``failures``: where a row that fails
        is recorded (row -> its exception; its token is -1 and its state is not advanced);
        without it, the first failure is raised."""
        count = len(rows)
        if plain(rows):  # the common case: one argmax, no per-row work (no row can fail)
            return np.argmax(logits, axis=-1).astype(np.int64, copy=False), [None] * count
        bad: dict[int, Exception] = {}
        logprobs: list[TokenLogprob | None] = [None] * count
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_lp = log_softmax(logits[asked]) if asked else None
        if any(r.processed for r in rows):
            logits = logits.copy()
            for i, row in enumerate(rows):
                if row.processed:
                    try:
                        _process(logits[i], row, generated[i])
                    except Exception as exc:
                        bad[i] = exc
        live = [i for i in range(count) if i not in bad]
        uniforms = self._uniforms(rows, live)
        tokens = np.full(count, -1, dtype=np.int64)
        together_else_alone(
            lambda which: self._choose(logits, rows, which, uniforms, tokens), live, bad
        )
        if raw_lp is not None:
            for j, i in enumerate(asked):
                if i not in bad:
                    try:
                        logprobs[i] = logprob_entry(
                            raw_lp[j], int(tokens[i]), rows[i].params.logprobs or 0
                        )
                    except Exception as exc:
                        bad[i] = exc
        return self._accepted(rows, tokens, logprobs, bad, failures)

    def _uniforms(self, rows: Sequence[SamplingState], live: list[int]) -> np.ndarray:
        """One uniform number per live sampled row, from its own generator (else the
        engine's), drawn before any choice (a row that is chosen again draws no more)."""
        uniforms = np.zeros(len(rows), dtype=np.float64)
        for i in live:
            if rows[i].params.temperature != 0.0:
                uniforms[i] = (rows[i].generator or self.generator).random()
        return uniforms

    @staticmethod
    def _accepted(
        rows: Sequence[SamplingState],
        tokens: np.ndarray,
        logprobs: list[TokenLogprob | None],
        bad: dict[int, Exception],
        failures: dict[int, Exception] | None,
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """Each good row's token recorded in its state; the failed rows' (``bad``) into
        ``failures`` (token -1, no logprobs), or the first raised without it."""
        for i, row in enumerate(rows):
            if i not in bad:
                try:
                    row.accepted(int(tokens[i]))
                except Exception as exc:
                    bad[i] = exc
        if bad:
            if failures is None:
                raise next(iter(bad.values()))
            failures.update(bad)
            for i in bad:
                tokens[i], logprobs[i] = -1, None
        return tokens, logprobs

    def _choose(
        self,
        logits: np.ndarray,
        rows: Sequence[SamplingState],
        which: list[int],
        uniforms: np.ndarray,
        tokens: np.ndarray,
    ) -> None:
        """The tokens of rows ``which`` into ``tokens``: greedy ones by one argmax, sampled
        ones by one draw over the batch."""
        greedy = [i for i in which if rows[i].params.temperature == 0.0]
        if greedy:
            tokens[greedy] = np.argmax(logits[greedy], axis=-1)
        drawn = [i for i in which if rows[i].params.temperature != 0.0]
        if drawn:
            tokens[drawn] = self._draw(logits[drawn], [rows[i] for i in drawn], uniforms[drawn])

    def _draw(
        self, logits: np.ndarray, rows: Sequence[SamplingState], uniforms: np.ndarray
    ) -> np.ndarray:
        probs = self.probabilities(logits, rows)
        cdf = np.cumsum(probs, axis=-1, dtype=np.float64)
        targets = uniforms * cdf[:, -1]
        # the first token whose cumulative probability passes the draw (never a zero one)
        chosen = np.array(
            [np.searchsorted(cdf[i], targets[i], side="right") for i in range(len(rows))],
            dtype=np.int64,
        )
        return np.minimum(chosen, probs.shape[1] - 1)

    def probabilities(self, logits: np.ndarray, rows: Sequence[SamplingState]) -> np.ndarray:
        """The distribution each sampled row draws from (temperature, top-k, top-p, min-p),
        float32 ``[rows, vocab]``, zeros where cut."""
        temperatures = np.array([r.params.temperature for r in rows], dtype=np.float32)
        scaled = logits / temperatures[:, None]
        for i, row in enumerate(rows):
            p = row.params
            if 0 < p.top_k < scaled.shape[1]:
                kth = np.partition(scaled[i], -p.top_k)[-p.top_k]
                scaled[i][scaled[i] < kth] = -np.inf
        scaled -= scaled.max(axis=-1, keepdims=True)
        probs = np.exp(scaled, dtype=np.float32)
        probs /= probs.sum(axis=-1, keepdims=True)
        for i, row in enumerate(rows):
            p = row.params
            if p.top_p < 1.0:
                _top_p(probs[i], p.top_p)
            if p.min_p > 0.0:
                probs[i][probs[i] < p.min_p * probs[i].max()] = 0.0
        return probs


def plain(rows: Sequence[SamplingState]) -> bool:
    """Whether every row is :attr:`SamplingState.plain` (the step's choice is one argmax)."""
    return all(row.plain for row in rows)


def together_else_alone(choose: Any, live: list[int], bad: dict[int, Exception]) -> None:
    """``choose(rows)`` for every live row at once; if that raises, for each row alone, the
    rows that fail alone recorded in ``bad`` (whose failure was it?)."""
    try:
        choose(live)
    except Exception:
        for i in live:
            try:
                choose([i])
            except Exception as exc:
                bad[i] = exc


def _process(row: np.ndarray, state: SamplingState, generated: int) -> None:
    """The processing of one row's logits, in place."""
    p = state.params
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
        values = np.fromiter(p.logit_bias.values(), dtype=np.float32)
        keep = ids < row.shape[0]
        row[ids[keep]] += values[keep]
    if state.constraint is not None:
        allowed = np.asarray(state.constraint.mask(row.shape[0]), dtype=bool)
        row[: allowed.shape[0]][~allowed] = -np.inf
        row[allowed.shape[0] :] = -np.inf
    if generated < p.min_tokens and len(state.stop_ids):
        stop = state.stop_ids[state.stop_ids < row.shape[0]]
        row[stop] = -np.inf
    if state.counts is not None:
        out_ids = np.fromiter(state.counts.keys(), dtype=np.int64, count=len(state.counts))
        if p.repetition_penalty != 1.0:
            seen = (
                np.union1d(state.prompt_ids, out_ids) if state.prompt_ids is not None else out_ids
            )
            seen = seen[seen < row.shape[0]]
            values = row[seen]
            row[seen] = np.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        if len(out_ids) and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            counts = np.fromiter(state.counts.values(), dtype=np.float32, count=len(out_ids))
            keep = out_ids < row.shape[0]
            row[out_ids[keep]] -= p.frequency_penalty * counts[keep] + p.presence_penalty * (
                counts[keep] > 0
            )


def _top_p(probs: np.ndarray, top_p: float) -> None:
    """Zero every probability outside the smallest set of most likely tokens whose sum
    reaches ``top_p`` (the token that crosses it is kept), in place."""
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    cut = int(np.searchsorted(cumulative, top_p, side="left")) + 1
    probs[order[cut:]] = 0.0


def logprob_entry(row_lp: np.ndarray, token: int, top: int) -> TokenLogprob:
    """``token``'s logprob in ``row_lp`` (a log-softmax row) and the ``top`` most likely."""
    best: list[tuple[int, float]] = []
    if top > 0:
        k = min(top, row_lp.shape[0])
        ids = np.argpartition(-row_lp, k - 1)[:k]
        ids = ids[np.argsort(-row_lp[ids], kind="stable")]
        best = [(int(i), float(row_lp[i])) for i in ids]
    return TokenLogprob(token, float(row_lp[token]), best)
