"""The key/value cache: one slot per sequence, owned by the engine, bounded by bytes.

Layout. Each of the decoder's cache inputs (``past_key_values.N.key`` / ``.value``) has one
array ``[slots, kv_heads, capacity, head_dim]`` allocated at load; a sequence holds one slot
(row) from its admission to its end, its token at position p in column p. ``capacity`` is the
model's context length (``max_model_len``), ``slots`` what the byte budget holds
(``kv_cache_bytes // bytes per slot``, at most ``max_num_seqs`` plus the slots kept for the
prefix cache). A slot is a contiguous row, so the running sequences in rows ``0..B-1`` are
one ``[B, heads, capacity, dim]`` view: onnxruntime-genai's GroupQueryAttention graphs read
and write it in place (past and present bound to the same memory, per-row lengths in the
attention mask), and optimum's graphs read the rows' first columns. This is
onnxruntime-genai's buffer layout (``past_present_share_buffer``), not vLLM's pages: its
attention ops take a dense buffer per row, and a page table would cost a gather of the whole
cache every step. The price: a slot holds the whole context's bytes however short its
sequence, so the budget admits ``kv_cache_bytes / (capacity x bytes per token)`` sequences
at once; the operator sizes ``max_model_len`` to what the deployment needs.

Memory: the arrays are allocated with ``np.zeros`` (pages the kernel maps on first write),
so what the budget allows is reserved, and resident only as far as sequences have written.
Nothing is allocated per request or per step; moving a sequence between rows copies its
own written columns.

Prefix caching (vLLM's block hashes, on slots): a slot's written tokens are hashed by blocks
of ``block_size``, each hash covering every token before it (a chain), and the table maps
each hash to the slot holding it. A finished sequence's slot keeps its tokens and hashes
while it is free; a new prompt whose first blocks are in the table reuses them: it takes
that slot when it is free (nothing copied), or copies the blocks from a slot in use. A hit
is checked token by token before it is used, so a hash collision can never serve another
prompt's cache. A new sequence takes a free slot holding no whole block first (the lowest, so
new rows tend to follow the running ones), else the one holding the fewest blocks (least
recently freed first): short prompts come and go without evicting a long one's blocks.

Tenants (vLLM's ``cache_salt``, docs/design/prefix_caching.md): a chain starts from a salt, not
from 0, so the first block's hash, and every hash after it, is the salt's as well as the
tokens'. The salt is made of the request's tenant (its token's, ``auth.py``) and its
``cache_salt`` (:func:`salt`); a slot keeps the salt of the sequence that wrote it, and a lookup
with another salt finds none of its blocks. Without either (a server without tokens, no
``cache_salt``) the salt is 0: one cache for every request, as before. A hit's cached-token
count (``usage.prompt_tokens_details.cached_tokens``) and its time to first token therefore
tell a client about its own tenant's prompts only: with one cache for all, a token recovered a
4-digit PIN from another token's system prompt through ``cached_tokens`` in ~900 requests.
Eviction is not partitioned (slots are the model's, shared): another tenant's prompts can only
make a hit less likely, which tells nothing about their contents.

Host copies (:class:`~plugserve.plugins.decoding.HostBlocks`, the host tier's one interface to
every layout): :meth:`KVCache.read_blocks` and :meth:`KVCache.write_blocks` copy whole blocks of
a slot to and from host arrays, each block's bytes packed as every array's ``[kv_heads,
block_size, head_dim]`` one after the other (:func:`block_views`): one strided copy per array
for a run of blocks, whatever each array's heads and dims.

KV events (``kvevents.py``, off by default): the table tells an observer (``events``, None when
off: the hot path checks that one attribute) each hash entering its index (``stored``, with the
block's tokens and parent hash), each hash leaving it (``removed``), and a reset of the whole
cache (``cleared``, :meth:`SlotTable.forget`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from plugserve.plugins.decoding import CacheLayout

if TYPE_CHECKING:
    from plugserve.server.apps.generate.engine.kvevents import BlockEvents

__all__ = ["CacheLayout", "KVCache", "Slot", "SlotTable", "block_views", "chain", "salt", "split"]


class KVCache:
    """The cache arrays, ``rows`` slots of ``layout.capacity`` tokens."""

    def __init__(self, layout: CacheLayout, rows: int) -> None:
        self.layout = layout
        self.rows = rows
        self.arrays: dict[str, np.ndarray] = {
            past: np.zeros((rows, heads, layout.capacity, dim), layout.dtype)
            for past, _present, heads, dim in layout.entries
        }

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def view(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start..stop-1`` of every array (contiguous views, no copy)."""
        return {name: array[start:stop] for name, array in self.arrays.items()}

    def copy(self, src: int, dst: int, length: int) -> None:
        """The first ``length`` positions of slot ``src`` into slot ``dst``."""
        if length <= 0 or src == dst:
            return
        for array in self.arrays.values():
            array[dst, :, :length] = array[src, :, :length]

    def swap(self, a: int, length_a: int, b: int, length_b: int) -> None:
        """Exchange the written positions of slots ``a`` and ``b`` (what lies beyond a slot's
        length is never read, so only the written columns move)."""
        if a == b:
            return
        for array in self.arrays.values():
            keep = array[a, :, :length_a].copy()
            array[a, :, :length_b] = array[b, :, :length_b]
            array[b, :, :length_a] = keep

    # --- host copies (the host tier's, :class:`~plugserve.plugins.decoding.HostBlocks`)

    def host_block_bytes(self, block_size: int) -> int:
        return self.layout.bytes_per_token * block_size

    def read_blocks(
        self, row: int, first_block: int, count: int, block_size: int
    ) -> list[np.ndarray]:
        """Blocks of row ``row`` to host arrays: one strided copy per cache array into a
        stage, then one copy per block (so each block is its own memory)."""
        stage = np.empty((count, self.host_block_bytes(block_size)), np.uint8)
        runs = self._runs(row, first_block, count, block_size)
        for run, view in zip(runs, block_views(stage, self._shapes(), block_size)):
            view[...] = run.transpose(1, 0, 2, 3)
        return split(stage)

    def write_blocks(
        self, row: int, first_block: int, blocks: Sequence[np.ndarray], block_size: int
    ) -> None:
        stage = np.stack(blocks)
        runs = self._runs(row, first_block, len(blocks), block_size)
        for run, view in zip(runs, block_views(stage, self._shapes(), block_size)):
            run[...] = view.transpose(1, 0, 2, 3)

    def _runs(self, row: int, first: int, count: int, size: int) -> list[np.ndarray]:
        """Each array's positions of ``count`` blocks from ``first``, ``[heads, count, size,
        dim]`` views (no copy)."""
        runs = []
        for array in self.arrays.values():
            heads, _cap, dim = array.shape[1:]
            run = array[row, :, first * size : (first + count) * size]
            runs.append(run.reshape(heads, count, size, dim))
        return runs

    def _shapes(self) -> list[tuple[int, int, np.dtype]]:
        return [(a.shape[1], a.shape[3], a.dtype) for a in self.arrays.values()]


