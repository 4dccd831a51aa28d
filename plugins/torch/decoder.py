"""A safetensors folder's decoder in torch (:mod:`.decoder_model`), the device's answer to
the Plugin API's decoder (``plugins/decoding.py``): the module, its weights and the cache
tensors owned here, on a torch device (the CPU, or a CUDA card: the same code, ``device``
and ``dtype`` chosen at load). The server reaches it only through the device plugin's
:meth:`~plugserve.plugins.api.Plugin.load_decoder`.

Devices. The folder is served on ``TORCH`` (torch on the CPU) or ``GPU`` (CUDA; ``GPU.1`` is
``cuda:1``: the device plugin's own name and card); ``AUTO`` (the server's) takes the GPU
when the Core lists it, else the CPU. The other devices run graphs (ONNX, OpenVINO IR),
which a safetensors folder is not: their ``load_decoder`` refuses it (InvalidArgument). The
configuration is the device's (:mod:`.config`, one meaning of every key): the precision is
``INFERENCE_PRECISION_HINT`` (``f32``, ``bf16``, ``f16``; default ``f32`` on the CPU,
``bf16`` on a GPU, ``EXECUTION_MODE_HINT=ACCURACY`` f32); weights and the cache are both in
it, and the logits go to the engine in float32.

The engine's calls. The backend is :attr:`~plugserve.plugins.decoding.Decoder.mixed`: each
step's decoding rows and prompt chunks are one forward (:meth:`TorchDecoder.step`), as the paged
OpenVINO backend runs them, so the runner never arranges rows. The cache keeps the engine's slot
layout (``server/apps/generate/engine/kvcache.py``: a slot a row
``[kv_heads, capacity, head_dim]`` of
each layer's tensors), so prefix hits and ``n`` > 1 forks copy a slot's written positions on the
tensors' device.

The host tier (the engine's ``--kv-offloading-size``): :class:`TorchKVCache` copies whole
blocks of a slot to host numpy and back (the Plugin API's
:class:`~plugserve.plugins.decoding.HostBlocks`), so the engine keeps them without importing
torch. On a card the copy out goes to pinned host memory, queued on a side stream after the
steps queued before it, and the card's stream waits for it before its next write (the evicted
slot is about to be reused), so the host does not wait; a restore waits for the side stream's
copies, then copies in on the card's stream. On the CPU the same code copies in memory.

What crosses between the host and the device per step: the step's token ids, positions and
slots in (a few hundred bytes); the logits stay on the device, float32 ``[sequences,
vocab]`` torch tensors, and the engine's sampler is :class:`.sampler.TorchSampler`
(:meth:`TorchDecoder.new_sampler`), which chooses there and brings back the ids (and the
logprobs a request asked for). The cache's slots are the device's tensors: prefix-cache
copies, ``n`` > 1 forks and slot moves (:class:`TorchKVCache`) run on the device.

Threads: torch's own intra-op pool, all cores by default; ``INFERENCE_NUM_THREADS`` sets it
(``torch.set_num_threads``, the process's pool, so the last torch model loaded with the key
decides). On cores shared with other work, fewer is faster for a small model: the 12 prompts
of tests/generate/test_generate_torch.py on the 0.4 M-parameter tiny-llama took 10.8 s with
torch's 2 threads on 2 cores under a load average of 12 (steps of one shape from 2 ms to 1.6
s: a thread barrier waiting for a descheduled thread) and 1.0 s with 1.

CUDA graphs (:class:`DecodeGraphs`): on a CUDA device, a step made of decoding rows only runs
in one of a bounded set of shapes (batch padded up to the next of :data:`GRAPH_SIZES`, keys
read over the next power-of-two width), each captured as a graph after warm-up and replayed;
``CUDA_GRAPHS`` is the count of shapes kept captured, the least recently used dropped (the
device's key: GPU's default 8, 0 none); prompts and mixed steps run eagerly. On the CPU
(TORCH's default 0) the step is the plain eager one; ``CUDA_GRAPHS`` > 0 there runs the same
padded, static-buffer step eagerly (the CPU twin tests/generate/test_generate_torch_device.py
checks).

Errors: a torch error in a step (out of memory on the card, a CUDA error that is not sticky)
fails that step's sequences with InferenceError (ResourceExhausted for out-of-memory) and the
engine goes on; an asynchronous CUDA error that surfaces when the sampler fetches the ids fails
the step's rows there, with InferenceError. A sticky CUDA error (an illegal address, a
device-side assert: ``plugins/torch/devmem.py``'s STICKY) leaves the process's CUDA context
unusable: the step's sequences fail UNAVAILABLE, the device is marked failed (logged
CRITICAL), and every later step is refused UNAVAILABLE at once until the server restarts; the
engine itself keeps answering (its requests fail saying so). A graph whose capture fails
leaves that shape eager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import (
    Configuration,
    InferenceError,
    ResourceExhausted,
)
from plugserve.plugins.decoding import CacheLayout, MixedDecoder, StepSampler
from plugserve.plugins.torch import capture as graph_capture
from plugserve.plugins.torch import devmem
from plugserve.plugins.torch.backend import ieee_fp32
from plugserve.plugins.torch.config import DTYPES, GRAPHS_YES, precision
from plugserve.plugins.torch.decoder_model import (
    DecoderModel,
    KVTensors,
    ModelShape,
    safetensors_files,
    weight_bytes,
)
from plugserve.plugins.torch.sampler import TorchSampler

__all__ = ["TorchDecoder", "TorchKVCache", "check_model", "load_decoder"]

log = logging.getLogger(__name__)

#: decode batch sizes a CUDA graph is captured for (a batch runs in the next one up)
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: the fewest keys a captured decode step reads (its width doubles up to the capacity)
MIN_WIDTH = 128
#: the memory a load may take at most, of what the machine (or the card) has free
LOAD_SHARE = 0.9


class TorchKVCache:
    """The engine's slots (a :class:`~plugserve.plugins.decoding.Cache`) over
    :class:`KVTensors` (``arrays``: ``key.N`` / ``value.N`` -> the torch tensors); copies and
    swaps run on the tensors' device."""

    def __init__(self, layout: CacheLayout, rows: int, tensors: KVTensors) -> None:
        self.layout = layout
        self.rows = rows
        self.tensors = tensors
        self.arrays: dict[str, Any] = {}
        for i, (k, v) in enumerate(zip(tensors.keys, tensors.values)):
            self.arrays[f"key.{i}"] = k
            self.arrays[f"value.{i}"] = v

    @property
    def nbytes(self) -> int:
        return self.tensors.nbytes if self.tensors is not None else 0

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

    # --- host copies (the host tier's, :class:`~plugserve.plugins.decoding.HostBlocks`)

    def host_block_bytes(self, block_size: int) -> int:
        """The tensors' own element size (bf16's 2: the layout's dtype only matches it)."""
        return block_size * sum(t[0, :, 0].nbytes for t in self.arrays.values())

    def read_blocks(
        self, row: int, first_block: int, count: int, block_size: int
    ) -> list[np.ndarray]:
        """Blocks of ``row`` as host arrays (each block's bytes: every tensor's ``[kv_heads,
        block_size, head_dim]``, in ``arrays``' order): staged on the tensors' device in one
        copy per tensor, then one copy per block to the host (on a card: pinned memory, a
        side stream, nothing waited for; :class:`_SideCopy`)."""
        import torch

        tensors = list(self.arrays.values())
        sample = tensors[0]
        shape = (len(tensors), sample.shape[1], block_size, sample.shape[3])
        side = _SideCopy(sample.device) if sample.is_cuda else None
        pin = side is not None
        hosts = [torch.empty(shape, dtype=sample.dtype, pin_memory=pin) for _ in range(count)]
        with side if side is not None else contextlib.nullcontext():
            stage = torch.empty((count, *shape), dtype=sample.dtype, device=sample.device)
            for i, run in enumerate(self._runs(row, first_block, count, block_size)):
                stage[:, i] = run.transpose(0, 1)
            for host, block in zip(hosts, stage):
                host.copy_(block, non_blocking=pin)
        return [h.view(torch.uint8).numpy().reshape(-1) for h in hosts]

    def write_blocks(
        self, row: int, first_block: int, blocks: Sequence[np.ndarray], block_size: int
    ) -> None:
        import torch

        sample = next(iter(self.arrays.values()))
        if sample.is_cuda:  # the copies out of the card are done before their bytes are read
            _SideCopy(sample.device).stream.synchronize()
        count, entries = len(blocks), len(self.arrays)
        staged = torch.from_numpy(np.stack(blocks)).view(sample.dtype)
        staged = staged.reshape(count, entries, sample.shape[1], block_size, sample.shape[3])
        staged = staged.to(sample.device, non_blocking=True)
        for i, run in enumerate(self._runs(row, first_block, count, block_size)):
            run.copy_(staged[:, i].transpose(0, 1))

    def _runs(self, row: int, first: int, count: int, size: int) -> list[Any]:
        """Each tensor's positions of ``count`` blocks from ``first``: ``[heads, count, size,
        dim]`` views."""
        span = slice(first * size, (first + count) * size)
        return [t[row, :, span].unflatten(1, (count, size)) for t in self.arrays.values()]


