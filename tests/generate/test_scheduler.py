"""The scheduler's rules and the cache's slots (server/apps/generate/engine/scheduler.py,
kvcache.py), with
the real scheduler, slot table and cache arrays: what each step computes, who waits, and what
the prefix cache reuses."""

from __future__ import annotations

import numpy as np

from plugserve.server.apps.generate.engine.kvcache import CacheLayout, KVCache, SlotTable
from plugserve.server.apps.generate.engine.scheduler import (
    DECODE,
    FORK,
    PREFILL,
    RequestState,
    Scheduler,
)
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

LAYOUT = CacheLayout(
    (
        ("past_key_values.0.key", "present.0.key", 2, 4),
        ("past_key_values.0.value", "present.0.value", 2, 4),
    ),
    np.dtype(np.float32),
    64,
)


def make(slots=4, seqs=4, budget=16, block=4, caching=True):
    cache = KVCache(LAYOUT, slots)
    table = SlotTable(cache, block, caching)

    def copy(source, target, length):
        cache.copy(source.index, target.index, length)

    return cache, table, Scheduler(table, seqs, budget, 100, copy)


def request(rid: str, prompt, n: int = 1) -> RequestState:
    return RequestState(GenerationRequest(rid, list(prompt), SamplingParams(), n), None, 0.0)


def compute(table, seq, count):
    """What the engine does after a forward: the tokens are in the slot."""
    table.written(seq.slot, seq.tokens[seq.computed : seq.computed + count])
    seq.computed += count


def test_decoding_sequences_first_then_prompt_chunks_within_the_budget():
    _cache, table, scheduler = make(budget=10)
    a, b = request("a", range(1, 4)), request("b", range(1, 30))
    scheduler.waiting.extend([a, b])
    plan = scheduler.schedule()
    assert [(s.request.request_id, c) for s, c in plan.first] == [("a", 3), ("b", 7)]
    for seq, count in plan.first:
        compute(table, seq, count)
    a.sequences[0].status = DECODE
    a.sequences[0].tokens.append(9)  # its first token was chosen
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.decode] == ["a"]
    assert [(s.request.request_id, c) for s, c in plan.extend] == [("b", 9)]  # 10 - 1 decode
    assert plan.tokens == 10


def test_requests_wait_for_slots_and_come_in_order():
    _cache, table, scheduler = make(slots=2, seqs=8)
    states = [request(str(i), [1, 2, 3]) for i in range(3)]
    big = request("n3", [4, 5], n=2)
    scheduler.waiting.extend([*states, big])
    plan = scheduler.schedule()
    assert [s.request.request_id for s, _ in plan.first] == ["0", "1"]
    assert [s.request_id for s in scheduler.waiting] == ["2", "n3"]
    for seq, count in plan.first:
        compute(table, seq, count)
        seq.status = DECODE
    scheduler.finish(states[0].sequences[0])
    assert table.free_count == 1
    plan = scheduler.schedule()
    assert [s.request.request_id for s, _ in plan.first] == ["2"]
    assert [s.request.request_id for s in plan.decode] == ["1"]
    compute(table, plan.first[0][0], 3)
    plan.first[0][0].status = DECODE
    # n=2 needs two slots: it waits, and nothing behind it overtakes it
    scheduler.waiting.append(request("late", [1]))
    plan = scheduler.schedule()
    assert not plan.first and [s.request_id for s in scheduler.waiting] == ["n3", "late"]
    assert len(plan.decode) == 2
    for state in (states[1], states[2]):
        scheduler.finish(state.sequences[0])
    plan = scheduler.schedule()
    assert [s.request.request_id for s, _ in plan.first] == ["n3", "late"][:1]
    assert [s.status for s in big.sequences] == [PREFILL, FORK]


def test_max_num_seqs_bounds_what_holds_a_slot():
    _cache, _table, scheduler = make(slots=4, seqs=2)
    scheduler.waiting.extend(request(str(i), [1, 2]) for i in range(3))
    scheduler.schedule()
    assert scheduler.held == 2 and len(scheduler.waiting) == 1


def test_a_finished_prompt_is_reused_from_its_free_slot_without_a_copy():
    cache, table, scheduler = make(block=4)
    prompt = list(range(10, 21))  # 11 tokens: two whole blocks before the last token
    first = request("a", prompt)
    scheduler.waiting.append(first)
    seq = scheduler.schedule().first[0][0]
    compute(table, seq, len(prompt))
    cache.arrays["past_key_values.0.key"][seq.slot.index, :, :11] = 7.0
    slot = seq.slot
    scheduler.finish(seq)
    again = request("b", [*prompt[:9], 99, 98])
    scheduler.waiting.append(again)
    plan = scheduler.schedule()
    leader = again.sequences[0]
    assert leader.slot is slot and leader.computed == 8 and again.cached == 8
    assert [(s.request.request_id, c) for s, c in plan.extend] == [("b", 3)]
    assert slot.tokens == prompt[:8]  # what lies past the hit is forgotten


def test_a_prefix_held_by_a_running_sequence_is_copied():
    cache, table, scheduler = make(block=4)
    prompt = list(range(30, 39))
    scheduler.waiting.append(request("a", prompt))
    running = scheduler.schedule().first[0][0]
    compute(table, running, len(prompt))
    keys = cache.arrays["past_key_values.0.key"]
    keys[running.slot.index, :, :9] = np.arange(9, dtype=np.float32)[None, :, None]
    follower = request("b", prompt)
    scheduler.waiting.append(follower)
    scheduler.schedule()
    seq = follower.sequences[0]
    assert seq.slot is not running.slot and seq.computed == 8
    np.testing.assert_array_equal(keys[seq.slot.index, :, :8], keys[running.slot.index, :, :8])


