"""A safetensors folder's decoder in torch (:mod:`.torch_model`), as the engine's backend: the
module, its weights and the cache tensors owned here, on a torch device (the CPU, or a CUDA
card: the same code, ``device`` and ``dtype`` chosen at load).

Devices. The folder is served on ``TORCH`` (torch on the CPU) or ``GPU`` (CUDA; ``GPU.1`` is
``cuda:1``); ``AUTO`` takes the GPU when torch sees one, else the CPU. The other devices run
graphs (ONNX, OpenVINO IR), which a safetensors folder is not: InvalidArgument says so. The
precision is the device config's ``INFERENCE_PRECISION_HINT`` (``f32``, ``bf16``, ``f16``;
default ``f32`` on the CPU, ``bf16`` on a GPU); weights and the cache are both in it, and the
logits go to the engine in float32.

The engine's calls. The backend is :attr:`~.decoder.Decoder.mixed`: each step's decoding rows
and prompt chunks are one forward (:meth:`TorchDecoder.step`), as the paged OpenVINO backend
runs them, so the runner never arranges rows. The cache keeps the engine's slot layout
(:mod:`.kvcache`: a slot a row ``[kv_heads, capacity, head_dim]`` of each layer's tensors), so
prefix hits and ``n`` > 1 forks copy a slot's written positions on the tensors' device.

What crosses between the host and the device per step: the step's token ids, positions and
slots in (a few hundred bytes), and the float32 logits of each sequence's last token out
(``[sequences, vocab]``): the engine's sampler (:mod:`.sampler`) runs on the host, on numpy.
Sampling on the card (the issue's item 4) would bring only the chosen ids back.

Threads: torch's own intra-op pool, all cores by default; ``INFERENCE_NUM_THREADS`` sets it
(``torch.set_num_threads``, the process's pool, so the last torch model loaded with the key
decides). On cores shared with other work, fewer is faster for a small model: the 12 prompts
of tests/generate/test_generate_torch.py on the 0.4 M-parameter tiny-llama took 10.8 s with
torch's 2 threads on 2 cores under a load average of 12 (steps of one shape from 2 ms to 1.6
s: a thread barrier waiting for a descheduled thread) and 1.0 s with 1.

CUDA graphs (:class:`DecodeGraphs`): on a CUDA device, a step made of decoding rows only is
replayed from a graph captured for the next of a bounded set of batch sizes (the rows padded
with a scratch slot), when ``CUDA_GRAPHS`` is on; prompts and mixed steps run eagerly. On the
CPU nothing is captured.

Errors: a torch error in a step (out of memory on the card, a CUDA error) fails that step's
sequences with InferenceError (ResourceExhausted for out-of-memory) and the engine goes on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    InferenceError,
    InvalidArgument,
    ResourceExhausted,
)
from plugserve.plugins.configuration import BOOL, ConfigKey, Configuration
from plugserve.server.apps.generate.decoder import MixedDecoder
from plugserve.server.apps.generate.kvcache import CacheLayout, KVCache
from plugserve.server.apps.generate.torch_model import (
    DTYPES,
    DecoderModel,
    KVTensors,
    ModelShape,
    safetensors_files,
    weight_bytes,
)
from plugserve.server.control.devices import parse_device

__all__ = ["TorchConfig", "TorchDecoder", "TorchKVCache", "load_torch_decoder", "torch_device"]

log = logging.getLogger(__name__)

#: the device names that serve a safetensors folder (the torch device plugin's names)
CPU_DEVICE, GPU_DEVICE = "TORCH", "GPU"
#: decode batch sizes a CUDA graph is captured for (a batch runs in the next one up)
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: the memory a load may take at most, of what the machine (or the card) has free
LOAD_SHARE = 0.9


def _parse_precision(value: str) -> str:
    text = value.strip().lower()
    text = {"fp32": "f32", "float32": "f32", "bfloat16": "bf16", "fp16": "f16"}.get(text, text)
    if text and text not in DTYPES:
        raise ValueError(f"expected one of {', '.join(DTYPES)}")
    return text


class TorchConfig(Configuration):
    """The torch backend's device config keys (the others refused, as a device refuses)."""

    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "",
            _parse_precision,
            doc="f32, bf16 or f16: the weights' and the cache's precision (default f32 on the "
            "CPU, bf16 on a GPU)",
        ),
        ConfigKey(
            "CUDA_GRAPHS",
            True,
            **BOOL,
            doc="on a GPU, decode steps replayed from CUDA graphs captured per batch size",
        ),
    )


