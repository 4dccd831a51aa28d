"""Hostile calls (issue 13, items 1 and 2): calls held open without a message, wrong-typed
tensors that would be expensive to decode, and streams whose responses are never read.

Each test does what the attacker did against a real server process on 127.0.0.1, with raw
gRPC calls where no client library would send such traffic, and asserts the bound: the right
status, other clients served within seconds, memory (VmHWM from /proc) bounded.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper
from serving import RunningServer, wait_for

from plugserve.client import Client
from plugserve.proto import plugserve_pb2 as pb
from plugserve.server.control.examples import build_examples
from plugserve.server.protocols.grpc import callgate
from plugserve.server.protocols.grpc.handlers import STREAM_WINDOW
from plugserve.server.protocols.http import app as rest_app
from plugserve.server.protocols.http import http_server as rest_http

MB = 1 << 20
TOKEN = "infer-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
WORKERS = 16
A = np.array([1, 2], np.float32)
KSERVE = "/inference.GRPCInferenceService/"


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def fanout() -> onnx.ModelProto:
    """x [1] -> y [1M]: a 4-byte request with a 4 MB response."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [1 << 20])
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"])],
        "fanout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1 << 20])],
        [shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _serve(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    repo = build_examples(root / "repo")
    (repo / "fanout" / "1").mkdir(parents=True)
    onnx.save(fanout(), str(repo / "fanout" / "1" / "model.onnx"))
    tokens = root / "tokens.txt"
    tokens.write_text(f"{TOKEN} infer\n{ADMIN} admin\n")
    tokens.chmod(0o600)
    args = ["--model-repository", str(repo), "--auth-tokens", str(tokens)]
    args += ["--grpc-workers", str(WORKERS), "--health-port", "0"]
    return RunningServer(*args, "--request-read-timeout", "5")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _serve(tmp_path_factory) as running:
        yield running


@pytest.fixture
def fresh(tmp_path_factory):
    """A server of its own, so its peak memory (VmHWM) is this test's alone."""
    with _serve(tmp_path_factory) as running:
        yield running


def auth(token: str = TOKEN) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def served_soon(server: RunningServer, within: float = 10.0) -> None:
    """Another, well-behaved client gets a right answer within ``within`` seconds."""
    assert server.process.poll() is None, server.log
    with Client(server.target, timeout=within, token=TOKEN) as client:
        np.testing.assert_allclose(client.infer("add", {"a": A, "b": A})["sum"], A + A)
    with grpc.insecure_channel(server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=within
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


class Silent:
    """Calls that send headers and never a message, held until :meth:`close`."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.quiet = threading.Event()
        self.calls: list = []

    def _nothing(self):
        self.quiet.wait()
        return
        yield  # pragma: no cover - a generator that never yields

    def open(self, method: str, count: int, metadata=None, streaming: bool = False) -> None:
        if streaming:
            call = self.channel.stream_stream(method)
            for _ in range(count):
                self.calls.append(call(self._nothing(), metadata=metadata))
        else:
            call = self.channel.stream_unary(method)
            for _ in range(count):
                self.calls.append(call.future(self._nothing(), metadata=metadata))

    def codes(self, timeout: float = 30) -> list[grpc.StatusCode | None]:
        """Each call's status once it ended (None: still open after ``timeout``)."""
        end = time.monotonic() + timeout
        codes = []
        for call in self.calls:
            while not call.done() and time.monotonic() < end:  # code() would block
                time.sleep(0.05)
            codes.append(call.code() if call.done() else None)
        return codes

    def close(self) -> None:
        self.quiet.set()
        for call in self.calls:
            call.cancel()
        self.channel.close()


@pytest.fixture
def silent(server):
    calls = Silent(server.target)
    yield calls
    calls.close()


def test_calls_without_a_token_hold_no_thread(server, silent):
    """Four times the pool of unary and streaming calls, no token, no message: each is refused
    UNAUTHENTICATED at once, and everyone else is served."""
    silent.open(KSERVE + "ModelInfer", 2 * WORKERS)
    silent.open(KSERVE + "ModelStreamInfer", 2 * WORKERS, streaming=True)
    served_soon(server)
    assert set(silent.codes()) == {grpc.StatusCode.UNAUTHENTICATED}


def test_calls_without_a_token_over_tls_hold_no_thread(tmp_path):
    """The attack as reported: TLS and tokens on, a client with no token holds open twice the
    pool of calls that never send a message; everyone else is served."""
    import shutil

    from pki import make_pki

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    pki = make_pki(tmp_path)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{TOKEN} infer\n")
    tokens.chmod(0o600)
    args = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    args += ["--auth-tokens", str(tokens), "--grpc-workers", str(WORKERS)]
    with RunningServer(*args) as server:
        credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
        channel = grpc.secure_channel(server.target, credentials)
        quiet = threading.Event()

        def nothing():
            quiet.wait()
            return
            yield  # pragma: no cover - a generator that never yields

        calls = [
            channel.stream_unary(KSERVE + "ModelInfer").future(nothing())
            for _ in range(2 * WORKERS)
        ]
        calls += [
            channel.stream_stream(KSERVE + "ModelStreamInfer")(nothing())
            for _ in range(2 * WORKERS)
        ]
        try:
            with Client(server.target, timeout=10, token=TOKEN, tls_ca=pki / "ca.pem") as client:
                np.testing.assert_allclose(client.infer("add", {"a": A, "b": A})["sum"], A + A)
            end = time.monotonic() + 30
            while not all(c.done() for c in calls) and time.monotonic() < end:
                time.sleep(0.05)
            assert {c.code() for c in calls if c.done()} == {grpc.StatusCode.UNAUTHENTICATED}
            assert all(c.done() for c in calls)
        finally:
            quiet.set()
            for call in calls:
                call.cancel()
            channel.close()


def test_idle_streams_are_capped_and_leave_threads_for_unary_calls(server, silent):
    """An infer token opens more idle streams than there are threads: half the pool at most
    is theirs (RESOURCE_EXHAUSTED beyond), unary calls and health are still answered."""
    silent.open(KSERVE + "ModelStreamInfer", WORKERS + 4, metadata=auth(), streaming=True)
    served_soon(server)

    def refused() -> list:
        exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
        return [c for c in silent.calls if c.done() and c.code() == exhausted]

    # the cap is half the pool: the other streams are refused at once (allow a loaded machine)
    assert wait_for(lambda: len(refused()) >= 4 + WORKERS // 2, timeout=30), [
        c.code() for c in silent.calls if c.done()
    ]
    assert "--max-open-streams" in refused()[0].details()


def test_unary_calls_that_never_send_their_message_are_evicted(server, silent):
    """As many silent unary calls as the pool has threads: the ones waiting longest make room
    for real clients; the rest are refused or cancelled, never served."""
    silent.open(KSERVE + "ModelInfer", WORKERS, metadata=auth())
    # they have waited longer than a real client's message ever takes (the gate's bound)
    time.sleep(2 * callgate.EVICT_AFTER)
    served_soon(server)
    served_soon(server)
    assert server.process.poll() is None


def test_one_active_handler_thread_is_not_held_by_silent_or_idle_calls(tmp_path_factory):
    """--grpc-active-workers 1: silent unary calls and idle streams take the one thread that
    runs calls, and real clients are still answered (streams wait as blocked; a silent call's
    stall starts another thread), through unary calls, a stream and health, long before the
    silent calls' read timeout would free anything."""
    args = [*_serve(tmp_path_factory).args, "--grpc-active-workers", "1"]
    with RunningServer(*args, "--request-read-timeout", "60") as server:
        silent = Silent(server.target)
        try:
            silent.open(KSERVE + "ModelStreamInfer", 3, metadata=auth(), streaming=True)
            silent.open(KSERVE + "ModelInfer", 3, metadata=auth())
            for _ in range(3):
                served_soon(server)
            with Client(server.target, timeout=30, token=TOKEN) as client:
                answers = list(
                    client.infer_stream([(str(i), "add", {"a": A, "b": A}) for i in range(5)])
                )
            assert sorted(rid for rid, _, _ in answers) == ["0", "1", "2", "3", "4"]
            for _, outputs, _ in answers:
                np.testing.assert_allclose(outputs["sum"], A + A)
        finally:
            silent.close()


def test_a_silent_unary_call_is_cancelled_after_the_read_timeout(server, silent):
    silent.open(KSERVE + "ModelInfer", 1, metadata=auth())
    [code] = silent.codes(timeout=40)  # --request-read-timeout 5, the watchdog checks each second
    assert code == grpc.StatusCode.CANCELLED


def test_idle_calls_on_the_plaintext_health_port_leave_probes_answered(server, silent):
    [port] = re.findall(r"health \(plaintext, health service only\): [\d.]+:(\d+)", server.log)
    target = f"127.0.0.1:{port}"
    held = Silent(target)
    try:
        held.open("/grpc.health.v1.Health/Check", 4)
        held.open("/grpc.health.v1.Health/Watch", 2, streaming=True)
        time.sleep(2 * callgate.EVICT_AFTER)  # past the gate's bound: the oldest may go
        for _ in range(3):
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        held.close()


# --------------------------------------------------------------------------- item 2


def _kserve_request(model: str, name: str, datatype: str, count: int, raw: bytes) -> bytes:
    """A ModelInferRequest, serialized with tritonclient's protobuf classes."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=[count])
    request.raw_input_contents.append(raw)
    return request.SerializeToString()


def _peak_growth(server: RunningServer, send) -> int:
    """How far the server's peak RSS rose (bytes) while ``send()`` ran."""
    before = proc_status(server.process.pid, "VmRSS")
    peak_before = proc_status(server.process.pid, "VmHWM")
    send()
    return (proc_status(server.process.pid, "VmHWM") - max(before, peak_before)) * 1024


STRINGS = 12 << 20  # 12M two-letter strings: 72 MB on the wire, ~800 MB as Python objects
PAYLOAD = b"\2\0\0\0ab" * STRINGS


def _grpc_bytes(server, model: str, name: str) -> grpc.RpcError:
    body = _kserve_request(model, name, "BYTES", STRINGS, PAYLOAD)
    options = [("grpc.max_send_message_length", 256 * MB)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        call = channel.unary_unary(KSERVE + "ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(body, metadata=auth(), timeout=60)
    return info.value


def test_bytes_sent_to_a_float_input_are_refused_before_decoding(fresh):
    errors = []
    growth = _peak_growth(fresh, lambda: errors.append(_grpc_bytes(fresh, "add", "a")))
    assert errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "element type object, expected float32" in errors[0].details()
    assert growth < 400 * MB, growth  # the 64 MB message and its copies; decoding was ~1 GB
    served_soon(fresh)


def test_too_many_strings_for_a_string_input_are_refused_before_decoding(fresh):
    errors = []
    growth = _peak_growth(fresh, lambda: errors.append(_grpc_bytes(fresh, "echo", "text")))
    assert errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "split the batch" in errors[0].details()
    assert growth < 400 * MB, growth
    served_soon(fresh)


def test_rest_and_plugserve_v1_refuse_wrong_typed_data_before_decoding(fresh):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "a",
                    "shape": [STRINGS],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(PAYLOAD)},
                }
            ]
        }
    ).encode()

    def rest() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", fresh.http_port, timeout=60)
        headers = {
            "Inference-Header-Content-Length": str(len(header)),
            "Authorization": f"Bearer {TOKEN}",
        }
        connection.request("POST", "/v2/models/add/infer", header + PAYLOAD, headers)
        response = connection.getresponse()
        errors.append((response.status, json.loads(response.read())["error"]))
        connection.close()

    errors: list = []
    growth = _peak_growth(fresh, rest)
    assert errors[0][0] == 400 and "expected float32" in errors[0][1], errors
    assert growth < 400 * MB, growth

    request = pb.InferRequest(network="add")
    request.inputs.add(name="a", dtype="string", shape=[STRINGS], data=PAYLOAD)
    options = [("grpc.max_send_message_length", 256 * MB)]

    def plugserve_v1() -> None:
        with grpc.insecure_channel(fresh.target, options=options) as channel:
            call = channel.unary_unary("/plugserve.v1.Plugserve/Infer")
            with pytest.raises(grpc.RpcError) as info:
                call(request.SerializeToString(), metadata=auth(), timeout=60)
        errors.append(info.value)

    growth = _peak_growth(fresh, plugserve_v1)
    assert errors[1].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected float32" in errors[1].details()
    assert growth < 400 * MB, growth
    served_soon(fresh)


