"""The gRPC handler pool (server/plane/callpool.py): few threads run calls while calls keep
starting; more start when calls wait (declared with ``blocked``) or stall; extra threads leave."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from serving import wait_for

from plugserve.server.plane.callpool import CallPool, blocked


@pytest.fixture
def pools():
    made: list[CallPool] = []

    def make(*args, **kwargs) -> CallPool:
        made.append(CallPool(*args, **kwargs))
        return made[-1]

    yield make
    for pool in made:
        pool.shutdown(wait=True, cancel_futures=True)


def test_calls_run_and_fail_through_their_futures(pools):
    pool = pools(8, 2)
    assert pool.submit(lambda a, b=0: a + b, 2, b=3).result(10) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(10)


def test_no_more_than_active_threads_run_while_calls_keep_starting(pools):
    """200 short calls at once: at most 2 run at a time on 2 threads (the stall bound is far
    away, so nothing else may start one)."""
    pool = pools(64, 2, stall=60)
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    def call() -> None:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        sum(range(2000))
        with lock:
            running[0] -= 1

    for future in [pool.submit(call) for _ in range(200)]:
        future.result(30)
    assert running[1] <= 2
    assert pool.threads <= 2


def test_a_thread_that_waits_as_blocked_lets_another_call_start(pools):
    """One active thread, waiting inside blocked(): the next call starts at once (with a
    stall bound of a minute, nothing else could start it)."""
    pool = pools(8, 1, stall=60)
    release = threading.Event()

    def waiting() -> str:
        with blocked():
            release.wait(30)
        return "waited"

    first = pool.submit(waiting)
    second = pool.submit(lambda: "second")
    assert second.result(10) == "second"
    assert not first.done()
    release.set()
    assert first.result(10) == "waited"


def test_calls_stuck_without_saying_so_make_the_pool_grow(pools):
    """Both active threads hang in a wait nobody declared: after the stall bound a third
    thread takes the queued calls, up to the limit of threads."""
    pool = pools(4, 2, stall=0.05)
    release = threading.Event()
    stuck = [pool.submit(release.wait, 30) for _ in range(2)]
    quick = [pool.submit(lambda i=i: i) for i in range(20)]
    assert [f.result(10) for f in quick] == list(range(20))
    assert not any(f.done() for f in stuck)
    assert 3 <= pool.threads <= 4
    release.set()
    assert all(f.result(10) for f in stuck)


def test_a_call_behind_stuck_ones_starts_within_the_stall_bound_not_the_watchers_nap(pools):
    """Both active threads hang (a load, say): a small call queued a while after the last
    call came starts once the stall bound (5 ms) has passed, not at the watcher's next look
    (it looks every 0.1 s while calls come: a gRPC health probe beside three loads waited
    90-100 ms, every time)."""
    pool = pools(8, 2, stall=0.005)
    release = threading.Event()
    stuck = [pool.submit(release.wait, 30) for _ in range(2)]
    pool.submit(lambda: None).result(10)  # the third thread: the watcher is looking now
    waits = []
    for _ in range(10):
        time.sleep(0.13)  # past the third thread's call: the watcher naps its 0.1 s look
        sent = time.perf_counter()
        pool.submit(lambda: None).result(10)
        waits.append(time.perf_counter() - sent)
    release.set()
    assert all(f.result(10) for f in stuck)
    assert sorted(waits)[len(waits) // 2] < 0.03, waits  # median: the stall, not the nap


def test_a_long_queue_that_moves_gets_no_more_threads(pools):
    """600 calls of ~0.5 ms each on 2 active threads: the last waits ~150 ms, far past the
    stall bound of 20 ms, but calls keep starting, so the pool does not grow (a pool that grew
    on a call's wait alone would reach its 16 threads)."""
    pool = pools(16, 2, stall=0.02)

    def call() -> None:
        end = time.perf_counter() + 0.0005
        while time.perf_counter() < end:
            pass

    for future in [pool.submit(call) for _ in range(600)]:
        future.result(60)
    assert pool.threads <= 4  # a descheduled thread on a loaded machine may look stuck once


def test_no_more_threads_than_max_workers(pools):
    pool = pools(3, 1, stall=0.02)
    release = threading.Event()
    stuck = [pool.submit(release.wait, 30) for _ in range(3)]
    late = pool.submit(lambda: "late")
    time.sleep(0.3)  # many stall bounds: the pool would have grown by now if it could
    assert pool.threads == 3
    assert not late.done()
    release.set()
    assert late.result(10) == "late"
    assert all(f.result(10) for f in stuck)


def test_extra_threads_leave_after_lingering_idle(pools):
    pool = pools(8, 1, stall=0.02, linger=0.2)
    release = threading.Event()
    stuck = pool.submit(release.wait, 30)
    assert pool.submit(lambda: 1).result(10) == 1  # on a second thread, after the stall
    assert pool.threads == 2
    release.set()
    stuck.result(10)
    assert wait_for(lambda: pool.threads == 1, timeout=10)


def test_shutdown_cancels_what_is_queued_and_takes_no_more(pools):
    pool = pools(1, 1, stall=60)
    release = threading.Event()
    running = pool.submit(release.wait, 30)
    queued = pool.submit(lambda: "never")
    threading.Timer(0.2, release.set).start()
    pool.shutdown(wait=True, cancel_futures=True)
    assert running.result(10) is True
    assert queued.cancelled()
    assert pool.threads == 0
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 1)


