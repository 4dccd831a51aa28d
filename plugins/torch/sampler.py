"""The sampler of ``plugins/sampling.py`` on the logits' own device (a CUDA card, or torch on the
CPU): the torch decoder's logits never cross to the host; the chosen ids do, and the logprobs a
request asked for.

Same semantics, same order, same numbers as the host's ``plugins/sampling.py`` (its module
docstring is the reference): ``logit_bias``, the grammar's mask, ``min_tokens``, repetition
penalty (prompt and output tokens), frequency and presence penalties; then greedy rows take
the argmax and sampled rows divide by the temperature, cut by top-k (ties with the k-th kept),
top-p (the token that crosses p kept) and min-p, and draw by inverse CDF over float64
cumulative sums. Logprobs are the log-softmax of the raw logits.

What crosses per step, and where the host waits. Host to device, in one copy: every array
the step needs that is not on the device already is packed into one byte buffer
(:class:`_Pack`; pinned on a CUDA device, so the copy is ``non_blocking`` and nothing waits
for the forward queued before it): the per-row parameters (temperatures, top-k's k, top-p,
min-p, which rows are greedy), the row indices of each cut and of the rows asking for
logprobs, one uniform number per sampled row, and for the rows that ask for processing the
flat ``(row, token id, value)`` triples of their bias and penalties (a few bytes per
generated token of those rows) and the grammar's packed bitmask (llguidance's int32 words,
``vocab / 8`` bytes, unpacked on the device); each is a view of the device's copy. What the
host must decide itself (top-k's largest k, which rows are cut) it reads from the
parameters, never from the device. Device to host: the ids (8 bytes a row) and the asked
logprobs (the chosen token's and the ``top_logprobs`` best), concatenated into one tensor and
copied back once: the step's one synchronisation (:meth:`Drawn.host`). So a sampled step
makes one copy each way, as a greedy one makes one copy back (tests/generate/
test_sampler_torch_syncs.py counts them on the CPU form; a plain greedy batch sends nothing);
:meth:`TorchSampler.draw`, the half a pipelined step (the engine's ``overlap.py``) runs at launch,
reads nothing back. Before (the review's finding 18), each parameter, index and the uniforms were
a pageable copy of their own and top-k's largest k was read back (``int(ks.max())``): each
a wait for the card, the first one for the whole forward, 12 to 15 copies a step for a
batch mixing every kind of row (counted on the CPU form by that test).

Seeds: each sampled row's uniform number is drawn on the host from the request's own numpy
generator (seeded ``seed + index``, the engine's ``seeded_generator``), as the host sampler
draws it, so a seeded request gives the same answer on the CPU engine, on the card, and
whatever shares its batches, and no device generator state enters a CUDA graph (one float a
row is the whole price). The draw itself, over the vocabulary, runs on the device.

Failures are the rows': a row whose host-side preparation raises (its grammar's mask, its
bias) fails alone; if the batched choice raises, each row is chosen again alone, as on the
host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import InferenceError
from plugserve.plugins.sampling import (
    Sampler,
    SamplingState,
    TokenLogprob,
    plain,
    together_else_alone,
)
from plugserve.plugins.torch import devmem

__all__ = ["Drawn", "TorchSampler"]


class TorchSampler(Sampler):
    """:class:`~plugserve.plugins.sampling.Sampler` over torch logits on ``device``; numpy
    logits (another decoder's) go to the host sampler unchanged."""

    def __init__(self, seed: int | None = None, device: Any = "cpu") -> None:
        import torch

        super().__init__(seed)
        self.torch = torch
        self.device = torch.device(device)

    def __call__(
        self,
        logits: Any,
        rows: Sequence[SamplingState],
        generated: Sequence[int],
        failures: dict[int, Exception] | None = None,
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        if isinstance(logits, np.ndarray):
            return super().__call__(logits, rows, generated, failures)
        if plain(rows):  # outside inference_mode: an argmax of its tensors needs none
            return self._plain(logits, rows, failures)
        with self.torch.inference_mode():  # the decoder's logits are inference tensors
            return self._sample(logits, rows, generated, failures)

    def _sample(
        self,
        logits: Any,
        rows: Sequence[SamplingState],
        generated: Sequence[int],
        failures: dict[int, Exception] | None,
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        return self.fetched(self.draw(logits, rows, generated), failures)

    def draw(self, logits: Any, rows: Sequence[SamplingState], generated: Sequence[int]) -> Drawn:
        """The choice made on the device, nothing brought back yet: the first half of a
        call, which a pipelined step (the engine's ``overlap.py``) runs at launch, before the host
        needs the ids (:meth:`fetched`, the second half). The host's share (each row's
        processing, its uniform number, the parameters) is gathered first and sent in one
        copy; then the device's operations are queued, none of which waits for the card."""
        torch = self.torch
        count = len(rows)
        drawn = Drawn(rows)
        bad = drawn.bad
        logits = logits.float()
        vocab = logits.shape[1]
        pack = _Pack()
        asked = drawn.asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if asked and len(asked) < count:
            pack.add("asked", np.asarray(asked, dtype=np.int64))
        stages = None
        if any(r.processed for r in rows):
            stages = _Stages.of(rows, generated, vocab, bad)
            stages.put(pack)
        live = drawn.live = [i for i in range(count) if i not in bad]
        uniforms = self._uniforms(rows, live)
        if any(rows[i].params.temperature != 0.0 for i in live):  # greedy only: no uniforms
            pack.add("u", uniforms)
        _put_choice(pack, rows, live, vocab)
        chosen = torch.full((count,), -1, dtype=torch.int64, device=logits.device)
        drawn.chosen = chosen
        try:
            sent = pack.sent(torch, logits.device)  # the step's one copy to the device
            raw_lp = None
            if asked:
                raw = logits if len(asked) == count else logits.index_select(0, sent["asked"])
                raw_lp = torch.log_softmax(raw, dim=-1)
            if stages is not None:
                logits = stages.applied(torch, logits, sent)
        except Exception as exc:  # the device failed (an asynchronous CUDA error surfaces here)
            drawn.error = exc
            return drawn
        u = sent.get("u")
        together_else_alone(
            lambda which: self._choose_on(
                logits, rows, which, u, chosen, sent if which is live else None
            ),
            live,
            bad,
        )
        try:
            drawn.tensors = self._gathered(chosen, raw_lp, asked, rows, sent)
        except Exception as exc:  # the device failed (an asynchronous CUDA error surfaces here)
            drawn.error = exc
        return drawn

    def fetched(
        self, drawn: Drawn, failures: dict[int, Exception] | None
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """The ids (and asked logprobs) of :meth:`draw` on the host (the one synchronisation),
        each row's token recorded in its state."""
        rows, bad, asked = drawn.rows, drawn.bad, drawn.asked
        count = len(rows)
        logprobs: list[TokenLogprob | None] = [None] * count
        try:
            if drawn.error is not None:
                raise drawn.error
            tokens, entries = self._entries(drawn.host(), asked, rows, bad)
        except Exception as exc:  # the device failed (an asynchronous CUDA error surfaces here)
            error = devmem.sticky_failure(exc, self.device, "sampling") or InferenceError(
                f"sampling on {self.device} failed: {exc}"
            )
            tokens, entries = np.full(count, -1, dtype=np.int64), [None] * len(asked)
            bad.update({i: error for i in drawn.live if i not in bad})
        for j, i in enumerate(asked):
            if i not in bad:
                logprobs[i] = entries[j]
        return self._accepted(rows, tokens, logprobs, bad, failures)

    # --- processing: each stage over all the rows asking for it, as one indexed operation

    def processed(
        self,
        logits: Any,
        rows: Sequence[SamplingState],
        generated: Sequence[int],
        bad: dict[int, Exception],
    ) -> Any:
        """A copy of ``logits`` with each processed row's bias, mask and penalties applied
        (the host's ``_process``, stage by stage over the rows); a row whose preparation
        raises is recorded in ``bad`` and left as it was. (:meth:`draw` sends the stages'
        arrays with the rest of its step's.)"""
        stages = _Stages.of(rows, generated, logits.shape[1], bad)
        pack = _Pack()
        stages.put(pack)
        return stages.applied(self.torch, logits, pack.sent(self.torch, logits.device))

    # --- choosing

    def _plain(
        self, logits: Any, rows: Sequence[SamplingState], failures: dict[int, Exception] | None
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """A batch of :attr:`~plugserve.plugins.sampling.SamplingState.plain` rows (greedy, nothing
        processed, no logprobs: the common case, decided once per step): one argmax and the ids'
        copy to the host, nothing per row (no generator, no state to advance); on the CPU, numpy's
        argmax of the same memory (the first maximum too, as torch's). The sampler's call a step,
        greedy rows of 2,048 float32 logits, one thread, measured here: 109 us at 8 rows and
        239 at 32 before (the general path), 54 and 154 with torch's argmax, 18 and 34 with
        numpy's."""
        try:
            if logits.device.type == "cpu" and logits.dtype == self.torch.float32:
                chosen = np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False)
            else:  # the step's one synchronisation: the ids to the host
                chosen = self.torch.argmax(logits, dim=-1).cpu().numpy()
            return chosen, [None] * len(rows)
        except Exception as exc:  # the device failed (an asynchronous CUDA error surfaces here)
            error = devmem.sticky_failure(exc, self.device, "sampling") or InferenceError(
                f"sampling on {self.device} failed: {exc}"
            )
            bad: dict[int, Exception] = dict.fromkeys(range(len(rows)), error)
            tokens = np.full(len(rows), -1, dtype=np.int64)
            return self._accepted(rows, tokens, [None] * len(rows), bad, failures)

    def _choose_on(
        self,
        logits: Any,
        rows: Sequence[SamplingState],
        which: list[int],
        u: Any,
        chosen: Any,
        sent: dict[str, Any] | None = None,
    ) -> None:
        """The tokens of rows ``which`` into ``chosen``, one set of operations over them
        whatever their mix: the argmax of every row and, when any row samples, the draw of
        every row (greedy rows drawn at temperature 1 and their draw discarded by one
        ``where``), instead of indexing the greedy and the sampled rows apart. ``sent``: the
        step's arrays on the device (:func:`_put_choice`'s for these rows); without it (rows
        chosen again alone after the batch's choice raised), their own copy."""
        torch = self.torch
        if sent is None:
            pack = _Pack()
            _put_choice(pack, rows, which, logits.shape[1])
            sent = pack.sent(torch, logits.device)
        whole = len(which) == len(rows)
        if whole:
            part, sub = logits, rows
        else:
            index = sent["which"]
            part, sub = logits.index_select(0, index), [rows[i] for i in which]
        greedy = [r.params.temperature == 0.0 for r in sub]
        best = torch.argmax(part, dim=-1)
        if not all(greedy):
            probs = self.probabilities(part, sub, sent)
            cdf = torch.cumsum(probs.double(), dim=-1)
            targets = (u if whole else u.index_select(0, index)) * cdf[:, -1]
            picked = torch.searchsorted(cdf, targets[:, None], right=True)[:, 0]
            picked = picked.clamp_(max=probs.shape[1] - 1)
            if any(greedy):
                picked = torch.where(sent["greedy"], best, picked)
            best = picked
        if whole:
            chosen.copy_(best)
        else:
            chosen.index_copy_(0, index, best)

    def probabilities(
        self, logits: Any, rows: Sequence[SamplingState], sent: dict[str, Any] | None = None
    ) -> Any:
        """The distribution each sampled row draws from (temperature, top-k, top-p, min-p),
        float32 ``[rows, vocab]``, zeros where cut: the host's
        :meth:`~plugserve.plugins.sampling.Sampler.probabilities` on the device. ``sent``: the
        rows' parameters on the device (:func:`_put_cuts`'), else sent here; which rows each cut
        takes, and top-k's largest k, are read from ``rows`` on the host."""
        torch = self.torch
        vocab = logits.shape[1]
        if sent is None:
            pack = _Pack()
            _put_cuts(pack, rows, vocab)
            sent = pack.sent(torch, logits.device)
        scaled = logits / sent["temperature"][:, None]  # a greedy row (drawn, discarded) at 1
        cut = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
        if cut:
            index, ks = sent["cut"], sent["k"]
            part = scaled.index_select(0, index)
            best = torch.topk(part, max(rows[i].params.top_k for i in cut), dim=-1).values
            kth = best.gather(1, (ks - 1)[:, None])
            scaled[index] = part.masked_fill(part < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if any(r.params.top_p < 1.0 for r in rows):
            index, p = sent["nucleus"], sent["p"]
            part = probs.index_select(0, index)
            ordered, order = torch.sort(part, dim=-1, descending=True, stable=True)
            cumulative = torch.cumsum(ordered, dim=-1)
            before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], 1)
            # kept: the tokens before the one whose cumulative sum reaches p, and that one
            keep = torch.zeros_like(part, dtype=torch.bool).scatter_(1, order, before < p[:, None])
            probs[index] = part * keep
        if any(r.params.min_p > 0.0 for r in rows):
            index, m = sent["floor"], sent["m"]
            part = probs.index_select(0, index)
            top = part.max(dim=-1, keepdim=True).values
            probs[index] = part.masked_fill(part < m[:, None] * top, 0.0)
        return probs

    def _gathered(
        self,
        chosen: Any,
        raw_lp: Any,
        asked: list[int],
        rows: Sequence[SamplingState],
        sent: dict[str, Any],
    ) -> list[Any]:
        """What the host needs, on the device: the ids; when rows ask for logprobs, one
        float64 tensor instead (one copy to the host: one synchronisation on a card; exact
        for float32 values and for ids below 2**53): the ids, the asked rows' chosen
        tokens' logprobs, and the ``top_logprobs`` best ones' values and ids."""
        torch = self.torch
        if not asked:
            return [chosen]
        mine = chosen if len(asked) == len(rows) else chosen.index_select(0, sent["asked"])
        picked = raw_lp.gather(1, mine.clamp(min=0)[:, None])[:, 0]
        top = max((rows[i].params.logprobs or 0) for i in asked)
        k = min(top, raw_lp.shape[1])
        parts = [chosen.double(), picked.double()]
        if k:
            best = torch.topk(raw_lp, k, dim=-1)
            parts += [best.values.double().reshape(-1), best.indices.double().reshape(-1)]
        return [torch.cat(parts)]

    @staticmethod
    def _entries(
        host: list[np.ndarray],
        asked: list[int],
        rows: Sequence[SamplingState],
        bad: dict[int, Exception],
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """The ids and the asked rows' logprob entries from :meth:`_gathered`'s arrays."""
        if not asked:
            return host[0].copy(), []  # a copy: a pipelined step reads the CPU's ids
        flat, count, many = host[0], len(rows), len(asked)
        tokens = flat[:count].astype(np.int64)
        picked_h = flat[count : count + many]
        rest = flat[count + many :]
        k = len(rest) // (2 * many)
        values = rest[: many * k].reshape(many, k) if k else None
        ids = rest[many * k :].reshape(many, k).astype(np.int64) if k else None
        entries: list[TokenLogprob | None] = []
        for j, i in enumerate(asked):
            if i in bad:
                entries.append(None)
                continue
            want = rows[i].params.logprobs or 0
            pairs = (
                [(int(ids[j, n]), float(values[j, n])) for n in range(min(want, k))]
                if want and ids is not None
                else []
            )
            entries.append(TokenLogprob(int(tokens[i]), float(picked_h[j]), pairs))
        return tokens, entries


def _put_choice(pack: _Pack, rows: Sequence[SamplingState], which: list[int], vocab: int) -> None:
    """What :meth:`TorchSampler._choose_on` reads on the device for rows ``which``: their
    index (unless all rows), and when any samples, which are greedy and their cuts."""
    sub = rows if len(which) == len(rows) else [rows[i] for i in which]
    if len(sub) < len(rows):
        pack.add("which", np.asarray(which, dtype=np.int64))
    greedy = [r.params.temperature == 0.0 for r in sub]
    if all(greedy):
        return
    if any(greedy):
        pack.add("greedy", np.asarray(greedy, dtype=np.bool_))
    _put_cuts(pack, sub, vocab)


def _put_cuts(pack: _Pack, rows: Sequence[SamplingState], vocab: int) -> None:
    """What :meth:`TorchSampler.probabilities` reads on the device: the temperatures (a
    greedy row's 1), and each cut's rows and values (top-k's k, top-p, min-p)."""
    params = [r.params for r in rows]
    pack.add("temperature", np.asarray([p.temperature or 1.0 for p in params], np.float32))
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if cut:
        pack.add("cut", np.asarray(cut, dtype=np.int64))
        pack.add("k", np.asarray([params[i].top_k for i in cut], dtype=np.int64))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        pack.add("nucleus", np.asarray(nucleus, dtype=np.int64))
        pack.add("p", np.asarray([params[i].top_p for i in nucleus], dtype=np.float32))
    floor = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if floor:
        pack.add("floor", np.asarray(floor, dtype=np.int64))
        pack.add("m", np.asarray([params[i].min_p for i in floor], dtype=np.float32))


class _Pack:
    """A step's host arrays, sent to the device in one copy: laid end to end in one byte
    buffer (each at a multiple of 8 bytes, so every dtype's view of the device's copy is
    aligned), pinned on a CUDA device and copied ``non_blocking`` (a pageable copy waits
    for everything queued before it: the step's forward), then each array a view of the
    copy. The pinned buffer comes from torch's caching host allocator, which does not hand
    a block out again before the copies that read it are done, so a pipelined step's
    buffer is never overwritten by the step launched behind it."""

    __slots__ = ("_arrays", "_size")

    def __init__(self) -> None:
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}
        self._size = 0

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self._arrays[name] = (array, self._size)
        self._size += -(-array.nbytes // 8) * 8

    def sent(self, torch: Any, device: Any) -> dict[str, Any]:
        """Each array by name, a view of the device's copy (nothing sent when empty)."""
        if not self._arrays:
            return {}
        host = torch.empty(self._size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        buffer = host.numpy()
        for array, offset in self._arrays.values():
            buffer[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        copy = host.to(device, non_blocking=True)  # on the CPU: the buffer itself
        return {
            # numpy's dtype names are torch's for the five used (int64, int32, float32,
            # float64, bool)
            name: copy[offset : offset + array.nbytes]
            .view(getattr(torch, array.dtype.name))
            .view(array.shape)
            for name, (array, offset) in self._arrays.items()
        }


class Drawn:
    """One batch's choice on the device (:meth:`TorchSampler.draw`): the rows, those that
    failed their preparation (``bad``), the ids (``chosen``: -1 where a row failed) and what
    the host will read (``tensors``), until :meth:`host` brings it back.

    :meth:`copy_out` starts the copy early: on a CUDA device into pinned host memory,
    ``non_blocking``, with an event recorded after it, so :meth:`host` waits for this
    step's ids only, not for what was queued on the stream after it (the next step's
    forward); on the CPU the tensors are the host's already."""

    __slots__ = ("asked", "bad", "chosen", "error", "event", "live", "out", "rows", "tensors")

    def __init__(self, rows: Sequence[SamplingState]) -> None:
        self.rows = rows
        self.bad: dict[int, Exception] = {}
        self.asked: list[int] = []
        self.live: list[int] = []
        self.chosen: Any = None
        self.tensors: list[Any] = []
        self.error: Exception | None = None
        self.out: list[Any] | None = None
        self.event: Any = None

    def copy_out(self) -> None:
        if self.error is not None or not self.tensors or self.tensors[0].device.type != "cuda":
            return
        import torch

        try:
            self.out = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in self.tensors
            ]
            self.event = torch.cuda.Event()
            self.event.record()
        except Exception as exc:  # surfaces when the host asks (:meth:`host`)
            self.error = exc

    def host(self) -> list[np.ndarray]:
        """The tensors as host arrays (waiting for them: the step's one synchronisation)."""
        if self.out is not None:
            self.event.synchronize()
            return [t.numpy() for t in self.out]
        return [t.cpu().numpy() for t in self.tensors]


class _Stages:
    """The processed rows' edits, gathered on the host per stage as flat arrays (row, id,
    value), each stage applied to the batch by one indexed operation on the device."""

    def __init__(self) -> None:
        self.bias_rows: list[np.ndarray] = []
        self.bias_ids: list[np.ndarray] = []
        self.bias_values: list[np.ndarray] = []
        self.mask_rows: list[int] = []
        self.masks: list[np.ndarray] = []
        self.stop_rows: list[np.ndarray] = []
        self.stop_ids: list[np.ndarray] = []
        self.rep_rows: list[np.ndarray] = []
        self.rep_ids: list[np.ndarray] = []
        self.rep_values: list[np.ndarray] = []
        self.pen_rows: list[np.ndarray] = []
        self.pen_ids: list[np.ndarray] = []
        self.pen_values: list[np.ndarray] = []
        self.vocab = 0

    @classmethod
    def of(
        cls,
        rows: Sequence[SamplingState],
        generated: Sequence[int],
        vocab: int,
        bad: dict[int, Exception],
    ) -> _Stages:
        """The processed rows' edits; a row whose preparation raises recorded in ``bad``."""
        stages = cls()
        stages.vocab = vocab
        for i, row in enumerate(rows):
            if row.processed:
                try:
                    stages.add(i, row, generated[i], vocab)
                except Exception as exc:
                    bad[i] = exc
        return stages

    def put(self, pack: _Pack) -> None:
        """The stages' arrays into the step's :class:`_Pack` (those of stages some row has)."""
        if self.mask_rows:
            pack.add("mask_rows", np.asarray(self.mask_rows, dtype=np.int64))
            pack.add("mask_words", np.stack(self.masks).astype(np.int32, copy=False))
        for stage in ("bias", "stop", "rep", "pen"):
            rows = getattr(self, f"{stage}_rows")
            if not rows:
                continue
            ids = getattr(self, f"{stage}_ids")
            pack.add(f"{stage}_rows", np.concatenate(rows).astype(np.int64, copy=False))
            pack.add(f"{stage}_ids", np.concatenate(ids).astype(np.int64, copy=False))
            if stage != "stop":
                values = np.concatenate(getattr(self, f"{stage}_values"))
                pack.add(f"{stage}_values", values.astype(np.float32, copy=False))

    def applied(self, torch: Any, logits: Any, sent: dict[str, Any]) -> Any:
        """A copy of ``logits`` with the stages applied, in the host's order, from their
        arrays on the device (``sent``)."""
        out = logits.clone()
        if "bias_rows" in sent:
            where = (sent["bias_rows"], sent["bias_ids"])
            out.index_put_(where, sent["bias_values"], accumulate=True)
        if "mask_rows" in sent:
            which = sent["mask_rows"]
            allowed = _unpacked(torch, sent["mask_words"], self.vocab)
            out[which] = out.index_select(0, which).masked_fill(~allowed, float("-inf"))
        if "stop_rows" in sent:  # the value made on the device (no host tensor lifted)
            out.index_put_((sent["stop_rows"], sent["stop_ids"]), out.new_full((1,), float("-inf")))
        if "rep_rows" in sent:
            where, penalty = (sent["rep_rows"], sent["rep_ids"]), sent["rep_values"]
            values = out[where]
            out[where] = torch.where(values > 0, values / penalty, values * penalty)
        if "pen_rows" in sent:
            where = (sent["pen_rows"], sent["pen_ids"])
            out[where] = out[where] - sent["pen_values"]
        return out

    def add(self, i: int, state: SamplingState, generated: int, vocab: int) -> None:
        """Row ``i``'s edits (the host's ``_process``, as arrays); all or nothing."""
        p = state.params
        parts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray] | np.ndarray] = {}
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64)
            values = np.fromiter(p.logit_bias.values(), dtype=np.float32)
            keep = ids < vocab
            parts["bias"] = (ids[keep], values[keep])
        if state.constraint is not None:
            parts["mask"] = _bitmask(state.constraint, vocab)
        if generated < p.min_tokens and len(state.stop_ids):
            parts["stop"] = state.stop_ids[state.stop_ids < vocab]
        if state.counts is not None:
            out_ids = np.fromiter(state.counts.keys(), dtype=np.int64, count=len(state.counts))
            if p.repetition_penalty != 1.0:
                seen = (
                    np.union1d(state.prompt_ids, out_ids)
                    if state.prompt_ids is not None
                    else out_ids
                )
                seen = seen[seen < vocab]
                parts["rep"] = (
                    seen, np.full(len(seen), p.repetition_penalty, dtype=np.float32)
                )  # fmt: skip
            if len(out_ids) and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
                counts = np.fromiter(state.counts.values(), dtype=np.float32, count=len(out_ids))
                keep = out_ids < vocab
                values = p.frequency_penalty * counts[keep] + p.presence_penalty * (
                    counts[keep] > 0
                )
                parts["pen"] = (out_ids[keep], values.astype(np.float32))
        for stage, part in parts.items():
            if stage == "mask":
                self.mask_rows.append(i)
                self.masks.append(part)  # type: ignore[arg-type]
            elif stage == "stop":
                self.stop_rows.append(np.full(len(part), i, dtype=np.int64))
                self.stop_ids.append(part)  # type: ignore[arg-type]
            else:
                ids, values = part  # type: ignore[misc]
                getattr(self, f"{stage}_rows").append(np.full(len(ids), i, dtype=np.int64))
                getattr(self, f"{stage}_ids").append(ids)
                getattr(self, f"{stage}_values").append(values)


def _bitmask(constraint: Any, vocab: int) -> np.ndarray:
    """The grammar's allowed tokens as packed int32 words (bit ``t % 32`` of word ``t // 32``,
    llguidance's layout), ``ceil(vocab / 32)`` of them; from its ``bitmask()`` when it has one
    (llguidance's own words, nothing unpacked on the host), else packed from its bool mask."""
    words = (vocab + 31) // 32
    packed = getattr(constraint, "bitmask", None)
    if packed is not None:
        bits = np.asarray(packed(), dtype=np.int32).reshape(-1)
    else:
        allowed = np.asarray(constraint.mask(vocab), dtype=bool)[:vocab]
        bits = np.packbits(allowed, bitorder="little")
        bits = np.pad(bits, (0, (-len(bits)) % 4)).view(np.int32)
    if len(bits) >= words:
        return bits[:words]
    return np.pad(bits, (0, words - len(bits)))  # tokens past the grammar's vocabulary: banned


def _unpacked(torch: Any, words: Any, vocab: int) -> Any:
    """Packed int32 words ``[rows, words]`` (on the device) to bool ``[rows, vocab]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()
