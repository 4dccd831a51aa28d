"""The OpenVINO IR of a decoder on OPENVINO, in openvino's paged-attention form: every step's
decoding rows and prompt chunks in one forward.

Why this form. optimum-intel's IR is stateful: the key/value cache lives in the model's
variables, one dense tensor per layer whose rows all have one length, so it cannot batch
sequences of different lengths, which is all continuous batching does. The OPENVINO plugin
rewrites it at load (``PAGED_ATTENTION=YES``, :mod:`plugserve.plugins.openvino.paged`) into
the form openvino-genai's ``ContinuousBatchingPipeline`` runs: the tokens of any number of
sequences one after the other, each sequence's ``past_lens`` and its list of cache blocks
(``block_indices``), and the cache as ``[blocks, kv_heads, block_size, head_dim]`` inputs per
layer that the ``PagedAttentionExtension`` op reads and writes in place. The CPU plugin fixes
``block_size`` (32) and the cache's element type (``KV_CACHE_PRECISION``: f32 under
ACCURACY; under PERFORMANCE what the CPU computes fastest, f16 on an AVX2 CPU, bf16 or u8
where it has them); this backend allocates what the compiled network declares.

Chosen by ``load_generative`` when the compiled network is in that form (:func:`is_paged`).

The engine's slots on blocks. The engine thinks in slots (:mod:`.kvcache`: one per sequence,
the whole context long). Here a slot is a contiguous run of ``ceil(capacity / block_size)``
blocks, its block table ``run * blocks_per_slot + 0, 1, 2...``, so nothing is gathered or
copied per step: the op writes each new token into its slot's block. The engine's moves of
slots are cheap: a swap of two rows trades their runs in a table (no data moves; the dense
backends copy the written columns; the mixed step below needs no arranging of rows at all),
and a copy (a prefix from another slot, ``n`` > 1 forks) copies the written blocks of each
layer's arrays. The cache arrays are bound to the infer request once (``infer_into`` keeps a
binding while the array is the same) and never move; the step's small inputs and its logits
live in buffers kept while their shapes repeat (every decode step), so a decode step binds
nothing new (12 bindings a step before: ~0.5 ms of 4 on the tiny test model).

One forward per step (:attr:`PagedDecoder.mixed`): the decoding rows (one token each) and
the prompt chunks (first or continuing) of a step are one list of sequences for the op, as
openvino-genai and vLLM run them; the logits come back for each sequence's last token only
(the plugin gathers those rows before the LM head, ``sampled_tokens_indices``).

The host tier (``--kv-offloading-size``, :mod:`..engine.kv_host_tier`): the engine's blocks
(16 positions by default) are not the cache's (32), so :meth:`PagedKVCache.read_blocks` and
:meth:`~PagedKVCache.write_blocks` copy positions: each engine block's run of positions within
the slot's run of blocks, one slice per array where the two kinds of block overlap. An f32,
f16 or bf16 cache keeps a position's keys and values on their own; a u8 one keeps scales and
zero points per block (keys by channel), so a position's bytes are not a slice of it: its
blocks are copied whole, scales and zero points with them, and the engine's block is then a
multiple of the cache's (:meth:`PagedKVCache.host_block_size`: 32 positions where 16 was
asked, logged).

Bounds: every array is the cache's (allocated once at load: ``rows x blocks_per_slot``
blocks per layer) or the step's own, sized by the step's tokens and sequences (at most
``max_num_batched_tokens`` and ``max_num_seqs``, the scheduler's bounds).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import CompiledNetwork, InvalidArgument, InvalidModel, Unsupported
from plugserve.server.apps.generate.backends.onnx import MixedDecoder
from plugserve.server.apps.generate.engine.kvcache import CacheLayout, KVCache, block_views, split
from plugserve.server.control.devices import parse_device

__all__ = ["PagedDecoder", "PagedKVCache", "PagedLayout", "is_paged", "serving_device"]

_CACHE = re.compile(r"(key|value)_cache\.(\d+)")
#: the inputs of the paged form besides the caches, and what the backend fills them with
_STEP_INPUTS = (
    "input_ids",
    "position_ids",
    "past_lens",
    "subsequence_begins",
    "block_indices",
    "block_indices_begins",
    "max_context_len",
)
_SAMPLED = "sampled_tokens_indices"


def is_paged(network: CompiledNetwork) -> bool:
    """Whether ``network`` is a decoder in openvino's paged-attention form."""
    names = {s.name for s in network.inputs}
    return "block_indices" in names and any(_CACHE.fullmatch(n) for n in names)


