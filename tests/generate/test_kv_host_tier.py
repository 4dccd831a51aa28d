"""The KV host tier's rules (server/apps/generate/engine/kv_host_tier.py) with the real
scheduler, slot table, cache arrays, runner restore and memory budget: what an evicted slot
leaves there, what a prompt gets back (the very bytes), what is never served (another salt,
other tokens, a chain whose parent left), the bound and the budget. The copies are each
cache's own (the Plugin API's ``HostBlocks``): the dense slot cache, OpenVINO's paged cache
(its blocks of 8 and of 3 positions against the engine's 4: pieces of blocks crossing both
ways; f32 and f16) and the torch decoder's tensors on the CPU (f32 and bf16), each checked by
its own bytes. The served path (a real server, the openai client, a real decoder) is
tests/generate/test_openai_kv_offload.py."""

from __future__ import annotations

import numpy as np
import pytest

from plugserve.plugins.api import ResourceExhausted, Unsupported
from plugserve.server.apps.generate.backends.openvino import PagedKVCache, PagedLayout
from plugserve.server.apps.generate.engine.kv_host_tier import HostTier, supports
from plugserve.server.apps.generate.engine.kvcache import CacheLayout, KVCache, SlotTable, salt
from plugserve.server.apps.generate.engine.runner import ModelRunner
from plugserve.server.apps.generate.engine.scheduler import DECODE, RequestState, Scheduler
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams
from plugserve.server.plane.budget import MemoryBudget

LAYOUT = CacheLayout(
    (
        ("past_key_values.0.key", "present.0.key", 2, 4),
        ("past_key_values.0.value", "present.0.value", 2, 4),
        ("past_key_values.1.key", "present.1.key", 2, 4),
        ("past_key_values.1.value", "present.1.value", 2, 4),
    ),
    np.dtype(np.float32),
    64,
)
BLOCK = 4
#: one block's bytes: 4 arrays x 2 heads x 4 positions x 4 dims x 4 bytes
BLOCK_BYTES = 4 * 2 * BLOCK * 4 * 4


def paged(block_size: int, dtype=np.float32) -> PagedKVCache:
    """Two slots of OpenVINO's paged cache, blocks of ``block_size`` positions; the runs of
    the two rows exchanged (as a swap leaves them), so a row's blocks are not its number's."""
    layout = PagedLayout(
        LAYOUT.entries,
        np.dtype(dtype),
        LAYOUT.capacity,
        block_size=block_size,
        block_shapes=((2, block_size, 4),) * 4,
        dtypes=(np.dtype(dtype),) * 4,
    )
    cache = PagedKVCache(layout, 2)
    cache.swap(0, 0, 1, 0)
    return cache


def torch_cache(dtype: str):
    """Two slots of the torch decoder's cache on the CPU, in ``dtype``."""
    torch = pytest.importorskip("torch", reason="pip install 'plugserve[torch]'")
    from plugserve.plugins.torch.decoder import TorchKVCache
    from plugserve.plugins.torch.decoder_model import KVTensors, ModelShape

    config = {
        "model_type": "llama", "vocab_size": 32, "hidden_size": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 32,
    }  # fmt: skip
    shape = ModelShape.from_config(config)  # 2 layers x 2 KV heads x 4 dims: LAYOUT's
    tensors = KVTensors(shape, 2, LAYOUT.capacity, getattr(torch, dtype), torch.device("cpu"))
    return TorchKVCache(LAYOUT, 2, tensors)


#: the caches the tier serves, by name
CACHES = {
    "dense": lambda: KVCache(LAYOUT, 2),
    "paged-8": lambda: paged(8),
    "paged-3": lambda: paged(3),
    "paged-8-f16": lambda: paged(8, np.float16),
    "torch-f32": lambda: torch_cache("float32"),
    "torch-bf16": lambda: torch_cache("bfloat16"),
}


def position(cache, row: int, at: int) -> list:
    """Each cache array's ``[heads, dim]`` at position ``at`` of slot ``row`` (views: written
    through), whatever the cache's layout."""
    if isinstance(cache, PagedKVCache):
        block = int(cache.runs[row]) * cache.per_slot + at // cache.block_size
        return [a[block, :, at % cache.block_size] for a in cache.arrays.values()]
    return [a[row, :, at] for a in cache.arrays.values()]


def as_bytes(value) -> bytes:
    """A position's bytes (numpy's, or a torch tensor's, bf16 too)."""
    if isinstance(value, np.ndarray):
        return value.tobytes()
    import torch

    return value.contiguous().view(torch.uint8).numpy().tobytes()


