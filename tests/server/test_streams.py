"""The streams executor: queued work, caller-runs work, and the limit of N at once."""

from __future__ import annotations

import threading
import time

import pytest

from plugserve.plugins.api import BackendUnavailable, Cancelled, ResourceExhausted
from plugserve.plugins.streams import StreamsExecutor


def test_run_inline_runs_on_the_callers_thread_with_a_streams_state():
    executor = StreamsExecutor("T", 2, state_factory=lambda i: f"state-{i}")
    try:
        seen = []
        future = executor.run_inline(lambda state: seen.append((state, threading.get_ident())))
        assert future is not None and future.done()
        assert seen == [(seen[0][0], threading.get_ident())]
        assert seen[0][0] in ("state-0", "state-1")
        assert executor.busy == 0
    finally:
        executor.shutdown()


def test_each_stream_runs_once_on_every_streams_state_which_requests_then_reuse():
    made = []
    executor = StreamsExecutor("T", 3, state_factory=lambda i: made.append(i) or f"state-{i}")
    try:
        assert executor.each_stream(lambda state: state) == ["state-0", "state-1", "state-2"]
        assert sorted(made) == [0, 1, 2] and executor.busy == 0
        # requests run on the states made then (a warm-up's), none made again
        seen = [executor.submit(lambda state: state).result(timeout=30) for _ in range(6)]
        assert set(seen) <= {"state-0", "state-1", "state-2"} and sorted(made) == [0, 1, 2]
        with pytest.raises(ValueError, match="boom"):  # an error reaches the caller, streams
            executor.each_stream(lambda state: (_ for _ in ()).throw(ValueError("boom")))
        assert executor.busy == 0  # freed
        executor.shutdown()
        with pytest.raises(BackendUnavailable):
            executor.each_stream(lambda state: state)
    finally:
        executor.shutdown()


def test_run_inline_error_lands_in_the_future_and_frees_the_stream():
    executor = StreamsExecutor("T", 1)
    try:
        future = executor.run_inline(lambda _s: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            future.result()
        assert executor.busy == 0
        assert executor.run_inline(lambda _s: 7).result() == 7
    finally:
        executor.shutdown()


def test_run_inline_declines_while_every_stream_is_busy_or_work_is_queued():
    executor = StreamsExecutor("T", 1)
    release = threading.Event()
    started = threading.Event()

    def hold(_state):
        started.set()
        release.wait(10)
        return "held"

    try:
        first = executor.submit(hold)
        assert started.wait(10)
        assert executor.run_inline(lambda _s: "inline") is None  # the only stream is busy
        queued = executor.submit(lambda _s: "queued")
        release.set()
        assert first.result(10) == "held"
        assert queued.result(10) == "queued"
        assert executor.run_inline(lambda _s: "inline").result() == "inline"
    finally:
        release.set()
        executor.shutdown()


def test_queued_work_waits_for_a_stream_an_inline_caller_holds():
    """A queued request never runs beside an inline one beyond the stream count."""
    executor = StreamsExecutor("T", 1)
    inside = threading.Event()
    release = threading.Event()
    order = []

    def inline_work(_state):
        inside.set()
        release.wait(10)
        order.append("inline")

    try:
        caller = threading.Thread(target=lambda: executor.run_inline(inline_work))
        caller.start()
        assert inside.wait(10)
        queued = executor.submit(lambda _s: order.append("queued"))
        time.sleep(0.2)  # room for a wrong implementation to run it early
        assert order == []
        release.set()
        caller.join(10)
        queued.result(10)
        assert order == ["inline", "queued"]
    finally:
        release.set()
        executor.shutdown()


def test_never_more_than_n_at_once_across_inline_and_queued_work():
    streams = 2
    executor = StreamsExecutor("T", streams, queue_size=1000)
    lock = threading.Lock()
    running = [0, 0]  # now, most seen

    def work(_state):
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return 1

    def caller(results):
        for i in range(30):
            if i % 2:
                future = executor.run_inline(work) or executor.submit(work)
            else:
                future = executor.submit(work)
            results.append(future.result(30))

    try:
        results: list[int] = []
        threads = [threading.Thread(target=caller, args=(results,)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 180
        assert running[1] == streams
    finally:
        executor.shutdown()


def test_full_queue_and_shutdown_refuse_and_cancel_reads_as_cancelled():
    executor = StreamsExecutor("T", 1, queue_size=1)
    release = threading.Event()
    started = threading.Event()
    try:
        executor.submit(lambda _s: (started.set(), release.wait(10)))
        assert started.wait(10)
        waiting = executor.submit(lambda _s: None)
        with pytest.raises(ResourceExhausted, match="queue full"):
            executor.submit(lambda _s: None)
        assert waiting.cancel()
        with pytest.raises(Cancelled):
            waiting.result()
        assert executor.pending == 0
    finally:
        release.set()
        executor.shutdown()
    with pytest.raises(BackendUnavailable):
        executor.submit(lambda _s: None)
    with pytest.raises(BackendUnavailable):
        executor.run_inline(lambda _s: None)


def test_shutdown_finishes_queued_work():
    executor = StreamsExecutor("T", 2)
    futures = [executor.submit(lambda _s, i=i: (time.sleep(0.01), i)[1]) for i in range(10)]
    executor.shutdown(wait=True)
    assert [f.result(0) for f in futures] == list(range(10))
