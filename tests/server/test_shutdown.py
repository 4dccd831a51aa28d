"""Graceful shutdown of a real server: SIGTERM/SIGINT drain it, nothing admitted is lost.

Requests run on the third-party ``GATED`` device (see test_server_load.py), so they are certainly
in flight when the signal arrives and finish only when the test opens their gate.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import wait_for
from test_server_load import add_model_bytes, gated_server, gauge, site

from plugserve.client import Client
from plugserve.server.plane.children import STOP_SECONDS

tc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

__all__ = ["site"]  # the fixture, re-used from test_server_load

QUEUE = 3
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def feeds(i: int) -> dict[str, np.ndarray]:
    return {"a": np.full(2, i, np.float32), "b": np.array([0.5, 1.5], np.float32)}


def start(site, tmp_path, exit_timeout: float = 30):
    (tmp_path / "models").mkdir()
    running, gates = gated_server(
        site,
        tmp_path,
        "--model-repository",
        str(tmp_path / "models"),
        "--queue-size",
        str(QUEUE),
        "--exit-timeout",  # overrides gated_server's 5 s
        str(exit_timeout),
        plugins={"NUMPY": {}, "GATED": {"config": {"NUM_STREAMS": "1"}}},
    )
    gates.open("load")
    running.start()
    return running, gates


def health(running) -> int | grpc.StatusCode:
    with running.channel() as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                .status
            )
        except grpc.RpcError as exc:
            return exc.code()


def outcome(fn, *args, **kwargs):
    """The result of a call, or ``(status code, message)`` for either client's error."""
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    except InferenceServerException as exc:
        return grpc.StatusCode[exc.status().split(".")[-1]], exc.message()


REST_BODY = json.dumps(
    {"inputs": [{"name": n, "shape": [2], "datatype": "FP32", "data": [1, 2]} for n in "ab"]}
).encode()