class Engine:
    """The engine's parts that admission touches, real, over two slots (no decoder: a
    forward's work is written by :meth:`run`)."""

    def __init__(
        self, max_bytes: int = 64 * BLOCK_BYTES, budget=None, slots: int = 2, cache=None
    ) -> None:
        self.cache = cache if cache is not None else KVCache(LAYOUT, slots)
        self.table = SlotTable(self.cache, BLOCK)
        self.tier = HostTier(self.cache, BLOCK, max_bytes, budget)
        self.runner = ModelRunner(None, self.cache, self.table, 64, self.tier)  # type: ignore[arg-type]
        self.scheduler = Scheduler(
            self.table, slots, 64, 100, self.runner.copy_prefix, self.runner.restore_prefix
        )

    def run(self, prompt, tenant: str = "") -> RequestState:
        """``prompt`` admitted, computed (each position's cache: a function of the tokens up
        to it, so a wrong restore shows) and finished; its state."""
        state = RequestState(
            GenerationRequest(str(id(prompt)), list(prompt), SamplingParams(), 1, tenant=tenant),
            None,
            0.0,
        )
        state.staging = self.runner.stage(list(prompt), state.salt, lambda: None)
        if state.staging is not None:  # as the engine's loop: admitted once read
            state.staging.done.wait(5)
        self.scheduler.waiting.append(state)
        self.scheduler.schedule()
        seq = state.sequences[0]
        assert seq.slot is not None
        for at in range(seq.computed, len(prompt)):
            for i, value in enumerate(position(self.cache, seq.slot.index, at)):
                fill(value, expected(prompt, at, i))
        self.table.written(seq.slot, prompt[seq.computed :])
        seq.computed = len(prompt)
        seq.status = DECODE
        self.scheduler.finish(seq)
        return state

    def check(self, state: RequestState) -> None:
        """Every position of ``state``'s prompt in its slot holds the very bytes computing it
        writes (so restored blocks are the prompt's own)."""
        prompt = state.sequences[0].tokens
        rows = [s for s in self.table.slots if s.tokens[: len(prompt)] == prompt]
        assert rows, "the prompt's slot is gone"
        for at in range(len(prompt)):
            for i, value in enumerate(position(self.cache, rows[0].index, at)):
                # what computing it writes, in the cache's element type
                written = value.copy() if isinstance(value, np.ndarray) else value.clone()
                fill(written, expected(prompt, at, i))
                assert as_bytes(value) == as_bytes(written), (at, i)


def expected(prompt, at: int, array: int) -> np.ndarray:
    """A position's cache ``[heads, dim]`` as a function of the prompt up to it (and of the
    array), each head and dim its own number (whole numbers below 256: exact in bf16 too)."""
    seed = hash((tuple(prompt[: at + 1]), array)) & 0x7F
    return (seed + np.arange(8, dtype=np.float32)).reshape(2, 4)


def fill(value, numbers: np.ndarray) -> None:
    """``value`` (a numpy view or a torch tensor view) set to ``numbers`` in its own type."""
    if isinstance(value, np.ndarray):
        value[...] = numbers
    else:
        import torch

        value.copy_(torch.from_numpy(numbers))


def prompts(count: int, length: int, start: int = 100) -> list[list[int]]:
    return [[start + 1000 * i + t for t in range(length)] for i in range(count)]


@pytest.mark.parametrize("kind", CACHES)
def test_an_evicted_slots_blocks_are_restored_as_they_were(kind):
    engine = Engine(cache=CACHES[kind]())
    a, b, c = prompts(3, 13)  # three blocks each and a token
    engine.run(a)
    engine.run(b)
    engine.run(c)  # two slots: a's slot (the least recently freed) is taken, a's blocks kept
    assert engine.tier.nbytes == 3 * engine.tier.block_bytes
    again = engine.run([*a, 7, 8, 9])  # a's next turn: its history comes back
    assert again.cached == 12
    assert engine.tier.restored_tokens == 12
    engine.check(again)


@pytest.mark.parametrize("kind", CACHES)
def test_the_device_hit_then_the_host_blocks_after_it(kind):
    engine = Engine(cache=CACHES[kind]())
    system = list(range(1, 9))  # two blocks every conversation shares
    a, b, c = ([*system, *p] for p in prompts(3, 9))
    engine.run(a)
    engine.run(b)
    engine.run(c)  # takes a's slot after its two shared blocks: a's own blocks go to the tier
    state = engine.run([*a, 5])
    assert state.cached == 16  # 2 blocks from the device, 2 from the host
    engine.check(state)


