"""The decoder graph on its device: each forward's inputs built from token ids and the cache.

A backend per kind of graph, chosen at load from the graph itself (its inputs, outputs and
attention op), never from the model family's name:

``SharedBufferDecoder``
    Graphs whose attention is onnxruntime's ``GroupQueryAttention`` (onnxruntime-genai's model
    builder): the op reads each row's length from the attention mask (``seqlens_k``, right
    padding), computes the rotary positions itself, and writes the new keys and values at each
    row's own position of a buffer as long as the context. The cache rows are bound as both
    past and present (in place, nothing copied) on a device whose requests bind outputs (ORT);
    on the others the present each run returns is read back at the new positions only.
    The op refuses a batch of several rows with S > 1 tokens and a past, so continuing
    prefill chunks run one row at a time; first prompts run as one right-padded batch.

``ConcatDecoder``
    Graphs that concatenate past and new keys (optimum's export: ``past_key_values.N.*`` in,
    ``present.N.*`` out, ``position_ids`` an input). The batch's past is the rows' first
    ``L`` columns (``L`` the longest row; rows shorter than it are masked where they have no
    token), copied into one array for the run (the graph copies it again into its present:
    the copy is the graph's design, bounded by the longest row, not the context), and the new
    token's keys and values are written back at each row's own position.

``PagedDecoder`` (:mod:`.openvino`)
    optimum-intel's OpenVINO IR, loaded on OPENVINO in openvino's paged-attention form: the
    cache in blocks, a slot a run of them, and each step's decoding rows and prompt chunks
    in one forward (:attr:`Decoder.mixed`, :meth:`PagedDecoder.step`).

Every forward takes rows of the cache (``SlotTable`` rows) and returns float32 logits of the
last position of each row's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins import decoding
from plugserve.plugins.api import CompiledNetwork, InvalidModel
from plugserve.plugins.sampling import Sampler
from plugserve.server.apps.generate.engine.kvcache import CacheLayout, KVCache

__all__ = ["ConcatDecoder", "Decoder", "MixedDecoder", "SharedBufferDecoder", "choose_decoder"]

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")
#: inputs a decoder graph may have besides the ids, mask, positions and cache, and their value
_CONSTANT_INPUTS = {"use_cache_branch": np.array([True])}


class Decoder(decoding.Decoder):
    """One decoder graph compiled on a device, run from the engine's one thread (the Plugin
    API's :class:`~plugserve.plugins.decoding.Decoder` over a compiled network)."""

    def __init__(self, network: CompiledNetwork, layout: CacheLayout, vocab: int) -> None:
        self.network = network
        self.layout = layout
        self.vocab = vocab
        self.request = network.create_infer_request()
        self.specs = {s.name: s for s in network.inputs}
        self.order = [s.name for s in network.inputs]
        self.ids_dtype = self.specs["input_ids"].dtype
        mask = self.specs.get("attention_mask")
        self.mask_dtype = mask.dtype if mask is not None else np.dtype(np.int64)
        positions = self.specs.get("position_ids")
        self.positions_dtype = positions.dtype if positions is not None else None
        self.binds = bool(self.request.binds_outputs)
        logits = next((s for s in network.outputs if s.name == "logits"), None)
        self.logits_dtype = logits.dtype if logits is not None else np.dtype(np.float32)
        self._logits_buffer: np.ndarray | None = None
        self.forwards = 0  # runs made (for stats)

    def new_cache(self, rows: int) -> KVCache:
        """The cache this backend reads and writes, ``rows`` slots (a backend whose graph
        keeps its cache itself, as a stateful OpenVINO IR, returns one whose ``view``,
        ``copy`` and ``swap`` move rows of the model's variable states instead)."""
        return KVCache(self.layout, rows)

    # --- sleep and wake (:meth:`.engine.Engine.sleep`), on the engine's loop thread

    def release_cache(self, cache: KVCache) -> None:
        """``cache``'s memory freed (its arrays emptied; :meth:`restore_cache` makes them
        again): the object stays, since the engine's slot table and runner hold it."""
        cache.arrays = {n: np.empty((0, *a.shape[1:]), a.dtype) for n, a in cache.arrays.items()}

    def restore_cache(self, cache: KVCache) -> None:
        """``cache``'s memory again, as :meth:`new_cache` makes it (zeros)."""
        vars(cache).update(vars(self.new_cache(cache.rows)))

    def sleep(self, level: int) -> None:
        """Release the weights as ``level`` says. A graph compiled on a device keeps its
        weights inside the compiled network, which cannot be offloaded: level 1 frees the
        cache only; level 2 closes the compiled network (its weights and the device's memory
        for it given back), which :meth:`wake_up` compiles again (docs/operations.md)."""
        if level >= 2 and self.reload is not None and self.network is not None:
            network, self.network, self.request = self.network, None, None  # type: ignore[assignment]
            network.close()

    def wake_up(self) -> None:
        """The weights back after :meth:`sleep`: the graph compiled again, a new request."""
        if self.network is None and self.reload is not None:
            self.network = self.reload()
            self.request = self.network.create_infer_request()
            self.binds = bool(self.request.binds_outputs)

    def new_sampler(self, seed: int | None) -> Sampler:
        """The host's sampler: a graph's logits come back as numpy arrays."""
        return Sampler(seed)

    def _feeds(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> dict[str, Any]:
        """A forward's token ids, mask and positions in the graph's dtypes; the positions
        only where the graph takes them (a GroupQueryAttention graph computes its own)."""
        feeds: dict[str, Any] = {
            "input_ids": ids.astype(self.ids_dtype, copy=False),
            "attention_mask": mask.astype(self.mask_dtype),
        }
        if self.positions_dtype is not None:
            feeds["position_ids"] = positions.astype(self.positions_dtype)
        return feeds

    def _prompt_feeds(self, chunks: Sequence[Sequence[int]]) -> tuple[dict[str, Any], np.ndarray]:
        """The feeds of first chunks (nothing cached), right-padded into one batch, and each
        chunk's length."""
        ids, lengths = _right_padded(chunks, self.ids_dtype)
        count, width = ids.shape
        mask = np.arange(width)[None, :] < lengths[:, None]
        return self._feeds(ids, mask, np.tile(np.arange(width), (count, 1))), lengths

    def _chunk_feeds(self, start: int, chunk: Sequence[int]) -> dict[str, Any]:
        """The feeds of one row's chunk after its first ``start`` cached positions."""
        stop = start + len(chunk)
        ids = np.asarray([chunk], dtype=self.ids_dtype)
        return self._feeds(ids, np.ones((1, stop), bool), np.arange(start, stop)[None])

    def _arrays(self, values: dict[str, Any]) -> list[Any]:
        return [values.get(name, _CONSTANT_INPUTS.get(name)) for name in self.order]

    def _logits(self, out: dict[str, np.ndarray]) -> np.ndarray:
        logits = out["logits"]
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)