class _SideCopy:
    """A card's side stream for the host tier's copies out (one per device): entered, the
    copies queued in it run after what the card's current stream holds; left, that stream
    waits for them (the evicted slot's next writes come after its bytes left)."""

    streams: dict[Any, Any] = {}

    def __init__(self, device: Any) -> None:
        import torch

        self.torch = torch
        self.current = torch.cuda.current_stream(device)
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        self.stream = self.streams[device]
        self._context: Any = None

    def __enter__(self) -> None:
        self.stream.wait_stream(self.current)
        self._context = self.torch.cuda.stream(self.stream)
        self._context.__enter__()

    def __exit__(self, *error: Any) -> None:
        self._context.__exit__(*error)
        self.current.wait_stream(self.stream)


class TorchDecoder(MixedDecoder):
    """The torch forward as the engine's decoder: one forward a step (:attr:`mixed`);
    decode steps can be pipelined (:attr:`pipelined`, :meth:`decode_ids`)."""

    pipelined = True

    def __init__(
        self, model: DecoderModel, layout: CacheLayout, graphs: int = 0, threads: int = 0
    ) -> None:  # no compiled network: the module is owned here
        self.model = model
        self.threads = threads
        self.layout = layout
        self.vocab = model.shape.vocab
        self.forwards = 0
        self.steps = 0
        self.device = model.device
        #: a step's tokens by default (Decoder.step_tokens): the LM head runs on each
        #: sequence's last token only, so a step's memory is its activations, and each step
        #: reads every weight once. On the CPU 512: an agent's turn (a tool call and its
        #: result, ~330 tokens) is one step, not 256 + 74 (the tier-on turn 0.89x the time),
        #: while streams decoding beside a long prompt wait 1.8x as long between two tokens
        #: (BENCHMARKS.md); on a card 2048, vLLM's OpenAI server's default
        self.step_tokens = 2048 if self.device.type == "cuda" else 512
        #: the decode shapes kept captured (CUDA_GRAPHS: on CUDA, graphs; on the CPU their
        #: static buffers run eagerly, the CPU twin CI tests); 0: decode steps run eagerly
        self.use_graphs = graphs
        self.graphs: DecodeGraphs | None = None
        self.dtype = model.dtype
        #: what :meth:`wake_up` reads the weights again from after a level-2 sleep: the
        #: folder and its config (``load_decoder`` sets it)
        self.source: tuple[Path, dict[str, Any]] | None = None
        #: a level-1 sleep on a card: each weight storage and its copy in pinned host memory
        self._offloaded: list[tuple[Any, Any]] = []

    @property
    def precision(self) -> str:
        return next(k for k, v in DTYPES.items() if v == str(self.dtype).split(".")[-1])

    # --- sleep and wake (:meth:`.engine.Engine.sleep`)

    def release_cache(self, cache: Any) -> None:
        """The cache's tensors dropped, and the decode graphs with them (they replay over
        the tensors' addresses; :meth:`restore_cache` makes both again)."""
        assert isinstance(cache, TorchKVCache)
        cache.tensors, cache.arrays = None, {}  # type: ignore[assignment]
        self.graphs = None  # its charges released with it (DecodeGraphs' finalizer)
        self._empty_cache()

    def restore_cache(self, cache: Any) -> None:
        assert isinstance(cache, TorchKVCache)
        fresh = self.new_cache(cache.rows)
        cache.tensors, cache.arrays = fresh.tensors, fresh.arrays

    def sleep(self, level: int) -> None:
        """Level 2: the weights dropped (:meth:`wake_up` reads them from the folder again).
        Level 1: on a card, each weight storage copied to pinned host memory and emptied on
        the card (``resize_(0)``: every view of it, the fused ``qkv`` and its parts, stays
        the same tensor and gets its memory back at wake); on the CPU the weights are host
        memory already and stay."""
        if level >= 2:
            self._restore_offloaded(into_device=False)
            self.model = None  # type: ignore[assignment]
        elif self.device.type == "cuda":
            self.offload()
        self._empty_cache()

    def offload(self) -> int:
        """Each weight storage copied to host memory (pinned on a card) and emptied where it
        was (``resize_(0)``); :meth:`wake_up` refills it. The bytes moved. Run on the CPU by
        the tests (a bf16 load's storages are torch's own: resizable)."""
        import torch

        if self._offloaded:
            return 0
        seen: set[int] = set()
        pin = self.device.type == "cuda"
        for tensor in _tensors_of(self.model):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.device != tensor.device:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(storage)
            self._offloaded.append((storage, host))
        if pin:
            torch.cuda.synchronize(self.device)
        for storage, _host in self._offloaded:
            storage.resize_(0)
        return sum(host.numel() for _storage, host in self._offloaded)

    def wake_up(self) -> None:
        if self.model is None:
            assert self.source is not None, "a torch decoder without its folder cannot wake"
            folder, config = self.source
            self.model = DecoderModel.load(folder, config, self.device, self.dtype)
        self._restore_offloaded(into_device=True)

    def _restore_offloaded(self, into_device: bool) -> None:
        for storage, host in self._offloaded:
            if into_device:
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage())
        self._offloaded.clear()

    def _empty_cache(self) -> None:
        """The caching allocator's free blocks back to the card (what ``nvidia-smi`` and the
        other processes see)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def new_cache(self, rows: int) -> TorchKVCache:
        extra = 1 if self.use_graphs else 0  # the scratch slot padded rows write into
        tensors = KVTensors(
            self.model.shape, rows + extra, self.layout.capacity, self.model.dtype, self.device
        )
        cache = TorchKVCache(self.layout, rows, tensors)
        if self.use_graphs:
            self.graphs = DecodeGraphs(self.model, tensors, scratch=rows, keep=self.use_graphs)
        return cache

    # --- the engine's calls

    def new_sampler(self, seed: int | None) -> TorchSampler:
        return TorchSampler(seed, self.device)

    def decode(self, cache: Any, rows: int, tokens: np.ndarray, lens: np.ndarray) -> Any:
        return self.step(cache, list(range(rows)), list(tokens), list(lens), [])[0]

    def step(
        self,
        cache: Any,
        rows: Sequence[int],
        tokens: Sequence[int],
        lens: Sequence[int],
        chunks: Sequence[tuple[int, int, Sequence[int]]],
    ) -> tuple[Any, Any]:
        """One forward: decoding ``rows`` (``tokens[i]`` at position ``lens[i]``) and prompt
        ``chunks`` (``(row, start, tokens)``); the logits of each decoding row and of each
        chunk's last token (float32 torch tensors on the decoder's device: the engine's
        sampler, :meth:`new_sampler`, chooses there). A step of decoding rows only builds
        its three arrays straight from the lists (no per-row ``arange``: 6 us a step at 32
        rows against 45 here)."""
        assert isinstance(cache, TorchKVCache), "the torch backend runs on its own cache"
        decoding = len(rows)
        if not chunks:  # decoding rows only (most steps): one token a row, no per-row arrays
            ids = np.array(tokens, dtype=np.int64)
            positions = np.array(lens, dtype=np.int64)
            slots = np.array(rows, dtype=np.int64)
            starts, counts, seq_rows = positions.tolist(), [1] * decoding, slots.tolist()
        else:
            seq_rows = [*map(int, rows), *(int(r) for r, _s, _c in chunks)]
            starts = [*map(int, lens), *(int(s) for _r, s, _c in chunks)]
            counts = [1] * decoding + [len(c) for _r, _s, c in chunks]
            ids = np.fromiter(
                (*map(int, tokens), *(int(t) for _r, _s, c in chunks for t in c)), np.int64
            )
            sizes = np.asarray(counts, dtype=np.int64)
            ends = np.cumsum(sizes)  # each sequence's positions: start .. start + count - 1
            positions = np.arange(ends[-1], dtype=np.int64) - np.repeat(
                ends - sizes - np.asarray(starts, dtype=np.int64), sizes
            )
            slots = np.repeat(np.asarray(seq_rows, np.int64), counts)
        if decoding and chunks:
            self.steps += 1
        self.forwards += 1
        logits = self._run(cache, ids, positions, slots, starts, counts, seq_rows, bool(chunks))
        return logits[:decoding], logits[decoding:]

    def bind_thread(self) -> None:
        """On a card, the calling thread's current CUDA device is the decoder's (``GPU.1``:
        its events and streams are ``cuda:1``'s, not the default card's)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)

    def launch(
        self,
        cache: Any,
        rows: Sequence[int],
        lens: Sequence[int],
        ids: np.ndarray | None,
        sampler: StepSampler,
        states: Sequence[Any],
        generated: Sequence[int],
        previous: Any = None,
        picks: Sequence[int] | None = None,
    ) -> Any:
        """A pipelined decode step (``server/apps/generate/engine/overlap.py``), on the device
        stream's thread: its ids ``ids``, or the ones ``previous`` (a :class:`.sampler.Drawn`)
        chose, gathered at ``picks`` on the device; the forward and the sampler's draw queued, the
        ids' copy to the host started (:meth:`.sampler.Drawn.copy_out`), nothing waited for."""
        import torch

        assert isinstance(sampler, TorchSampler), "a pipelined step draws on the device"
        with torch.inference_mode():
            inputs: Any = ids
            if previous is not None:
                chosen = previous.chosen
                if picks is not None:  # rows left: the ones going on, gathered there
                    index = torch.tensor(list(picks))
                    if chosen.device.type == "cuda":  # not a copy that waits for the card
                        index = index.pin_memory().to(chosen.device, non_blocking=True)
                    chosen = chosen[index]
                inputs = chosen.clamp(min=0)  # a failed row's -1: a wasted row
            logits = self.decode_ids(cache, rows, inputs, lens)
            drawn = sampler.draw(logits, states, generated)
            drawn.copy_out()
            return drawn

    def fetch(
        self, sampler: StepSampler, launched: Any, failures: dict[int, Exception]
    ) -> tuple[np.ndarray, list[Any]]:
        """A launched step's ids and logprobs on the host (the step's one wait)."""
        assert isinstance(sampler, TorchSampler), "a pipelined step draws on the device"
        return sampler.fetched(launched, failures)

    def decode_ids(self, cache: Any, rows: Sequence[int], ids: Any, lens: Sequence[int]) -> Any:
        """A decode step whose token ids are a tensor on the device already (the previous
        step's sampled ids: a pipelined step, ``server/apps/generate/engine/overlap.py``):
        ``rows[i]`` decodes ``ids[i]`` at position ``lens[i]``; its logits, as :meth:`step`'s
        decoding ones."""
        assert isinstance(cache, TorchKVCache), "the torch backend runs on its own cache"
        rows = [int(r) for r in rows]
        starts = [int(n) for n in lens]
        positions = np.asarray(starts, np.int64)
        self.forwards += 1
        return self._run(
            cache, ids, positions, np.asarray(rows, np.int64), starts, [1] * len(rows), rows,
            False,
        )  # fmt: skip

    def _run(
        self,
        cache: TorchKVCache,
        ids: Any,
        positions: np.ndarray,
        slots: np.ndarray,
        starts: list[int],
        counts: list[int],
        rows: list[int],
        prompts: bool,
    ) -> Any:
        import torch

        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # the process's pool: see the module's docstring
        devmem.refuse_failed(self.device, "the torch decoder's step")  # a sticky error before
        try:
            with torch.inference_mode():
                if self.graphs is not None and not prompts:
                    out = self.graphs.run(ids, positions, rows)
                    if out is not None:
                        return out
                device = self.device
                at = torch.from_numpy(positions).to(device)
                plan = self.model.plan(starts, counts, rows, at)
                if isinstance(ids, np.ndarray):
                    ids = torch.from_numpy(ids).to(device)
                return self.model.forward(
                    cache.tensors,
                    ids,
                    at,
                    torch.from_numpy(slots).to(device),
                    plan,
                )
        except torch.OutOfMemoryError as exc:
            raise ResourceExhausted(
                f"the torch decoder ran out of memory in a step: {exc}"
            ) from None
        except RuntimeError as exc:
            sticky = devmem.sticky_failure(exc, self.device, "the torch decoder's step")
            raise sticky or InferenceError(f"the torch decoder's step failed: {exc}") from None


