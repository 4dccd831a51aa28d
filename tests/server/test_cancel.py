"""Runs that would never end (issue 21, item 1): a Loop whose trip count is the client's.

The attack: ``M = 10**12`` sent with a short deadline. Before, the client got
DEADLINE_EXCEEDED but the run went on, its stream busy and a core burning until SIGTERM. Each
test sends it to a real server and asserts that the run stopped: the network's only stream
serves the next request, the server's CPU goes quiet, the metrics count it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import FOREVER, spin_loop
from serving import RunningServer, wait_for
from test_server_load import busy_streams

tritonclient_grpc = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient")
tritonclient_http = pytest.importorskip("tritonclient.http", reason="pip install tritonclient")
from tritonclient.utils import InferenceServerException  # noqa: E402

#: device -> the name of its copy of the model
DEVICES = {
    "NUMPY": "spin_numpy",
    "ORT": "spin_ort",
    "HETERO:OPENVINO,NUMPY": "spin_hetero",
    "MULTI:NUMPY,ORT": "spin_multi",
    "BATCH:NUMPY(4)": "spin_batch",
}


def _write(root: Path, name: str, model: onnx.ModelProto, config: dict) -> None:
    folder = root / name
    (folder / "1").mkdir(parents=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    from plugserve.server import Core

    core = Core()
    root = tmp_path_factory.mktemp("cancel")
    for device, name in DEVICES.items():
        if any(d not in core.available_devices for d in re.findall(r"[A-Z]+", device)):
            continue
        # one stream: a run that is not stopped would hold the network's only one
        config = {"NUM_STREAMS": "1"} if not device.startswith(("MULTI", "BATCH")) else {}
        _write(
            root, name, spin_loop(device.startswith("BATCH")), {"device": device, "config": config}
        )
    return root


@pytest.fixture(scope="module")
def server(repository):
    with RunningServer(
        "--model-repository", str(repository), "--max-request-seconds", "20"
    ) as running:
        yield running


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quiet(pid: int, window: float = 1.0) -> float:
    """CPU seconds the server spends over ``window`` s of wall time."""
    before = cpu_seconds(pid)
    time.sleep(window)
    return cpu_seconds(pid) - before


def grpc_inputs(trips: int, batched: bool):
    shape = [1] if batched else []
    m = tritonclient_grpc.InferInput("M", shape, "INT64")
    m.set_data_from_numpy(np.full(shape, trips, np.int64))
    x = tritonclient_grpc.InferInput("x", [1, 4] if batched else [4], "FP32")
    x.set_data_from_numpy(np.ones([1, 4] if batched else [4], np.float32))
    return [m, x]


def requests_with_status(server, model: str, status: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("plugserve_inference_requests_total{")
            and f'model="{model}"' in line
            and f'status="{status}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def client(server):
    with tritonclient_grpc.InferenceServerClient(server.target) as c:
        yield c


@pytest.mark.parametrize("device", list(DEVICES))
def test_a_run_past_its_deadline_is_stopped_and_frees_its_stream(
    server, client, repository, device
):
    name = DEVICES[device]
    if not (repository / name).exists():
        pytest.skip(f"{device} is not available here")
    batched = device.startswith("BATCH")
    with pytest.raises(InferenceServerException) as failed:
        client.infer(name, grpc_inputs(FOREVER, batched), client_timeout=2.0)
    assert "Deadline" in str(failed.value) or "DEADLINE" in str(failed.value.status())
    past_deadline = time.monotonic()
    # the next request is served by the same (only) stream, within a second of the deadline
    answer = client.infer(name, grpc_inputs(3, batched), client_timeout=10.0)
    assert np.array_equal(answer.as_numpy("y").reshape(-1), np.full(4, 3.0, np.float32))
    waited = time.monotonic() - past_deadline
    assert waited < 1.0, f"the next request waited {waited:.2f} s for the runaway run"
    assert quiet(server.process.pid) < 0.5, "the server still burns CPU: the run goes on"
    assert wait_for(lambda: requests_with_status(server, name, "deadline") >= 1, timeout=10)


def test_the_server_limit_stops_a_run_without_a_client_deadline(repository):
    with (
        RunningServer(
            "--model-repository", str(repository), "--max-request-seconds", "1.5"
        ) as server,
        tritonclient_grpc.InferenceServerClient(server.target) as client,
    ):
        began = time.monotonic()
        with pytest.raises(InferenceServerException) as failed:
            client.infer("spin_numpy", grpc_inputs(FOREVER, False))
        assert failed.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "--max-request-seconds" in failed.value.message()
        assert time.monotonic() - began < 10
        # REST: 504, with the same message
        http = tritonclient_http.InferenceServerClient(server.http_target, network_timeout=30)
        m = tritonclient_http.InferInput("M", [], "INT64")
        m.set_data_from_numpy(np.array(FOREVER, np.int64))
        x = tritonclient_http.InferInput("x", [4], "FP32")
        x.set_data_from_numpy(np.ones(4, np.float32))
        with pytest.raises(InferenceServerException) as failed:
            http.infer("spin_ort", [m, x])
        assert failed.value.status() == "504"
        assert "--max-request-seconds" in failed.value.message()
        assert client.infer("spin_ort", grpc_inputs(2, False)).as_numpy("y")[0] == 2.0
        assert quiet(server.process.pid) < 0.5


def test_a_client_that_cancels_its_call_stops_the_run(server, client):
    name = "spin_numpy"
    before = requests_with_status(server, name, "cancelled")
    done = []
    call = client.async_infer(name, grpc_inputs(FOREVER, False), lambda r, e: done.append(e))
    assert wait_for(lambda: busy_streams(server, "NUMPY")), "it did not start"
    call.cancel()
    assert wait_for(lambda: requests_with_status(server, name, "cancelled") > before, timeout=10)
    assert client.infer(name, grpc_inputs(1, False), client_timeout=10).as_numpy("y")[0] == 1.0
    assert quiet(server.process.pid) < 0.5


def test_a_rest_client_that_hangs_up_stops_the_run(server, client):
    name = "spin_ort"
    before = requests_with_status(server, name, "cancelled")
    body = json.dumps(
        {
            "inputs": [
                {"name": "M", "shape": [], "datatype": "INT64", "data": [FOREVER]},
                {"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 1, 1, 1]},
            ]
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(
            f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_for(lambda: busy_streams(server, "ORT")), "it did not start"
        # then the client hangs up
    assert wait_for(lambda: requests_with_status(server, name, "cancelled") > before, timeout=10)
    assert client.infer(name, grpc_inputs(2, False), client_timeout=10).as_numpy("y")[0] == 2.0
    assert quiet(server.process.pid) < 0.5


def test_openvino_refuses_a_loop_the_request_bounds_and_says_why(tmp_path):
    from plugserve.server import Core

    core = Core()
    if "OPENVINO" not in core.available_devices:
        pytest.skip("OPENVINO is not available: pip install openvino")
    from plugserve.plugins.api import Unsupported

    with pytest.raises(Unsupported, match="openvino cannot stop a Loop once it runs"):
        core.load_network(spin_loop(), "OPENVINO")
    assert "spin" not in core.query_network(spin_loop(), "OPENVINO")
    assert core.query_network(spin_loop(), "HETERO:OPENVINO,NUMPY")["spin"] == "NUMPY"
    # the operator who accepts the risk can say so
    network = core.load_network(spin_loop(), "OPENVINO", {"UNBOUNDED_LOOPS": "YES"})
    out = network.infer({"M": np.array(3, np.int64), "x": np.ones(4, np.float32)})
    assert np.array_equal(out["y"], np.full(4, 3.0, np.float32))
    assert "Loop" in core.get_metric("OPENVINO", "CANCELLATION")


def test_sigterm_stops_a_runaway_run_after_the_exit_timeout(repository):
    server = RunningServer(
        "--model-repository", str(repository), "--exit-timeout", "1", "--max-request-seconds", "0"
    ).start()
    try:
        client = tritonclient_grpc.InferenceServerClient(server.target)
        done = []
        client.async_infer("spin_numpy", grpc_inputs(FOREVER, False), lambda r, e: done.append(e))
        assert wait_for(lambda: busy_streams(server, "NUMPY")), "it did not start"
        began = time.monotonic()
        server.signal()
        server.process.wait(20)
        assert time.monotonic() - began < 10, "shutdown waited for a run that never ends"
        assert "their runs and calls are cancelled" in server.log
    finally:
        server.stop()


def test_tritons_timeout_parameter_is_a_deadline_on_both_protocols(server, client):
    """tritonclient's ``timeout=`` (microseconds) is the request's own deadline: REST has no
    other way to give one."""
    http = tritonclient_http.InferenceServerClient(server.http_target, network_timeout=30)
    m = tritonclient_http.InferInput("M", [], "INT64")
    m.set_data_from_numpy(np.array(FOREVER, np.int64))
    x = tritonclient_http.InferInput("x", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))
    began = time.monotonic()
    with pytest.raises(InferenceServerException) as failed:
        http.infer("spin_numpy", [m, x], timeout=1_000_000)
    assert failed.value.status() == "504" and "deadline" in failed.value.message()
    with pytest.raises(InferenceServerException) as failed:
        client.infer("spin_ort", grpc_inputs(FOREVER, False), timeout=1_000_000)
    assert failed.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert time.monotonic() - began < 8
    bad = json.dumps(
        {
            "parameters": {"timeout": "soon"},
            "inputs": [
                {"name": "M", "shape": [], "datatype": "INT64", "data": [1]},
                {"name": "x", "shape": [4], "datatype": "FP32", "data": [1, 1, 1, 1]},
            ],
        }
    ).encode()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{server.http_url}/v2/models/spin_ort/infer", bad, timeout=10)
    assert refused.value.code == 400 and b"microseconds" in refused.value.read()
    assert client.infer("spin_ort", grpc_inputs(2, False), timeout=5_000_000).as_numpy("y")[0] == 2