def rest_status(running, path: str, body: bytes | None = None) -> tuple[int, str]:
    """Status and error message of a REST call (200, "" when it succeeds)."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{running.http_url}{path}", body), timeout=30
        ) as response:
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc).get("error", "")


def triton_infer(triton, name: str, i: int):
    inputs = [tc.InferInput("a", [2], "FP32"), tc.InferInput("b", [2], "FP32")]
    inputs[0].set_data_from_numpy(feeds(i)["a"])
    inputs[1].set_data_from_numpy(feeds(i)["b"])
    return {"sum": triton.infer(name, inputs, client_timeout=60).as_numpy("sum")}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_admitted_and_queued_requests_then_exits_0(site, tmp_path, signum):
    running, gates = start(site, tmp_path)
    name = "slow"
    try:
        with Client(running.target, timeout=60) as client:
            client.load(name, add_model_bytes(), device="GATED")
            results: dict[int, object] = {}
            threads = [
                threading.Thread(
                    target=lambda i=i: results.__setitem__(i, outcome(client.infer, name, feeds(i)))
                )
                for i in range(1 + QUEUE)
            ]
            threads[0].start()  # takes the stream, so the others certainly fit in the queue
            assert wait_for(lambda: gauge(running, "plugserve_busy_streams", "GATED") == 1)
            for thread in threads[1:]:
                thread.start()
            assert wait_for(lambda: gauge(running, "plugserve_queue_depth", "GATED") == QUEUE)
            running.signal(signum)
            assert wait_for(lambda: health(running) == NOT_SERVING), running.log
            # new requests, loads and KServe calls are refused while the admitted ones wait
            got = outcome(client.infer, name, feeds(9))
            assert got[0] == UNAVAILABLE and "shutting down" in got[1], got
            got = outcome(client.load, "late", add_model_bytes())
            assert got[0] == UNAVAILABLE and "shutting down" in got[1], got
            with tc.InferenceServerClient(running.target) as triton:
                got = outcome(triton_infer, triton, name, 9)
                assert got[0] == UNAVAILABLE and "shutting down" in got[1], got
                got = outcome(triton.load_model, "late")
                assert got[0] == UNAVAILABLE, got
            # and over REST: not ready, new inferences 503
            assert rest_status(running, "/v2/health/ready")[0] == 503
            status, message = rest_status(running, f"/v2/models/{name}/infer", REST_BODY)
            assert status == 503 and "shutting down" in message, message
            assert running.process.poll() is None  # still draining: the gate is closed
            assert not results
            gates.open(name)
            for thread in threads:
                thread.join(60)
        assert not any(t.is_alive() for t in threads)
        for i in range(1 + QUEUE):  # every admitted request got its own result
            assert isinstance(results[i], dict), results[i]
            assert results[i]["sum"].tolist() == (feeds(i)["a"] + feeds(i)["b"]).tolist()
        assert running.process.wait(60) == 0, running.log
        assert "shutdown: every admitted request finished" in running.log
        assert "unexpected error" not in running.log
    finally:
        gates.open(name)
        running.stop()


def test_sigusr2_writes_every_threads_stack_and_the_server_serves_on(site, tmp_path):
    """``kill -USR2``: the stacks show where a request that does not end waits (here in the
    GATED device), and nothing else changes: the request finishes, the server stays SERVING."""
    running, gates = start(site, tmp_path)
    name = "held"
    try:
        with Client(running.target, timeout=60) as client:
            client.load(name, add_model_bytes(), device="GATED")
            result: list[object] = []
            thread = threading.Thread(target=lambda: result.append(client.infer(name, feeds(1))))
            thread.start()
            assert wait_for(lambda: gauge(running, "plugserve_busy_streams", "GATED") == 1)
            running.signal(signal.SIGUSR2)
            assert wait_for(lambda: "in wait_for_gate" in running.log), running.log
            assert "Thread 0x" in running.log  # faulthandler names each thread by its id
            gates.open(name)
            thread.join(60)
            assert result and result[0]["sum"].tolist() == [1.5, 2.5]
            assert health(running) == health_pb2.HealthCheckResponse.SERVING
        assert running.process.poll() is None
    finally:
        gates.open(name)
        running.stop()


def test_killed_under_load_loses_no_admitted_request(site, tmp_path):
    """16 clients (both protocols) keep sending to a full device; SIGTERM arrives. Each call
    ends with its own correct result (it was admitted) or a refusal (RESOURCE_EXHAUSTED before
    the signal, UNAVAILABLE after): nothing admitted is lost, nothing hangs, exit code 0."""
    running, gates = start(site, tmp_path)
    name = "busy"
    n = 16
    capacity = 1 + QUEUE
    outcomes: list[list] = [[] for _ in range(n)]
    try:
        with (
            Client(running.target, timeout=60) as client,
            tc.InferenceServerClient(running.target) as triton,
        ):
            client.load(name, add_model_bytes(), device="GATED")

            def send(k: int) -> None:
                for attempt in range(5000):  # bounded; ends at the first non-refusal
                    i = k * 10_000 + attempt
                    if k % 2:
                        got = outcome(client.infer, name, feeds(i))
                    else:
                        got = outcome(triton_infer, triton, name, i)
                    outcomes[k].append((i, got))
                    if not (
                        isinstance(got, tuple) and got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
                    ):
                        return
                    threading.Event().wait(0.005)

            threads = [threading.Thread(target=send, args=(k,)) for k in range(n)]
            for thread in threads:
                thread.start()
            assert wait_for(lambda: gauge(running, "plugserve_queue_depth", "GATED") == QUEUE)
            running.signal(signal.SIGTERM)
            # the clients that were not admitted are all refused while the gate is still closed
            assert wait_for(lambda: sum(t.is_alive() for t in threads) == capacity), running.log
            assert running.process.poll() is None
            gates.open(name)
            for thread in threads:
                thread.join(60)
            assert not any(t.is_alive() for t in threads)  # nothing left hanging
        assert running.process.wait(60) == 0, running.log
    finally:
        gates.open(name)
        running.stop()
    finals = [calls[-1] for calls in outcomes]
    admitted = [(i, got) for i, got in finals if isinstance(got, dict)]
    refused = [got for _, got in finals if not isinstance(got, dict)]
    assert len(admitted) == capacity, finals
    for i, got in admitted:
        assert got["sum"].tolist() == (feeds(i)["a"] + feeds(i)["b"]).tolist()
    for code, message in refused:
        assert code == UNAVAILABLE and "shutting down" in message, (code, message)
    for calls in outcomes:  # everything before the last call was a full queue
        for _, got in calls[:-1]:
            assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, got
    assert "shutdown: every admitted request finished" in running.log


def test_exit_timeout_bounds_the_drain(site, tmp_path):
    """A request that never finishes does not keep the server up past --exit-timeout: its call
    ends with an error (not a hang) and the process still exits 0."""
    running, gates = start(site, tmp_path, exit_timeout=1)
    name = "never"
    try:
        with Client(running.target, timeout=60) as client:
            client.load(name, add_model_bytes(), device="GATED")
            result: list = []
            thread = threading.Thread(
                target=lambda: result.append(outcome(client.infer, name, feeds(1)))
            )
            thread.start()
            assert wait_for(lambda: gauge(running, "plugserve_busy_streams", "GATED") == 1)
            running.signal(signal.SIGTERM)
            assert running.process.wait(60) == 0, running.log
            thread.join(60)
            assert not thread.is_alive()
            code, _ = result[0]
            assert code in (grpc.StatusCode.CANCELLED, UNAVAILABLE), result
        assert "1 admitted request(s) or load(s) still running" in running.log
    finally:
        gates.open(name)
        running.stop()


# --- a stopped server leaves nothing running (issue 52, finding 11)

HUNG_CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

#: execute writes its process's id (and, for "spins", that of a subprocess it starts) into
#: PIDS_DIR, then never returns: "spins" loops in Python with a child of its own, "stuck" holds
#: the GIL in C (sum over a range), where no thread of its process runs again
HUNG_MODEL = """
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        mark = Path(os.environ["PIDS_DIR"])
        (mark / f"{self.name}-{os.getpid()}").write_text("model")
        if self.name == "spins":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            (mark / f"{self.name}-child-{child.pid}").write_text("child")
            while True:
                pass
        sum(range(1 << 62))
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.zeros(1, np.float32))])]
"""


#: answers its input; its finalize (run at shutdown, as the model is idle) leaves a mark
ECHO_MODEL = """
import os
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", r.inputs()[0].as_numpy())])
            for r in requests
        ]

    def finalize(self):
        (Path(os.environ["PIDS_DIR"]).parent / "echo-finalized").write_text("")