def serving_device(graph: Any, device: str, config: Mapping[str, Any]) -> tuple[str, dict]:
    """The device and device config an OpenVINO IR folder loads with: OPENVINO (what AUTO
    picks: only openvino runs an IR) in the paged-attention form; InvalidArgument for a
    device that cannot read an IR."""
    name = parse_device(device)
    if (
        name.kind == "AUTO"
        and "OPENVINO" not in name.excluded
        and (not name.children or any(c.kind == "OPENVINO" for c in name.children))
    ):
        device = "OPENVINO"
    elif name.kind != "OPENVINO":
        raise InvalidArgument(
            f"{graph}: an OpenVINO IR (optimum-intel's export) is served on OPENVINO, not "
            f"{device}; set the model's device to OPENVINO, or export the model to ONNX "
            "(optimum-cli export onnx) for the other devices"
        )
    return device, {"PAGED_ATTENTION": "YES", **config}


@dataclasses.dataclass(frozen=True)
class PagedLayout(CacheLayout):
    """The paged cache: each entry's array shape per block (``entries`` keep the engine's
    ``(input, output, heads, dim)``; paged caches have no output), and the bytes a block
    takes across every layer (u8 caches carry scales and zero points in the block)."""

    block_size: int = 32
    block_shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[np.dtype, ...] = ()

    @property
    def blocks_per_slot(self) -> int:
        return -(-self.capacity // self.block_size)

    @property
    def block_bytes(self) -> int:
        return sum(
            int(np.prod(shape)) * dtype.itemsize
            for shape, dtype in zip(self.block_shapes, self.dtypes)
        )

    @property
    def bytes_per_token(self) -> int:
        return -(-self.block_bytes // self.block_size)

    @property
    def bytes_per_slot(self) -> int:
        return self.block_bytes * self.blocks_per_slot


class PagedKVCache(KVCache):
    """The engine's slots as runs of blocks: ``arrays[name]`` is ``[rows x blocks_per_slot,
    *block shape]``, and row ``r``'s blocks start at ``runs[r] * blocks_per_slot``."""

    layout: PagedLayout

    def __init__(self, layout: PagedLayout, rows: int) -> None:  # no dense arrays: blocks
        self.layout = layout
        self.rows = rows
        self.per_slot = layout.blocks_per_slot
        self.block_size = layout.block_size
        self.arrays = {
            past: np.zeros((rows * self.per_slot, *shape), dtype)
            for (past, _o, _h, _d), shape, dtype in zip(
                layout.entries, layout.block_shapes, layout.dtypes
            )
        }
        #: each row's run of blocks (swaps trade runs; nothing moves)
        self.runs = np.arange(rows, dtype=np.int64)
        #: whether a position's bytes are no slice of a block: a u8 cache keeps scales and
        #: zero points per block (keys by channel, after the block's tokens; values after each
        #: token's dims), so its blocks are copied whole (:meth:`host_block_size`)
        self.quantized = any(
            dtype.kind in "iub" or shape[1] != self.block_size
            for shape, dtype in zip(layout.block_shapes, layout.dtypes)
        )

    def view(self, start: int, stop: int) -> dict[str, np.ndarray]:
        raise NotImplementedError("a paged cache has no dense view of its rows")

    def copy(self, src: int, dst: int, length: int) -> None:
        """The blocks holding the first ``length`` positions of row ``src`` into row
        ``dst``'s (a partly written last block is copied whole; what lies beyond ``length``
        is never read)."""
        if length <= 0 or src == dst:
            return
        count = -(-length // self.block_size)
        a = int(self.runs[src]) * self.per_slot
        b = int(self.runs[dst]) * self.per_slot
        for array in self.arrays.values():
            array[b : b + count] = array[a : a + count]

    def swap(self, a: int, length_a: int, b: int, length_b: int) -> None:
        self.runs[[a, b]] = self.runs[[b, a]]

    # --- host copies (the host tier's, :class:`~plugserve.plugins.decoding.HostBlocks`)

    def host_block_size(self, block_size: int) -> int:
        """The engine's block size the host copies serve, nearest ``block_size``: any for an
        f32, f16 or bf16 cache (positions are copied); for a u8 one, the least multiple of
        the cache's own block (32 positions) at least ``block_size``, since its blocks are
        copied whole, scales and zero points with them."""
        if not self.quantized:
            return block_size
        return -(-block_size // self.block_size) * self.block_size

    def _whole(self, block_size: int) -> int:
        """The cache's blocks in one engine block when blocks are copied whole (a u8 cache),
        0 when positions are copied; Unsupported where an engine block is not whole blocks."""
        if not self.quantized:
            return 0
        if block_size % self.block_size:
            raise Unsupported(
                f"the paged cache keeps scales and zero points in each block of "
                f"{self.block_size} positions (a u8 cache: keys by channel), so the host tier "
                f"copies whole blocks, and block_size {block_size} is not a multiple of "
                f"{self.block_size}"
            )
        return block_size // self.block_size

    def host_block_bytes(self, block_size: int) -> int:
        """A block's bytes packed as the dense cache packs them (each array's ``[heads,
        block_size, dim]``), or, for a u8 cache, the cache's whole blocks it spans, each
        array's after the other's."""
        whole = self._whole(block_size)
        if whole:
            return whole * self.layout.block_bytes
        return sum(h * block_size * d * t.itemsize for (h, d, t) in self._shapes())

    def read_blocks(
        self, row: int, first_block: int, count: int, block_size: int
    ) -> list[np.ndarray]:
        stage = np.empty((count, self.host_block_bytes(block_size)), np.uint8)
        whole = self._whole(block_size)
        if whole:
            for array, part in zip(self.arrays.values(), self._whole_parts(stage, whole)):
                start = int(self.runs[row]) * self.per_slot + first_block * whole
                part[...] = array[start : start + count * whole].reshape(part.shape)
            return split(stage)
        views = block_views(stage, self._shapes(), block_size)
        pieces = self._pieces(row, first_block, count, block_size)
        for array, view in zip(self.arrays.values(), views):
            for j, block, at, offset, n in pieces:
                view[j, :, at : at + n] = array[block, :, offset : offset + n]
        return split(stage)

    def write_blocks(
        self, row: int, first_block: int, blocks: Sequence[np.ndarray], block_size: int
    ) -> None:
        stage = np.stack(blocks)
        whole = self._whole(block_size)
        if whole:
            for array, part in zip(self.arrays.values(), self._whole_parts(stage, whole)):
                start = int(self.runs[row]) * self.per_slot + first_block * whole
                array[start : start + len(stage) * whole] = part.reshape(-1, *array.shape[1:])
            return
        views = block_views(stage, self._shapes(), block_size)
        pieces = self._pieces(row, first_block, len(blocks), block_size)
        for array, view in zip(self.arrays.values(), views):
            for j, block, at, offset, n in pieces:
                array[block, :, offset : offset + n] = view[j, :, at : at + n]

    def _whole_parts(self, stage: np.ndarray, whole: int) -> list[np.ndarray]:
        """``stage`` (``[blocks, bytes]``) seen as each array's ``whole`` cache blocks of every
        engine block, ``[blocks, whole, *block shape]`` in its element type (views)."""
        parts, offset = [], 0
        for array in self.arrays.values():
            size = whole * int(np.prod(array.shape[1:])) * array.itemsize
            part = stage[:, offset : offset + size].view(array.dtype)
            parts.append(part.reshape(len(stage), whole, *array.shape[1:]))
            offset += size
        return parts

    def _pieces(
        self, row: int, first: int, count: int, size: int
    ) -> list[tuple[int, int, int, int, int]]:
        """Where the engine's blocks ``first..first+count-1`` of ``row`` lie in the cache's
        blocks: ``(engine block, cache block, position in the engine block, position in the
        cache block, positions)`` for each piece where the two overlap."""
        base = int(self.runs[row]) * self.per_slot
        pieces = []
        position, stop = first * size, (first + count) * size
        while position < stop:
            within, offset = position % size, position % self.block_size
            n = min(size - within, self.block_size - offset, stop - position)
            block = base + position // self.block_size
            pieces.append((position // size - first, block, within, offset, n))
            position += n
        return pieces

    def _shapes(self) -> list[tuple[int, int, np.dtype]]:
        return [(s[0], s[2], t) for s, t in zip(self.layout.block_shapes, self.layout.dtypes)]


class PagedDecoder(MixedDecoder):
    """A paged-attention network: decode, prompt chunks and mixed steps as one forward each."""

    #: decoding rows and prompt chunks go in one forward (:meth:`step`)

    def __init__(self, network: CompiledNetwork, layout: PagedLayout, vocab: int) -> None:
        super().__init__(network, layout, vocab)
        self.layout: PagedLayout = layout
        self.sampled = _SAMPLED in self.specs
        logits = next(s for s in network.outputs if s.name == "logits")
        self.logits_dtype = np.dtype(logits.dtype or np.float32)
        self.step_dtypes = {name: self.specs[name].dtype for name in _STEP_INPUTS}
        if self.sampled:
            self.step_dtypes[_SAMPLED] = self.specs[_SAMPLED].dtype
        #: the step's inputs and logits, kept while their shapes repeat (decode steps do):
        #: the request keeps a binding to an array whose memory and shape are unchanged
        self._buffers: dict[str, np.ndarray] = {}
        self.steps = 0  # forwards that held decoding rows and prompt chunks together

    @classmethod
    def create(
        cls, network: CompiledNetwork, config: Mapping[str, Any], capacity: int
    ) -> PagedDecoder:
        """The backend for ``network`` with slots of ``capacity`` tokens (InvalidModel for an
        input it does not know how to fill, or a cache it cannot hold)."""
        specs = {s.name: s for s in network.inputs}
        caches = sorted(
            (int(m.group(2)), m.group(1) == "value", name)
            for name in specs
            if (m := _CACHE.fullmatch(name))
        )
        unknown = sorted(
            set(specs) - set(_STEP_INPUTS) - {_SAMPLED} - {name for *_k, name in caches}
        )
        missing = [n for n in _STEP_INPUTS if n not in specs]
        if unknown or missing:
            raise InvalidModel(
                f"network {network.name}: a paged-attention decoder with inputs plugserve "
                f"does not fill ({unknown}) or without {missing}"
            )
        entries, shapes, dtypes = [], [], []
        block_size = None
        for _layer, is_value, name in caches:
            spec = specs[name]
            shape = spec.shape
            if (
                shape is None
                or len(shape) != 4
                or not all(isinstance(d, int) for d in shape[1:])
                or spec.dtype is None
            ):
                raise InvalidModel(
                    f"network {network.name}: cache input {name!r} has shape {shape}; "
                    "expected [blocks, kv_heads, block_size, head_dim] with all but the "
                    "first known"
                )
            heads, dim = shape[1], shape[3]
            if is_value and block_size is None:
                # values are kept by token (u8 ones with their scales after each token's
                # dims): the third axis is the block's tokens (keys in u8 are by channel,
                # their scales and zero points after the tokens)
                block_size = shape[2]
            entries.append((name, "", heads, dim))
            shapes.append(tuple(shape[1:]))
            dtypes.append(np.dtype(spec.dtype))
        if not entries or block_size is None or block_size < 1:
            raise InvalidModel(f"network {network.name}: no key_cache.N/value_cache.N inputs")
        layout = PagedLayout(
            tuple(entries),
            dtypes[0],
            capacity,
            block_size=block_size,
            block_shapes=tuple(shapes),
            dtypes=tuple(dtypes),
        )
        logits = next((s for s in network.outputs if s.name == "logits"), None)
        if logits is None:
            raise InvalidModel(f"network {network.name}: the decoder graph has no 'logits' output")
        vocab = (
            logits.shape[-1]
            if logits.shape and isinstance(logits.shape[-1], int)
            else int(config.get("vocab_size", 0))
        )
        return cls(network, layout, vocab)

    def new_cache(self, rows: int) -> PagedKVCache:
        return PagedKVCache(self.layout, rows)

    # --- the engine's calls

    def decode(self, cache: KVCache, rows: int, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
        ones = np.ones(rows, np.int64)
        return self._forward(cache, np.arange(rows), np.asarray(lens), ones, np.asarray(tokens))

    def step(
        self,
        cache: KVCache,
        rows: Sequence[int],
        tokens: Sequence[int],
        lens: Sequence[int],
        chunks: Sequence[tuple[int, int, Sequence[int]]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """One forward: decoding ``rows`` (``tokens[i]`` at position ``lens[i]``) and prompt
        ``chunks`` (``(row, start, tokens)``); the logits of each decoding row and of each
        chunk's last token."""
        decoding = len(rows)
        starts = np.fromiter(
            (*lens, *(s for _r, s, _c in chunks)), np.int64, decoding + len(chunks)
        )
        counts = np.ones(len(starts), np.int64)
        pieces = [np.asarray(tokens, np.int64)]
        for i, (_row, _start, chunk) in enumerate(chunks):
            counts[decoding + i] = len(chunk)
            pieces.append(np.asarray(chunk, np.int64))
        which = np.fromiter((*rows, *(r for r, _s, _c in chunks)), np.int64, len(starts))
        if decoding and chunks:
            self.steps += 1
        logits = self._forward(cache, which, starts, counts, np.concatenate(pieces))
        return logits[:decoding], logits[decoding:]

    # --- the forward

    def _forward(
        self,
        cache: KVCache,
        rows: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        ids: np.ndarray,
    ) -> np.ndarray:
        """Sequences in ``rows``, each ``counts[i]`` tokens (``ids``, one after the other)
        written from position ``starts[i]``; the logits of each one's last token."""
        assert isinstance(cache, PagedKVCache), "the paged backend runs on its own cache"
        seqs = len(rows)
        ends = starts + counts
        begins = np.zeros(seqs + 1, np.int64)
        np.cumsum(counts, out=begins[1:])
        total = int(begins[-1])
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - begins[:-1], counts)
        blocks = (ends + cache.block_size - 1) // cache.block_size
        block_begins = np.zeros(seqs + 1, np.int64)
        np.cumsum(blocks, out=block_begins[1:])
        first_block = cache.runs[rows] * cache.per_slot
        block_indices = np.arange(int(block_begins[-1]), dtype=np.int64) + np.repeat(
            first_block - block_begins[:-1], blocks
        )
        last = begins[1:] - 1
        values: dict[str, Any] = {
            "input_ids": self._filled("input_ids", ids),
            "position_ids": self._filled("position_ids", positions),
            "past_lens": self._filled("past_lens", starts),
            "subsequence_begins": self._filled("subsequence_begins", begins),
            "block_indices": self._filled("block_indices", block_indices),
            "block_indices_begins": self._filled("block_indices_begins", block_begins),
            "max_context_len": self._filled("max_context_len", ends.max()),
        }
        outputs: dict[str, np.ndarray] = {}
        if self.sampled:
            values[_SAMPLED] = self._filled(_SAMPLED, last)
            outputs["logits"] = self._buffer("logits", (seqs, 1, self.vocab), self.logits_dtype)
        values.update(cache.arrays)
        self.forwards += 1
        out = self.request.infer_into(self._arrays(values), outputs)
        logits = self._logits(out)
        logits = logits.reshape(logits.shape[0], -1)  # [seqs or tokens, 1, vocab] -> 2-D
        return logits if self.sampled else logits[last]

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The kept array for ``name`` when it has this shape, else a new one kept instead."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != shape:
            buffer = self._buffers[name] = np.empty(shape, dtype)
        return buffer

    def _filled(self, name: str, value: Any) -> np.ndarray:
        value = np.asarray(value)
        buffer = self._buffer(name, value.shape, self.step_dtypes[name])
        buffer[...] = value
        return buffer
