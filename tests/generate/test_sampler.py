"""The sampler's rules (plugins/sampling.py), on made-up logits: greedy, seeded draws
independent of the batch, the cuts, penalties as transformers and OpenAI define them, and
logprobs of the raw distribution."""

from __future__ import annotations

import numpy as np
import pytest

from plugserve.plugins.sampling import Sampler, SamplingState, log_softmax
from plugserve.server.apps.generate.types import SamplingParams

VOCAB = 50


def state(prompt=(1, 2, 3), stops=(0,), seed=None, **params) -> SamplingState:
    generator = np.random.default_rng(seed) if seed is not None else None
    return SamplingState(SamplingParams(**params), list(prompt), list(stops), generator)


def logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2, (rows, VOCAB)).astype(np.float32)


def test_greedy_takes_the_highest_logit_and_the_lowest_id_on_a_tie():
    x = logits(3)
    x[2, [7, 9]] = 100.0
    tokens, _ = Sampler()(x, [state(temperature=0.0) for _ in range(3)], [0, 0, 0])
    assert tokens.tolist() == [int(np.argmax(x[0])), int(np.argmax(x[1])), 7]


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    steps = [logits(4, seed=s) for s in range(12)]
    alone = state(seed=42, temperature=0.8, top_p=0.9, top_k=20)
    crowded = state(seed=42, temperature=0.8, top_p=0.9, top_k=20)
    others = [state(temperature=1.0), state(seed=5), state(temperature=0.0)]
    sampler = Sampler(seed=1)
    got_alone, got_crowded = [], []
    for x in steps:
        got_alone.append(int(sampler(x[1:2], [alone], [0])[0][0]))
        rows = [others[0], crowded, others[1], others[2]]
        got_crowded.append(int(sampler(x, rows, [0] * 4)[0][1]))
    assert got_alone == got_crowded
    assert len(set(got_alone)) > 1  # it did sample


def test_cuts_that_leave_one_token_answer_greedily():
    x = logits(4, seed=3)
    rows = [
        state(seed=1, top_k=1),
        state(seed=2, top_p=1e-6),
        state(seed=3, min_p=1.0),
        state(seed=4, temperature=1e-4),
    ]
    tokens, _ = Sampler()(x, rows, [0] * 4)
    assert tokens.tolist() == np.argmax(x, axis=1).tolist()


def test_top_k_and_top_p_only_draw_what_they_keep():
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)], np.float32))
    top_k = state(seed=0, top_k=2)
    top_p = state(seed=0, top_p=0.75)  # 0.5 + 0.3 reaches it: two tokens
    sampler = Sampler()
    seen_k = {int(sampler(x, [top_k], [0])[0][0]) for _ in range(300)}
    seen_p = {int(sampler(x, [top_p], [0])[0][0]) for _ in range(300)}
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}


def test_repetition_penalty_is_transformers_own():
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits(1, seed=4)
    x[0, 3] = -abs(x[0, 3])  # one negative logit among the seen tokens
    row = state(prompt=(3, 5, 8), stops=(), temperature=0.0, repetition_penalty=1.7)
    row.accepted(11)
    processed = RepetitionPenaltyLogitsProcessor(1.7)(
        torch.tensor([[3, 5, 8, 11]]), torch.tensor(x.copy())
    )
    from plugserve.plugins import sampling as module

    mine = x[0].copy()
    module._process(mine, row, 1)
    np.testing.assert_allclose(mine, processed[0].numpy(), rtol=1e-6)
    tokens, _ = Sampler()(x, [row], [1])
    assert tokens[0] == int(processed.argmax())


def test_frequency_and_presence_penalties_follow_openai():
    x = np.zeros((1, VOCAB), np.float32)
    row = state(stops=(), frequency_penalty=0.5, presence_penalty=0.25)
    for token in (4, 4, 9):
        row.accepted(token)
    from plugserve.plugins import sampling as module

    module._process(x[0], row, 3)
    assert x[0, 4] == pytest.approx(-(2 * 0.5 + 0.25))
    assert x[0, 9] == pytest.approx(-(1 * 0.5 + 0.25))
    assert x[0, 5] == 0.0


def test_logit_bias_and_min_tokens():
    x = logits(1, seed=5)
    forced = state(temperature=0.0, logit_bias={17: 100.0})
    assert Sampler()(x, [forced], [0])[0][0] == 17
    x[0, 0] = 1000.0  # the stop token would win
    held = state(stops=(0,), temperature=0.0, min_tokens=2)
    assert Sampler()(x, [held], [1])[0][0] != 0  # one token so far: masked
    free = state(stops=(0,), temperature=0.0, min_tokens=2)
    assert Sampler()(x, [free], [2])[0][0] == 0


def test_logprobs_are_the_raw_distribution_and_the_top_tokens_sorted():
    x = logits(2, seed=6)
    rows = [
        state(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        state(temperature=0.0),
    ]
    tokens, entries = Sampler()(x, rows, [0, 0])
    expected = log_softmax(x[:1])[0]
    entry = entries[0]
    assert entries[1] is None
    assert entry.token_id == tokens[0]
    assert entry.logprob == pytest.approx(float(expected[tokens[0]]), abs=1e-6)
    top = np.argsort(-expected)[:3]
    assert [t for t, _ in entry.top] == top.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(expected[top].tolist(), abs=1e-6)