"""


def _stat(pid: int) -> tuple[int, str, str] | None:
    """(parent, state, start time) of a process, None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], fields[19]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(gone)"


def _descendants(root: int) -> dict[int, str]:
    """Every process under ``root`` (pid -> its start time)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (found := _stat(int(entry.name))) is not None:
            parents.setdefault(found[0], []).append(int(entry.name))
            starts[int(entry.name)] = found[2]
    out, todo = {}, [root]
    while todo:
        for pid in parents.get(todo.pop(), []):
            out[pid] = starts[pid]
            todo.append(pid)
    return out


def _running(processes: dict[int, str]) -> list[int]:
    """Those of ``processes`` still running (a zombie has ended; a new process with a reused
    id has another start time)."""
    left = []
    for pid, start in processes.items():
        found = _stat(pid)
        if found is not None and found[2] == start and found[1] not in "ZX":
            left.append(pid)
    return left


def _quietly(running, path: str, body: bytes) -> None:
    """A REST call that the server's end cuts short."""
    with contextlib.suppress(OSError, ValueError):
        rest_status(running, path, body)


def _big_json() -> bytes:
    """A JSON body over the REST helper process's threshold (1 MiB): it starts the helper."""
    n = 300_000
    data = [0.5] * n
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [n], "datatype": "FP32", "data": data}]}
    ).encode()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_server_leaves_no_process_running(tmp_path, signum):
    """Two Python models hung in execute (one spinning in Python with a subprocess of its own,
    one holding the GIL in C), an idle one and the REST helper process: after SIGTERM (exit 0
    within --exit-timeout + STOP_SECONDS + margin, 2.6 s here; the idle model runs finalize)
    or SIGKILL, none of the server's processes runs 30 s later (before: each hung model's
    process stayed, for an hour and more)."""
    from serving import RunningServer

    root, pids = tmp_path / "models", tmp_path / "pids"
    pids.mkdir()
    for name in ("spins", "stuck", "echo"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(HUNG_CONFIG.format(name=name))
    (root / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    for name in ("spins", "stuck"):
        (root / name / "1" / "model.py").write_text(HUNG_MODEL)
    exit_timeout = 2
    running = RunningServer(
        "--model-repository", str(root), "--exit-timeout", str(exit_timeout),
        env={"PIDS_DIR": str(pids)},
    ).start()  # fmt: skip
    started: dict[int, str] = {}
    try:
        status, message = rest_status(running, "/v2/models/echo/infer", _big_json())
        assert status == 200, message
        for name in ("spins", "stuck"):
            body = json.dumps(
                {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1]}]}
            ).encode()
            threading.Thread(
                target=_quietly, args=(running, f"/v2/models/{name}/infer", body), daemon=True
            ).start()
        # both models are in execute, the spinning one's subprocess started
        assert wait_for(lambda: len(list(pids.iterdir())) == 3, 120), running.log
        server = running.process.pid
        started = _descendants(server)
        marked = {int(path.name.rsplit("-", 1)[1]) for path in pids.iterdir()}
        assert marked <= set(started), (marked, started)
        commands = [_command(pid) for pid in started]
        assert any("multiprocessing" in c for c in commands), commands  # the REST helper
        began = time.monotonic()
        running.signal(signum)
        running.process.wait(exit_timeout + STOP_SECONDS + 60)
        took = time.monotonic() - began
        if signum == signal.SIGTERM:
            assert running.process.returncode == 0, running.log
            assert took < exit_timeout + STOP_SECONDS + 60
            assert (tmp_path / "echo-finalized").exists()  # the idle model ran finalize
        assert wait_for(lambda: not _running(started), 30), (
            {pid: _command(pid) for pid in _running(started)},
            running.log[-3000:],
        )
    finally:
        running.stop()
        for pid in _running(started):  # what a failed check left: never past the test
            os.kill(pid, signal.SIGKILL)


