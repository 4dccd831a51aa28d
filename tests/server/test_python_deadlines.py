"""A client's deadline on a Python model, as Triton keeps it (issue 42): a request still queued
when its deadline passes is answered at once with DEADLINE_EXCEEDED (504) and never reaches the
model; one already in ``execute`` is told (``request.is_cancelled()``); the model's process is
never stopped for it, so the next client is served by the same process, without waiting for
``initialize`` again. A real server and tritonclient over both protocols; the model answers its
process id, so a restart cannot hide."""

from __future__ import annotations

import gc
import re
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serving import wait_for

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

CONFIG = """
name: "slow"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

#: execute takes INPUT0 seconds (in 10 ms steps, returning early once its request is
#: cancelled, and saying so; saying when it starts one of a second or more), then answers the
#: process id; initialize takes 3 s, so a process
#: started again would make the next client wait that long
MODEL = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(3)

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            if seconds >= 1:
                pb_utils.Logger.log_info("[slow] runs a long request")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if request.is_cancelled():
                    pb_utils.Logger.log_info("[slow] saw its request cancelled")
                    break
                time.sleep(0.01)
            pid = pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))
            responses.append(pb_utils.InferenceResponse(output_tensors=[pid]))
        return responses
"""

#: the issue's figures: 40 queued requests with a 50 ms deadline, each answered within 1 s
QUEUED, DEADLINE_US, ANSWERED_WITHIN = 40, 50_000, 1.0

#: the server's own figure in the deadline watch's answer (``dataplane._past_deadline``); a
#: request the stream found past its deadline only when it picked it up says "while queued"
WATCHED = re.compile(r"passed its deadline \(([0-9.]+) s after it was admitted\)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving import RunningServer

    root = tmp_path_factory.mktemp("deadlines")
    (root / "slow" / "1").mkdir(parents=True)
    (root / "slow" / "config.pbtxt").write_text(CONFIG)
    (root / "slow" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    with RunningServer("--model-repository", str(root)) as running:
        yield running


def _client(server, protocol: str):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(server.target)
    return httpclient, httpclient.InferenceServerClient(server.http_target, concurrency=1)


def _infer(server, protocol: str, seconds: float, timeout_us: int | None = None):
    """(seconds the answer took, the process id or the error)."""
    module, client = _client(server, protocol)
    given = module.InferInput("INPUT0", [1], "FP32")
    given.set_data_from_numpy(np.array([seconds], np.float32))
    try:
        start = time.monotonic()
        try:
            answer = client.infer("slow", [given], timeout=timeout_us)
            return time.monotonic() - start, int(answer.as_numpy("PID")[0])
        except InferenceServerException as exc:
            return time.monotonic() - start, exc
    finally:
        client.close()


def _past_deadline(protocol: str, error) -> bool:
    if not isinstance(error, InferenceServerException):
        return False
    if protocol == "grpc":
        return error.status() == "StatusCode.DEADLINE_EXCEEDED"
    return error.status() == "504"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_queued_requests_past_their_deadline_are_answered_at_once(server, protocol):
    """One request keeps the model busy for 2 s; 40 sent behind it with Triton's ``timeout``
    of 50 ms each get DEADLINE_EXCEEDED (504 over HTTP) within 1 s of being sent (before:
    over HTTP, 38 of 40 got nothing within 60 s), and the busy one is answered by the same
    process afterwards."""
    _, pid = _infer(server, protocol, 0.0)
    assert isinstance(pid, int), pid
    # This process times the answers, so it must not pause meanwhile: by this file a test
    # worker's heap is large, and a full collection of it (41 threads allocating start one)
    # stops every thread here at once. In CI at 5fd8d0b, 24 of 40 answers were timed at
    # 2.42-2.45 s together (16 in time); the server's own figures were not kept then.
    gc.collect()
    gc.disable()
    try:
        with ThreadPoolExecutor(QUEUED + 1) as pool:
            running = server.log.count("[slow] runs a long request")
            busy = pool.submit(_infer, server, protocol, 2.0)
            # it runs, so the next ones queue behind it (after a fixed 0.5 s, 17 of 40 were
            # once answered only at the busy one's end, under four test processes on 2 cores)
            started = wait_for(lambda: server.log.count("[slow] runs a long request") > running)
            assert started, "the busy request did not start"
            queued = [
                pool.submit(_infer, server, protocol, 0.0, DEADLINE_US) for _ in range(QUEUED)
            ]
            answers = [future.result(timeout=60) for future in queued]
            _, same = busy.result(timeout=60)
    finally:
        gc.enable()
    wrong = [error for _, error in answers if not _past_deadline(protocol, error)]
    assert not wrong, wrong[:3]
    # the server's figure: its deadline watch answered each (not the stream, at the busy
    # one's end), this long after admitting it
    server_seconds = [WATCHED.search(str(error)) for _, error in answers]
    assert all(server_seconds), [str(e) for _, e in answers if not WATCHED.search(str(e))][:3]
    watched = [float(found.group(1)) for found in server_seconds]
    late = [round(seconds, 3) for seconds, _ in answers if seconds > ANSWERED_WITHIN]
    assert max(watched) <= ANSWERED_WITHIN and not late, (
        f"{len(late)} of {QUEUED} answered after {ANSWERED_WITHIN} s: {late}; the server "
        f"stopped the last five {sorted(watched)[-5:]} s after admitting them"
    )
    assert same == pid, f"the busy request was answered by process {same}, not {pid}"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_deadlines_on_a_working_model_restart_nothing(server, protocol):
    """Six requests with a 50 ms deadline on an execute of 200 ms: each is answered with
    DEADLINE_EXCEEDED, the model sees each cancelled (``is_cancelled()``), and its process
    is the same one before and after: the next client is served without a 3 s initialize
    (before: the process was killed at each deadline)."""
    _, pid = _infer(server, protocol, 0.0)
    seen = server.log.count("[slow] saw its request cancelled")
    for _ in range(6):
        _, error = _infer(server, protocol, 0.2, DEADLINE_US)
        assert _past_deadline(protocol, error), error
    took, after = _infer(server, protocol, 0.0)
    assert after == pid, f"the process was started again: {pid} before, {after} after"
    assert took < 3.0, f"the next client waited {took:.2f} s (a new process's initialize)"
    deadline = time.monotonic() + 10
    while server.log.count("[slow] saw its request cancelled") < seen + 6:
        assert time.monotonic() < deadline, "the model did not see its requests cancelled"
        time.sleep(0.05)
    assert "starting its process again" not in server.log
