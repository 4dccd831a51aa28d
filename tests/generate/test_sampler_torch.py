"""Sampling on the logits' device (plugins/torch/sampler.py, issue 51's item 4),
here on torch's CPU (the same code a CUDA card runs): for each parameter, the torch sampler's
processed logits, its cut distributions (top-k, top-p, min-p) and its choices equal the host
sampler's (plugins/sampling.py) on the same logits with the same seeds; seeded
draws repeat; logprobs are the raw log-softmax; a grammar's mask travels as llguidance's packed
words and bans what the bool mask bans."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch sampler needs torch (pip install torch)")

from plugserve.plugins.sampling import (  # noqa: E402
    Sampler,
    SamplingState,
    _process,
    log_softmax,
)
from plugserve.plugins.torch.sampler import TorchSampler  # noqa: E402
from plugserve.server.apps.generate.types import SamplingParams  # noqa: E402

VOCAB = 300
PROMPT = (1, 2, 3, 40, 41)
STOPS = (0, 7)

#: one case per parameter (and a few together), each run on 4 rows for 12 steps
CASES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 1.0, "top_k": 5},
    "top_p": {"temperature": 1.0, "top_p": 0.6},
    "min_p": {"temperature": 1.0, "min_p": 0.2},
    "cuts": {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "min_p": 0.05},
    "repetition": {"temperature": 0.0, "repetition_penalty": 1.7},
    "frequency": {"temperature": 1.0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
    "presence": {"temperature": 0.0, "presence_penalty": 3.0},
    "logit_bias": {"temperature": 1.0, "logit_bias": {5: 8.0, 6: -100.0, 299: 3.0}},
    "min_tokens": {"temperature": 1.0, "min_tokens": 6},
    "everything": dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        logit_bias={11: 2.0},
        min_tokens=3,
        logprobs=3,
    ),
}


def states(params: dict, seeds=(11, 12, None, 14), constraint=None) -> list[SamplingState]:
    out = []
    for seed in seeds:
        generator = np.random.default_rng(seed) if seed is not None else None
        out.append(
            SamplingState(
                SamplingParams(**params), list(PROMPT), list(STOPS), generator, constraint
            )
        )
    return out


def logits(rows: int, step: int) -> np.ndarray:
    """Logits peaked enough that the cuts keep few tokens, with the stop ids and the prompt's
    ids among the likely ones (so min_tokens and the penalties change the answers)."""
    x = np.random.default_rng(100 + step).normal(0, 3, (rows, VOCAB)).astype(np.float32)
    x[:, [0, 7, 1, 40, 5, 11]] += 6.0
    return x


def run(sampler, rows, steps=12, as_tensor=False):
    tokens, entries = [], []
    for step in range(steps):
        x = logits(len(rows), step)
        generated = [step] * len(rows)
        chosen, lp = sampler(torch.from_numpy(x) if as_tensor else x, rows, generated)
        tokens.append(chosen.tolist())
        entries.append(lp)
    return tokens, entries


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_torch_sampler_chooses_what_the_host_sampler_chooses(case):
    params = CASES[case]
    host_tokens, host_lp = run(Sampler(seed=3), states(params))
    torch_tokens, torch_lp = run(TorchSampler(seed=3), states(params), as_tensor=True)
    assert torch_tokens == host_tokens
    flat = [t for step in host_tokens for t in step]
    if params.get("temperature", 1.0) != 0.0:
        assert len(set(flat)) > 4, "it did sample"
    for host_step, torch_step in zip(host_lp, torch_lp):
        for h, t in zip(host_step, torch_step):
            assert (h is None) == (t is None)
            if h is not None:
                assert t.token_id == h.token_id
                assert t.logprob == pytest.approx(h.logprob, abs=1e-5)
                assert [i for i, _ in t.top] == [i for i, _ in h.top]
                assert np.allclose([v for _, v in t.top], [v for _, v in h.top], atol=1e-5)


PROCESSED = ["repetition", "frequency", "presence", "logit_bias", "min_tokens", "everything"]


@pytest.mark.parametrize("case", PROCESSED)
def test_processed_logits_equal_the_hosts(case):
    params = CASES[case]
    rows = states(params)
    for row, ids in zip(rows, ([5, 5, 9], [40, 40, 40, 2], [], [299])):
        for token in ids:
            row.accepted(token)
    x = logits(len(rows), 0)
    generated = [3, 4, 0, 1]
    expected = x.copy()
    for i, row in enumerate(rows):
        _process(expected[i], row, generated[i])
    bad: dict = {}
    got = TorchSampler().processed(torch.from_numpy(x), rows, generated, bad).numpy()
    assert not bad
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(got, x), "the case changes the logits"


@pytest.mark.parametrize("case", ["temperature", "top_k", "top_p", "min_p", "cuts", "everything"])
def test_the_cut_distributions_equal_the_hosts(case):
    rows = states(CASES[case])
    x = logits(len(rows), 5)
    host = Sampler().probabilities(x.copy(), rows)
    got = TorchSampler().probabilities(torch.from_numpy(x), rows).numpy()
    np.testing.assert_array_equal(got == 0, host == 0)  # the same tokens cut
    np.testing.assert_allclose(got, host, rtol=1e-5, atol=1e-7)
    kept = (host > 0).sum(axis=1)
    if case in ("top_k", "top_p", "min_p", "cuts"):
        assert (kept < VOCAB).all() and (kept > 1).any(), kept
    if case == "top_k":
        assert (kept == 5).all()


def test_a_seed_gives_the_same_answer_again_and_alone():
    params = {"temperature": 1.0, "top_p": 0.95}
    first, _ = run(TorchSampler(seed=1), states(params, seeds=(5, 6, 7, 8)), as_tensor=True)
    again, _ = run(TorchSampler(seed=2), states(params, seeds=(5, 6, 7, 8)), as_tensor=True)
    assert first == again  # the engine's own generator (seed=) is not what they draw from
    sampler = TorchSampler(seed=9)
    (row,) = states(params, seeds=(7,))
    solo = []
    for step in range(12):
        x = logits(4, step)[2:3]  # the row that had seed 7 in the batch, alone
        solo.append(int(sampler(torch.from_numpy(x), [row], [step])[0][0]))
    assert solo == [step[2] for step in first]
    other, _ = run(TorchSampler(seed=1), states(params, seeds=(50, 60, 70, 80)), as_tensor=True)
    assert other != first


def test_logprobs_are_the_raw_log_softmax():
    rows = states({"temperature": 0.9, "top_k": 3, "logprobs": 4, "repetition_penalty": 2.0})
    x = logits(len(rows), 2)
    tokens, entries = TorchSampler(seed=0)(torch.from_numpy(x), rows, [0] * len(rows))
    lp = log_softmax(x)
    for i, entry in enumerate(entries):
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(float(lp[i, tokens[i]]), abs=1e-5)
        best = np.argsort(-lp[i])[:4]
        assert [t for t, _ in entry.top] == best.tolist()
        assert np.allclose([v for _, v in entry.top], lp[i, best], atol=1e-5)


class BoolMask:
    """A constraint as the host sampler takes it: ``mask(vocab)`` (bool), ``accept``."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed
        self.accepted: list[int] = []

    def mask(self, vocab: int) -> np.ndarray:
        out = np.zeros(vocab, dtype=bool)
        out[self.allowed] = True
        return out

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True