def test_a_stream_whose_responses_are_never_read_is_bounded(fresh):
    """1,200 requests for 4 MB responses on one stream, none read: the server stops reading
    the stream's requests after its window (64 responses or 64 MB), so its memory stays near
    that, not 4.8 GB; after the client cancels, other clients are served."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="fanout")
    request.inputs.add(name="x", datatype="FP32", shape=[1])
    request.raw_input_contents.append(struct.pack("<f", 1.0))
    body = request.SerializeToString()

    def requests():
        for _ in range(1200):
            yield body

    start = proc_status(fresh.process.pid, "VmRSS")
    with grpc.insecure_channel(fresh.target) as channel:
        call = channel.stream_stream(KSERVE + "ModelStreamInfer")(requests(), metadata=auth())
        # the server reads, computes and tries to send; nobody reads: wait until it has
        # computed its window and then stopped. The window is 64 responses or 64 MB, and how
        # many 4 MB responses gRPC takes into its buffers first depends on the machine's load,
        # so the count it stops at is not fixed: it stops well short of the 1,200 sent.
        stopped = [0.0]
        assert wait_for(
            lambda: stopped.__setitem__(0, _stopped_at(fresh, "fanout")) or stopped[0] > 0,
            timeout=60,
        )
        assert stopped[0] < 1200 - STREAM_WINDOW, stopped[0]
        rss = proc_status(fresh.process.pid, "VmHWM")
        call.cancel()
    assert (rss - start) * 1024 < 600 * MB, (rss - start) >> 10
    served_soon(fresh)


def _succeeded(server: RunningServer, model: str) -> float:
    """``model``'s successful requests, from the server's /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("plugserve_inference_requests_total{")
        and f'model="{model}"' in line
        and 'status="success"' in line
    )


