"""The KV disk tier's rules (server/apps/generate/engine/kv_disk_tier.py) beneath the real host
tier, scheduler, slot table, cache arrays, runner restore and memory budget (the parts
tests/generate/test_kv_host_tier.py drives), its files in a real directory: what the host tier
drops goes to disk and comes back as the very bytes; the bound; files that fail their check
(another model, truncated, a flipped byte) are deleted, never served; another salt's blocks are
never served; a new tier on the same directory (a restart) keeps the valid blocks; a full write
queue drops a block rather than wait, and the queued blocks stay charged to the budget; a
request's blocks are read ahead while it waits (so its admission reads no file), charged to the
budget until it is admitted or leaves the queue, and bounded across the queue; a size
over the directory's free space stops a real model's load (InvalidArgument); close returns
past a hung write, its queued blocks' charges given back. The
served path (a real server, the openai client, a restart) is
tests/generate/test_openai_kv_disk.py."""

from __future__ import annotations

import contextlib
import os
import threading

import numpy as np
import pytest
from test_kv_host_tier import BLOCK, BLOCK_BYTES, Engine, expected, prompts

from plugserve.plugins.api import InvalidArgument
from plugserve.server.apps.generate.engine.kv_disk_tier import (
    CLOSE_WRITE_S,
    STAGE_QUEUE,
    STAGE_WAIT_S,
    DiskEntry,
    DiskTier,
)
from plugserve.server.apps.generate.engine.kvcache import salt
from plugserve.server.apps.generate.engine.scheduler import RequestState
from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams
from plugserve.server.plane.budget import MemoryBudget