def block_views(
    stage: np.ndarray, shapes: Sequence[tuple[int, int, np.dtype]], block_size: int
) -> list[np.ndarray]:
    """``stage`` (``[blocks, bytes]``, uint8: host blocks stacked) seen as each cache array's
    part of every block, ``[blocks, heads, block_size, dim]`` in its element type, one after
    the other in ``shapes``' order ``(heads, dim, dtype)`` (views: writing one fills the
    stage)."""
    views, offset = [], 0
    for heads, dim, dtype in shapes:
        size = heads * block_size * dim * dtype.itemsize
        part = stage[:, offset : offset + size].view(dtype)
        views.append(part.reshape(len(stage), heads, block_size, dim))
        offset += size
    return views


def split(stage: np.ndarray) -> list[np.ndarray]:
    """A stage's blocks as arrays of their own (a block dropped frees its bytes)."""
    return [stage[j].copy() for j in range(len(stage))]


class Slot:
    """One row of the cache: its tokens written (in order, from position 0), their block
    hashes, the salt their chain starts from, and the sequence holding it (None: free; its
    tokens stay as a prefix cache)."""

    __slots__ = ("hashes", "index", "owner", "salt", "tokens")

    def __init__(self, index: int) -> None:
        self.index = index
        self.tokens: list[int] = []
        self.hashes: list[int] = []
        self.owner: object | None = None
        self.salt = 0

    def __repr__(self) -> str:
        return f"Slot({self.index}, {len(self.tokens)} tokens, owner={self.owner is not None})"


