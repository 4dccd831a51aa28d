"""A read of a model holds --max-read-bytes of the server's memory budget while it runs
(``server/control/read_charge.py``): a client's read without room is refused at once naming
both flags, a repository's read waits for room, and the charge is given back after."""

from __future__ import annotations

import threading
import time

import pytest

from plugserve.plugins import reading
from plugserve.plugins.api import ResourceExhausted
from plugserve.server.control.read_charge import read_charge
from plugserve.server.plane.budget import MemoryBudget

MB = 1 << 20


@pytest.fixture
def read_bytes():
    before = reading.limits()
    reading.set_limits(reading.ReadLimits(32 * MB, before.seconds, before.max_nodes))
    yield 32 * MB
    reading.set_limits(before)


def test_a_read_holds_its_bound_while_it_runs(read_bytes):
    budget = MemoryBudget(100 * MB)
    with read_charge(budget, "QueryNetwork"):
        assert budget.used == read_bytes
    assert budget.used == 0


def test_a_clients_read_without_room_is_refused_at_once(read_bytes):
    budget = MemoryBudget(100 * MB)
    held = budget.charge(80 * MB, "a request")
    began = time.monotonic()
    with pytest.raises(ResourceExhausted) as refused, read_charge(budget, "QueryNetwork"):
        pass
    assert time.monotonic() - began < 1
    assert "--max-read-bytes" in str(refused.value)
    assert "--max-inflight-bytes" in str(refused.value)
    held.release()
    assert budget.used == 0


def test_a_repository_read_waits_for_room(read_bytes):
    budget = MemoryBudget(100 * MB)
    held = budget.charge(80 * MB, "a request")
    threading.Timer(0.3, held.release).start()
    began = time.monotonic()
    with read_charge(budget, "network 'm'", wait=True):
        assert budget.used == read_bytes
    assert time.monotonic() - began >= 0.25
    assert budget.used == 0


def test_a_budget_smaller_than_a_read_is_charged_whole(read_bytes):
    budget = MemoryBudget(8 * MB)
    with read_charge(budget, "QueryNetwork"):
        assert budget.used == 8 * MB
    with read_charge(MemoryBudget(0), "QueryNetwork"):  # no budget: nothing counted
        pass


def test_the_default_bound_follows_the_budget():
    from plugserve.server.process.settings import Settings

    assert Settings().read_bytes(0) == 256 * MB  # no budget
    assert Settings().read_bytes(64 * MB) == 16 * MB  # a quarter, at least 16 MiB
    assert Settings().read_bytes(1 << 30) == 256 * MB  # a quarter, at most 256 MiB
    chosen = Settings.load(environ={"PLUGSERVE_MAX_READ_BYTES": str(5 * MB)})
    assert chosen.read_bytes(1 << 30) == 5 * MB
    flagged = Settings.from_argv(["--max-read-seconds", "2", "--max-model-nodes", "9"])
    assert (flagged.max_read_seconds, flagged.max_model_nodes) == (2.0, 9)