#: the host tier's blocks as the disk tier files them (HostTier.disk_shape: the cache's bytes)
SHAPE = (1, 1, BLOCK, BLOCK_BYTES // BLOCK)


def disk_tier(tmp_path, blocks: int = 64, identity: bytes = b"model-a", **kw) -> DiskTier:
    """A disk tier of ``blocks`` files in ``tmp_path``/blocks."""
    probe = DiskTier(tmp_path / "probe", 1 << 20, identity, SHAPE, np.uint8)
    probe.close()
    size = blocks * probe.file_bytes
    return DiskTier(tmp_path / "blocks", size, identity, SHAPE, np.uint8, **kw)


def with_disk(tmp_path, host_blocks: int = 3, budget=None, **kw) -> Engine:
    """The host-tier test's engine, its host tier ``host_blocks`` blocks, a disk tier under it."""
    engine = Engine(max_bytes=host_blocks * BLOCK_BYTES, budget=budget)
    engine.tier.disk = disk_tier(tmp_path, **kw)
    engine.tier.disk.budget = budget  # as the engine's: read-ahead blocks charged
    return engine


def spill(engine: Engine, *chains: list[int], tenant: str = "", length: int = 13) -> None:
    """``chains`` run, then three others of ``length`` tokens, so that their blocks leave the
    slots and the host tier (three blocks) for disk; the writer done."""
    for prompt in chains:
        engine.run(prompt, tenant=tenant)
    for prompt in prompts(3, length, start=50_000):
        engine.run(prompt)
    engine.tier.disk.flush()


def files(tmp_path) -> list[str]:
    return sorted(n for n in os.listdir(tmp_path / "blocks") if n.endswith(".kvb"))


def test_blocks_the_host_tier_drops_are_restored_from_disk_as_they_were(tmp_path):
    engine = with_disk(tmp_path)
    a = prompts(1, 13)[0]
    spill(engine, a)
    assert engine.tier.match([*a, 1], 0) == []  # not in the host tier any more
    assert len(engine.tier.disk.match([*a, 1], 0, 0)) == 3
    again = engine.run([*a, 7, 8, 9])
    assert again.cached == 12 and engine.tier.disk.restored_tokens == 12
    engine.check(again)  # the very bytes computing them wrote


def test_the_host_blocks_first_then_the_disk_blocks_after_them(tmp_path):
    engine = with_disk(tmp_path, host_blocks=5)
    a = prompts(1, 17)[0]  # four blocks: the host tier keeps its first one, disk the others
    spill(engine, a, length=17)
    on_host = len(engine.tier.match([*a, 1], 0))
    assert 0 < on_host < 4
    engine.table.forget(engine.table.slots[:1])  # a spare slot: the admission evicts nothing
    state = engine.run([*a, 1])
    assert state.cached == 16
    assert engine.tier.disk.restored_tokens == (4 - on_host) * BLOCK
    engine.check(state)


def test_the_bound_holds(tmp_path):
    engine = with_disk(tmp_path, blocks=5)
    disk = engine.tier.disk
    for prompt in prompts(8, 13):
        engine.run(prompt)
    disk.flush()
    assert disk.written_blocks > 5
    assert len(files(tmp_path)) == len(disk.entries) <= 5
    assert disk.nbytes == len(disk.entries) * disk.file_bytes <= disk.max_bytes
    assert sum(os.path.getsize(tmp_path / "blocks" / n) for n in files(tmp_path)) == disk.nbytes


def test_a_restart_keeps_the_valid_blocks(tmp_path):
    engine = with_disk(tmp_path)
    a = prompts(1, 13)[0]
    spill(engine, a, tenant="alice")
    engine.tier.disk.close()
    kept = files(tmp_path)
    later = with_disk(tmp_path)  # a new cache, host tier and index: only the files are left
    assert files(tmp_path) == kept and len(later.tier.disk.entries) == len(kept)
    state = later.run([*a, 5], tenant="alice")
    assert state.cached == 12
    row = next(s for s in later.table.slots if s.tokens[:12] == a[:12]).index
    for i, array in enumerate(later.cache.arrays.values()):  # what the first engine computed
        for position in range(12):
            want = expected(a, position, i)
            np.testing.assert_array_equal(array[row, :, position], want)


def test_files_that_fail_their_check_are_deleted_not_served(tmp_path):
    engine = with_disk(tmp_path)
    a, b, c = prompts(3, 13)
    spill(engine, a, b, c)
    engine.tier.disk.close()
    names = files(tmp_path)
    assert len(names) >= 9
    truncated, flipped = tmp_path / "blocks" / names[0], tmp_path / "blocks" / names[1]
    truncated.write_bytes(truncated.read_bytes()[:-5])
    raw = bytearray(flipped.read_bytes())
    raw[-40] ^= 1  # a payload byte
    flipped.write_bytes(bytes(raw))
    later = with_disk(tmp_path)
    assert later.tier.disk.refused_files == 2
    assert files(tmp_path) == names[2:]
    other = disk_tier(tmp_path, identity=b"model-b")  # another model's folder, same name
    assert other.refused_files == len(names) - 2 and files(tmp_path) == []


def test_a_file_spoiled_after_start_is_refused_at_restore(tmp_path):
    engine = with_disk(tmp_path)
    a = prompts(1, 13)[0]
    spill(engine, a)
    entries = engine.tier.disk.match([*a, 1], 0, 0)
    path = tmp_path / "blocks" / (entries[1].digest.hex() + ".kvb")
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 1
    path.write_bytes(bytes(raw))
    state = engine.run([*a, 1])
    assert state.cached == BLOCK  # the first block restored, the rest computed
    assert engine.tier.disk.refused_files == 1 and not path.exists()
    engine.check(state)


def test_another_salt_is_never_served_from_disk(tmp_path):
    engine = with_disk(tmp_path)
    a = prompts(1, 13)[0]
    spill(engine, a, tenant="alice")
    assert engine.tier.disk.match([*a, 1], salt("mallory"), 0) == []
    assert engine.tier.disk.match([*a, 1], 0, 0) == []
    assert engine.run([*a, 1], tenant="mallory").cached == 0
    assert engine.run([*a, 2], tenant="alice").cached == 12


def test_a_full_queue_drops_the_block_and_queued_blocks_stay_charged(tmp_path):
    budget = MemoryBudget(64 * BLOCK_BYTES)
    engine = with_disk(tmp_path, budget=budget, queue_blocks=1)
    disk = engine.tier.disk
    with disk.lock:  # the writer stalls on its index: nothing it takes is written meanwhile
        for prompt in prompts(6, 13):
            engine.run(prompt)  # returns: the loop never waits on the writer
        assert disk.skipped_blocks > 0 and disk.written_blocks == 0
        assert budget.used > engine.tier.nbytes  # the queued blocks' bytes still charged
    disk.flush()
    assert budget.used == engine.tier.nbytes
    # each block the host tier dropped was written, or skipped (the queue full)
    assert disk.written_blocks + disk.skipped_blocks == engine.tier.dropped_blocks
    assert 0 < disk.written_blocks <= 2  # the block the writer held, and the queue's one


def hung_disk(engine: Engine, tmp_path, prompt: list[int]) -> list:
    """``prompt``'s blocks spilled to disk, then each block file replaced by a FIFO nobody
    writes (a read of it waits, as on a hung disk); the FIFOs."""
    spill(engine, prompt)
    fifos = [tmp_path / "blocks" / name for name in files(tmp_path)]
    for path in fifos:
        path.unlink()
        os.mkfifo(path)
    return fifos


def answer(fifos: list, done) -> None:
    """Each FIFO the reader is in given an end of file (a writer opens and closes it), until
    ``done()`` (at most ~10 s)."""
    for _ in range(200):
        if done():
            return
        for path in fifos:
            with contextlib.suppress(OSError):  # ENXIO: the reader is not in this one (yet)
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _waiting(engine: Engine, prompt: list[int], tenant: str = "") -> RequestState:
    """A request as the engine queues it: its blocks read ahead by the disk tier's reader."""
    request = GenerationRequest(str(id(prompt)), prompt, SamplingParams(), 1, tenant=tenant)
    state = RequestState(request, None, 0.0)
    state.staging = engine.runner.stage(prompt, state.salt, lambda: None)
    assert state.staging is not None and state.staging.done.wait(5)
    return state


def test_blocks_are_read_while_the_request_waits_and_charged_until_it_leaves(tmp_path):
    budget = MemoryBudget(64 * BLOCK_BYTES)
    engine = with_disk(tmp_path, budget=budget)
    disk = engine.tier.disk
    a = prompts(1, 13)[0]
    spill(engine, a)
    used = budget.used
    gone = _waiting(engine, [*a, 9])  # read ahead, then it leaves the queue (an abort)
    assert budget.used == used + 3 * disk.payload_bytes
    engine.scheduler.waiting.append(gone)
    assert engine.scheduler.drop_waiting(gone) and gone.staging is None
    assert budget.used == used
    state = _waiting(engine, [*a, 7])
    for name in files(tmp_path):  # no file left: what its admission restores was read ahead
        os.remove(tmp_path / "blocks" / name)
    engine.scheduler.waiting.append(state)
    engine.scheduler.schedule()
    assert state.cached == 12 and disk.restored_tokens == 12 and state.staging is None
    row = state.sequences[0].slot.index
    for i, array in enumerate(engine.cache.arrays.values()):
        for position in range(12):
            np.testing.assert_array_equal(array[row, :, position], expected(a, position, i))
    assert disk.staged.nbytes == 0


def test_what_is_read_ahead_is_bounded(tmp_path):
    engine = with_disk(tmp_path)
    disk = engine.tier.disk
    a, b = prompts(2, 13)
    spill(engine, a, b)
    disk.staged.limit = 4 * disk.payload_bytes  # the engine's: the host tier's bound
    first, second = _waiting(engine, [*a, 1]), _waiting(engine, [*b, 1])
    assert len(first.staging.blocks) == 3 and len(second.staging.blocks) == 1
    assert disk.staged.nbytes == 4 * disk.payload_bytes
    engine.scheduler.waiting.extend([first, second])
    engine.scheduler.drop_waiting(first)
    engine.scheduler.drop_waiting(second)
    assert disk.staged.nbytes == 0


def test_a_request_whose_reads_are_under_way_is_set_aside_and_keeps_its_slot(tmp_path):
    """Two slots; the queue: ``first``, whose blocks' files do not answer (FIFOs nobody writes:
    a hung disk), then two others. The second is admitted at once into the slot ``first``
    leaves, the third waits for ``first``'s (kept for it); once the reader is done, ``first``
    is admitted before the third. Before, nothing behind ``first`` was admitted until its
    reads ended (up to STAGE_WAIT_S)."""
    engine = with_disk(tmp_path)
    scheduler = engine.scheduler
    a = prompts(1, 13)[0]
    fifos = hung_disk(engine, tmp_path, a)
    first = RequestState(GenerationRequest("first", [*a, 1], SamplingParams(), 1), None, 0.0)
    first.staging = engine.runner.stage([*a, 1], first.salt, lambda: None)
    assert first.staging is not None
    second, third = (
        RequestState(GenerationRequest(n, p, SamplingParams(), 1), None, 0.0)
        for n, p in zip(("second", "third"), prompts(2, 5, start=70_000))
    )
    scheduler.waiting.extend([first, second, third])
    plan = scheduler.schedule()
    assert [seq.request.request_id for seq, _count in plan.first] == ["second"]
    assert list(scheduler.waiting) == [first, third] and first.sequences[0].slot is None
    assert 0 < scheduler.ready_in() <= STAGE_WAIT_S
    answer(fifos, lambda: first.staging.done.wait(0.05))
    assert first.staging.done.is_set() and scheduler.ready_in() == 0
    plan = scheduler.schedule()  # (the second, not computed here, is planned again)
    assert [seq.request.request_id for seq, _count in plan.first] == ["second", "first"]
    assert first.sequences[0].slot is not None and list(scheduler.waiting) == [third]
    assert first.cached == 0  # an empty file fails its check: computed, never served


def test_close_waits_for_no_hung_read_and_no_queued_prompt(tmp_path):
    """The reader inside a file that does not answer (a FIFO: a hung disk) and its queue full
    of prompts: close returns at once, leaving them unread (done: their requests compute
    their blocks); the reader ends when its read does. Before, close waited for room in the
    full queue without end."""
    engine = with_disk(tmp_path)
    disk = engine.tier.disk
    a = prompts(1, 13)[0]
    fifos = hung_disk(engine, tmp_path, a)
    stagings = []
    while (staging := disk.stage([*a, len(stagings)], 0, lambda: None)) is not None:
        stagings.append(staging)  # the first one hangs the reader; the rest fill its queue
    assert len(stagings) >= STAGE_QUEUE
    closing = threading.Thread(target=disk.close)
    closing.start()
    closing.join(timeout=20)
    assert not closing.is_alive(), "close waited on the hung reader"
    assert disk.stage([*a, 1], 0, lambda: None) is None  # closed: nothing is queued
    answer(fifos, lambda: disk._reader.join(0.05) or not disk._reader.is_alive())
    assert not disk._reader.is_alive()
    assert all(s.done.is_set() for s in stagings)
    assert sum(bool(s.blocks) for s in stagings) == 0  # none read after close


def _drain(fifo) -> None:
    """Read ``fifo`` to its end (a hung write let through), for at most ~10 s."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        for _ in range(1000):
            try:
                if os.read(fd, 1 << 16) == b"":
                    return  # (its writer closed it)
            except BlockingIOError:
                threading.Event().wait(0.01)
    finally:
        os.close(fd)


@pytest.mark.parametrize("queued", [4, 2], ids=["queue-full", "queue-half"])
def test_close_drops_the_blocks_a_hung_write_holds_up_and_gives_back_their_charges(
    tmp_path, queued
):
    """The writer inside a write that does not return (its temporary file a FIFO nobody
    reads: a hung disk), ``queued`` blocks behind it: close returns within CLOSE_WRITE_S, the
    queued blocks dropped and their charges given back; the writer ends when its write does,
    its own block's charge given back then. Before, close waited without end for room in a
    full queue (a model's unload hung), each queued block's bytes charged meanwhile."""
    budget = MemoryBudget(64 * BLOCK_BYTES)
    disk = disk_tier(tmp_path, queue_blocks=4)
    data = np.zeros(SHAPE, np.uint8)
    entries = [DiskEntry(bytes([n]) * 32, n, None, 0, tuple(range(BLOCK))) for n in range(1, 6)]
    hung = disk._path(entries[0].digest).with_suffix(".tmp")
    os.mkfifo(hung)
    closing = threading.Thread(target=disk.close)
    try:
        assert disk.offer(entries[0], data, budget.charge(data.nbytes, "block"))
        for _ in range(500):  # the writer takes it, and hangs opening the FIFO
            if disk._queue.qsize() == 0:
                break
            threading.Event().wait(0.01)
        for entry in entries[1 : 1 + queued]:
            assert disk.offer(entry, data, budget.charge(data.nbytes, "block"))
        full = not disk.offer(DiskEntry(b"\7" * 32, 7, None, 0, ()), data)
        assert full == (queued == 4)
        assert budget.used == (1 + queued) * data.nbytes
        closing.start()
        closing.join(timeout=CLOSE_WRITE_S + 10)
        assert not closing.is_alive(), "close waited on the hung write"
        assert budget.used == data.nbytes  # only the block inside the write
        assert disk.skipped_blocks == queued + 1  # and the last offer's: refused or dropped
        assert not disk.pending.keys() - {entries[0].digest}
        assert not disk.offer(entries[1], data)  # closed: nothing more is queued
    finally:
        _drain(hung)
        disk._thread.join(timeout=10)
        closing.join(timeout=10)
    assert not disk._thread.is_alive()
    assert budget.used == 0 and disk.written_blocks == 1


def test_a_size_over_the_free_space_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="free"):
        DiskTier(tmp_path, 1 << 62, b"model-a", SHAPE, np.uint8)


def test_the_salt_is_the_same_in_every_process():
    import subprocess
    import sys

    code = "from plugserve.server.apps.generate.engine.kvcache import salt; print(salt('t', 's'))"
    runs = {subprocess.check_output([sys.executable, "-c", code], text=True) for _ in range(2)}
    assert runs == {f"{salt('t', 's')}\n"}
    assert salt() == 0 and salt("t") != salt("", "t")


def test_offer_skips_a_block_on_disk_already(tmp_path):
    disk = disk_tier(tmp_path)
    entry = DiskEntry(b"\1" * 32, 1, None, 0, tuple(range(BLOCK)))
    data = np.zeros(SHAPE, np.uint8)
    assert disk.offer(entry, data)
    disk.flush()
    assert not disk.offer(entry, data)
    assert disk.written_blocks == 1


def test_the_config_keys_and_flags():
    from plugserve.server.apps.generate.engine.engine import EngineSettings
    from plugserve.server.apps.generate.network import engine_settings
    from plugserve.server.process.settings import Settings

    keys = {"KV_DISK_PATH": "/var/cache/kv", "KV_DISK_SIZE": "2.5"}
    settings, rest = engine_settings(EngineSettings(), keys)
    assert (settings.kv_disk_path, settings.kv_disk_size, rest) == ("/var/cache/kv", 2.5, {})
    with pytest.raises(InvalidArgument, match="KV_DISK_SIZE"):
        engine_settings(EngineSettings(), {"KV_DISK_SIZE": "-1"})
    # the flags (and env, tests/server/test_settings.py) reach the engine; off by default
    flags = Settings.from_argv(["--kv-disk-path", "/d", "--kv-disk-size", "3"])
    defaults = flags.generate_defaults()
    assert (defaults.kv_disk_path, defaults.kv_disk_size) == ("/d", 3.0)
    off = Settings.load(None, {}).generate_defaults()
    assert (off.kv_disk_path, off.kv_disk_size) == ("", 0.0)


def test_a_model_whose_disk_size_is_over_the_free_space_does_not_load(core, llm_folder, tmp_path):
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available here")
    folder = llm_folder("tiny-llama", "optimum-onnx")
    keys = {"MAX_NUM_SEQS": "2", "KV_OFFLOADING_SIZE": "0.01", "KV_DISK_PATH": str(tmp_path)}
    with pytest.raises(InvalidArgument, match="free"):
        core.load_network(str(folder), "ORT", {**keys, "KV_DISK_SIZE": "1e9"})
    network = core.load_network(str(folder), "ORT", {**keys, "KV_DISK_SIZE": "0.01"})
    try:
        disk = network.engine.tier.disk
        assert disk is not None and disk.directory.parent == tmp_path
    finally:
        network.close()