def _stopped_at(server: RunningServer, model: str, still: float = 1.0) -> float:
    """``model``'s successful requests once that count has not moved for ``still`` seconds
    (0 while it moves)."""
    before = _succeeded(server, model)
    time.sleep(still)
    after = _succeeded(server, model)
    return after if after == before else 0


def _closed(sock) -> bool:
    """Whether the server has closed or reset ``sock``'s connection, read from the kernel's
    TCP state (without reading what the socket holds)."""
    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    return state in (_TCP_CLOSE, _TCP_CLOSE_WAIT)


_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8  # linux/tcp_states.h


def _server_closed(server_port: int, sock) -> bool:
    """Whether the server has closed its end of ``sock``'s connection, read from the server
    side's TCP state (/proc/net/tcp): a client that reads nothing never sees the server's FIN,
    queued behind the reply it does not read."""
    local = f"0100007F:{server_port:04X}"
    remote = f"0100007F:{sock.getsockname()[1]:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return fields[3] != "01"  # anything but ESTABLISHED: closing or closed
    return True  # gone


def _health(server: RunningServer, within: float = 10.0) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=within)
    try:
        connection.request("GET", "/v2/health/ready")
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_idle_and_half_sent_http_connections_leave_the_rest_port_serving(tmp_path):
    """Past the REST port's connection limit (4 x 16 here): 100 connections that never send
    a byte and 40 that send headers and half a body. The oldest idle ones make room for real
    clients, a half-sent body ends with 408 (past --request-read-timeout, or sooner: it comes
    under --http-min-body-rate, and the port, full, needs its slot), and every connection that
    never sent a request is closed by then."""
    args = ["--grpc-workers", str(WORKERS), "--request-read-timeout", "3"]
    with RunningServer(*args) as server:
        half = []
        for _ in range(40):
            c = socket.create_connection(("127.0.0.1", server.http_port))
            c.sendall(
                b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
            )
            half.append(c)
        # their headers are in: requests under way, waiting for their bodies (older than the
        # idle ones by the eviction bound, so those are evicted first)
        time.sleep(rest_http.EVICT_AFTER)
        idle = [socket.create_connection(("127.0.0.1", server.http_port)) for _ in range(100)]
        try:
            time.sleep(2 * rest_http.EVICT_AFTER)  # the idle ones have waited past EVICT_AFTER
            assert _health(server) == 200
            served_soon(server)
            half[0].settimeout(15)
            reply = b""
            while b'"}' not in reply:  # the body may come in a 2nd segment
                chunk = half[0].recv(4096)
                if not chunk:
                    break
                reply += chunk
            assert b" 408 " in reply.split(b"\r\n")[0], reply
            assert b"--request-read-timeout" in reply or b"--http-min-body-rate" in reply
            # past the read timeout: every silent connection is closed
            wait_for(lambda: all(_closed(c) for c in idle), timeout=15)
            closed = 0
            for c in idle:
                c.settimeout(1)
                try:
                    closed += c.recv(1) == b""
                except OSError:
                    closed += 1
            assert closed == len(idle)
            assert _health(server) == 200
        finally:
            for c in idle + half:
                c.close()