def test_a_waiting_requests_blocks_outlast_the_evictions_of_those_admitted_before_it():
    """The host tier holds six blocks: a's three, then b's. a's next turn joins the queue
    (``runner.stage``, as the engine's loop queues it) while another request is admitted
    before it and evicts c's slot: the tier drops three blocks for c's, b's (a's were touched
    when it came). Before, a's were the least recently used and went, and its turn computed its
    history again."""
    engine = Engine(max_bytes=6 * BLOCK_BYTES)
    a, b, c, d, e = prompts(5, 13)
    for prompt in (a, b, c, d):  # two slots: a's then b's blocks go to the tier
        engine.run(prompt)
    assert engine.tier.nbytes == 6 * engine.tier.block_bytes
    later = [*a, 7]
    engine.runner.stage(later, salt(""), lambda: None)  # it waits for a slot
    engine.run(e)  # admitted before it: c's slot taken, c's blocks in, three blocks out
    assert len(engine.tier.match(later, salt(""))) == 3
    assert engine.tier.match([*b, 1], salt("")) == []
    state = engine.run(later)
    assert state.cached == 12 and engine.tier.restored_tokens == 12
    engine.check(state)


@pytest.mark.parametrize("kind", CACHES)
def test_another_salt_or_other_tokens_are_never_restored(kind):
    engine = Engine(cache=CACHES[kind]())
    a, b, c = prompts(3, 13)
    engine.run(a, tenant="alice")
    engine.run(b)
    engine.run(c)
    assert engine.run([*a, 1], tenant="mallory").cached == 0  # another tenant's blocks
    assert engine.tier.match([*a, 1], salt("mallory")) == []
    other = [*a[:4], 555, *a[5:], 1]  # the second block differs: only the first is the same
    assert [len(b.tokens) for b in engine.tier.match(other, salt("alice"))] == [BLOCK]
    state = engine.run(other, tenant="alice")
    assert state.cached == BLOCK
    engine.check(state)


def test_a_block_whose_parent_left_is_not_served():
    engine = Engine()
    a, b, c = prompts(3, 13)
    engine.run(a)
    engine.run(b)
    engine.run(c)
    first = engine.tier.match([*a, 1], 0)
    assert len(first) == 3
    del engine.tier.blocks[first[0].key]  # its first block leaves (as least recently used)
    engine.tier.nbytes -= BLOCK_BYTES
    assert engine.tier.match([*a, 1], 0) == []


def test_the_bound_holds_and_a_chain_loses_its_tail_first():
    engine = Engine(max_bytes=5 * BLOCK_BYTES)
    history = prompts(6, 13)
    for prompt in history:
        engine.run(prompt)
        assert engine.tier.nbytes <= 5 * BLOCK_BYTES
    # the latest evicted chain is whole; the one before kept its first blocks (its tail left)
    kept = [len(engine.tier.match([*p, 1], 0)) for p in history]
    assert kept[3] == 3 and kept[2] == 2 and kept[:2] == [0, 0]
    assert engine.tier.dropped_blocks > 0


def test_blocks_are_charged_to_the_memory_budget_and_given_back():
    budget = MemoryBudget(8 * BLOCK_BYTES)  # the tier may hold half: four blocks
    engine = Engine(budget=budget)
    assert engine.tier.max_bytes == 4 * BLOCK_BYTES
    for prompt in prompts(5, 13):
        engine.run(prompt)
        assert budget.used == engine.tier.nbytes <= 4 * BLOCK_BYTES
    assert engine.tier.nbytes > 0
    held = budget.charge(budget.limit - budget.used, "a request")  # requests take the rest
    with pytest.raises(ResourceExhausted):
        budget.charge(1, "one more")
    engine.run(prompts(1, 13, start=9)[0])
    engine.run(prompts(1, 13, start=11)[0])  # its eviction drops older blocks to fit
    assert budget.used == engine.tier.nbytes + held.nbytes
    held.release()
    engine.tier.clear()
    assert budget.used == 0 and engine.tier.nbytes == 0


def test_hooks_see_each_block_stored_and_dropped():
    engine = Engine(max_bytes=3 * BLOCK_BYTES)
    stored, dropped = [], []
    engine.tier.on_stored.append(lambda block: stored.append(block.key))
    engine.tier.on_dropped.append(lambda block: dropped.append(block.key))
    for prompt in prompts(4, 13):
        engine.run(prompt)
    assert len(stored) == 6 and len(dropped) == 3  # two chains of 3 evicted; the bound is 3
    assert set(stored) - set(dropped) == set(engine.tier.blocks)