def test_blocked_outside_a_pool_thread_leaves_every_pool_alone(pools):
    """blocked() on a thread no pool runs (a REST thread, a stream's reader) counts for no
    pool: while the one running thread of a pool is busy, a queued call still waits, however
    long this thread stays inside (the same wait inside the pool's thread starts it at once,
    above)."""
    pool = pools(8, 1, stall=60)
    release, started = threading.Event(), threading.Event()

    def busy() -> str:
        started.set()
        release.wait(30)
        return "first"

    first = pool.submit(busy)
    assert started.wait(10)
    second = pool.submit(lambda: "second")
    with blocked(), blocked():
        assert not wait_for(second.done, 0.5)
    assert not second.done()
    release.set()
    assert first.result(10) == "first"
    assert second.result(10) == "second"
    assert pool.threads == 1


def test_a_long_run_inline_lets_another_call_start(pools, tmp_path):
    """The data plane gives the one running thread's turn away while it runs a request inline
    of a network whose runs are long (the spinner: a Loop as long as the request asks, on
    NUMPY): another call starts while the run goes on (with a stall bound of an hour, nothing
    else could start it), and the run still stops when its request is cancelled."""
    from models import FOREVER
    from sequence_models import spinner

    from plugserve.plugins import cancel
    from plugserve.plugins.errors import Cancelled
    from plugserve.server.control.core import Core
    from plugserve.server.control.model_control import ModelControl
    from plugserve.server.control.repository import Repository
    from plugserve.server.plane.dataplane import LONG_RUN, DataPlane
    from plugserve.server.plane.metrics import Metrics
    from plugserve.server.plane.request import Request
    from plugserve.server.process.settings import Settings

    # the server's two halves without its protocols (server/process/app.py's Server imports the
    # KServe protos, which clash with tritonclient's in one test process)
    s = Settings()
    metrics = Metrics("test")
    plane = DataPlane(metrics, s.max_request_seconds, 1 << 30)
    control = ModelControl(plane, Core(), metrics, Repository(str(tmp_path)), max_networks=4)
    try:
        entry, _ = control.load("spinner", spinner().SerializeToString(), "NUMPY")
        state = np.zeros((1, 4), np.float32)
        plane.infer(Request(entry, {"M": np.array([[2000]]), "STATE_IN": state})).result(60)
        assert entry.run_seconds > LONG_RUN
        pool = pools(8, 1, stall=3600)
        token = cancel.Token()
        endless = {"M": np.array([[FOREVER]]), "STATE_IN": state}
        spinning = pool.submit(
            lambda: plane.infer(Request(entry, endless, inline=True, run=token)).result()
        )
        assert pool.submit(lambda: "answered").result(60) == "answered"
        assert not spinning.done()
        token.cancel(Cancelled("the test is over"))
        with pytest.raises(Cancelled, match="the test is over"):
            spinning.result(60)
    finally:
        plane.cancel_all("the test is over")
        plane.close()
        control.close()
        metrics.close()
