"""A Python model's process attacking the server through its own socket (issue 36 item 2, and
the hardening rule: nothing a model's process sends reaches a path that can fault or exhaust
the server). The model is ordinary Triton python-backend code that reaches past
``triton_python_backend_utils`` to the worker's socket and sends what the worker never would:
tensor descriptions that lie outside the memory sent, a BYTES tensor claiming more elements
than its bytes hold, an element type that is not a number, a memfd not sealed against
shrinking and then shrunk (which would SIGBUS a server that mapped it), a header that is not a
JSON object, responses that are no list, an output named and never sent, and hundreds of calls
to the server at once without reading the answers. Each request fails with a reason naming the
model (and the process is started again), the server keeps its threads bounded, and the other
models keep serving."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
"""

#: what the model sends instead of its answer, by INPUT0[0]; then it exits (its process is
#: started again for the next request), except for the call flood, after which it answers
HOSTILE = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

RESPONSE = [{"outputs": ["OUTPUT0"], "error": None, "parameters": "{}"}]


class TritonPythonModel:
    def execute(self, requests):
        worker = pb_utils._worker
        a = pb_utils.get_input_tensor_by_name(requests[0], "INPUT0").as_numpy()
        what = int(a[0])
        reply = {"op": "result", "responses": RESPONSE}
        if what == 1:  # a tensor lying past the end of the arena
            reply.update(arena=True, tensors=[["0/OUTPUT0", "<f4", [1 << 40], 0, 4 << 40]])
            worker.mailbox.send(reply)
        elif what == 2:  # more BYTES elements than its bytes could hold
            reply.update(arena=True, tensors=[["0/OUTPUT0", "BYTES", [1 << 40], 0, 16]])
            worker.mailbox.send(reply)
        elif what == 3:  # an element type that is not a number (numpy would make objects)
            reply.update(arena=True, tensors=[["0/OUTPUT0", "|O", [4], 0, 32]])
            worker.mailbox.send(reply)
        elif what == 4:  # a memfd not sealed, shrunk once sent
            fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 1 << 20)
            reply.update(tensors=[["0/OUTPUT0", "<f4", [4], 0, 16]])
            worker.mailbox.send(reply, fd)
            time.sleep(0.5)  # the server has it by now: shrinking would fault its mapping
            os.ftruncate(fd, 0)
        elif what == 5:  # a header that is not a JSON object
            worker.mailbox.sock.sendmsg([b"[1, 2, 3]"])
        elif what == 6:  # a description that is no list at all
            reply.update(arena=True, tensors={"0/OUTPUT0": "everything"})
            worker.mailbox.send(reply)
        elif what == 8:  # responses that are no list of the request's responses
            reply.update(responses="everything", tensors=[])
            worker.mailbox.send(reply)
        elif what == 9:  # an output named in its response and never sent
            reply.update(tensors=[])
            worker.mailbox.send(reply)
        elif what == 7:  # hundreds of calls at once, their answers never read
            for number in range(300):
                worker.mailbox.send({"op": "call", "what": "is_model_ready", "call": 10**6 + number,
                                     "model_name": "sleepy", "model_version": "", "tensors": []})
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a)])]
        else:
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a)])]
        os._exit(0)
"""

#: a model whose is_ready() takes 0.2 s: each call asking for its readiness holds a thread
SLEEPY = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def is_ready(self):
        time.sleep(0.2)
        return True

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
            for r in requests]
"""


def _entry(root: Path, name: str, model: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from serving import RunningServer

    root = tmp_path_factory.mktemp("hostile-models")
    _entry(root, "hostile", HOSTILE)
    _entry(root, "sleepy", SLEEPY)
    _entry(root, "plain", SLEEPY.replace("time.sleep(0.2)", "pass"))
    with RunningServer("--model-repository", str(root), "--max-request-seconds", "60") as server:
        yield server


def _infer(running, model: str, value: float) -> np.ndarray:
    client = grpcclient.InferenceServerClient(running.target)
    try:
        given = grpcclient.InferInput("INPUT0", [4], "FP32")
        given.set_data_from_numpy(np.full(4, value, np.float32))
        return client.infer(model, [given], client_timeout=60).as_numpy("OUTPUT0")
    finally:
        client.close()


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


@pytest.mark.parametrize(
    ("attack", "words"),
    [
        (1, "lies outside the memory sent"),
        (2, "BYTES elements in 16 bytes"),
        (3, "is not a number"),
        (4, "not sealed against shrinking"),
        (5, "its process ended while running the request"),
        (6, "descriptions are not a list"),
        (8, "its answer holds no list of 1 responses"),
        (9, "output 'OUTPUT0' is named in its response but not sent"),
    ],
)
def test_a_forged_answer_fails_its_request_and_the_server_serves_on(running, attack, words):
    with pytest.raises(InferenceServerException) as refused:
        _infer(running, "hostile", attack)
    assert "python model 'hostile'" in str(refused.value), refused.value
    assert words in str(refused.value), refused.value
    assert running.process.poll() is None
    np.testing.assert_array_equal(_infer(running, "plain", 3.0), np.full(4, 3.0, np.float32))
    # the hostile model's process is started again (or goes on) for its next request
    np.testing.assert_array_equal(_infer(running, "hostile", 0.0), np.zeros(4, np.float32))


def test_a_flood_of_calls_gets_a_bounded_number_of_threads(running):
    """300 readiness calls at once, each holding a thread 0.2 s, never read by the model: the
    server runs them on a few threads of the model's (the rest wait or are refused at once),
    not a thread each; the request itself is answered and the other models serve."""
    pid = running.process.pid
    np.testing.assert_array_equal(_infer(running, "hostile", 0.0), np.zeros(4, np.float32))
    before = _threads(pid)
    np.testing.assert_array_equal(_infer(running, "hostile", 7.0), np.full(4, 7.0, np.float32))
    peak, end = before, time.monotonic() + 2.0
    while time.monotonic() < end:
        peak = max(peak, _threads(pid))
        time.sleep(0.01)
    assert peak - before <= 16, (before, peak)
    np.testing.assert_array_equal(_infer(running, "plain", 2.0), np.full(4, 2.0, np.float32))
    assert running.process.poll() is None
