"""One memory budget for every request in flight (issue 21, item 3), driven as the attacker did.

Before, a 100 MB JSON body raised the server's peak RSS by 2 GB while it was decoded and four
at once by 2.9 GB: each limit was per request. Now each request is charged before it is read
(JSON tensors at 20x their size, binary 2x, gRPC messages 2x) against --max-inflight-bytes,
and what does not fit is refused at once with 503 / RESOURCE_EXHAUSTED naming the flag.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from serving import RunningServer, examples_repository

MB = 1 << 20
BUDGET = 5 << 30


def vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def json_body(elements: int) -> bytes:
    """An ``add`` request whose two inputs are ``elements`` zeros each: the cheapest JSON to
    send (2 bytes a number) and the costliest to decode."""
    zeros = b"0," * (elements - 1) + b"0"
    head = b'{"inputs":[{"name":"a","shape":[%d],"datatype":"FP32","data":[' % elements
    middle = b']},{"name":"b","shape":[%d],"datatype":"FP32","data":[' % elements
    return head + zeros + middle + zeros + b"]}]}"


def post(port: int, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One raw HTTP/1.1 POST to the add model; (status, reply body), status 0 when the server
    closed the connection before answering."""
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    request = (
        f"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{head}\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        try:
            sock.sendall(request)
            view = memoryview(body)
            for start in range(0, len(body), 4 * MB):
                sock.sendall(view[start : start + 4 * MB])
        except OSError:
            pass  # refused mid-body: the answer was sent before the server closed
        chunks = []
        try:
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                text = b"".join(chunks)
                if b"\r\n\r\n" in text:
                    header, _, rest = text.partition(b"\r\n\r\n")
                    length = int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    if len(rest) >= length:
                        return int(header.split()[1]), rest[:length]
        except OSError:
            pass
    text = b"".join(chunks)
    return (int(text.split()[1]), text.partition(b"\r\n\r\n")[2]) if text else (0, b"")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = examples_repository(tmp_path_factory.mktemp("budget"))
    with RunningServer(
        "--model-repository", str(repo), "--max-inflight-bytes", str(BUDGET)
    ) as running:
        yield running


def small_ok(server) -> bool:
    body = json.dumps(
        {
            "inputs": [
                {"name": "a", "shape": [2], "datatype": "FP32", "data": [1, 2]},
                {"name": "b", "shape": [2], "datatype": "FP32", "data": [3, 4]},
            ]
        }
    ).encode()
    answer = urllib.request.urlopen(f"{server.http_url}/v2/models/add/infer", body, timeout=60)
    return json.loads(answer.read())["outputs"][0]["data"] == [4, 6]


@pytest.mark.slow
def test_eight_100_mb_json_bodies_at_once_stay_within_the_budget(server):
    body = json_body(25 * MB)  # 2 x 25M zeros: a 100 MB body, charged 2 GB
    assert 100 * MB <= len(body) < 101 * MB
    pid = server.process.pid
    before = vm(pid, "VmHWM")
    results: list[tuple[int, bytes]] = []
    threads = [
        threading.Thread(target=lambda: results.append(post(server.http_port, body)))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    grown = vm(pid, "VmHWM") - before
    statuses = sorted(status for status, _ in results)
    assert len(results) == 8 and statuses.count(200) >= 1, statuses
    refused = [reply for status, reply in results if status == 503]
    assert refused, f"8 x 2 GB cannot fit a 5 GB budget, yet none was refused: {statuses}"
    assert all(b"--max-inflight-bytes" in reply for reply in refused)
    assert set(statuses) <= {200, 503}, statuses
    assert grown <= BUDGET, f"peak RSS grew {grown / MB:.0f} MiB, over the {BUDGET / MB:.0f} budget"
    assert small_ok(server)  # nothing else harmed


def test_a_body_over_the_whole_budget_is_refused_before_it_is_read(server):
    body = json_body(3 * MB)
    with RunningServer(
        "--model-repository",
        str(server.args[1]),
        "--max-inflight-bytes",
        str(50 * MB),  # a 12 MB JSON body is charged 240 MB
    ) as small:
        before = vm(small.process.pid, "VmHWM")
        status, reply = post(small.http_port, body)
        assert status == 503, (status, reply[:200])
        message = json.loads(reply)["error"]
        assert "--max-inflight-bytes" in message and "binary data" in message
        assert vm(small.process.pid, "VmHWM") - before < 30 * MB  # the body was never taken in
        assert small_ok(small)


def test_a_gzip_bomb_is_charged_as_it_inflates(server):
    """1 MB of gzip that inflates to 400 MB of JSON zeros (8 GB to decode): refused while it
    is inflated, never decoded."""
    bomb = gzip.compress(json_body(100 * MB), compresslevel=9)
    assert len(bomb) < 2 * MB
    pid = server.process.pid
    before = vm(pid, "VmHWM")
    status, reply = post(server.http_port, bomb, {"Content-Encoding": "gzip"})
    assert status == 503 and b"--max-inflight-bytes" in reply, (status, reply[:300])
    assert vm(pid, "VmHWM") - before <= BUDGET
    assert small_ok(server)


def test_grpc_requests_are_charged_too(server):
    tritonclient = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient")
    from tritonclient.utils import InferenceServerException

    with (
        RunningServer(
            "--model-repository", str(server.args[1]), "--max-inflight-bytes", str(64 * MB)
        ) as small,
        tritonclient.InferenceServerClient(small.target) as client,
    ):
        inputs = []
        for name in ("a", "b"):
            tensor = tritonclient.InferInput(name, [10 * MB], "FP32")  # 40 MB each
            tensor.set_data_from_numpy(np.zeros(10 * MB, np.float32))
            inputs.append(tensor)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("add", inputs)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "--max-inflight-bytes" in refused.value.message()
        inputs = [tritonclient.InferInput(n, [MB // 4], "FP32") for n in ("a", "b")]
        for tensor in inputs:
            tensor.set_data_from_numpy(np.ones(MB // 4, np.float32))
        assert client.infer("add", inputs).as_numpy("sum")[0] == 2.0  # 2 MB fits


def test_plugserve_v1_requests_are_charged_their_size_on_the_wire(server):
    """plugserve.v1 Infer is charged what its message took on the wire (twice, as every gRPC
    message), as grpcio hands it over: neither counted from its fields nor serialized again."""
    import grpc

    from plugserve.client import Client

    with (
        RunningServer(
            "--model-repository", str(server.args[1]), "--max-inflight-bytes", str(64 * MB)
        ) as small,
        Client(small.target, timeout=60) as client,
    ):
        big = {name: np.zeros(4 * MB, np.float32) for name in ("a", "b")}  # 32 MB on the wire
        with pytest.raises(grpc.RpcError) as refused:
            client.infer("add", big)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-inflight-bytes" in refused.value.details()
        fits = {name: np.ones(MB, np.float32) for name in ("a", "b")}  # 8 MB: charged 16
        for _ in range(6):  # each charge is given back
            assert client.infer("add", fits)["sum"][0] == 2.0


def test_charges_are_given_back_once_requests_are_answered(server):
    """Under a budget that holds one such request at a time, the same request served over and
    over: a charge that is not given back (plain, or a gzip body charged as it inflates) would
    refuse the next."""
    plain = json_body(MB // 2)  # a 2 MB body: charged 40 MB of a 64 MB budget
    packed = gzip.compress(json_body(MB // 8))  # inflates to 0.5 MB: charged at most ~20 MB
    with RunningServer(
        "--model-repository",
        str(server.args[1]),
        "--max-inflight-bytes",
        str(64 * MB),
        "--max-inflight-bytes-per-peer",
        "0",  # the whole budget for this one client (its default share is half)
    ) as small:
        for _ in range(6):
            status, reply = post(small.http_port, plain)
            assert status == 200, reply[:300]
        for _ in range(6):
            status, reply = post(small.http_port, packed, {"Content-Encoding": "gzip"})
            assert status == 200, reply[:300]
        assert small_ok(small)