class DecodeGraphs:
    """Decode steps (decoding rows only) run through static buffers of a bounded set of
    shapes, each a CUDA graph on a CUDA device; the same code eagerly on the CPU (its twin,
    which CI runs: no graph, the same padding, buffers and attention widths).

    A step of ``B`` rows whose furthest position is ``P`` runs in the shape ``(size, width)``:
    ``size`` the first of :data:`GRAPH_SIZES` >= ``B``, ``width`` the first power of two >=
    ``P + 1`` (at least :data:`MIN_WIDTH`, at most the cache's capacity): the keys each row
    reads, masked past its position. So the shapes are at most ``len(GRAPH_SIZES) x
    log2(capacity / MIN_WIDTH)``, and a row attends over at most twice the keys it has (a
    graph over the whole capacity would read every slot's full length each step). The
    rows are copied into the static ids/positions/rows tensors, padding rows decode token 0
    at position 0 of the ``scratch`` slot (a row no sequence holds, so nothing real is
    written), the graph replays, and the real rows' logits are copied out of its static
    output (the next replay overwrites it).

    Capture, per shape on first use (``plugins/torch/capture.py``: one capture at a time in
    the process, cuBLAS's workspaces cleared around it, on the model's device): two warm-up
    runs on the decoder's own capture stream (the allocator's blocks, the kernels' choices),
    then the capture there, into one memory pool shared by every shape (they replay one at a
    time), whose growth is charged to the device's memory budget (``plugins/torch/devmem.py``)
    while the graphs live. A capture that fails leaves that shape eager (logged); the step
    itself then runs eagerly and the engine goes on; one that ran out of memory is captured
    again after ``capture.RETRY_AFTER`` steps. More rows than the largest size: eager
    (None)."""

    def __init__(
        self,
        model: DecoderModel,
        tensors: KVTensors,
        scratch: int,
        capture: bool | None = None,
        keep: int = GRAPHS_YES,
    ) -> None:
        self.model = model
        self.tensors = tensors
        self.scratch = scratch
        self.capacity = int(tensors.keys[0].shape[2])
        #: CUDA graphs (a CUDA device), else the static-buffer step run eagerly
        self.capture = model.device.type == "cuda" if capture is None else capture
        #: the shapes made, least recently used first; at most ``keep`` (CUDA_GRAPHS)
        self.shapes: OrderedDict[tuple[int, int, bool], _Shape] = OrderedDict()
        self.keep = max(1, keep)
        #: the cache's rows: a step whose rows are 0..B-1 reads ``keys[:size]`` in place
        self.slots = int(tensors.keys[0].shape[0])
        self.pool: Any = None
        #: the capture stream, the decoder's own (made at the first capture)
        self.stream: Any = None
        #: shapes whose capture failed (out of memory: retried), and the budget's charges
        self.failures = graph_capture.RetryPolicy(len(GRAPH_SIZES) * 32)
        self._charges: list[Any] = []
        weakref.finalize(self, _release, self._charges)
        #: steps run through the static buffers, and of them CUDA graph replays
        self.runs = 0
        self.replays = 0
        self._staging: list[Any] = [None, None]
        self._turn = 0

    def shape_of(self, rows: int, furthest: int) -> tuple[int, int] | None:
        """``(size, width)`` a step of ``rows`` rows reaching position ``furthest`` runs in."""
        size = next((n for n in GRAPH_SIZES if n >= rows), None)
        if size is None or furthest >= self.capacity:
            return None
        width = MIN_WIDTH
        while width < furthest + 1:
            width *= 2
        return size, min(width, self.capacity)

    def _shape(self, key: tuple[int, int, bool]) -> _Shape | None:
        """The shape's static buffers (and graph), made at its first use; None: it runs
        eagerly (its capture failed, and no retry is due)."""
        self.failures.use()
        shape = self.shapes.get(key)
        if shape is not None:
            self.shapes.move_to_end(key)
        elif not self.failures.eager(key):
            shape = self._make(*key)
            if shape is not None:
                if len(self.shapes) >= self.keep:  # CUDA_GRAPHS' count: the oldest goes
                    self.shapes.popitem(last=False)
                self.shapes[key] = shape
        return shape

    def run(self, ids: np.ndarray, positions: np.ndarray, rows: list[int]) -> Any:
        """The logits of a decode step (float32 ``[len(rows), vocab]`` on the device), or
        None: no shape fits, run it eagerly."""
        fits = self.shape_of(len(rows), int(positions.max()))
        if fits is None:
            return None
        # rows 0..B-1 (the runner's arrangement: every synchronous step's, and a pipelined
        # step's unless a row before the last finished): the keys are read in place, not
        # gathered (the gather was 22-33 % of an H100's busy time a step, 2026-11-26);
        # padding rows then read rows B..size-1, whose logits are dropped
        front = fits[0] <= self.slots and list(rows) == list(range(len(rows)))
        key = (*fits, front)
        shape = self._shape(key)
        if shape is None:
            return None
        real = len(rows)
        padded = key[0] - real
        on_device = not isinstance(ids, np.ndarray)  # a pipelined step's: the last one's ids
        inputs = np.concatenate(
            [
                np.zeros(key[0], np.int64) if on_device else np.concatenate(
                    [ids, np.zeros(padded, np.int64)]
                ),
                np.concatenate([positions, np.zeros(padded, np.int64)]),
                np.concatenate([np.asarray(rows, np.int64), np.full(padded, self.scratch)]),
            ]
        )  # fmt: skip
        self._fill(shape.inputs, inputs)  # one copy in
        if on_device:
            shape.ids[:real].copy_(ids)  # device to device: no host round trip
        self.runs += 1
        if shape.graph is not None:
            shape.graph.replay()
            self.replays += 1
            out = shape.out
        else:
            out = shape.step()
        return out[:real].clone()

    def _fill(self, target: Any, inputs: np.ndarray) -> None:
        """``inputs`` into a shape's static tensor. On a card, through pinned host memory
        with ``non_blocking`` (a pageable copy would wait for every kernel queued before it:
        the previous step's, which a pipelined step runs behind); two pinned buffers in
        turn, so the one written was read by a step whose ids the host has waited for (its
        copy is done)."""
        import torch

        if target.device.type != "cuda":
            target.copy_(torch.from_numpy(inputs))
            return
        self._turn ^= 1
        staged = self._staging[self._turn]
        if staged is None or staged.numel() < inputs.size:
            staged = torch.empty(max(inputs.size, 3 * GRAPH_SIZES[-1]), dtype=torch.int64)
            self._staging[self._turn] = staged = staged.pin_memory()
        staged[: inputs.size].numpy()[:] = inputs
        target.copy_(staged[: inputs.size], non_blocking=True)

    def _make(self, size: int, width: int, front: bool) -> _Shape | None:
        import torch

        shape = _Shape(self.model, self.tensors, size, width, front)
        if not self.capture:
            return shape
        device = self.model.device
        try:
            with graph_capture.capturing(torch, device):
                if self.stream is None:
                    self.stream = graph_capture.new_stream(torch, device, self)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                stream, current = self.stream, torch.cuda.current_stream(device)
                shape.inputs[2 * size :].fill_(self.scratch)  # warm-ups write the scratch slot
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up outside the graph (allocations, kernels)
                        shape.step()
                try:  # thread_local (capture.capture's mode): the engine's loop thread may
                    # wait on an earlier step's event while the device stream's thread captures
                    captured = graph_capture.capture(torch, stream, shape.step, pool=self.pool)
                finally:  # the warm-ups' work before the steps after, failed or not
                    current.wait_stream(stream)
        except Exception as exc:  # the shape runs eagerly; the step goes on
            oom = graph_capture.out_of_memory(torch, exc)
            self.failures.failed((size, width), oom)
            log.warning(
                "CUDA graph capture of decode batch %d, width %d failed (%s: %s); that shape "
                "runs eagerly%s", size, width, type(exc).__name__, exc,
                f" (captured again after {graph_capture.RETRY_AFTER} steps)" if oom else "",
            )  # fmt: skip
            return None
        shape.graph, shape.out = captured.graph, captured.outputs
        if captured.nbytes:  # the shared pool's growth, charged while the graphs live
            card = torch.device("cuda", stream.device.index)  # (the plugin's key: cuda:N)
            memory = devmem.device_memory(torch, card)
            self._charges.append(memory.hold(captured.nbytes))
        return shape


