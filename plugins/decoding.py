"""What a generative network asks of a device: the decoder the generation engine calls.

The engine (``server/apps/generate/``: its scheduler, runner and pipelined steps) holds a
:class:`Decoder` and nothing below it: a graph compiled on a device (ONNX on ORT or
OPENVINO, openvino's paged IR) or a module a device owns (a safetensors folder on TORCH or
GPU) both answer these calls, so the engine never asks which device runs the forward, and a
next accelerator plugs in by implementing them. Everything device-specific (the tensors'
library, the CUDA stream, the cache's memory) stays behind them.

The calls, one thread at a time (the engine's loop, or its device stream for a launched
step):

- the cache: :meth:`Decoder.new_cache` makes the slots (a :class:`Cache` of the decoder's
  :class:`CacheLayout`), and
  :meth:`~Decoder.release_cache` / :meth:`~Decoder.restore_cache` free and remake their
  memory around a sleep; a cache that also copies whole blocks of a slot to and from host
  memory (:class:`HostBlocks`) gets the engine's host tier (``--kv-offloading-size``);
- the forwards: :meth:`~Decoder.decode`, :meth:`~Decoder.first` and :meth:`~Decoder.extend`
  (every decoder), :meth:`~Decoder.step` (a :attr:`~Decoder.mixed` one: a step's decoding
  rows and prompt chunks in one forward);
- the choice: :meth:`~Decoder.new_sampler`, the sampler of this decoder's logits (where they
  are: the host's for numpy logits, the device's for its own tensors);
- a pipelined decode step (:attr:`~Decoder.pipelined`): :meth:`~Decoder.launch` runs the
  forward and the draw on the device stream's thread with the previous step's ids still on
  the device, :meth:`~Decoder.fetch` brings the chosen ids to the host later, and
  :meth:`~Decoder.bind_thread` makes that thread the device's;
- sleep and wake: :meth:`~Decoder.sleep` gives memory back, :meth:`~Decoder.wake_up` takes it
  again.

A call a decoder does not offer raises Unsupported (its flag says it never will be made).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from plugserve.plugins.base import CompiledNetwork
from plugserve.plugins.errors import Unsupported

__all__ = ["Cache", "CacheLayout", "Decoder", "HostBlocks", "MixedDecoder", "StepSampler"]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The decoder's cache arrays: ``(past input, present output, heads, head_dim)`` each,
    their element type, and the tokens a slot holds."""

    entries: tuple[tuple[str, str, int, int], ...]
    dtype: np.dtype
    capacity: int

    @property
    def bytes_per_token(self) -> int:
        return sum(h * d for _p, _o, h, d in self.entries) * self.dtype.itemsize

    @property
    def bytes_per_slot(self) -> int:
        return self.bytes_per_token * self.capacity


class Cache(Protocol):
    """The key/value slots a decoder reads and writes: ``rows`` slots of the layout's
    capacity, a slot a sequence's; the engine's slot table moves and copies their rows."""

    rows: int

    @property
    def nbytes(self) -> int:
        """The bytes the slots hold (the engine's memory report)."""
        ...

    def view(self, start: int, stop: int) -> dict[str, Any]:
        """Rows ``start..stop-1`` of each array, in place."""
        ...

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot ``src``'s first ``length`` positions into slot ``dst`` (a prefix hit, a fork)."""
        ...

    def swap(self, a: int, length_a: int, b: int, length_b: int) -> None:
        """Two slots' written positions exchanged (the runner's arrangement of rows)."""
        ...