@pytest.mark.parametrize("kind", CACHES)
def test_every_cache_copies_a_block_in_the_bytes_it_takes(kind):
    cache = CACHES[kind]()
    assert supports(cache)
    size = BLOCK_BYTES // 2 if kind.endswith("16") else BLOCK_BYTES
    assert HostTier(cache, BLOCK, BLOCK_BYTES).block_bytes == size
    blocks = cache.read_blocks(1, 2, 3, BLOCK)
    assert [b.nbytes for b in blocks] == [size] * 3


def test_arrays_of_other_shapes_copy_too():
    uneven = CacheLayout((("a", "b", 2, 4), ("c", "d", 1, 8)), np.dtype(np.float16), 8)
    cache = KVCache(uneven, 2)
    for array in cache.arrays.values():
        array[1] = np.arange(array[1].size).reshape(array.shape[1:])
    blocks = cache.read_blocks(1, 0, 2, 4)
    assert [b.nbytes for b in blocks] == [(2 * 4 + 1 * 8) * 4 * 2] * 2
    cache.write_blocks(0, 0, blocks, 4)
    for array in cache.arrays.values():
        np.testing.assert_array_equal(array[0], array[1])


def paged_u8(block_size: int = 8) -> PagedKVCache:
    """Two slots of OpenVINO's u8 paged cache: keys by channel (their scales and zero points
    after the block's tokens: ``block_size + 8`` rows), values by token (after each token's
    dims: ``dim + 8``); the runs of the two rows exchanged."""
    shapes = ((2, block_size + 8, 4), (2, block_size, 4 + 8)) * 2
    layout = PagedLayout(
        LAYOUT.entries,
        np.dtype(np.uint8),
        LAYOUT.capacity,
        block_size=block_size,
        block_shapes=shapes,
        dtypes=(np.dtype(np.uint8),) * 4,
    )
    cache = PagedKVCache(layout, 2)
    cache.swap(0, 0, 1, 0)
    return cache


def test_a_u8_paged_cache_copies_its_blocks_whole_scales_and_all():
    cache = paged_u8(8)
    assert cache.host_block_size(4) == 8 and cache.host_block_size(16) == 16
    assert paged(8).host_block_size(4) == 4  # f32: positions are copied
    with pytest.raises(Unsupported, match="block_size 4 is not a multiple of 8"):
        HostTier(cache, 4, 64 * BLOCK_BYTES)
    rng = np.random.default_rng(0)
    for array in cache.arrays.values():
        array[...] = rng.integers(0, 256, array.shape, np.uint8)
    before = {n: a.copy() for n, a in cache.arrays.items()}
    blocks = cache.read_blocks(1, 1, 2, 16)  # engine blocks 1-2 of row 1: its cache blocks 2-5
    assert [b.nbytes for b in blocks] == [2 * cache.layout.block_bytes] * 2
    cache.write_blocks(0, 1, blocks, 16)
    src, dst = int(cache.runs[1]) * cache.per_slot, int(cache.runs[0]) * cache.per_slot
    for name, array in cache.arrays.items():
        np.testing.assert_array_equal(array[dst + 2 : dst + 6], before[name][src + 2 : src + 6])
        np.testing.assert_array_equal(array[dst : dst + 2], before[name][dst : dst + 2])
        np.testing.assert_array_equal(array[dst + 6 :], before[name][dst + 6 :])
    tier = HostTier(cache, 16, 64 * BLOCK_BYTES)
    assert tier.block_bytes == 2 * cache.layout.block_bytes
    assert not supports(object())


def test_the_config_key_is_a_number_of_gib():
    from plugserve.plugins.api import InvalidArgument
    from plugserve.server.apps.generate.engine.engine import EngineSettings
    from plugserve.server.apps.generate.network import engine_settings

    settings, rest = engine_settings(EngineSettings(), {"KV_OFFLOADING_SIZE": "0.5", "X": "1"})
    assert settings.kv_offloading_size == 0.5 and rest == {"X": "1"}
    for bad in ("lots", "-1", "nan", "inf"):
        with pytest.raises(InvalidArgument, match="KV_OFFLOADING_SIZE"):
            engine_settings(EngineSettings(), {"KV_OFFLOADING_SIZE": bad})