def _tensors_of(model: DecoderModel) -> list[Any]:
    """Every tensor ``model`` holds: its weights and its own buffers (rotary frequencies)."""
    import torch

    found = [t for t in model.w.values() if isinstance(t, torch.Tensor)]
    return found + [t for t in vars(model).values() if isinstance(t, torch.Tensor)]


def _release(charges: list[Any]) -> None:
    """A :class:`DecodeGraphs`' charges, released when it goes (its graphs and pool with it)."""
    for charge in charges:
        charge.release()
    charges.clear()


class _Shape:
    """One decode shape's static tensors (ids, positions and rows in one int64 buffer, so one
    copy fills them) and its step over them (a CUDA graph's body, or the CPU twin's run)."""

    def __init__(
        self, model: DecoderModel, tensors: KVTensors, size: int, width: int, front: bool
    ) -> None:
        import torch

        self.model = model
        self.tensors = tensors
        self.size = size
        self.width = width
        self.front = front
        self.inputs = torch.zeros(3 * size, dtype=torch.int64, device=model.device)
        self.ids = self.inputs[:size]
        self.positions = self.inputs[size : 2 * size]
        self.rows = self.inputs[2 * size :]
        self.graph: Any = None
        self.out: Any = None

    def step(self) -> Any:
        plan = self.model.decode_plan(self.rows, self.positions, self.width, self.front)
        return self.model.forward(self.tensors, self.ids, self.positions, self.rows, plan)