@runtime_checkable
class HostBlocks(Protocol):
    """A cache's blocks copied to host memory and back: what the engine's host tier
    (``server/apps/generate/engine/kv_host_tier.py``) calls, so the tier keeps opaque host
    arrays and knows no layout (dense slots, paged blocks, a device's tensors). A block is
    ``block_size`` positions of one slot, every cache array's keys or values there (the
    engine's block, whatever the cache's own block size); block ``b`` is positions
    ``b * block_size`` up to the next block's.

    A cache implements it where a position's bytes can be copied on their own, or its own
    blocks whole (scales shared by a block's positions): such a cache also has
    ``host_block_size(block_size) -> int``, the engine's block size it serves nearest the one
    asked (a multiple of its own), which the engine then uses. Where it cannot,
    :meth:`host_block_bytes` raises Unsupported, saying why, and the engine runs without the
    tier."""

    def host_block_bytes(self, block_size: int) -> int:
        """The bytes one block takes in host memory (what the tier charges and bounds)."""
        ...

    def read_blocks(
        self, row: int, first_block: int, count: int, block_size: int
    ) -> list[np.ndarray]:
        """Blocks ``first_block..first_block+count-1`` of slot ``row`` copied to host memory,
        one array per block, each its own memory (the tier drops blocks one at a time). A
        device's copies may still be under way when it returns: the cache orders its later
        writes to the slot after them, and :meth:`write_blocks` waits for them."""
        ...

    def write_blocks(
        self, row: int, first_block: int, blocks: Sequence[np.ndarray], block_size: int
    ) -> None:
        """``blocks`` (what :meth:`read_blocks` gave, in order) into slot ``row``'s blocks
        ``first_block`` on."""
        ...


class StepSampler(Protocol):
    """The choice of each row's next token from a step's logits, as the engine calls it:
    ``(ids, logprobs)``, a row whose choice raised left in ``failures``."""

    def __call__(
        self,
        logits: Any,
        rows: Sequence[Any],
        generated: Sequence[int],
        failures: dict[int, Exception] | None = None,
    ) -> tuple[np.ndarray, list[Any]]: ...


