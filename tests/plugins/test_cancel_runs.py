"""``InferRequest.cancel()`` on every device, in process (OpenVINO's cancel): a run that would
not end stops with Cancelled, synchronous (cancelled from another thread) or started with
``start_async``, and the request serves the next run as before."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from models import FOREVER, spin_loop

from plugserve.plugins import cancel
from plugserve.plugins.api import Cancelled, DeadlineExceeded
from plugserve.plugins.streams import StreamsExecutor

DEVICES = ["NUMPY", "ORT", "HETERO:OPENVINO,NUMPY", "MULTI:NUMPY,ORT", "AUTO", "BATCH:NUMPY(2)"]


def _inputs(device: str, trips: int) -> dict[str, np.ndarray]:
    if device.startswith("BATCH"):
        return {"M": np.array([trips], np.int64), "x": np.ones((1, 4), np.float32)}
    return {"M": np.array(trips, np.int64), "x": np.ones(4, np.float32)}


@pytest.fixture(scope="module")
def networks(core):
    loaded = {}
    for device in DEVICES:
        kinds = device.replace(":", ",").replace("(2)", "").split(",")
        if all(k in core.available_devices for k in kinds):
            loaded[device] = core.load_network(spin_loop(device.startswith("BATCH")), device)
    return loaded


@pytest.mark.parametrize("device", DEVICES)
def test_cancel_stops_a_synchronous_run_from_another_thread(networks, device):
    if device not in networks:
        pytest.skip(f"{device} is not available here")
    request = networks[device].create_infer_request()
    timer = threading.Timer(0.3, request.cancel)
    timer.start()
    began = time.monotonic()
    with pytest.raises(Cancelled, match="cancelled"):
        request.infer(_inputs(device, FOREVER))
    assert time.monotonic() - began < 5
    out = request.infer(_inputs(device, 3))  # the same request runs again, not cancelled
    assert np.array_equal(out["y"].reshape(-1), np.full(4, 3.0, np.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_cancel_stops_an_async_run(networks, device):
    if device not in networks:
        pytest.skip(f"{device} is not available here")
    request = networks[device].create_infer_request()
    errors = []
    request.start_async(_inputs(device, FOREVER), callback=lambda out, error: errors.append(error))
    time.sleep(0.3)
    request.cancel()
    with pytest.raises(Cancelled):
        request.wait(5)
    assert isinstance(errors[0], Cancelled)
    request.start_async(_inputs(device, 2))
    assert request.wait(10)["y"].reshape(-1)[0] == 2.0


def test_cancel_with_nothing_running_does_nothing(networks):
    request = networks["NUMPY"].create_infer_request()
    request.cancel()
    assert request.infer(_inputs("NUMPY", 1))["y"][0] == 1.0


def test_a_token_cancelled_before_the_run_stops_it_before_it_starts(networks):
    request = networks["NUMPY"].create_infer_request()
    token = cancel.Token()
    token.cancel(DeadlineExceeded("too late"))
    with cancel.running(token), pytest.raises(DeadlineExceeded, match="too late"):
        request.infer(_inputs("NUMPY", 1))


def test_cancelling_a_running_executor_future_stops_its_run_with_the_tokens_error():
    executor = StreamsExecutor("T", 1)
    started = threading.Event()

    def spin_until_cancelled(_state):
        started.set()
        while True:
            cancel.checkpoint()
            time.sleep(0.001)

    try:
        token = cancel.Token()

        def run(state):
            with cancel.running(token):
                return spin_until_cancelled(state)

        future = executor.submit(run, token=token)
        assert started.wait(5)
        assert future.cancel() is False  # it ran: not "cancelled before it ran"
        with pytest.raises(Cancelled):
            future.result(5)
        # a queued one cancelled by its token leaves the queue with the token's error
        blocker, held = threading.Event(), threading.Event()
        executor.submit(lambda _s: (held.set(), blocker.wait(5)))
        assert held.wait(5)  # the only stream is busy: the next one queues
        late = cancel.Token()
        queued = executor.submit(lambda _s: "ran", token=late)
        late.cancel(DeadlineExceeded("past its deadline"))
        with pytest.raises(DeadlineExceeded, match="past its deadline"):
            queued.result(1)
        assert executor.pending == 0
        blocker.set()
    finally:
        executor.shutdown()


def test_a_run_for_several_requests_stops_only_when_every_one_is_cancelled():
    """cancel.every (BATCH's batches, the sequence batcher's oldest batches): the run's token
    holds while any request still wants the run, is cancelled with the given error by the
    last one, and once forgotten is no longer reached by the requests' tokens."""
    tokens = [cancel.Token() for _ in range(3)]
    run, forget = cancel.every(tokens, lambda: Cancelled("all gone"))
    tokens[0].cancel()
    tokens[2].cancel()
    assert run is not None and not run.cancelled
    tokens[1].cancel()
    assert run.cancelled
    with pytest.raises(Cancelled, match="all gone"):
        run.raise_if_cancelled()

    later = [cancel.Token() for _ in range(2)]
    run, forget = cancel.every(later, lambda: Cancelled("all gone"))
    forget()
    for token in later:
        token.cancel()
    assert run is not None and not run.cancelled

    one = cancel.Token()
    assert cancel.every([one], lambda: Cancelled("x"))[0] is one
    assert cancel.every([one, None], lambda: Cancelled("x"))[0] is None
