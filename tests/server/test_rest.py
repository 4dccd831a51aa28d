"""KServe v2 over HTTP/REST through a real server: tritonclient.http, and raw HTTP requests
(what curl would send) for the malformed bodies a client library never makes.

Auth and TLS on the REST port are in test_security.py (next to the gRPC ones).
"""

from __future__ import annotations

import gzip
import http.client
import io
import json
import socket
import struct
import urllib.error
import urllib.request

import numpy as np
import pytest
from serving import RunningServer, examples_repository

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

BUNDLED = ("add", "cnn", "echo", "mlp")


@pytest.fixture(scope="module")
def client(server):
    with httpclient.InferenceServerClient(server.http_target) as c:
        yield c


def _input(name, array, datatype, binary=True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _add(a, b, binary=True):
    return [
        _input("a", np.asarray(a, np.float32), "FP32", binary),
        _input("b", np.asarray(b, np.float32), "FP32", binary),
    ]


def _sized(datatype: str, count: int, size: int, name: str = "a") -> bytes:
    """The JSON part of a binary request: input ``name`` of ``count`` elements, ``size`` bytes."""
    tensor = {"name": name, "shape": [count], "datatype": datatype}
    return _infer_json([{**tensor, "parameters": {"binary_data_size": size}}])


def _request(server, method, path, body=b"", headers=None):
    """A raw request; (status, headers, parsed JSON body or raw bytes)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        headers_out = {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()
    if headers_out.get("content-type") == "application/json":
        return response.status, headers_out, json.loads(data)
    return response.status, headers_out, data


def _infer_json(inputs, outputs=None, **extra):
    body = {"inputs": inputs, **extra}
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body).encode()


# --- tritonclient.http


def test_health_and_readiness(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    for name in BUNDLED:
        assert client.is_model_ready(name)
        assert client.is_model_ready(name, "1")
    assert not client.is_model_ready("nope")
    assert not client.is_model_ready("add", "7")


def test_server_and_model_metadata(client):
    from plugserve.plugins.version import plugserve_version

    meta = client.get_server_metadata()
    assert meta["name"] == "plugserve" and meta["version"] == plugserve_version()
    assert "model_repository" in meta["extensions"]
    model = client.get_model_metadata("add")
    assert model["name"] == "add" and model["versions"] == ["1"]
    assert [(i["name"], i["datatype"], i["shape"]) for i in model["inputs"]] == [
        ("a", "FP32", [-1]),
        ("b", "FP32", [-1]),
    ]
    assert model["outputs"][0]["name"] == "sum"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "404"
    # Triton's words first: its simple_http_infer_client checks them
    assert info.value.message().startswith("Request for unknown model: 'nope' is not found")


def test_model_config_is_triton_json_with_numbers(client):
    config = client.get_model_config("mlp")
    assert config["name"] == "mlp" and config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert all(isinstance(d, int) for d in config["input"][0]["dims"])
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["parameters"]["device"]["string_value"].startswith("BATCH:")


@pytest.mark.parametrize("binary", [False, True])
def test_infer_with_json_or_binary_tensors(client, binary):
    outputs = [httpclient.InferRequestedOutput("sum", binary_data=binary)]
    result = client.infer("add", _add([1, 2, 3], [10, 20, 30], binary), outputs=outputs)
    assert result.as_numpy("sum").tolist() == [11, 22, 33]
    response = result.get_response()
    assert response["model_name"] == "add" and response["model_version"] == "1"
    assert ("parameters" in response["outputs"][0]) is binary


def test_infer_a_named_version_with_an_id(client):
    result = client.infer("add", _add([1], [2]), model_version="1", request_id="req-7")
    assert result.get_response()["id"] == "req-7"
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", _add([1], [2]), model_version="3")
    assert info.value.status() == "404"
    unknown = "Request for unknown model: 'add' version 3 is not found"
    assert info.value.message().startswith(unknown)


def test_infer_matches_the_grpc_result_on_the_cnn(client, server):
    from plugserve.client import Client

    x = np.random.default_rng(0).normal(size=(2, 1, 28, 28)).astype(np.float32)
    name = client.get_model_metadata("cnn")["inputs"][0]["name"]
    rest = client.infer("cnn", [_input(name, x, "FP32")])
    with Client(server.target) as grpc_client:
        expected = grpc_client.infer("cnn", {name: x})
    # The two requests may run different conv kernels while NUMPY still explores batch 2
    # (tuning.py): float32 rounding apart, they must agree.
    for output, value in expected.items():
        np.testing.assert_allclose(rest.as_numpy(output), value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("binary", [False, True])
def test_bytes_tensors_round_trip(client, binary):
    text = np.array(["hello", "wörld", ""], dtype=object)
    outputs = [httpclient.InferRequestedOutput("echo", binary_data=binary)]
    result = client.infer("echo", [_input("text", text, "BYTES", binary)], outputs=outputs)
    got = [v.decode() if isinstance(v, bytes) else v for v in result.as_numpy("echo")]
    assert got == ["hello", "wörld", ""]


def test_async_infer(server):
    with httpclient.InferenceServerClient(server.http_target, concurrency=4) as c:
        pending = [c.async_infer("add", _add([i], [1])) for i in range(8)]
        assert [p.get_result().as_numpy("sum").tolist() for p in pending] == [
            [i + 1] for i in range(8)
        ]


def test_statistics_count_what_ran(client):
    before = client.get_inference_statistics("add")["model_stats"][0]
    client.infer("add", _add([1], [2]))
    with pytest.raises(InferenceServerException):
        client.infer("add", [_input("a", np.ones(2, np.float32), "FP32")])  # b missing
    after = client.get_inference_statistics("add", "1")["model_stats"][0]
    assert after["name"] == "add" and after["version"] == "1"
    stats = after["inference_stats"]
    assert stats["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert stats["fail"]["count"] == before["inference_stats"]["fail"]["count"] + 1
    assert isinstance(stats["success"]["ns"], int) and stats["success"]["ns"] > 0
    everything = client.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in everything} >= set(BUNDLED)


def test_repository_index_unload_and_load(client):
    index = client.get_model_repository_index()
    assert {(m["name"], m["state"]) for m in index} >= {(n, "READY") for n in BUNDLED}
    client.unload_model("cnn")
    assert not client.is_model_ready("cnn")
    rows = {m["name"]: m for m in client.get_model_repository_index()}
    assert rows["cnn"]["state"] == "UNAVAILABLE"
    client.load_model("cnn")
    assert client.is_model_ready("cnn")
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("nope")
    assert info.value.status() == "404"
    with pytest.raises(InferenceServerException, match="file overrides need") as info:
        client.load_model("cnn", files={"file:1/model.onnx": b"x"})
    assert info.value.status() == "400"


def test_a_bad_class_count_and_a_cuda_registration_are_refused(client):
    outputs = [httpclient.InferRequestedOutput("sum", class_count=-1)]
    with pytest.raises(InferenceServerException, match="class count from 1") as info:
        client.infer("add", _add([1], [2]), outputs=outputs)
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException, match="GPUs not supported") as info:
        client.register_cuda_shared_memory("r", b"handle", 0, 16)
    assert info.value.status() == "400"


# --- raw HTTP: what a client library never sends


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        (b"{not json", {}, "not valid JSON"),
        (b"\xff\xfe\x00garbage", {}, "not valid JSON"),
        (b"[1, 2]", {}, "must be a JSON object"),
        (b'{"inputs": 3}', {}, "must be a JSON array"),
        # deeper than simdjson's 1,024 levels (its DEPTH_ERROR was a 500)
        (b'{"parameters": {"x": ' + b"[" * 1100 + b"]" * 1100 + b"}}", {}, "deeper than 1,024"),
        (
            _infer_json([{"name": "a", "shape": [2], "datatype": "FP99", "data": [1, 2]}]),
            {},
            "datatype 'FP99' is not supported",
        ),
        (
            _infer_json([{"name": "a", "shape": [3], "datatype": "FP32", "data": [1, 2]}]),
            {},
            "2 values in 'data', but shape [3] needs 3",
        ),
        (
            _infer_json([{"name": "a", "shape": [2], "datatype": "FP32", "data": ["x", "y"]}]),
            {},
            "do not fit FP32",
        ),
        (
            # an input the model lacks: its data is decoded (and refused) before the name is
            _infer_json([{"name": "i", "shape": [2], "datatype": "INT32", "data": [1.5, 2]}]),
            {},
            "do not fit INT32",
        ),
        (
            _infer_json([{"name": "i", "shape": [1], "datatype": "INT8", "data": [300]}]),
            {},
            "outside INT8's range",
        ),
        (  # a float past FP32's range was cast to inf, which the model saw
            _infer_json([{"name": "a", "shape": [2], "datatype": "FP32", "data": [1, 1e39]}]),
            {},
            "outside FP32's range",
        ),
        (
            _infer_json([{"name": "a", "shape": [2], "datatype": "FP32", "data": [[1], [2, 3]]}]),
            {},
            "3 values in 'data'",
        ),
        (
            _infer_json([{"name": "a", "shape": [-2], "datatype": "FP32", "data": []}]),
            {},
            "negative dimension",
        ),
        (
            _infer_json([{"name": "a", "shape": [2], "datatype": "FP32"}]),
            {},
            "neither 'data' nor a binary_data_size",
        ),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "999999"}, "within the body"),
        (b'{"inputs": []}', {"Inference-Header-Content-Length": "-4"}, "must be a byte count"),
        (
            _sized("FP32", 2, 8) + b"\0" * 4,
            {"Inference-Header-Content-Length": None},
            "goes past the end of the binary data",
        ),
        (
            _sized("FP32", 2, 8) + b"\0" * 12,
            {"Inference-Header-Content-Length": None},
            "4 bytes of binary data are not claimed",
        ),
        (
            _sized("FP32", 3, 8) + b"\0" * 8,
            {"Inference-Header-Content-Length": None},
            "needs 12",
        ),
        (
            _sized("BYTES", 1, 8, "i") + struct.pack("<I", 99) + b"abcd",
            {"Inference-Header-Content-Length": None},
            "claims 99 bytes",
        ),
    ],
)
def test_a_malformed_infer_body_is_400_with_a_message(server, body, headers, message):
    if headers.get("Inference-Header-Content-Length", "") is None:  # the JSON part's length
        headers = {"Inference-Header-Content-Length": str(body.index(b"}]}") + 3)}
    status, _, reply = _request(server, "POST", "/v2/models/add/infer", body, headers)
    assert status == 400, reply
    assert message in reply["error"]


def test_a_wrong_input_name_or_output_is_400(server):
    body = _infer_json(
        [
            {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]},
            {"name": "c", "shape": [1], "datatype": "FP32", "data": [1]},
        ]
    )
    status, _, reply = _request(server, "POST", "/v2/models/add/infer", body)
    assert status == 400 and "unknown input(s) ['c']" in reply["error"]
    body = _infer_json(
        [
            {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]},
            {"name": "b", "shape": [1], "datatype": "FP32", "data": [2]},
        ],
        outputs=[{"name": "nope"}],
    )
    status, _, reply = _request(server, "POST", "/v2/models/add/infer", body)
    assert status == 400 and "unknown output" in reply["error"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("systemsharedmemory", {"key": "/plugserve_x", "offset": "0", "byte_size": 16}, "offset"),
        ("systemsharedmemory", {"key": "/plugserve_x", "byte_size": True}, "byte_size"),
        ("cudasharedmemory", {"raw_handle": {"b64": "AA=="}, "device_id": 0.5}, "device_id"),
        ("cudasharedmemory", {"raw_handle": {"b64": "AA=="}, "byte_size": "16"}, "byte_size"),
    ],
)
def test_a_shared_memory_registration_with_a_field_not_an_integer_is_400(server, path, body, field):
    """Each register route names the field that is not a JSON integer (true is not one),
    before anything is registered."""
    status, _, reply = _request(
        server, "POST", f"/v2/{path}/region/r/register", json.dumps(body).encode()
    )
    assert status == 400, reply
    assert f"the register request's {field!r} must be an integer" in reply["error"]


def test_json_infer_by_hand_returns_flat_row_major_data(server):
    body = _infer_json(
        [
            {"name": "a", "shape": [4], "datatype": "FP32", "data": [[1, 2], [3, 4]]},
            {"name": "b", "shape": [4], "datatype": "FP32", "data": [10, 20, 30, 40]},
        ]
    )
    status, headers, reply = _request(server, "POST", "/v2/models/add/infer", body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert reply["outputs"] == [
        {"name": "sum", "datatype": "FP32", "shape": [4], "data": [11.0, 22.0, 33.0, 44.0]}
    ]


def test_binary_output_by_hand(server):
    body = _infer_json(
        [
            {"name": "a", "shape": [2], "datatype": "FP32", "data": [1, 2]},
            {"name": "b", "shape": [2], "datatype": "FP32", "data": [3, 4]},
        ],
        parameters={"binary_data_output": True},
    )
    status, headers, reply = _request(server, "POST", "/v2/models/add/infer", body)
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    length = int(headers["inference-header-content-length"])
    header = json.loads(reply[:length])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert np.frombuffer(reply[length:], "<f4").tolist() == [4, 6]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/", 404),
        ("GET", "/v3/health/live", 404),
        ("GET", "/v2/models/nope", 404),
        ("GET", "/v2/models/nope/ready", 404),
        ("GET", "/v2/models/add/versions/x/ready", 400),
        ("POST", "/v2/models/nope/infer", 404),
        ("GET", "/v2/models/add/infer", 405),
        ("DELETE", "/v2/health/live", 405),
        ("GET", "/v2/health/live", 200),
        ("GET", "/v2/health/ready", 200),
    ],
)
def test_paths_and_methods(server, method, path, status):
    body = _infer_json([]) if method == "POST" else b""
    got, headers, reply = _request(server, method, path, body)
    assert got == status, reply
    if status >= 400:
        assert isinstance(reply["error"], str) and reply["error"]
    if status == 405:  # RFC 9110: the methods the path allows
        assert headers["allow"] == ("POST" if path.endswith("/infer") else "GET")


def test_health_answers_carry_the_open_inference_protocol_bodies(server):
    """The KServe SDK's is_server_live / is_server_ready / is_model_ready read these bodies
    (Triton sends none and its clients read only the status)."""
    assert _request(server, "GET", "/v2/health/live")[::2] == (200, {"live": True})
    assert _request(server, "GET", "/v2/health/ready")[::2] == (200, {"ready": True})
    assert _request(server, "GET", "/v2/models/add/ready")[::2] == (
        200,
        {"name": "add", "ready": True},
    )
    assert _request(server, "GET", "/v2/models/add/versions/1/ready")[2]["ready"] is True


class _Replies:
    """Reads one HTTP reply after another from a raw socket (http.client's parser)."""

    class _File(io.BufferedReader):
        def close(self):  # http.client closes a reply's file when it is read: keep reading
            pass

    def __init__(self, sock):
        self.file = self._File(socket.SocketIO(sock, "r"))

    def makefile(self, *args, **kwargs):
        return self.file

    def next(self):
        response = http.client.HTTPResponse(self)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def _raw(method, path, body=b"", headers=""):
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


def _connect(server):
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    return sock, _Replies(sock)


def test_pipelined_requests_are_answered_in_order(server):
    """Three requests in one write, the infer with a query string and an escaped path."""
    add = _add_small()
    sock, replies = _connect(server)
    with sock:
        sock.sendall(
            _raw("GET", "/v2/models/nope")
            + _raw("POST", "/v2/models/%61dd/infer?trace=1", add)
            + _raw("GET", "/v2/health/live")
        )
        status, _, body = replies.next()
        assert status == 404 and b"nope" in body
        status, _, body = replies.next()
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [3.0]
        status, headers, body = replies.next()
        assert (status, body, headers["content-length"]) == (200, b'{"live":true}', "13")


def test_expect_100_continue_gets_its_interim_reply(server):
    body = _add_small()
    head = _raw("POST", "/v2/models/add/infer", body, "Expect: 100-continue\r\n")[: -len(body)]
    sock, replies = _connect(server)
    with sock:
        sock.sendall(head)  # the body only once the server says to go on
        assert replies.file.readline() == b"HTTP/1.1 100 Continue\r\n"
        assert replies.file.readline() == b"\r\n"
        sock.sendall(body)
        status, _, reply = replies.next()
    assert status == 200 and json.loads(reply)["outputs"][0]["data"] == [3.0]


def test_oversized_headers_and_malformed_requests_are_refused_and_closed(server):
    for request, status, message in [
        (_raw("GET", "/v2/health/live", headers="X-Big: " + "y" * 70_000 + "\r\n"), 431,
         b"headers are over"),
        (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", 400,
         b"malformed HTTP request"),
        (b"BREW /v2 HTCPCP/1.0\r\n\r\n", 400, b"malformed HTTP request"),
    ]:  # fmt: skip
        sock, replies = _connect(server)
        with sock:
            sock.sendall(request)
            got, headers, body = replies.next()
            assert got == status and message in body, body
            assert headers["connection"] == "close"
            assert sock.recv(1) == b""  # closed by the server


def test_head_gets_no_body(server):
    sock, replies = _connect(server)
    with sock:
        sock.sendall(_raw("HEAD", "/v2/health/live") + _raw("GET", "/v2/health/live"))
        response = http.client.HTTPResponse(replies, method="HEAD")
        response.begin()
        assert response.status == 405 and int(response.getheader("content-length")) > 0
        assert response.read() == b""
        status, _, body = replies.next()  # the next reply starts right after the head
        assert (status, json.loads(body)) == (200, {"live": True})


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(client, algorithm):
    result = client.infer(
        "add",
        _add([1, 2], [3, 4]),
        request_compression_algorithm=algorithm,
        response_compression_algorithm=algorithm,
    )
    assert result.as_numpy("sum").tolist() == [4, 6]


def test_unknown_or_broken_compression_is_refused(server):
    status, _, reply = _request(
        server, "POST", "/v2/models/add/infer", b"xx", {"Content-Encoding": "br"}
    )
    assert status == 415 and "'br' is not supported" in reply["error"]
    status, _, reply = _request(
        server, "POST", "/v2/models/add/infer", b"\x1f\x8bnot gzip", {"Content-Encoding": "gzip"}
    )
    assert status == 400 and "cannot be inflated" in reply["error"]
    truncated = gzip.compress(_add_small())[:-12]
    status, _, reply = _request(
        server, "POST", "/v2/models/add/infer", truncated, {"Content-Encoding": "gzip"}
    )
    assert status == 400 and "truncated" in reply["error"]


# --- limits, and the metrics port


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    with RunningServer("--model-repository", str(repo), "--max-message-bytes", "4096") as s:
        yield s


def test_a_body_over_max_message_bytes_is_413(small):
    body = _infer_json(
        [
            {"name": "a", "shape": [1000], "datatype": "FP32", "data": [1.0] * 1000},
            {"name": "b", "shape": [1000], "datatype": "FP32", "data": [1.0] * 1000},
        ]
    )
    status, _, reply = _request(small, "POST", "/v2/models/add/infer", body)
    assert status == 413 and "--max-message-bytes" in reply["error"]
    status, _, reply = _request(small, "POST", "/v2/models/add/infer", _add_small())
    assert status == 200, reply
    bomb = gzip.compress(b" " * 100_000 + _add_small())  # small on the wire, not inflated
    status, _, reply = _request(
        small, "POST", "/v2/models/add/infer", bomb, {"Content-Encoding": "gzip"}
    )
    assert status == 413 and "once inflated" in reply["error"]


def _add_small() -> bytes:
    return _infer_json(
        [
            {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]},
            {"name": "b", "shape": [1], "datatype": "FP32", "data": [2]},
        ]
    )


def test_the_metrics_port_serves_metrics_only(server):
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        assert response.status == 200
        assert b"plugserve_inference_requests" in response.read()
    base = server.metrics_url.rsplit("/", 1)[0]
    for path in ("/", "/v2/health/ready", "/v2/models/nope/ready", "/metricsx"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(base + path, timeout=10)
        assert info.value.code == 404, path


def test_http_port_minus_one_turns_rest_off(tmp_path):
    repo = examples_repository(tmp_path)
    with RunningServer("--model-repository", str(repo), "--http-port", "-1") as s:
        assert s.http_port == 0
        assert "HTTP" not in next(line for line in s.lines if "listening:" in line)


@pytest.mark.parametrize("flag", ["--http-port", "--metrics-port"])
def test_an_occupied_port_is_a_one_line_error(flag, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = {"--grpc-port": "0", "--http-port": "0", "--metrics-port": "0"}
        ports[flag] = str(busy.getsockname()[1])
        result = subprocess.run(
            [sys.executable, "-m", "plugserve.server.process.cli", "serve", "--host", "127.0.0.1",
             "--model-repository", str(examples_repository(tmp_path)),
             *[part for item in ports.items() for part in item]],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"plugserve: cannot listen on 127.0.0.1:{ports[flag]} ({flag})"), last
    assert "Traceback" not in result.stderr


def test_sequence_parameters_are_refused(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", _add([1], [2]), sequence_id=7, sequence_start=True)
    assert info.value.status() == "400"
    assert "no sequence batching" in info.value.message()
    assert client.infer("add", _add([1], [2]), sequence_id=0).as_numpy("sum").tolist() == [3]


# --- JSON tensors of every kind, as curl users send them (token ids are INT64)

_TYPED = {  # input name: (ONNX type, KServe datatype)
    "i8": (3, "INT8"),
    "i64": (7, "INT64"),
    "u64": (13, "UINT64"),
    "f16": (10, "FP16"),
    "f64": (11, "FP64"),
    "b": (9, "BOOL"),
}


@pytest.fixture(scope="module")
def typed(tmp_path_factory):
    """A server with one Identity per element type (``<name>`` in, ``<name>_out`` out)."""
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in _TYPED],
        "typed",
        [helper.make_tensor_value_info(n, t, ["n"]) for n, (t, _) in _TYPED.items()],
        [helper.make_tensor_value_info(f"{n}_out", t, ["n"]) for n, (t, _) in _TYPED.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    repo = tmp_path_factory.mktemp("repo")
    (repo / "typed" / "1").mkdir(parents=True)
    (repo / "typed" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    with RunningServer("--model-repository", str(repo)) as s:
        yield s


def _typed_body(**data) -> bytes:
    return _infer_json(
        [
            {"name": n, "shape": [len(v)], "datatype": _TYPED[n][1], "data": v}
            for n, v in data.items()
        ]
    )


_VALUES = {
    "i8": [-128, 0, 127],
    "i64": [-(2**63), 2**62 + 1, 2**63 - 1],  # 2**62 + 1 has no float64: exact or lost
    "u64": [0, 2**63, 2**64 - 1],
    "f16": [0.5, -2.0, 65504.0],
    "f64": [0.1, -1e300, 3],
    "b": [True, False, True],
}


def test_json_tensors_of_every_type_round_trip_exactly(typed):
    status, _, reply = _request(typed, "POST", "/v2/models/typed/infer", _typed_body(**_VALUES))
    assert status == 200, reply
    outputs = {o["name"]: o for o in reply["outputs"]}
    for name, values in _VALUES.items():
        assert outputs[f"{name}_out"]["datatype"] == _TYPED[name][1]
        assert outputs[f"{name}_out"]["data"] == values, name


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("i64", [2**63], "outside INT64's range"),
        ("u64", [-1], "outside UINT64's range"),
        ("u64", [2**64], "integers must fit 64 bits"),
        ("i8", [1.5, 2], "do not fit INT8"),
        ("i64", [True, 1], "must be JSON numbers"),
        ("f16", ["1"], "do not fit FP16"),
        ("f64", [1, None], "do not fit FP64"),
        ("b", [1, 0], "must be JSON true/false"),
    ],
)
def test_json_values_that_do_not_fit_their_type_are_400(typed, name, data, message):
    body = _typed_body(**{**_VALUES, name: data})
    status, _, reply = _request(typed, "POST", "/v2/models/typed/infer", body)
    assert status == 400 and message in reply["error"], reply


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        # numpy lays out an empty array's other dimensions too: [0, 2**62] of FP32 spans
        # 2**64 bytes, which it refuses with a ValueError (a 500 "internal error" before)
        ({"shape": [0, 2**62], "datatype": "FP32", "data": []}, "[0, 4611686018427387904]"),
        ({"shape": [0, 2**63 - 1], "datatype": "BYTES", "data": []}, "cannot be held"),
        ({"shape": [3, 0, 2**61], "datatype": "FP32", "data": []}, "cannot be held"),
        # a type named by a JSON object: its type, never the parser's object and its address
        ({"shape": [1], "datatype": {"a": 1}, "data": [1]}, "datatype of dict"),
    ],
)
def test_json_tensors_that_cannot_be_held_are_400_naming_them(server, tensor, message):
    body = _infer_json([{"name": "a", **tensor}, {"name": "b", "shape": [1], "datatype": "FP32",
                                                  "data": [1]}])  # fmt: skip
    status, _, reply = _request(server, "POST", "/v2/models/add/infer", body)
    assert status == 400 and message in reply["error"], reply
    assert "0x" not in reply["error"], reply


def test_a_request_id_of_the_wrong_type_is_named_by_its_json_type(server):
    for value, kind in (({"a": 1}, "dict"), ([1], "list"), (7, "int")):
        body = _infer_json([], id=value)
        status, _, reply = _request(server, "POST", "/v2/models/add/infer", body)
        assert status == 400, reply
        assert reply["error"] == f"the request's id must be a string, not {kind}", reply
    a = {"name": "a", "shape": [1], "datatype": "FP32", "data": [1]}
    long = _infer_json([a, {**a, "name": "b"}], id="x" * 1025)  # every response echoes it
    status, _, reply = _request(server, "POST", "/v2/models/add/infer", long)
    assert status == 400 and "at most 1024" in reply["error"], reply


def test_json_tensors_decode_after_errors_and_past_a_megabyte(server):
    """The server reuses its JSON parser for small bodies: one whose request failed halfway
    (its partial decoding still referenced by the error) must not break the next, and a body
    over a megabyte gets a parser of its own."""
    rng = np.random.default_rng(0)
    for size in (3, 300_000, 3):  # ~5 MB of JSON in the middle
        a, b = rng.normal(size=size).astype(np.float32), rng.normal(size=size).astype(np.float32)
        bad = _infer_json([{"name": "a", "shape": [2], "datatype": "FP32", "data": [1, "x"]}])
        status, _, reply = _request(server, "POST", "/v2/models/add/infer", bad)
        assert status == 400 and "do not fit FP32" in reply["error"]
        body = _infer_json(
            [
                {"name": "a", "shape": [size], "datatype": "FP32", "data": a.tolist()},
                {"name": "b", "shape": [size], "datatype": "FP32", "data": b.tolist()},
            ]
        )
        status, _, reply = _request(server, "POST", "/v2/models/add/infer", body)
        assert status == 200, reply
        np.testing.assert_array_equal(np.asarray(reply["outputs"][0]["data"], np.float32), a + b)
