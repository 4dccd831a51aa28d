"""A Python model's resources are bounded as documented (issue 42): hostile models against a
real server. Its ``/dev/shm`` files live in a tmpfs of its own (MAX_SHM_BYTES) that the host
never sees and that is gone with the process (before: a model bounded at 256 MiB left 1,258 MB
in the host's ``/dev/shm``, which no restart freed); what it starts goes with it; and what it
prints reaches the server's log bounded and rate-limited while the server serves on."""

from __future__ import annotations

import os
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")

CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_INT64 dims: [ 3 ] }} ]
{extra}
"""

#: INPUT0 1: write 1 MiB files into /dev/shm until it refuses (at most 512 MiB), answering
#: [bytes written, files of ours found there before writing, pid of the child it started];
#: 2: exit (the process is started again for the next request)
SHM = """
import os
import subprocess

import numpy as np
import triton_python_backend_utils as pb_utils

PREFIX = "{prefix}"


class TritonPythonModel:
    def initialize(self, args):
        self.child = subprocess.Popen(["sleep", "600"])

    def execute(self, requests):
        what = int(pb_utils.get_input_tensor_by_name(requests[0], "INPUT0").as_numpy()[0])
        if what == 2:
            os._exit(3)
        before = len([n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)])
        written, block = 0, b"x" * (1 << 20)
        try:
            while written < (512 << 20):
                with open(f"/dev/shm/{{PREFIX}}{{written >> 20}}", "wb") as file:
                    file.write(block)
                written += len(block)
        except OSError:
            pass
        answer = np.array([written, before, self.child.pid], np.int64)
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", answer)])]
"""

#: prints as fast as it can for INPUT0 seconds, on stdout and stderr
FLOOD = """
import sys
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        seconds = float(pb_utils.get_input_tensor_by_name(requests[0], "INPUT0").as_numpy()[0])
        end, count = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            for _ in range(100):
                print("PRINTFLOOD", count, flush=False)
                print("PRINTFLOOD on stderr", count, file=sys.stderr)
                count += 2
        answer = np.array([count, 0, 0], np.int64)
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", answer)])]
"""

SHM_BYTES = 32 << 20
PREFIX = f"plugserve-test-{os.getpid()}-"


def _entry(root: Path, name: str, model: str, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from serving import RunningServer

    root = tmp_path_factory.mktemp("python-resources")
    limits = (
        'parameters { key: "MAX_PROCESS_BYTES" value: { string_value: "268435456" } }\n'
        f'parameters {{ key: "MAX_SHM_BYTES" value: {{ string_value: "{SHM_BYTES}" }} }}'
    )
    _entry(root, "shm", SHM.format(prefix=PREFIX), limits)
    _entry(root, "flood", FLOOD)
    with RunningServer("--model-repository", str(root)) as server:
        yield server
    for name in os.listdir("/dev/shm"):  # none should be there; never leave any
        if name.startswith(PREFIX):
            os.unlink(f"/dev/shm/{name}")


def _infer(running, model: str, value: float):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        given = grpcclient.InferInput("INPUT0", [1], "FP32")
        given.set_data_from_numpy(np.array([value], np.float32))
        return client.infer(model, [given]).as_numpy("OUTPUT0")
    finally:
        client.close()


def _ours() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(PREFIX)]


def test_shm_files_are_bounded_private_and_gone_with_the_process(running):
    """The model writes /dev/shm files until refused: it gets MAX_SHM_BYTES (32 MiB), not the
    host's; the host's /dev/shm never holds them; once its process ends (it exits here), the
    next process finds none, and the subprocess the first one started is gone too."""
    written, before, child = (int(v) for v in _infer(running, "shm", 1))
    if "uses the host's /dev/shm" in running.log:
        pytest.skip("this kernel gives the server no private mount for a model's /dev/shm")
    assert SHM_BYTES - (2 << 20) <= written <= SHM_BYTES, written
    assert before == 0
    assert not _ours(), "the model's files are in the host's /dev/shm"
    with pytest.raises(Exception, match="exit code 3"):
        _infer(running, "shm", 2)
    written, before, new_child = (int(v) for v in _infer(running, "shm", 1))
    assert before == 0, "the files of the process that ended outlived it"
    assert SHM_BYTES - (2 << 20) <= written <= SHM_BYTES, written
    assert new_child != child
    deadline = time.monotonic() + 10
    while _alive(child):  # stopped with its process's group
        assert time.monotonic() < deadline, f"the model's subprocess {child} outlived it"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_model_printing_in_a_loop_is_rate_limited(running):
    """Four seconds of printing as fast as it can (hundreds of thousands of lines): the log
    gets at most the burst and 20 lines a second of it, says lines were dropped, and the
    server's health answers throughout."""
    seen = sum("PRINTFLOOD" in line for line in running.lines)
    health: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            with urllib.request.urlopen(f"{running.http_url}/v2/health/live", timeout=30):
                health.append(time.monotonic() - start)
            time.sleep(0.25)

    prober = threading.Thread(target=probe)
    prober.start()
    start = time.monotonic()
    try:
        printed = int(_infer(running, "flood", 4.0)[0])
    finally:
        stop.set()
        prober.join()
    elapsed = time.monotonic() - start
    time.sleep(1.0)  # what was read is logged
    logged = sum("PRINTFLOOD" in line for line in running.lines) - seen
    assert printed > 10 * logged, (printed, logged)
    assert logged <= 200 + 20 * (elapsed + 1.0) + 5, (logged, elapsed)
    assert "lines of its output were dropped" in running.log
    assert health, "the health probe never answered"