class Decoder(abc.ABC):
    """A generative network on its device, as the engine drives it (the module's docstring).
    Its ``layout`` is the cache's (its bytes per slot size the engine's budget), ``vocab``
    the logits' width, ``forwards`` the runs made (for stats)."""

    layout: CacheLayout
    vocab: int
    forwards: int = 0

    #: whether a step may hold several sequences (False: the warm-up and the scheduler run
    #: one sequence at a time)
    batches = True

    #: whether ``first`` and ``extend`` take ``all_positions=True`` and then return the
    #: logits of every position of each chunk (a prompt's logprobs)
    prompt_logits = False

    #: whether one forward runs a step's decoding rows and prompt chunks (:meth:`step`): the
    #: engine then makes one call a step instead of decode, first and extend
    mixed = False

    #: whether a decode step can be launched with the previous step's sampled ids still on
    #: the device and its outcome fetched later (:meth:`launch`, :meth:`fetch`)
    pipelined = False

    #: the tokens one step computes when the model's config and the server set none
    #: (MAX_NUM_BATCHED_TOKENS 0): a graph's step returns every computed position's logits,
    #: so it holds this many x the vocabulary x 4 bytes of them (256 x 152k: 155 MB); a
    #: decoder whose forward returns each sequence's last token's only may take more tokens
    #: in one pass over its weights (the torch decoder's)
    step_tokens = 256

    #: what compiles the graph again after a level-2 sleep (None: nothing to compile again)
    reload: Callable[[], CompiledNetwork] | None = None

    # --- the cache

    @abc.abstractmethod
    def new_cache(self, rows: int) -> Any:
        """The cache this decoder reads and writes (a :class:`Cache`), ``rows`` slots."""

    @abc.abstractmethod
    def release_cache(self, cache: Any) -> None:
        """``cache``'s memory freed; the object stays (the engine's slot table holds it)."""

    @abc.abstractmethod
    def restore_cache(self, cache: Any) -> None:
        """``cache``'s memory again, as :meth:`new_cache` makes it."""

    # --- sleep and wake

    def sleep(self, level: int) -> None:
        """Memory given back as ``level`` says (1: what can come back fast, 2: the weights
        too); nothing by default."""
        return None

    def wake_up(self) -> None:
        """The memory :meth:`sleep` gave back taken again."""
        return None

    # --- the forwards and the choice

    @abc.abstractmethod
    def new_sampler(self, seed: int | None) -> StepSampler:
        """The sampler of this decoder's logits, seeded with ``seed``."""

    @abc.abstractmethod
    def decode(self, cache: Any, rows: int, tokens: np.ndarray, lens: np.ndarray) -> Any:
        """One token for each of rows ``0..rows-1`` (``tokens[r]`` at position ``lens[r]``);
        its keys and values written there; the logits ``[rows, vocab]``."""

    @abc.abstractmethod
    def first(
        self,
        cache: Any,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        all_positions: bool = False,
    ) -> Any:
        """Rows with nothing written yet, each given its first tokens; the logits of each
        row's last token ``[len(rows), vocab]`` (with ``all_positions``, a
        :attr:`prompt_logits` decoder's: of every position, ``[len(rows), width, vocab]``)."""

    @abc.abstractmethod
    def extend(
        self, cache: Any, row: int, start: int, chunk: Sequence[int], all_positions: bool = False
    ) -> Any:
        """``chunk`` written at positions ``start..`` of one row; its last token's logits
        (with ``all_positions``: every position's)."""

    def step(
        self,
        cache: Any,
        rows: Sequence[int],
        tokens: Sequence[int],
        lens: Sequence[int],
        chunks: Sequence[tuple[int, int, Sequence[int]]],
    ) -> tuple[Any, Any]:
        """One forward (a :attr:`mixed` decoder's): decoding ``rows`` (``tokens[i]`` at
        position ``lens[i]``) and prompt ``chunks`` (``(row, start, tokens)``); the logits
        of each decoding row and of each chunk's last token."""
        raise Unsupported(f"{type(self).__name__} runs no mixed step")

    # --- a pipelined decode step

    def bind_thread(self) -> None:
        """The calling thread made the device's (the thread :meth:`launch` runs on: on a
        card, its current device); nothing by default."""
        return None

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
        """A decode step of ``rows`` (each at position ``lens[i]``) run and its tokens drawn
        by ``sampler``, nothing brought to the host: what :meth:`fetch` takes. The input ids
        are ``ids`` (on the host), or with ``previous`` (the step launched before, its
        :meth:`launch`'s value) the ids it chose, still on the device, taken at ``picks``
        (None: all of them, in order)."""
        raise Unsupported(f"{type(self).__name__} pipelines no decode step")

    def fetch(
        self, sampler: StepSampler, launched: Any, failures: dict[int, Exception]
    ) -> tuple[np.ndarray, list[Any]]:
        """A launched step's chosen ids and logprobs on the host (waits for the device);
        a row whose choice failed left in ``failures``."""
        raise Unsupported(f"{type(self).__name__} pipelines no decode step")


class MixedDecoder(Decoder):
    """A decoder whose one forward takes a step's decoding rows and prompt chunks together
    (:attr:`Decoder.mixed`): ``first`` and ``extend`` are steps with chunks only."""

    mixed = True

    @abc.abstractmethod
    def step(
        self,
        cache: Any,
        rows: Sequence[int],
        tokens: Sequence[int],
        lens: Sequence[int],
        chunks: Sequence[tuple[int, int, Sequence[int]]],
    ) -> tuple[Any, Any]:
        """One forward: decoding ``rows`` and prompt ``chunks``; the logits of each decoding
        row and of each chunk's last token (float32)."""

    def first(
        self,
        cache: Any,
        rows: Sequence[int],
        chunks: Sequence[Sequence[int]],
        all_positions: bool = False,
    ) -> Any:
        if all_positions:
            raise Unsupported(f"{type(self).__name__} returns no prompt's logits")
        return self.step(cache, [], [], [], [(r, 0, c) for r, c in zip(rows, chunks)])[1]

    def extend(
        self, cache: Any, row: int, start: int, chunk: Sequence[int], all_positions: bool = False
    ) -> Any:
        if all_positions:
            raise Unsupported(f"{type(self).__name__} returns no prompt's logits")
        return self.step(cache, [], [], [], [(row, start, chunk)])[1][0]
