"""What crosses between the host and the device in one step of the torch sampler
(plugins/torch/sampler.py; issue 51: nothing per token crosses to the host but
the ids and the logprobs asked; the review's finding 18: sampled rows made 6-10 copies that
each waited for the card). Counted on torch's CPU form, where a copy costs nothing but every
call is still seen: a TorchFunctionMode and a TorchDispatchMode record, during one sampler
call on a batch that mixes every kind of row, each

- copy to the device: a ``Tensor.to`` / ``.cuda`` / ``.copy_`` call, and each host value
  made a tensor (``aten.lift_fresh``: ``torch.tensor``, ``torch.as_tensor``,
  ``torch.from_numpy``, indexing by a Python list), each a pageable copy (a wait) on a card;
- read on the host: ``.cpu()``, ``.tolist()``, ``.numpy()`` of a tensor the step made
  (not the sampler's own host buffer), and ``aten._local_scalar_dense`` (``.item()``,
  ``int()``, ``bool()`` of a tensor).

The design: one ``.to(device, non_blocking=True)`` of the step's packed buffer, no host
value lifted, one ``.cpu()`` of the one concatenated tensor, nothing else; the pipelined
halves split them (``draw`` sends, ``fetched`` reads). The tokens are still the host
sampler's for the same logits and seeds.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch sampler needs torch (pip install torch)")

from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from plugserve.plugins.sampling import Sampler, SamplingState  # noqa: E402
from plugserve.plugins.torch.sampler import TorchSampler  # noqa: E402
from plugserve.server.apps.generate.types import SamplingParams  # noqa: E402

VOCAB = 320
PROMPT = (1, 2, 3, 40, 41)
STOPS = (0, 7)

#: one row of each kind, in one batch
MIXED = [
    {"temperature": 0.0, "logprobs": 3},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.6, "logprobs": 0},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.8, "min_p": 0.05, "logprobs": 2},
    {"temperature": 1.0, "logit_bias": {5: 8.0, 6: -100.0, 299: 3.0}},
    {"temperature": 1.0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"temperature": 0.0, "repetition_penalty": 1.7},
    {"temperature": 1.0, "min_tokens": 6},
    {"temperature": 0.0},
]


class Mask:
    """A grammar's constraint as the sampler takes it: llguidance's packed words."""

    def __init__(self, allowed: list[int], broken: bool = False) -> None:
        self.allowed = allowed
        self.broken = broken

    def bitmask(self) -> np.ndarray:
        if self.broken:
            raise ValueError("the grammar broke")
        out = np.zeros(VOCAB, dtype=bool)
        out[self.allowed] = True
        return np.packbits(out, bitorder="little").view(np.int32).copy()

    def mask(self, vocab: int) -> np.ndarray:  # the host sampler's form
        if self.broken:
            raise ValueError("the grammar broke")
        out = np.zeros(vocab, dtype=bool)
        out[self.allowed] = True
        return out

    def accept(self, token: int) -> bool:
        return True


def mixed(broken: bool = False) -> list[SamplingState]:
    rows = [
        SamplingState(
            SamplingParams(**params), list(PROMPT), list(STOPS), np.random.default_rng(20 + i)
        )
        for i, params in enumerate(MIXED)
    ]
    grammar = Mask([3, 31, 32, 63, 64, 200, 299], broken)
    rows.append(  # a sampled row under a grammar
        SamplingState(SamplingParams(temperature=1.0), list(PROMPT), list(STOPS), None, grammar)
    )
    return rows


def logits(rows: int, step: int) -> np.ndarray:
    x = np.random.default_rng(100 + step).normal(0, 3, (rows, VOCAB)).astype(np.float32)
    x[:, [0, 7, 1, 40, 5, 11]] += 6.0
    return x


class Crossings(TorchFunctionMode):
    """The copies to the device and the reads on the host made while it is entered (with
    :class:`_Lifted` for the dispatcher's view)."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: list[tuple] = []
        self.reads: list[str] = []
        self.hosts: list = []  # tensors made empty on the host (the sampler's host buffers)
        self.dispatch = _Lifted()

    def _host(self, tensor) -> bool:
        return any(tensor is t for t in self.hosts)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if (
            name == "cuda"
            or (name == "to" and _moves(args, kwargs))
            or (name == "copy_" and self._host(args[1]))  # a device tensor filled from the host
        ):
            self.uploads.append((name, args[1:], kwargs))
        if name in ("cpu", "tolist") or (name == "numpy" and not self._host(args[0])):
            self.reads.append(name)
        out = func(*args, **kwargs)
        if name == "empty":
            self.hosts.append(out)
        return out

    def __enter__(self):
        self.dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.dispatch.__exit__(*exc)


class _Lifted(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.lifted = 0
        self.scalars = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            self.lifted += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalars += 1
        return func(*args, **(kwargs or {}))


def _moves(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a device (not only a dtype)."""
    for value in (*args[1:], *kwargs.values()):
        if isinstance(value, (str, torch.device, torch.Tensor)):
            return True
    return "device" in kwargs


@pytest.mark.parametrize("broken", [False, True], ids=["mixed", "mixed-one-row-failing"])
def test_a_mixed_sampled_step_sends_once_and_reads_once(broken):
    """Every kind of row in one batch, for 8 steps: one non-blocking copy to the device,
    one copy back, nothing else (before: 6-10 waits, ``int(ks.max())`` among them); the
    tokens and logprobs are the host sampler's (a broken grammar fails its row alone)."""
    rows, host_rows = mixed(broken), mixed(broken)
    for row in (*rows, *host_rows):  # a history for the penalties
        if row.constraint is None:
            for token in (5, 5, 40, 299):
                row.accepted(token)
    sampler, host_sampler = TorchSampler(seed=3), Sampler(seed=3)
    sampled = set()
    for step in range(8):
        x = logits(len(rows), step)
        generated = [step] * len(rows)
        given = torch.from_numpy(x)
        failures: dict = {}
        with Crossings() as seen:
            tokens, entries = sampler(given, rows, generated, failures)
        host_failures: dict = {}
        want, want_lp = host_sampler(x, host_rows, generated, host_failures)
        assert tokens.tolist() == want.tolist()
        assert sorted(failures) == sorted(host_failures) == ([len(rows) - 1] if broken else [])
        for got, expected in zip(entries, want_lp):
            assert (got is None) == (expected is None)
            if got is not None:
                assert got.token_id == expected.token_id
                assert [i for i, _ in got.top] == [i for i, _ in expected.top]
        sampled.update(tokens[1:8].tolist())
        # the step's crossings: the design's two, and nothing else
        assert len(seen.uploads) == 1, seen.uploads
        (name, args, kwargs) = seen.uploads[0]
        assert name == "to" and kwargs.get("non_blocking") is True, seen.uploads[0]
        assert torch.device(args[0]) == sampler.device
        assert seen.dispatch.lifted == 0, "a host value was made a tensor (a pageable copy)"
        assert seen.dispatch.scalars == 0, "a tensor was read as a Python number (a wait)"
        assert seen.reads == ["cpu", "numpy"], seen.reads  # the one fetch (Drawn.host)
    assert len(sampled) > 4, "it did sample"


def test_the_pipelined_halves_split_them():
    """``draw`` (run at a pipelined step's launch) sends and reads nothing back; ``fetched``
    (when the host needs the ids) reads once and sends nothing."""
    rows = mixed()
    sampler = TorchSampler(seed=1)
    given = torch.from_numpy(logits(len(rows), 0))
    with torch.inference_mode():
        with Crossings() as seen:
            drawn = sampler.draw(given, rows, [0] * len(rows))
        assert len(seen.uploads) == 1 and seen.reads == [] and not seen.dispatch.scalars
        assert seen.dispatch.lifted == 0
        drawn.copy_out()  # on the CPU: nothing to start
        with Crossings() as seen:
            tokens, _ = sampler.fetched(drawn, {})
    assert seen.uploads == [] and seen.reads == ["cpu", "numpy"] and not seen.dispatch.scalars
    assert (tokens >= 0).all()


def test_a_greedy_batch_sends_nothing():
    """Greedy rows that ask for logprobs (not the plain path): nothing to send, one read."""
    rows = [
        SamplingState(SamplingParams(temperature=0.0, logprobs=2), list(PROMPT), list(STOPS))
        for _ in range(4)
    ]
    x = logits(4, 1)
    given = torch.from_numpy(x)
    with Crossings() as seen:
        tokens, entries = TorchSampler()(given, rows, [0] * 4)
    assert seen.uploads == [] and seen.dispatch.lifted == 0
    assert seen.reads == ["cpu", "numpy"] and not seen.dispatch.scalars
    assert tokens.tolist() == np.argmax(x, axis=1).tolist()
    assert all(e is not None and len(e.top) == 2 for e in entries)