def load_decoder(
    folder: Path,
    config: Mapping[str, Any],
    settings: Configuration,
    target: Any,
    capacity: int,
    kv_rows: Callable[[int], int],
) -> tuple[TorchDecoder, int, dict[str, Any]]:
    """The folder's decoder on the torch device ``target`` (the device plugin's, from its
    configuration ``settings``): ``(decoder, rows, report)``
    (:meth:`~plugserve.plugins.api.Plugin.load_decoder`).

    ``kv_rows(bytes_per_slot)`` gives the slots the engine's budget holds. The weights' and
    the cache's bytes are checked against the memory free on the device before either is
    allocated (ResourceExhausted naming both). The precision is the device's key, its
    default the decoder's own (bf16 on a card, f32 on the CPU; ACCURACY: f32)."""
    import torch

    chosen = precision(settings, "bf16" if target.type == "cuda" else "f32")
    dtype = getattr(torch, DTYPES[chosen])
    if chosen == "f32" and target.type == "cuda":  # IEEE float32 (no TF32), as GPU's f32
        ieee_fp32(torch)
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
    graphs = int(settings.get("CUDA_GRAPHS") or 0)
    needed = weights + (rows + bool(graphs)) * per_slot  # CUDA graphs' padding rows: a scratch slot
    free = _free_memory(target)
    if needed > free * LOAD_SHARE:
        raise ResourceExhausted(
            f"{folder}: the weights ({weights / 2**20:.0f} MiB in {chosen}) and "
            f"{rows} cache slots ({rows * per_slot / 2**20:.0f} MiB) need more than the "
            f"{free / 2**20:.0f} MiB free on {target} allows; lower KV_CACHE_BYTES, "
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
    decoder.source = (Path(folder), dict(config))
    report = {
        "precision": chosen,
        "torch_device": str(target),
        "weights_bytes": weights,
        "load_seconds": seconds,
    }
    log.info(
        "torch decoder %s: %s weights (%.1f MiB, %s) read to %s in %.2f s",
        folder, shape.family, weights / 2**20, chosen, target, seconds,
    )  # fmt: skip
    return decoder, rows, report


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