def test_a_hash_collision_never_serves_another_prompts_cache():
    _cache, table, scheduler = make(block=4)
    scheduler.waiting.append(request("a", list(range(1, 10))))
    seq = scheduler.schedule().first[0][0]
    compute(table, seq, 9)
    seq.slot.tokens[5] = 1000  # the hashes now point at tokens that differ
    found, hit = table.lookup(list(range(1, 10)))
    assert hit == 4 and found is seq.slot  # only the block that still matches


def test_a_prompt_is_found_only_under_its_own_tenant_and_salt():
    """The chain starts from the request's tenant and cache_salt (kvcache.salt): the same
    prompt under another tenant or salt finds nothing, free or running, and its n > 1 forks
    write under its salt; under its own it is found."""
    _cache, table, scheduler = make(slots=8, seqs=8, budget=64, block=4)
    prompt = list(range(40, 49))

    def asked(rid, tenant="", salt="", n=1):
        state = RequestState(
            GenerationRequest(rid, prompt, SamplingParams(), n, tenant=tenant, cache_salt=salt),
            None,
            0.0,
        )
        scheduler.waiting.append(state)
        scheduler.schedule()
        return state

    first = asked("a", tenant="A", n=2)
    compute(table, first.sequences[0], len(prompt))
    assert first.cached == 0 and all(s.slot.salt == first.salt != 0 for s in first.sequences)
    for rid, tenant, salt in (("b", "B", ""), ("c", "A", "x"), ("d", "", "")):
        other = asked(rid, tenant, salt)  # the prompt is running in A's slot: not copied
        assert other.cached == 0 and other.sequences[0].computed == 0, rid
    assert asked("e", tenant="A").cached == 8  # A's own: copied from its running slot
    scheduler.finish(first.sequences[0])
    assert table.lookup(prompt, salt=first.salt)[1] == 8
    assert table.lookup(prompt, salt=0) == (None, 0)


def test_without_prefix_caching_nothing_is_kept():
    _cache, table, scheduler = make(caching=False)
    scheduler.waiting.append(request("a", list(range(1, 10))))
    seq = scheduler.schedule().first[0][0]
    compute(table, seq, 9)
    scheduler.finish(seq)
    assert table.lookup(list(range(1, 10))) == (None, 0)
    assert all(not s.tokens for s in table.slots)


def test_swapping_rows_moves_data_tokens_and_index():
    cache, table, _scheduler = make(block=2)
    a, b = table.slots[0], table.slots[3]
    table.take("x", prefer=a)
    table.written(a, [5, 6, 7])
    cache.arrays["past_key_values.0.value"][0, :, :3] = 1.5
    table.swap(a, b)
    assert a.index == 3 and b.index == 0 and table.slots[3] is a
    assert (cache.arrays["past_key_values.0.value"][3, :, :3] == 1.5).all()
    assert table.lookup([5, 6, 7]) == (a, 2)
    assert 0 in table.free and 3 not in table.free  # the free row moved with its slot


def _of(tenant: str, rid: str) -> RequestState:
    return RequestState(
        GenerationRequest(rid, [1, 2, 3], SamplingParams(), 1, tenant=tenant), None, 0.0
    )


def test_the_waiting_queue_takes_tenants_in_turn_and_each_in_its_order():
    """A tenant with many requests waiting delays another's next one by one request, not by
    all of them (a red team's 1,008 queued over gRPC kept another tenant waiting 140 s)."""
    _cache, _table, scheduler = make(slots=1, seqs=1, budget=100)
    scheduler.enqueue([_of("a", f"a{i}") for i in range(4)])
    scheduler.enqueue([_of("b", "b0"), _of("b", "b1")])
    scheduler.enqueue([_of("c", "c0")])
    order = [s.request_id for s in scheduler.waiting]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert (scheduler.waiting_of("a"), scheduler.waiting_of("b")) == (4, 2)
    (admitted,) = scheduler.schedule().first  # one slot: a0 runs
    assert admitted[0].request.request_id == "a0" and scheduler.waiting_of("a") == 3
    scheduler.enqueue([_of("c", "c1"), _of("a", "a4")])  # after the others' next turns
    order = [s.request_id for s in scheduler.waiting]
    assert order == ["b0", "c0", "a1", "b1", "c1", "a2", "a3", "a4"]
    assert scheduler.drop_waiting(scheduler.waiting[0]) and scheduler.waiting_of("b") == 1


def test_without_tenants_the_queue_is_first_come_first_served():
    _cache, _table, scheduler = make(slots=1, seqs=1, budget=100)
    for i in range(5):
        scheduler.enqueue([_of("", f"r{i}")])
    assert [s.request_id for s in scheduler.waiting] == [f"r{i}" for i in range(5)]


def test_a_tenants_requests_that_left_unadmitted_cost_it_no_turns():
    _cache, _table, scheduler = make(slots=1, seqs=1, budget=100)
    gone = [_of("a", f"a{i}") for i in range(3)]
    scheduler.enqueue([*gone, _of("b", "b0"), _of("b", "b1")])
    for state in gone:  # cancelled while waiting
        assert scheduler.drop_waiting(state)
    scheduler.enqueue([_of("a", "a3")])
    # its turn comes after b0, which came first, and before b1 (not after all of b)
    assert [s.request_id for s in scheduler.waiting] == ["b0", "a3", "b1"]