def test_the_rest_port_queues_a_burst_of_connections_for_its_loop(server):
    """The REST port's listening queue holds BACKLOG connections (or the kernel's somaxconn,
    if lower), more than the port's limit: the event loop listened again at its own default of
    100, and a thousand OpenAI clients connecting at once on a loaded CI machine overflowed it
    (the kernel dropped their handshakes; one client's connection was reset mid-request,
    APIConnectionError, in test_a_thousand_clients_are_served_or_refused_within_the_budget)."""
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("iproute2's ss reads a listening socket's queue length")
    shown = subprocess.run(
        [ss, "-ltnH", f"sport = :{server.http_port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(shown[2]) == min(rest_app.BACKLOG, somaxconn), shown


def test_a_client_that_never_reads_its_replies_is_cut_off(tmp_path):
    """Two pipelined requests whose 4 MiB replies the client never reads: the transport's
    buffer stays full, and after --request-read-timeout the connection is cut off (before,
    it held its slot and the reply for as long as the client liked). Others are served."""
    n = 1 << 20
    data = np.ones(n, np.float32).tobytes()
    tensor = {"shape": [n], "datatype": "FP32", "parameters": {"binary_data_size": len(data)}}
    header = json.dumps(
        {
            "inputs": [{"name": "a", **tensor}, {"name": "b", **tensor}],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = header + data + data
    request = (
        b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: %d\r\nInference-Header-Content-Length: %d\r\n\r\n"
        % (len(body), len(header))
    ) + body
    with RunningServer("--request-read-timeout", "2") as server:
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", server.http_port))

        def send() -> None:
            with contextlib.suppress(OSError):  # cut off while sending: as expected
                client.sendall(request + request)

        threading.Thread(target=send, daemon=True).start()
        try:
            # past the read timeout: cut off
            wait_for(lambda: _server_closed(server.http_port, client), timeout=30)
            assert _health(server) == 200
            client.settimeout(10)
            received = 0
            try:
                while chunk := client.recv(1 << 20):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            assert received < 2 * n * 4  # the second reply never came
        finally:
            client.close()


def _rest_refusal(server, path: str, body: dict, token: str) -> tuple[int, str]:
    """The status and error of a REST call that must be refused."""
    request = urllib.request.Request(
        server.http_url + path,
        data=json.dumps(body).encode(),
        headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    return refused.value.code, json.loads(refused.value.read())["error"]


def test_absurd_device_names_and_config_values_are_invalid_argument(server):
    """A red team's control-plane calls that were INTERNAL, each with a traceback in the log:
    a JSON config value nested 100,000 deep (HETERO's AFFINITY, TORCH's MODEL_TENSORS; an
    ``infer`` token's QueryNetwork), a BATCH size of 5,000 digits (int() refuses past 4,300),
    and (admin) a load override's version folder of 300 digits (an OSError naming the
    server's folder). A virtual device's list of 20,000 ids ran QueryNetwork for 30 s: now
    at most 64 devices and 1,024 characters."""
    model = fanout().SerializeToString()
    logged = len(server.log)  # (the module's other tests log grpc's own tracebacks)
    with Client(server.target, timeout=30, token=TOKEN) as client:
        cases = [
            ("HETERO:NUMPY", {"AFFINITY": "[" * 100_000}, "config key 'AFFINITY': bad value"),
            ("BATCH:NUMPY(" + "9" * 5000 + ")", None, "a device name of 5,013 characters"),
            ("BATCH:NUMPY(99999999999999999999)", None, None),  # parses; a load is bounded
            ("MULTI:" + ",".join(f"NUMPY.{i}" for i in range(65)), None, "more than 64 devices"),
            ("HETERO:NUMPY", {"DEVICE_PRIORITIES": "NUMPY," * 70 + "ORT"}, "more than 64"),
        ]
        for device, config, needle in cases:
            if needle is None:
                client.query(model, device, config)
                continue
            with pytest.raises(grpc.RpcError) as refused:
                client.query(model, device, config)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, device[:40]
            details = refused.value.details()
            assert needle in details and len(details) < 1000, details[:300]
    long_version = "9" * 300
    config = json.dumps({"name": "long_version", "platform": "onnxruntime_onnx"})
    body = {"parameters": {"config": config, f"file:{long_version}/model.onnx": "AAAA"}}
    status, message = _rest_refusal(server, "/v2/repository/models/long_version/load", body, ADMIN)
    assert status == 400 and "1 to 18 digits" in message, message
    assert "plugserve-override" not in message
    assert "Traceback" not in server.log[logged:]
    served_soon(server)


def _add_request(parameters: int, on_input: bool = False) -> bytes:
    """ModelInfer of ``add`` carrying ``parameters`` request (or input) parameters."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="add")
    for name in ("a", "b"):
        request.inputs.add(name=name, datatype="FP32", shape=[2])
        request.raw_input_contents.append(A.tobytes())
    where = request.inputs[0].parameters if on_input else request.parameters
    for i in range(parameters):
        where[f"k{i}"].int64_param = i
    return request.SerializeToString()


def test_a_request_of_millions_of_parameters_is_refused_before_it_is_parsed(server):
    """A red team's ModelInfer of 4,000,000 ``parameters`` (73 MB, under the message limit)
    took 11 s of the server's CPU and 1.4 GB (the budget charges twice the message; protobuf's
    map entries take ~20 times): now a large message with more than wire.MAX_FIELDS fields
    is refused unparsed, and a request with more than MAX_PARAMETERS parameters before they
    are converted (a tensor's too, read or not); unary and streamed, over gRPC and REST."""
    from tritonclient.grpc import service_pb2

    from plugserve.server.protocols.kserve.codec import MAX_PARAMETERS

    options = [("grpc.max_send_message_length", 256 * MB)]
    with grpc.insecure_channel(server.target, options=options) as channel:
        infer = channel.unary_unary(KSERVE + "ModelInfer")
        cases = [
            (_add_request(200_000), "refused before it was read"),
            (_add_request(200_000, on_input=True), "refused before it was read"),
            (_add_request(MAX_PARAMETERS + 1), f"at most {MAX_PARAMETERS:,}"),
            (_add_request(MAX_PARAMETERS + 1, on_input=True), f"at most {MAX_PARAMETERS:,}"),
        ]
        for body, needle in cases:
            with pytest.raises(grpc.RpcError) as refused:
                infer(body, metadata=auth(), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in refused.value.details(), refused.value.details()
        assert infer(_add_request(3), metadata=auth(), timeout=60)  # (parameters of its own)
        stream = channel.stream_stream(
            KSERVE + "ModelStreamInfer",
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        answers = list(stream(iter([cases[0][0], _add_request(0)]), metadata=auth(), timeout=60))
        assert "refused before it was read" in answers[0].error_message
        assert not answers[1].error_message  # the stream goes on
    body = {
        "inputs": [
            {"name": n, "shape": [2], "datatype": "FP32", "data": [1, 2]} for n in ("a", "b")
        ],
        "parameters": {f"k{i}": i for i in range(MAX_PARAMETERS + 1)},
    }
    status, message = _rest_refusal(server, "/v2/models/add/infer", body, TOKEN)
    assert status == 400 and f"at most {MAX_PARAMETERS:,}" in message, message
    served_soon(server)