def test_a_job_stuck_on_the_openai_workers_does_not_keep_the_server_up(tmp_path):
    """A chat request whose model's template never ends (two nested loops of 100,000 that
    write nothing: 10^10 steps of jinja2, which nothing interrupts) holds an OpenAI worker
    thread. SIGTERM still ends the process, exit 0, counting it abandoned; before 4220cfb
    the server logged "stopped" and ran on (the interpreter's exit joined the worker: the red
    team's wedged workers kept one up 24 minutes)."""
    from serving import RunningServer
    from tiny_decoder import write as write_model

    folder = write_model(tmp_path / "chat" / "1")
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer["chat_template"] = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (tmp_path / "chat" / "config.json").write_text(json.dumps({"device": "NUMPY"}))
    args = ["--model-repository", str(tmp_path), "--exit-timeout", "2"]
    running = RunningServer(*args)
    running.start(timeout=300)
    try:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
        request = urllib.request.Request(
            f"{running.http_url}/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        outcome: list = []

        def send() -> None:
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    outcome.append(answer.status)
            except (urllib.error.URLError, OSError) as exc:
                outcome.append(exc)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        time.sleep(1.0)  # the request is on a worker, rendering
        assert not outcome, outcome  # it never ends by itself
        started = time.monotonic()
        running.signal(signal.SIGTERM)
        assert running.process.wait(60) == 0, running.log[-3000:]
        assert time.monotonic() - started < 30, "the server ran on past its --exit-timeout"
        assert "abandoning 1 stuck request(s) or load(s)" in running.log, running.log[-3000:]
    finally:
        running.stop()