class MixedDecoder(Decoder, decoding.MixedDecoder):
    """A graph whose one forward takes a step's decoding rows and prompt chunks together
    (:attr:`Decoder.mixed`): OpenVINO's paged IR. ``first`` and ``extend`` are steps with
    chunks only."""


def _right_padded(
    chunks: Sequence[Sequence[int]], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(c) for c in chunks)
    ids = np.zeros((len(chunks), width), dtype)
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    for i, chunk in enumerate(chunks):
        ids[i, : len(chunk)] = chunk
    return ids, lengths


class _EveryPosition(Decoder):
    """Graphs whose forward returns the logits of every position it was given (both ONNX
    layouts): ``first`` and ``extend`` keep each row's last position's unless asked for all,
    here once; a backend says how it runs a batch of first chunks and one row's chunk."""

    prompt_logits = True
    #: the rows of one run are one view of the cache (bound in place): rows that are not
    #: consecutive run one at a time
    consecutive_rows = False

    def first(
        self,
        cache: KVCache,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        all_positions: bool = False,
    ) -> np.ndarray:
        rows = list(rows)
        if self.consecutive_rows and rows != list(range(rows[0], rows[0] + len(rows))):
            parts = [self.first(cache, [r], [c], all_positions) for r, c in zip(rows, chunks)]
            if not all_positions:
                return np.concatenate(parts)
            width = max(len(c) for c in chunks)  # rows of different widths: padded
            return np.concatenate(
                [np.pad(p, ((0, 0), (0, width - p.shape[1]), (0, 0))) for p in parts]
            )
        logits, lengths = self._first(cache, rows, chunks)
        return logits if all_positions else logits[np.arange(len(rows)), lengths - 1]

    def extend(
        self,
        cache: KVCache,
        row: int,
        start: int,
        chunk: Sequence[int],
        all_positions: bool = False,
    ) -> np.ndarray:
        logits = self._extend(cache, row, start, chunk)
        return logits if all_positions else logits[-1]

    def _first(
        self, cache: KVCache, rows: list[int], chunks: Sequence[Sequence[int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """First chunks written at ``rows`` in one run: every position's logits
        ``[rows, longest chunk, vocab]``, and each chunk's length."""
        raise NotImplementedError

    def _extend(self, cache: KVCache, row: int, start: int, chunk: Sequence[int]) -> np.ndarray:
        """``chunk`` written at ``start..`` of ``row``: its positions' logits ``[len, vocab]``."""
        raise NotImplementedError


class SharedBufferDecoder(_EveryPosition):
    """GroupQueryAttention graphs: per-row lengths in the mask, the cache rows bound in place."""

    consecutive_rows = True

    def _run(
        self,
        cache: KVCache,
        start: int,
        stop: int,
        feeds: dict[str, Any],
        new: list[tuple[int, int, int]],
    ) -> np.ndarray:
        """Run rows ``start..stop-1``; ``new``: (row, first position, count) written."""
        views = cache.view(start, stop)
        feeds.update(views)
        arrays = self._arrays(feeds)
        self.forwards += 1
        if self.binds:
            outputs = {present: views[past] for past, present, _h, _d in self.layout.entries}
            tokens = feeds["input_ids"].shape[1]
            if tokens == 1:  # a decode step's logits into one buffer: bound once
                outputs["logits"] = self._decode_logits(stop - start)
            out = self.request.infer_into(arrays, outputs)
        else:
            out = self.request.infer_checked(arrays)
            for past, present, _h, _d in self.layout.entries:
                value = out[present]
                target = cache.arrays[past]
                for row, first, count in new:
                    target[row, :, first : first + count] = value[
                        row - start, :, first : first + count
                    ]
        return self._logits(out)

    def _decode_logits(self, rows: int) -> np.ndarray:
        """Rows ``0..rows-1`` of one ``[rows, 1, vocab]`` buffer, grown when needed."""
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[0] < rows:
            buffer = self._logits_buffer = np.empty(
                (max(rows, 8), 1, self.vocab), self.logits_dtype
            )
        return buffer[:rows]

    def decode(self, cache: KVCache, rows: int, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
        width = int(lens.max()) + 1
        mask = np.arange(width)[None, :] <= lens[:, None]
        feeds = self._feeds(tokens.reshape(rows, 1), mask, lens.reshape(rows, 1))
        new = [(r, int(lens[r]), 1) for r in range(rows)]
        return self._run(cache, 0, rows, feeds, new)[:, 0, :]

    def _first(
        self, cache: KVCache, rows: list[int], chunks: Sequence[Sequence[int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        feeds, lengths = self._prompt_feeds(chunks)
        new = [(r, 0, len(c)) for r, c in zip(rows, chunks)]
        return self._run(cache, rows[0], rows[0] + len(rows), feeds, new), lengths

    def _extend(self, cache: KVCache, row: int, start: int, chunk: Sequence[int]) -> np.ndarray:
        feeds = self._chunk_feeds(start, chunk)
        return self._run(cache, row, row + 1, feeds, [(row, start, len(chunk))])[0]


class ConcatDecoder(_EveryPosition):
    """Graphs that concatenate past and new keys, with explicit positions (optimum's)."""

    def __init__(self, network: CompiledNetwork, layout: CacheLayout, vocab: int) -> None:
        super().__init__(network, layout, vocab)
        if self.positions_dtype is None:
            raise InvalidModel(
                f"network {network.name}: the decoder graph concatenates its cache but takes no "
                "position_ids; plugserve batches rows of different lengths, which needs them "
                "(export with optimum's text-generation-with-past task)"
            )

    def _run(self, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
        self.forwards += 1
        return self.request.infer_checked(self._arrays(feeds))

    def decode(self, cache: KVCache, rows: int, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
        width = int(lens.max())
        columns = np.arange(width + 1)[None, :]
        mask = (columns < lens[:, None]) | (columns == width)
        feeds = self._feeds(tokens.reshape(rows, 1), mask, lens.reshape(rows, 1))
        for past, _present, _h, _d in self.layout.entries:
            feeds[past] = np.ascontiguousarray(cache.arrays[past][:rows, :, :width])
        out = self._run(feeds)
        index = np.arange(rows)
        for past, present, _h, _d in self.layout.entries:
            cache.arrays[past][index, :, lens] = out[present][:, :, width]
        return self._logits(out)[:, 0, :]

    def _first(
        self, cache: KVCache, rows: list[int], chunks: Sequence[Sequence[int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        feeds, lengths = self._prompt_feeds(chunks)
        for past, _present, heads, dim in self.layout.entries:
            feeds[past] = np.zeros((len(chunks), heads, 0, dim), self.layout.dtype)
        out = self._run(feeds)
        for past, present, _h, _d in self.layout.entries:
            for i, row in enumerate(rows):
                cache.arrays[past][row, :, : lengths[i]] = out[present][i, :, : lengths[i]]
        return self._logits(out), lengths

    def _extend(self, cache: KVCache, row: int, start: int, chunk: Sequence[int]) -> np.ndarray:
        feeds = self._chunk_feeds(start, chunk)
        for past, _present, _h, _d in self.layout.entries:
            feeds[past] = np.ascontiguousarray(cache.arrays[past][row : row + 1, :, :start])
        out = self._run(feeds)
        for past, present, _h, _d in self.layout.entries:
            cache.arrays[past][row, :, start : start + len(chunk)] = out[present][0, :, start:]
        return self._logits(out)[0]


def _has_group_query_attention(graph: Path) -> bool:
    """Whether the ONNX graph's attention is onnxruntime's GroupQueryAttention (read without
    its external weights)."""
    import onnx

    try:
        model = onnx.load(str(graph), load_external_data=False)
    except Exception as exc:
        raise InvalidModel(f"{graph}: not a readable ONNX model ({exc})") from None
    return any(n.op_type == "GroupQueryAttention" for n in model.graph.node)


def cache_layout(
    network: CompiledNetwork, config: dict[str, Any], capacity: int, names: dict[str, str]
) -> CacheLayout:
    """The cache arrays the graph reads and writes, their heads and head size (from the
    graph's shapes, else the config's), and their element type."""
    inputs = {s.name: s for s in network.inputs}
    outputs = {s.name for s in network.outputs}
    key_template = names.get("past_key_names", "past_key_values.%d.key")
    value_template = names.get("past_value_names", "past_key_values.%d.value")
    present_key = names.get("present_key_names", "present.%d.key")
    present_value = names.get("present_value_names", "present.%d.value")
    layers = sorted({int(m.group(1)) for n in inputs if (m := _PAST.fullmatch(n))})
    if not layers and key_template % 0 not in inputs:
        raise InvalidModel(
            f"network {network.name}: the graph has no past_key_values.N.key/value inputs; "
            "a generative model needs a decoder exported with its cache (optimum's "
            "text-generation-with-past, onnxruntime-genai's model builder)"
        )
    if not layers:
        layers = list(range(sum(1 for n in inputs if n.startswith(key_template.split("%")[0]))))
    heads_config = config.get("num_key_value_heads") or config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    dim_config = config.get("head_dim") or (
        hidden // config["num_attention_heads"]
        if hidden and config.get("num_attention_heads")
        else None
    )
    entries = []
    dtype = None
    for layer in layers:
        for past_t, present_t in ((key_template, present_key), (value_template, present_value)):
            past, present = past_t % layer, present_t % layer
            if past not in inputs or present not in outputs:
                raise InvalidModel(
                    f"network {network.name}: cache input {past!r} has no output {present!r}"
                )
            spec = inputs[past]
            shape = spec.shape
            heads = shape[1] if len(shape) == 4 and isinstance(shape[1], int) else heads_config
            dim = shape[3] if len(shape) == 4 and isinstance(shape[3], int) else dim_config
            if not heads or not dim:
                raise InvalidModel(
                    f"network {network.name}: the heads and head size of {past!r} are neither "
                    "in the graph nor in config.json"
                )
            entries.append((past, present, int(heads), int(dim)))
            dtype = spec.dtype
    return CacheLayout(tuple(entries), np.dtype(dtype), capacity)


def choose_decoder(
    network: CompiledNetwork,
    graph: Path,
    kind: str,
    config: dict[str, Any],
    genai: dict[str, Any],
    capacity: int,
) -> Decoder:
    """The backend for this graph: shared buffers for GroupQueryAttention, else concat (a
    network in openvino's paged-attention form takes :mod:`.openvino`'s, which
    ``load_generative`` picks before this)."""
    names = genai.get("model", {}).get("decoder", {}) or {}
    templates = {**names.get("inputs", {}), **names.get("outputs", {})}
    layout = cache_layout(network, config, capacity, templates)
    missing = [
        s.name
        for s in network.inputs
        if s.name not in {"input_ids", "attention_mask", "position_ids"}
        and s.name not in _CONSTANT_INPUTS
        and s.name not in {e[0] for e in layout.entries}
    ]
    if missing or "input_ids" not in {s.name for s in network.inputs}:
        raise InvalidModel(
            f"network {network.name}: the decoder graph takes inputs plugserve does not know "
            f"how to fill: {missing or ['(no input_ids)']}"
        )
    if "logits" not in {s.name for s in network.outputs}:
        raise InvalidModel(f"network {network.name}: the decoder graph has no 'logits' output")
    logits = next(s for s in network.outputs if s.name == "logits")
    vocab = (
        logits.shape[-1]
        if logits.shape and isinstance(logits.shape[-1], int)
        else int(config.get("vocab_size", 0))
    )
    if kind == "genai" or (kind == "onnx" and _has_group_query_attention(graph)):
        return SharedBufferDecoder(network, layout, vocab)
    return ConcatDecoder(network, layout, vocab)