def chain(previous: int, block: Sequence[int]) -> int:
    """The hash of ``block`` after the block whose hash is ``previous`` (the salt: the first)."""
    return hash((previous, tuple(block)))


def salt(tenant: str = "", cache_salt: str = "") -> int:
    """Where a request's chain of block hashes starts: 0 for neither (every request's cache
    shared, as without tokens), else a hash of both (a tenant's requests with one
    ``cache_salt`` share their cache, and nobody else's)."""
    if not tenant and not cache_salt:
        return 0
    # blake2b, not ``hash``: a string's hash changes with each process, and the disk tier's
    # blocks (:mod:`.kv_disk_tier`) are found again after a restart by their salt
    key = hashlib.blake2b(digest_size=8)
    for part in ("plugserve-salt", tenant, cache_salt):
        data = part.encode("utf-8", "surrogatepass")
        key.update(len(data).to_bytes(8, "little") + data)
    return int.from_bytes(key.digest(), "little", signed=True) or 1


class SlotTable:
    """Which slot holds what, the free slots, and the prefix cache's index."""

    def __init__(
        self,
        cache: KVCache,
        block_size: int = 16,
        prefix_caching: bool = True,
        events: BlockEvents | None = None,
    ) -> None:
        self.cache = cache
        #: told what enters and leaves the index (``kvevents.BlockEvents``); None: events off
        self.events = events
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.slots = [Slot(i) for i in range(cache.rows)]
        #: free slots, least recently freed first
        self.free: collections.OrderedDict[int, Slot] = collections.OrderedDict(
            (s.index, s) for s in self.slots
        )
        #: block chain hash -> the slot holding that block (and every block before it)
        self.index: dict[int, Slot] = {}
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up
        #: rows of free slots that requests about to be admitted will reuse (evicted last)
        self.wanted: set[int] = set()
        #: called with a slot whose whole blocks are about to be forgotten for another
        #: sequence (its data still there): the host tier keeps them (:mod:`.kv_host_tier`)
        self.evicting: Callable[[Slot], object] | None = None

    # --- allocation

    @property
    def free_count(self) -> int:
        return len(self.free)

    def take(self, owner: object, prefer: Slot | None = None, salt: int = 0) -> Slot:
        """A free slot for ``owner``: ``prefer`` when given (a prefix hit), else the lowest
        one holding no whole block (nothing a prompt could reuse), else the one holding the
        fewest blocks, least recently freed first (its cache is dropped). ``salt``: where the
        chain of the blocks it writes starts (:func:`salt`; a hit's slot has it already)."""
        slot = prefer
        if slot is None:
            spare = [s for s in self.free.values() if not s.hashes]
            if spare:
                slot = min(spare, key=lambda s: s.index)
            else:  # free slots in the order they were freed: min keeps the first of a tie
                slot = min(
                    self.free.values(), key=lambda s: (s.index in self.wanted, len(s.hashes))
                )
            self.truncate(slot, 0, evict=True)
        elif slot.salt != salt:  # a hit is found by its salt: never another's blocks
            self.truncate(slot, 0, evict=True)
        del self.free[slot.index]
        slot.owner = owner
        slot.salt = salt
        return slot

    def release(self, slot: Slot) -> None:
        """``slot`` is free again; its tokens stay cached (or are dropped without caching)."""
        slot.owner = None
        if not self.prefix_caching:
            self.truncate(slot, 0)
        self.free[slot.index] = slot

    # --- contents

    def written(self, slot: Slot, tokens: Sequence[int]) -> None:
        """``tokens`` were written at the slot's next positions (one token, a decode step's,
        costs an append and a comparison: no block completes)."""
        written = slot.tokens
        if len(tokens) == 1:
            written.append(int(tokens[0]))
        else:
            written.extend(int(t) for t in tokens)
        if not self.prefix_caching:
            return
        size = self.block_size
        fresh = None  # blocks whose hash is new to the index (events on)
        while (len(slot.hashes) + 1) * size <= len(slot.tokens):
            start = len(slot.hashes) * size
            previous = slot.hashes[-1] if slot.hashes else slot.salt
            value = chain(previous, slot.tokens[start : start + size])
            if self.events is not None and value not in self.index:
                fresh = fresh or []
                fresh.append(len(slot.hashes))
            slot.hashes.append(value)
            self.index[value] = slot
        if fresh:
            self._stored(slot, fresh)

    def _stored(self, slot: Slot, blocks: list[int]) -> None:
        """``BlockStored`` for ``blocks`` (numbers of the slot's blocks, ascending), one event
        per run of consecutive blocks."""
        size, hashes = self.block_size, slot.hashes
        start = 0
        for i in range(1, len(blocks) + 1):
            if i < len(blocks) and blocks[i] == blocks[i - 1] + 1:
                continue
            a, b = blocks[start], blocks[i - 1] + 1
            parent = hashes[a - 1] if a else None
            self.events.stored(hashes[a:b], parent, slot.tokens[a * size : b * size], size)
            start = i

    def truncate(self, slot: Slot, length: int, evict: bool = False) -> None:
        """Forget the slot's tokens from ``length`` on (they are about to be overwritten).
        ``evict``: for another sequence's tokens (:attr:`evicting` sees the whole blocks
        first), not a prefix cache forgotten on purpose."""
        if length >= len(slot.tokens):
            return
        if evict and self.evicting is not None and len(slot.hashes) > length // self.block_size:
            self.evicting(slot)
        del slot.tokens[length:]
        keep = length // self.block_size
        gone = []
        for value in slot.hashes[keep:]:
            if self.index.get(value) is slot:
                del self.index[value]
                gone.append(value)
        del slot.hashes[keep:]
        if gone and self.events is not None:
            self.events.removed(gone)

    def forget(self, slots: Sequence[Slot]) -> None:
        """The prefix cache of ``slots`` dropped (a sleep, the warm-up's prompts): announced as
        ``AllBlocksCleared`` when the index is empty after, else as the blocks removed."""
        events, self.events = self.events, None
        before = set(self.index) if events is not None else set()
        try:
            for slot in slots:
                self.truncate(slot, 0)
        finally:
            self.events = events
        if events is None:
            return
        if not self.index:
            events.cleared()
        elif gone := [value for value in before if value not in self.index]:
            events.removed(gone)

    def lookup(
        self, prompt: Sequence[int], count: bool = True, salt: int = 0
    ) -> tuple[Slot | None, int]:
        """The slot holding the longest cached prefix of ``prompt`` in whole blocks, leaving
        at least one prompt token to compute (its logits start the answer), and its length;
        ``(None, 0)`` without a hit. ``count``: a lookup for admission (counted in
        :attr:`hits` and :attr:`queries`), not a look ahead. ``salt``: the request's
        (:func:`salt`): only blocks written under the same salt are found."""
        if not self.prefix_caching:
            return None, 0
        size = self.block_size
        blocks = (len(prompt) - 1) // size
        if count:
            self.queries += len(prompt)
        found: Slot | None = None
        hit = 0
        previous = salt
        for b in range(blocks):
            previous = chain(previous, prompt[b * size : (b + 1) * size])
            slot = self.index.get(previous)
            if slot is None:
                break
            found, hit = slot, (b + 1) * size
        if found is None or found.salt != salt:  # a collision of salted hashes, too
            return None, 0
        # the blocks' tokens themselves, so a collision of hashes never serves them
        same = np.asarray(found.tokens[:hit]) == np.asarray(prompt[:hit])
        if not same.all():
            hit = int(np.argmin(same)) // size * size
            if hit == 0:
                return None, 0
        if count:
            self.hits += hit
        return found, hit

    def swap(self, a: Slot, b: Slot) -> None:
        """Exchange two rows' contents (data, tokens, hashes and owners move together; the
        Slot objects change rows)."""
        if a is b:
            return
        self.cache.swap(a.index, len(a.tokens), b.index, len(b.tokens))
        ia, ib = a.index, b.index
        self.slots[ia], self.slots[ib] = b, a
        a.index, b.index = ib, ia
        fa, fb = self.free.pop(ia, None), self.free.pop(ib, None)
        # free-list entries are keyed by row: re-key them (their order matters less than
        # their membership here)
        if fa is not None:
            self.free[ib] = fa
        if fb is not None:
            self.free[ia] = fb

    def held(self) -> int:
        return len(self.slots) - len(self.free)
