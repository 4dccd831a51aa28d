"""The helper processes that run native code on a client's bytes (``plugins/workers.py``), each
bound driven through a real helper: a program of its own, started by :class:`Worker` with the
server's interpreter, that sleeps, crashes or allocates as its request says."""

from __future__ import annotations

import signal
import textwrap
import time

import pytest

from plugserve.plugins import cancel
from plugserve.plugins.errors import Cancelled
from plugserve.plugins.workers import Crashed, TooLarge, Worker, Workers

PROGRAM = textwrap.dedent(
    """
    import os, signal, time
    from plugserve.plugins.workers import bound_data, serve

    def answer(header, body):
        if header.get("sleep"):
            time.sleep(header["sleep"])
        if header.get("crash"):
            os.kill(os.getpid(), signal.SIGSEGV)
        if header.get("allocate"):
            bound_data(header["max_bytes"])
            try:
                block = bytearray(header["allocate"])
                return {"held": len(block)}, b""
            except MemoryError:
                return {"error": "MemoryError"}, b""
            finally:
                bound_data(0)
        return {"echo": True}, body

    serve(answer)
    """
)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    (tmp_path / "test_helper_program.py").write_text(PROGRAM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    made = Worker("test_helper_program")
    yield made
    made.close()


def test_a_helper_answers_and_stays(worker):
    for _ in range(2):
        assert worker.ask({}, b"model", 10) == ({"echo": True}, b"model")
    assert worker.alive


def test_an_answer_over_its_bound_is_not_read(worker):
    with pytest.raises(TooLarge):
        worker.ask({}, b"x" * 1000, 10, most=100)


def test_a_crash_costs_the_request_only(worker):
    with pytest.raises(Crashed) as crashed:
        worker.ask({"crash": True}, b"", 10)
    assert crashed.value.args[0] == -signal.SIGSEGV


def test_its_data_is_bounded_per_request(worker):
    assert worker.ask({"allocate": 1 << 20, "max_bytes": 64 << 20}, b"", 10)[0] == {"held": 1 << 20}
    answer, _ = worker.ask({"allocate": 1 << 30, "max_bytes": 64 << 20}, b"", 10)
    assert answer == {"error": "MemoryError"}
    assert worker.ask({"allocate": 1 << 20, "max_bytes": 64 << 20}, b"", 10)[0]["held"]


def test_a_late_answer_times_out_and_the_helper_ends_itself(worker):
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        worker.ask({"sleep": 60}, b"", 0.5)
    assert time.monotonic() - started < 5
    # should its server be gone and unable to kill it, the helper ends a few seconds past
    # its request's time (SIGALRM)
    worker.process.wait(15)
    assert worker.process.returncode == -signal.SIGALRM


def test_a_caller_gone_stops_the_wait(worker):
    started = time.monotonic()
    with cancel.stop_when(lambda: time.monotonic() - started > 0.3), pytest.raises(Cancelled):
        worker.ask({"sleep": 60}, b"", 30, what="a test's request")
    assert time.monotonic() - started < 5


def test_an_idle_helper_ends_and_the_next_request_starts_one(tmp_path, monkeypatch):
    (tmp_path / "test_helper_program.py").write_text(PROGRAM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    kept = Workers("test_helper_program", 1, "kept")  # the default idle time, used first:
    with kept.one(10) as long_lived:  # the look must not then sleep for its five minutes
        assert long_lived.alive
    workers = Workers("test_helper_program", 2, "test", idle_seconds=0.5)
    with workers.one(10) as first:
        assert first.ask({}, b"a", 10) == ({"echo": True}, b"a")
    with workers.one(10) as again:  # kept between requests
        assert again is first
    end = time.monotonic() + 10
    while first.alive and time.monotonic() < end:
        time.sleep(0.05)
    assert not first.alive  # ended by the look, with no request
    with workers.one(10) as second:
        assert second is not first and second.ask({}, b"b", 10) == ({"echo": True}, b"b")
    assert workers.retire_idle() == 0  # just used
    assert long_lived.alive  # its five minutes are not over
    second.close()
    long_lived.close()