def torch_device(device: str) -> tuple[str, str]:
    """``(device name served, torch device)`` for a load on ``device``: TORCH is the CPU,
    GPU[.N] CUDA card N, AUTO the GPU when torch sees one; InvalidArgument for the others."""
    name = parse_device(device)
    if name.kind == "AUTO":
        import torch

        wanted = [c.kind for c in name.children] or [GPU_DEVICE, CPU_DEVICE]
        for kind in wanted:
            if kind in name.excluded:
                continue
            if kind == GPU_DEVICE and torch.cuda.is_available():
                return GPU_DEVICE, "cuda"
            if kind == CPU_DEVICE:
                return CPU_DEVICE, "cpu"
    elif name.kind == CPU_DEVICE:
        return device, "cpu"
    elif name.kind == GPU_DEVICE:
        import torch

        if not torch.cuda.is_available():
            raise InvalidArgument(
                f"device {device}: torch sees no CUDA device here; serve the folder on "
                f"{CPU_DEVICE} (torch on the CPU)"
            )
        index = int(name.ident) if name.ident.isdigit() else 0
        if index >= torch.cuda.device_count():
            raise InvalidArgument(
                f"device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
        return device, f"cuda:{index}"
    raise InvalidArgument(
        f"a safetensors folder (weights, not a graph) is served by the torch decoder on "
        f"{CPU_DEVICE} (the CPU) or {GPU_DEVICE} (CUDA), not {device}; set the model's device, "
        "or export the model to ONNX (optimum-cli export onnx) for the other devices"
    )


class TorchKVCache(KVCache):
    """The engine's slots over :class:`KVTensors` (``arrays``: ``key.N`` / ``value.N`` ->
    the torch tensors); copies and swaps run on the tensors' device."""

    def __init__(self, layout: CacheLayout, rows: int, tensors: KVTensors) -> None:
        self.layout = layout
        self.rows = rows
        self.tensors = tensors
        self.arrays = {}
        for i, (k, v) in enumerate(zip(tensors.keys, tensors.values)):
            self.arrays[f"key.{i}"] = k
            self.arrays[f"value.{i}"] = v

    @property
    def nbytes(self) -> int:
        return self.tensors.nbytes

    def view(self, start: int, stop: int) -> dict[str, Any]:
        return {name: t[start:stop] for name, t in self.arrays.items()}

    def copy(self, src: int, dst: int, length: int) -> None:
        if length <= 0 or src == dst:
            return
        for t in self.arrays.values():
            t[dst, :, :length] = t[src, :, :length]

    def swap(self, a: int, length_a: int, b: int, length_b: int) -> None:
        if a == b:
            return
        for t in self.arrays.values():
            keep = t[a, :, :length_a].clone()
            t[a, :, :length_b] = t[b, :, :length_b]
            t[b, :, :length_a] = keep


class TorchDecoder(MixedDecoder):
    """The torch forward as the engine's decoder: one forward a step (:attr:`mixed`)."""

    def __init__(
        self, model: DecoderModel, layout: CacheLayout, graphs: bool = True, threads: int = 0
    ) -> None:  # no compiled network: the module is owned here
        self.model = model
        self.threads = threads
        self.layout = layout
        self.vocab = model.shape.vocab
        self.forwards = 0
        self.steps = 0
        self.device = model.device
        self.use_graphs = graphs and model.device.type == "cuda"
        self.graphs: DecodeGraphs | None = None

    @property
    def precision(self) -> str:
        return next(k for k, v in DTYPES.items() if v == str(self.model.dtype).split(".")[-1])

    def new_cache(self, rows: int) -> TorchKVCache:
        # one more row on a GPU: the scratch slot padded graph rows write into
        extra = 1 if self.use_graphs else 0
        tensors = KVTensors(
            self.model.shape, rows + extra, self.layout.capacity, self.model.dtype, self.device
        )
        cache = TorchKVCache(self.layout, rows, tensors)
        if self.use_graphs:
            self.graphs = DecodeGraphs(self.model, tensors, scratch=rows)
        return cache

    # --- the engine's calls

    def decode(self, cache: KVCache, rows: int, tokens: np.ndarray, lens: np.ndarray) -> np.ndarray:
        return self.step(cache, list(range(rows)), list(tokens), list(lens), [])[0]

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
        chunk's last token (float32, on the host)."""
        assert isinstance(cache, TorchKVCache), "the torch backend runs on its own cache"
        decoding = len(rows)
        seq_rows = [*map(int, rows), *(int(r) for r, _s, _c in chunks)]
        starts = [*map(int, lens), *(int(s) for _r, s, _c in chunks)]
        counts = [1] * decoding + [len(c) for _r, _s, c in chunks]
        ids = np.fromiter(
            (*map(int, tokens), *(int(t) for _r, _s, c in chunks for t in c)), np.int64
        )
        positions = np.concatenate(
            [np.arange(s, s + c, dtype=np.int64) for s, c in zip(starts, counts)]
        )
        slots = np.repeat(np.asarray(seq_rows, np.int64), counts)
        if decoding and chunks:
            self.steps += 1
        self.forwards += 1
        logits = self._run(cache, ids, positions, slots, starts, counts, seq_rows, bool(chunks))
        return logits[:decoding], logits[decoding:]

    def _run(
        self,
        cache: TorchKVCache,
        ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        starts: list[int],
        counts: list[int],
        rows: list[int],
        prompts: bool,
    ) -> np.ndarray:
        import torch

        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # the process's pool: see the module's docstring
        try:
            with torch.inference_mode():
                if self.graphs is not None and not prompts:
                    out = self.graphs.run(ids, positions, rows)
                    if out is not None:
                        return out
                device = self.device
                at = torch.from_numpy(positions).to(device)
                plan = self.model.plan(starts, counts, rows, at)
                logits = self.model.forward(
                    cache.tensors,
                    torch.from_numpy(ids).to(device),
                    at,
                    torch.from_numpy(slots).to(device),
                    plan,
                )
                return logits.cpu().numpy()
        except torch.OutOfMemoryError as exc:
            raise ResourceExhausted(
                f"the torch decoder ran out of memory in a step: {exc}"
            ) from None
        except RuntimeError as exc:
            raise InferenceError(f"the torch decoder's step failed: {exc}") from None


class DecodeGraphs:
    """CUDA graphs of the decode step for :data:`GRAPH_SIZES` batch sizes, captured on first
    use of each size: the step's ids, positions and rows copied into static tensors, the
    graph replayed, the logits of the real rows copied out. Padding rows decode a token in
    the scratch slot (``scratch``: a row no sequence holds) at position 0.

    A skeleton for the GPU (issue 51's item 3): the mask and gather of the eager forward run
    inside the graph over a fixed width (the cache's capacity), so a captured step attends
    over the whole slot, masked; prompts and mixed steps stay eager."""

    def __init__(self, model: DecoderModel, tensors: KVTensors, scratch: int) -> None:
        self.model = model
        self.tensors = tensors
        self.scratch = scratch
        self.graphs: dict[int, tuple[Any, dict[str, Any], Any]] = {}

    def run(self, ids: np.ndarray, positions: np.ndarray, rows: list[int]) -> np.ndarray | None:
        """The logits of a decode step from a graph, or None (no size fits: run eagerly)."""
        import torch

        size = next((n for n in GRAPH_SIZES if n >= len(rows)), None)
        if size is None:
            return None
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, static, out = self.graphs[size]
        real = len(rows)
        static["ids"][:real].copy_(torch.from_numpy(ids), non_blocking=True)
        static["ids"][real:].zero_()
        static["positions"][:real].copy_(torch.from_numpy(positions), non_blocking=True)
        static["positions"][real:].zero_()
        static["rows"][:real].copy_(torch.as_tensor(rows), non_blocking=True)
        static["rows"][real:].fill_(self.scratch)
        graph.replay()
        return out[:real].cpu().numpy()

    def _capture(self, size: int) -> tuple[Any, dict[str, Any], Any]:
        import torch

        device = self.model.device
        static = {
            "ids": torch.zeros(size, dtype=torch.int64, device=device),
            "positions": torch.zeros(size, dtype=torch.int64, device=device),
            "rows": torch.full((size,), self.scratch, dtype=torch.int64, device=device),
        }
        capacity = self.tensors.keys[0].shape[2]

        def step() -> Any:
            plan = self.model.decode_plan(static["rows"], static["positions"], capacity)
            return self.model.forward(
                self.tensors, static["ids"], static["positions"], static["rows"], plan
            )

        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (cuBLAS workspaces, allocations)
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        return graph, static, out


def load_torch_decoder(
    folder: Path,
    config: Mapping[str, Any],
    device: str,
    device_config: Mapping[str, Any],
    capacity: int,
    kv_rows: Any,
) -> tuple[TorchDecoder, int, str, dict[str, Any]]:
    """The folder's decoder on ``device``: ``(decoder, rows, served device, report)``.

    ``kv_rows(bytes_per_slot)`` gives the slots the engine's budget holds. The weights' and
    the cache's bytes are checked against the memory free on the device before either is
    allocated (ResourceExhausted naming both)."""
    import torch

    settings = TorchConfig(dict(device_config))
    served, where = torch_device(device)
    target = torch.device(where)
    precision = settings.get("INFERENCE_PRECISION_HINT") or (
        "bf16" if target.type == "cuda" else "f32"
    )
    dtype = getattr(torch, DTYPES[precision])
    shape = ModelShape.from_config(dict(config), str(folder / "config.json"))
    itemsize = torch.empty((), dtype=dtype).element_size()
    layout = CacheLayout(
        tuple(
            (f"{kind}.{layer}", "", shape.kv_heads, shape.head_dim)
            for layer in range(shape.layers)
            for kind in ("key", "value")
        ),
        np.dtype(np.float32 if itemsize == 4 else np.float16),  # the element's size only
        capacity,
    )
    per_slot = layout.bytes_per_slot
    rows = int(kv_rows(per_slot))
    weights = weight_bytes(safetensors_files(folder), itemsize)
    graphs = bool(settings.get("CUDA_GRAPHS")) and target.type == "cuda"
    needed = weights + (rows + graphs) * per_slot  # CUDA graphs' padding rows: a scratch slot
    free = _free_memory(target)
    if needed > free * LOAD_SHARE:
        raise ResourceExhausted(
            f"{folder}: the weights ({weights / 2**20:.0f} MiB in {precision}) and "
            f"{rows} cache slots ({rows * per_slot / 2**20:.0f} MiB) need more than the "
            f"{free / 2**20:.0f} MiB free on {served} allows; lower KV_CACHE_BYTES, "
            "MAX_NUM_SEQS or MAX_MODEL_LEN, or load in a smaller precision"
        )
    started = time.monotonic()
    model = DecoderModel.load(folder, dict(config), target, dtype)
    seconds = time.monotonic() - started
    decoder = TorchDecoder(
        model,
        layout,
        graphs=graphs,
        threads=int(settings.get("INFERENCE_NUM_THREADS") or 0),
    )
    report = {
        "precision": precision,
        "torch_device": str(target),
        "weights_bytes": weights,
        "load_seconds": seconds,
    }
    log.info(
        "torch decoder %s: %s weights (%.1f MiB, %s) read to %s in %.2f s",
        folder, shape.family, weights / 2**20, precision, target, seconds,
    )  # fmt: skip
    return decoder, rows, served, report


def _free_memory(device: Any) -> int:
    """Bytes free on ``device``: the card's free memory, or the machine's available memory."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_model(config: Mapping[str, Any], where: str) -> None:
    """InvalidModel when the torch forward does not compute this config's model."""
    ModelShape.from_config(dict(config), where)