class PackedMask(BoolMask):
    """The same, with llguidance's packed int32 words (what the JSON constraint gives)."""

    def bitmask(self) -> np.ndarray:
        return np.packbits(self.mask(320), bitorder="little").view(np.int32).copy()


@pytest.mark.parametrize("kind", [BoolMask, PackedMask])
def test_a_grammars_mask_bans_on_the_device_what_it_bans_on_the_host(kind):
    allowed = [3, 31, 32, 63, 64, 200, 299]  # word edges included
    for temperature in (0.0, 1.0):
        host_c, torch_c = kind(allowed), kind(allowed)
        host_rows = states({"temperature": temperature}, seeds=(1,), constraint=host_c)
        torch_rows = states({"temperature": temperature}, seeds=(1,), constraint=torch_c)
        for step in range(10):
            x = logits(1, step)
            want = Sampler()(x, host_rows, [step])[0]
            got = TorchSampler()(torch.from_numpy(x), torch_rows, [step])[0]
            assert got.tolist() == want.tolist()
            assert int(got[0]) in allowed
        assert torch_c.accepted == host_c.accepted


def test_a_real_json_grammar_constrains_on_the_device(llm_folder):
    """llguidance's own words (JsonConstraint.bitmask) unpacked on the device: the answer is
    the schema's JSON, token for token the host sampler's."""
    from plugserve.server.apps.generate.text.grammar import compile_schema
    from plugserve.server.apps.generate.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(llm_folder("tiny-llama", "hf"))
    vocab = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    compiled = compile_schema(schema, tokenizer, vocab)
    answers = []
    for sampler, wrap in ((Sampler(), lambda x: x), (TorchSampler(), torch.from_numpy)):
        (row,) = states({"temperature": 0.0}, seeds=(None,), constraint=compiled.constraint())
        ids = []
        rng = np.random.default_rng(4)
        for step in range(40):
            x = rng.normal(0, 1, (1, vocab)).astype(np.float32)
            token = int(sampler(wrap(x), [row], [step])[0][0])
            ids.append(token)
            if row.constraint.done():
                break
        answers.append(ids)
    assert answers[0] == answers[1]
    text = tokenizer.decode(answers[0], True)
    import json

    assert json.loads(text)["ok"] in (True, False), text


def test_a_rows_failure_is_its_own():
    class Broken(BoolMask):
        def mask(self, vocab):
            raise ValueError("the grammar broke")

    good = states({"temperature": 0.0}, seeds=(1,))
    broken = states({"temperature": 0.0}, seeds=(2,), constraint=Broken([1]))
    x = logits(3, 0)
    failures: dict = {}
    rows = [good[0], broken[0], good[0]]
    tokens, _ = TorchSampler()(torch.from_numpy(x), rows, [0] * 3, failures)
    assert list(failures) == [1] and "grammar broke" in str(failures[1])
    assert tokens[1] == -1
    assert tokens[[0, 2]].tolist() == np.argmax(x[[0, 2]], axis=1).tolist()
