"""The KV host tier's rules (server/apps/generate/engine/kv_host_tier.py) with the real
scheduler, slot
table, cache arrays, runner restore and memory budget: what an evicted slot leaves there, what a
prompt gets back (the very bytes), what is never served (another salt, other tokens, a chain
whose parent left), the bound and the budget. The served path (a real server, the openai
client, a real decoder) is tests/generate/test_openai_kv_offload.py."""

from __future__ import annotations

import numpy as np
import pytest

from plugserve.plugins.api import ResourceExhausted
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


class Engine:
    """The engine's parts that admission touches, real, over two slots (no decoder: a
    forward's work is written by :meth:`compute`)."""

    def __init__(self, max_bytes: int = 64 * BLOCK_BYTES, budget=None, slots: int = 2) -> None:
        self.cache = KVCache(LAYOUT, slots)
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
        self.scheduler.waiting.append(state)
        self.scheduler.schedule()
        seq = state.sequences[0]
        assert seq.slot is not None
        for position in range(seq.computed, len(prompt)):
            for array in self.cache.arrays.values():
                array[seq.slot.index, :, position] = expected(prompt, position, array)
        self.table.written(seq.slot, prompt[seq.computed :])
        seq.computed = len(prompt)
        seq.status = DECODE
        self.scheduler.finish(seq)
        return state

    def check(self, state: RequestState) -> None:
        """Every position of ``state``'s prompt in its slot's row holds what computing it
        writes (so restored blocks are the prompt's own)."""
        prompt = state.sequences[0].tokens
        rows = [s for s in self.table.slots if s.tokens[: len(prompt)] == prompt]
        assert rows, "the prompt's slot is gone"
        for array in self.cache.arrays.values():
            for position in range(len(prompt)):
                want = expected(prompt, position, array)
                np.testing.assert_array_equal(array[rows[0].index, :, position], want)


def expected(prompt, position: int, array: np.ndarray) -> np.ndarray:
    """A position's cache as a function of the prompt up to it (and of the array)."""
    seed = hash((tuple(prompt[: position + 1]), id(array))) & 0xFFFF
    return np.full(array.shape[1:2] + array.shape[3:], seed, array.dtype)


def prompts(count: int, length: int, start: int = 100) -> list[list[int]]:
    return [[start + 1000 * i + t for t in range(length)] for i in range(count)]


def test_an_evicted_slots_blocks_are_restored_as_they_were():
    engine = Engine()
    a, b, c = prompts(3, 13)  # three blocks each and a token
    engine.run(a)
    engine.run(b)
    engine.run(c)  # two slots: a's slot (the least recently freed) is taken, a's blocks kept
    assert engine.tier.nbytes == 3 * BLOCK_BYTES
    again = engine.run([*a, 7, 8, 9])  # a's next turn: its history comes back
    assert again.cached == 12
    assert engine.tier.restored_tokens == 12
    engine.check(again)


def test_the_device_hit_then_the_host_blocks_after_it():
    engine = Engine()
    system = list(range(1, 9))  # two blocks every conversation shares
    a, b, c = ([*system, *p] for p in prompts(3, 9))
    engine.run(a)
    engine.run(b)
    engine.run(c)  # takes a's slot after its two shared blocks: a's own blocks go to the tier
    state = engine.run([*a, 5])
    assert state.cached == 16  # 2 blocks from the device, 2 from the host
    engine.check(state)


def test_another_salt_or_other_tokens_are_never_restored():
    engine = Engine()
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


def test_only_the_dense_slot_cache_is_supported():
    assert supports(KVCache(LAYOUT, 1))
    uneven = CacheLayout((("a", "b", 2, 4), ("c", "d", 1, 4)), np.dtype(np.float32), 8)
    assert not supports(KVCache(uneven, 1))


def test_the_config_key_is_a_number_of_gib():
    from plugserve.plugins.api import InvalidArgument
    from plugserve.server.apps.generate.engine.engine import EngineSettings
    from plugserve.server.apps.generate.network import engine_settings

    settings, rest = engine_settings(EngineSettings(), {"KV_OFFLOADING_SIZE": "0.5", "X": "1"})
    assert settings.kv_offloading_size == 0.5 and rest == {"X": "1"}
    for bad in ("lots", "-1", "nan", "inf"):
        with pytest.raises(InvalidArgument, match="KV_OFFLOADING_SIZE"):
            engine_settings(EngineSettings(), {"KV_OFFLOADING_SIZE": bad})
