"""The host tier of the key/value cache: whole blocks a slot loses, kept in host memory and
restored into a new prompt's slot instead of computed again (vLLM's CPU offloading,
``--kv-offloading-size``; SGLang's HiCache host level).

Why. The slot table (:mod:`.kvcache`) keeps a prefix only while a free slot holds it: with more
conversations than slots, each turn's slot was taken by another conversation meanwhile, and
its whole history is computed again. A block's keys and values are
``entries x kv_heads x block_size x head_dim`` numbers (every layer's key and value): copying
them back is a memcpy, computing them a forward over the block's tokens and all before them.

What is kept. When a slot holding whole blocks is taken for another sequence, or cut back to a
shorter prefix (:meth:`.kvcache.SlotTable.take`, :meth:`.kvcache.SlotTable.truncate` with
``evict``), each of its whole blocks is copied here (:meth:`HostTier.offload`), keyed by its
chain hash (the hash starts from the slot's salt: a tenant's and ``cache_salt``'s, so a block
is only ever found under its own salt) and holding its own token ids, its salt and the block
before it (the :class:`HostBlock` object itself, not its hash). A lookup
(:meth:`HostTier.match`) walks the prompt's chain from its first block and takes a block only
when its tokens are the prompt's, its salt the request's and its parent the block it took just
before: a collision of hashes, at any depth, can never serve another prompt's cache, and
neither can a block whose parent has left since (its parent would be another object).

Bound and order. At most ``max_bytes`` (``--kv-offloading-size`` GiB, ``KV_OFFLOADING_SIZE``
per model; 0: off); least recently used blocks leave first, and a block is always used more
recently than the blocks after it in its chain (a chain's blocks are touched from its last to
its first), so a chain loses its tail first and what is kept is always usable from its start.
Each block's bytes are charged to the server's memory budget (``--max-inflight-bytes``, as the
Responses store) while kept, the tier holding at most half of that budget whatever the flag
says (requests in flight keep the other half); a charge refused drops the least recently used
blocks until it fits, and stores nothing more when none is left to drop.

Restoring. :meth:`HostTier.restore` copies a run of blocks into a slot's positions (the
cache's ``write_blocks``). A restore shorter than :attr:`HostTier.min_blocks` is not done (the
prompt computes those tokens): on the measured CPU decoders restoring one block was already
cheaper than computing it (BENCHMARKS.md, *Host tier*), so the threshold is one block.

Beneath it (:mod:`.kv_disk_tier`, ``--kv-disk-path`` and ``--kv-disk-size``): each block
this tier drops as least recently used (not one dropped by :meth:`HostTier.clear`) is offered
to the disk tier's writer, its charge moving with it until written; a prompt whose chain goes
on past this tier's blocks restores the rest from what the disk tier's reader read ahead for
it while it waited (:meth:`HostTier.restore_disk`).

Hooks. :attr:`HostTier.on_stored` and :attr:`HostTier.on_dropped` are called with each block
stored and each block dropped (KV events publish from them: vLLM's ``BlockStored`` and
``BlockRemoved`` with the host medium).

Scope. Every cache that copies its blocks to host memory and back
(:class:`~plugserve.plugins.decoding.HostBlocks`: ``host_block_bytes``, ``read_blocks``,
``write_blocks``): the tier holds what ``read_blocks`` gives, opaque host arrays, and knows no
layout. The dense slot cache (:class:`.kvcache.KVCache`: an ONNX graph on ORT, NUMPY or
OPENVINO) copies each array's run of positions; OpenVINO's paged cache
(:class:`~plugserve.server.apps.generate.backends.openvino.PagedKVCache`) the engine's blocks'
positions within its own blocks of 32 (f32, f16, bf16; a u8 cache keeps scales and zero
points per block, so its blocks are copied whole and the engine's blocks are a multiple of
them: ``PagedKVCache.host_block_size``); the torch decoder's (``plugins/torch/decoder.py``)
copies its tensors to host numpy, on a card into pinned memory on a side stream, which the
slot's next writes wait for.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plugserve.plugins.api import ResourceExhausted
from plugserve.plugins.decoding import HostBlocks
from plugserve.server.apps.generate.engine.kv_disk_tier import (
    DiskEntry,
    DiskTier,
    Staging,
    digest,
    root,
)
from plugserve.server.apps.generate.engine.kvcache import Slot, chain

__all__ = ["HostBlock", "HostTier", "supports"]

#: blocks a restore must cover at least; fewer are computed (see the module's docstring)
MIN_RESTORE_BLOCKS = 1


@dataclasses.dataclass(eq=False, slots=True)
class HostBlock:
    """One block kept in host memory: its chain hash, its tokens, the salt its chain started
    from, the block before it (None: the chain's first) and its keys and values (what the
    cache's ``read_blocks`` gave: a host array in the cache's own packing)."""

    key: int
    tokens: tuple[int, ...]
    salt: int
    parent: HostBlock | None
    data: np.ndarray | None
    charge: Any = None
    #: its prefix digest (:func:`.kv_disk_tier.digest`), once the disk tier asked for it
    digest: bytes | None = None


def supports(cache: Any) -> bool:
    """Whether the host tier can serve ``cache``: it copies its blocks to host memory and back
    (:class:`~plugserve.plugins.decoding.HostBlocks`; its ``host_block_bytes`` may still
    refuse a layout of its own, Unsupported saying why)."""
    return isinstance(cache, HostBlocks)


class HostTier:
    """Blocks evicted from the device's slots, kept in host memory (the module's docstring)."""

    def __init__(
        self, cache: HostBlocks, block_size: int, max_bytes: int, budget: Any = None
    ) -> None:
        self.cache = cache
        self.block_size = block_size
        self.budget = budget
        #: the bound: the flag's bytes, and never more than half of the memory budget (the
        #: tier is an optimization: requests keep at least the other half)
        limit = getattr(budget, "limit", 0)
        self.max_bytes = min(max_bytes, limit // 2) if limit else max_bytes
        #: Unsupported where the cache cannot copy its blocks (the engine logs it)
        self.block_bytes = cache.host_block_bytes(block_size)
        self.min_blocks = MIN_RESTORE_BLOCKS
        #: chain hash -> block, least recently used first
        self.blocks: collections.OrderedDict[int, HostBlock] = collections.OrderedDict()
        self.nbytes = 0
        self.restored_tokens = 0  # prompt tokens restored from here
        self.stored_blocks = 0  # blocks copied in
        self.dropped_blocks = 0  # blocks that left (bound, budget, clear)
        #: called with each block stored, and each block dropped (KV events' hook points)
        self.on_stored: list[Callable[[HostBlock], None]] = []
        self.on_dropped: list[Callable[[HostBlock], None]] = []
        #: the disk tier beneath (None: none)
        self.disk: DiskTier | None = None

    @property
    def capacity(self) -> int:
        """Blocks the bound holds."""
        return self.max_bytes // self.block_bytes

    # --- in

    def offload(self, slot: Slot) -> int:
        """``slot``'s whole blocks kept (its chain from the first block; blocks kept already
        are only touched); called before the slot's tokens are forgotten. How many blocks
        were copied."""
        count = min(len(slot.hashes), self.capacity)
        if not count:
            return 0
        size = self.block_size
        kept: list[HostBlock] = []
        parent: HostBlock | None = None
        for b in range(count):
            block = self.blocks.get(slot.hashes[b])
            tokens = tuple(slot.tokens[b * size : (b + 1) * size])
            if block is None or not _same(block, tokens, slot.salt, parent):
                break
            kept.append(block)
            parent = block
        self._touch(kept)
        start = len(kept)
        if start < count:
            kept += self._store(slot, start, count, parent)
        self._touch(kept)
        return len(kept) - start

    def _store(self, slot: Slot, start: int, stop: int, parent: HostBlock | None) -> list:
        """Blocks ``start..stop-1`` of ``slot`` copied in after ``parent`` (as many as the
        bound and the budget let in, from ``start`` on)."""
        size = self.block_size
        room = stop - start
        while self.nbytes + room * self.block_bytes > self.max_bytes and self._drop_oldest(
            keep=parent
        ):
            pass
        room = min(room, (self.max_bytes - self.nbytes) // self.block_bytes)
        charges: list[Any] = []
        while len(charges) < room and self._charge(parent, charges):
            pass
        if not charges:
            return []
        stop = start + len(charges)
        data = self.cache.read_blocks(slot.index, start, stop - start, size)
        stored = []
        for b, charge, block_data in zip(range(start, stop), charges, data):
            key = slot.hashes[b]
            old = self.blocks.pop(key, None)
            if old is not None:  # a stale block (its parent left) or a collision: replaced
                self._forget(old)
            tokens = tuple(slot.tokens[b * size : (b + 1) * size])
            block = HostBlock(key, tokens, slot.salt, parent, block_data, charge)
            self.blocks[key] = block
            self.nbytes += self.block_bytes
            self.stored_blocks += 1
            stored.append(block)
            parent = block
            for hook in self.on_stored:
                hook(block)
        return stored

    def _charge(self, keep: HostBlock | None, charges: list[Any]) -> bool:
        """One more block's charge to the memory budget appended to ``charges`` (None
        without a budget); False when the budget refuses it and no block is left to drop."""
        if self.budget is None:
            charges.append(None)
            return True
        while True:
            try:
                charges.append(self.budget.charge(self.block_bytes, "a host-tier KV block"))
                return True
            except ResourceExhausted:
                if not self._drop_oldest(keep):
                    return False

    # --- out

    def match(self, prompt: Sequence[int], salt: int) -> list[HostBlock]:
        """The kept blocks that begin ``prompt`` under ``salt``, from its first block, each
        checked (tokens, salt, parent), leaving at least one prompt token to compute."""
        size = self.block_size
        found: list[HostBlock] = []
        previous, parent = salt, None
        for b in range((len(prompt) - 1) // size):
            tokens = tuple(prompt[b * size : (b + 1) * size])
            previous = chain(previous, tokens)
            block = self.blocks.get(previous)
            if block is None or not _same(block, tokens, salt, parent):
                break
            found.append(block)
            parent = block
        return found

    def touch(self, prompt: Sequence[int], salt: int) -> None:
        """The kept blocks that begin ``prompt`` count as used now (a request waiting for a
        slot: :meth:`.runner.ModelRunner.stage`)."""
        self._touch(self.match(prompt, salt))

    def restore(
        self, row: int, blocks: list[HostBlock], start: int, data: list[Any] | None = None
    ) -> None:
        """``blocks`` (the prompt's blocks ``start`` on, in order) into row ``row``'s
        positions (``data``: their bytes as :meth:`match` found them, if they may have been
        dropped since); they and the blocks before them count as used now."""
        data = [b.data for b in blocks] if data is None else data
        self.cache.write_blocks(row, start, data, self.block_size)
        first = blocks[0]
        chain_ = [*_ancestors(first), *blocks]
        self._touch(chain_)
        self.restored_tokens += len(blocks) * self.block_size

    @property
    def disk_shape(self) -> tuple[int, int, int, int] | None:
        """A host block's bytes as the disk tier's files shape them, ``[1, 1, block_size,
        bytes a token]`` of uint8 (the cache's own packing, opaque here); None where a block's
        bytes are not a whole number a token (no disk tier then)."""
        per_token, rest = divmod(self.block_bytes, self.block_size)
        return None if rest else (1, 1, self.block_size, per_token)

    def restore_disk(self, row: int, staging: Staging | None, start: int) -> int:
        """The prompt's blocks ``start`` on that the disk tier's reader staged for it
        (:meth:`.kv_disk_tier.DiskTier.stage`: read ahead while it waited, so no file is read
        here), at least the disk tier's ``min_blocks`` of them, else none, into row ``row``;
        how many."""
        disk = self.disk
        if disk is None or staging is None:
            return 0
        stage = disk.take(staging, start)
        if len(stage) < disk.min_blocks:
            return 0
        blocks = [block.reshape(-1) for block in stage]
        self.cache.write_blocks(row, start, blocks, self.block_size)
        return len(stage)

    # --- leaving

    def clear(self) -> None:
        """Every block dropped (the prefix cache forgotten: a sleep, a warm-up's end), none of
        them to disk."""
        while self._drop_oldest(None, spill=False):
            pass

    def _touch(self, blocks: list[HostBlock]) -> None:
        """``blocks`` (a chain, first to last) used now: the first one most recently."""
        for block in reversed(blocks):
            if self.blocks.get(block.key) is block:
                self.blocks.move_to_end(block.key)

    def _drop_oldest(self, keep: HostBlock | None, spill: bool = True) -> bool:
        """The least recently used block dropped, unless it is ``keep`` (the chain being
        stored: touched last, so it is reached only when nothing else is left); offered to
        the disk tier first (``spill``)."""
        if not self.blocks:
            return False
        key, block = next(iter(self.blocks.items()))
        if block is keep:
            return False
        del self.blocks[key]
        if spill and self.disk is not None and block.data is not None:
            self._spill(block, self.disk)
        self._forget(block)
        return True

    def _spill(self, block: HostBlock, disk: DiskTier) -> None:
        """``block`` queued for the disk tier, its charge with it (released once written)."""
        parent = None if block.parent is None else block.parent.key
        entry = DiskEntry(
            _digest(block, disk.identity), block.key, parent, block.salt, block.tokens
        )
        if disk.offer(entry, block.data, block.charge):
            block.charge = None

    def _forget(self, block: HostBlock) -> None:
        self.nbytes -= self.block_bytes
        self.dropped_blocks += 1
        block.data = None
        if block.charge is not None:
            block.charge.release()
        block.charge = None
        for hook in self.on_dropped:
            hook(block)


def _same(block: HostBlock, tokens: tuple[int, ...], salt: int, parent: HostBlock | None) -> bool:
    return block.tokens == tokens and block.salt == salt and block.parent is parent


def _digest(block: HostBlock, identity: bytes) -> bytes:
    """``block``'s prefix digest (:func:`.kv_disk_tier.digest`), kept on each block of its
    chain once computed (a chain's digests are computed once, from its first block)."""
    missing = []
    walk: HostBlock | None = block
    while walk is not None and walk.digest is None:
        missing.append(walk)
        walk = walk.parent
    previous = walk.digest if walk is not None else root(identity, block.salt)
    for item in reversed(missing):
        item.digest = previous = digest(previous, item.tokens)
    assert block.digest is not None
    return block.digest


def _ancestors(block: HostBlock) -> list[HostBlock]:
    """The blocks before ``block`` in its chain, first to last."""
    found = []
    parent = block.parent
    while parent is not None:
        found.append(parent)
        parent = parent.parent
    return found[::-1]
