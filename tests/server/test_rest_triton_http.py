"""Triton's HTTP behaviour that clients rely on, over a real server: the raw binary request, and
the refusals Triton makes (duplicate outputs, JSON nested too deep, element counts that
overflow), each with a message a person can act on and the server unharmed.

The second half runs the cases of Triton's own HTTP QA test (qa/L0_http/http_test.py: raw
binary, longer raw binary, manual chunked encoding, BYTES, too many BYTES elements, several
variable dimensions, several inputs, buffer overflows, JSON depth) against a Triton repository
of its QA "zero" models (identities, config.pbtxt, ``max_batch_size: 8``) made here, with
Triton's expected statuses and the words of its messages; where Triton answers 500 for a
caller's mistake (a negative dimension, a file name too long to load), plugserve keeps its 400.

The last part sends L0_http's cases with Python's requests, as http_test.py does (issue 42):
a manually chunked body that requests also gives a Content-Length, a raw BYTES body to a
model whose config says dims [1] over a graph of [-1], and a load request over the input
limit, answered in Triton's words to a client that sends its whole body first."""

from __future__ import annotations

import base64
import http.client
import json
import struct
from urllib.parse import urlsplit

import grpc
import numpy as np
import pytest

#: Triton's limit, which plugserve.server.protocols.kserve.json_codec.MAX_JSON_DEPTH keeps (not
#: imported here: plugserve's KServe protobuf module must not load before tritonclient's in this
#: process)
MAX_JSON_DEPTH = 100


def _post(server, path: str, body: bytes, headers: dict[str, str] | None = None):
    url = urlsplit(server.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request("POST", path, body, headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def _add(a_data: str, outputs: str = "") -> bytes:
    a = f'{{"name":"a","shape":[1],"datatype":"FP32","data":{a_data}}}'
    b = '{"name":"b","shape":[1],"datatype":"FP32","data":[1]}'
    return f'{{"inputs":[{a},{b}]{outputs}}}'.encode()


def _binary_outputs(headers: dict[str, str], body: bytes) -> tuple[dict, bytes]:
    length = int(headers["inference-header-content-length"])
    return json.loads(body[:length]), body[length:]


def test_a_raw_binary_request_is_the_one_inputs_data(server):
    """Inference-Header-Content-Length: 0: the body is the input's bytes; a batching model
    (the mlp: max_batch_size 8) gets batch 1, as Triton deduces it; every output comes back as
    binary data."""
    x = np.random.default_rng(0).normal(size=(1, 16)).astype(np.float32)
    status, headers, body = _post(
        server, "/v2/models/mlp/infer", x.tobytes(), {"Inference-Header-Content-Length": "0"}
    )
    assert status == 200, body
    header, data = _binary_outputs(headers, body)
    (output,) = header["outputs"]
    assert output["shape"][0] == 1 and output["parameters"]["binary_data_size"] == len(data)
    from plugserve.server import Core

    model = server.repository / "mlp" / "1" / "model.onnx"
    want = Core().load_network(str(model), "NUMPY").infer({"input": x})[output["name"]]
    np.testing.assert_allclose(np.frombuffer(data, np.float32).reshape(want.shape), want, 1e-5)


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (
            "add",
            np.ones(4, np.float32).tobytes(),
            "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
            "'add' model configuration",
        ),
        ("mlp", b"\x00" * 7, "is not a whole number of float32"),
        ("mlp", np.ones(17, np.float32).tobytes(), "do not make the model's shape"),
        ("mlp", np.ones(32, np.float32).tobytes(), "with batch 1"),  # two rows: not deduced
    ],
)
def test_a_raw_binary_request_that_cannot_be_read_is_refused(server, model, body, message):
    status, _, answer = _post(
        server, f"/v2/models/{model}/infer", body, {"Inference-Header-Content-Length": "0"}
    )
    assert status == 400 and message in json.loads(answer)["error"], answer


def test_json_data_nested_deeper_than_the_limit_is_refused(server):
    deep = "[" * MAX_JSON_DEPTH + "1" + "]" * MAX_JSON_DEPTH
    status, _, answer = _post(server, "/v2/models/add/infer", _add(deep))
    assert status == 200, answer
    for depth in (MAX_JSON_DEPTH + 1, 990):  # 990: near simdjson's own limit, past Python's
        deeper = "[" * depth + "1" + "]" * depth
        status, _, answer = _post(server, "/v2/models/add/infer", _add(deeper))
        assert status == 400, answer
        message = json.loads(answer)["error"]
        assert message.startswith(
            f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"
        ), message


def test_an_output_requested_twice_is_refused_on_both_protocols(server):
    status, _, answer = _post(
        server, "/v2/models/add/infer", _add("[1]", ',"outputs":[{"name":"sum"},{"name":"sum"}]')
    )
    message = json.loads(answer)["error"]
    assert status == 400 and message.startswith("output 'sum' already exists in request"), message
    request = _grpc_add()
    request.outputs.add(name="sum")
    request.outputs.add(name="sum")
    _refused_over_grpc(server, request, "output 'sum' already exists in request")


def _refused_over_grpc(server, request, message: str) -> None:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as info:
            call(request.SerializeToString(), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def _grpc_add(a_shape: tuple[int, ...] = (1,)):
    # tritonclient's copy of the KServe messages: plugserve's clashes with it in one process
    kpb = pytest.importorskip("tritonclient.grpc.service_pb2")

    request = kpb.ModelInferRequest(model_name="add")
    request.inputs.add(name="a", datatype="FP32", shape=list(a_shape))
    request.inputs.add(name="b", datatype="FP32", shape=[1])
    request.raw_input_contents.extend([b"\0" * 4, b"\0" * 4])
    return request


def test_a_shape_whose_element_count_overflows_is_refused(server):
    body = (
        b'{"inputs":[{"name":"a","shape":[4294967296,4294967296,4],"datatype":"FP32",'
        b'"data":[1]},{"name":"b","shape":[1],"datatype":"FP32","data":[1]}]}'
    )
    status, _, answer = _post(server, "/v2/models/add/infer", body)
    overflow = "causes total element count to exceed maximum size of"
    assert status == 400 and overflow in json.loads(answer)["error"]
    _refused_over_grpc(server, _grpc_add((1 << 32, 1 << 32, 4)), overflow)
    status, _, _ = _post(server, "/v2/models/add/infer", _add("[1]"))
    assert status == 200  # and the server still serves


def test_a_chunked_body_is_read_as_triton_reads_it(server):
    """Transfer-Encoding: chunked, the chunks joined (JSON and binary bodies alike)."""
    url = urlsplit(server.http_url)
    body = _add("[2]")
    pieces = [body[:7], body[7:30], body[30:]]
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.request("POST", "/v2/models/add/infer", iter(pieces), {}, encode_chunked=True)
        response = connection.getresponse()
        answer = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 200, answer
    assert answer["outputs"][0]["data"] == [3.0]


# ------------------------------------------------------------------ Triton's HTTP QA cases


def _zero_model(inputs: list[tuple[str, int, list]], batching: bool):
    """An identity per input (INPUTi -> OUTPUTi), as Triton's QA "zero" models."""
    import onnx
    from onnx import helper

    nodes, ins, outs = [], [], []
    for i, (dtype, _, dims) in enumerate(inputs):
        shape = (["B"] if batching else []) + [
            d if d >= 0 else f"d{i}_{j}" for j, d in enumerate(dims)
        ]
        ins.append(helper.make_tensor_value_info(f"INPUT{i}", dtype, shape))
        outs.append(helper.make_tensor_value_info(f"OUTPUT{i}", dtype, shape))
        nodes.append(helper.make_node("Identity", [f"INPUT{i}"], [f"OUTPUT{i}"]))
    graph = helper.make_graph(nodes, "zero", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.TensorProto, model


_TYPES = {"FP32": ("TYPE_FP32", 1), "FP16": ("TYPE_FP16", 10), "BYTES": ("TYPE_STRING", 8)}


def _zero_entry(
    root, name: str, datatype: str, dims: list[int], count: int = 1, config_dims=None
) -> None:
    """``config_dims``: what config.pbtxt says when it is not the graph's own ``dims`` (Triton's
    L0_http copies onnx_zero_1_object, whose graph is [-1, -1], and edits its config to [1])."""
    import onnx

    config_type, onnx_type = _TYPES[datatype]
    _, model = _zero_model([(onnx_type, 0, dims)] * count, batching=True)
    (root / name / "1").mkdir(parents=True)
    onnx.save(model, root / name / "1" / "model.onnx")
    said = dims if config_dims is None else config_dims
    tensors = lambda kind: ",".join(  # noqa: E731
        f'{{ name: "{kind}{i}" data_type: {config_type} dims: {said} }}' for i in range(count)
    )
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        f"input [ {tensors('INPUT')} ]\noutput [ {tensors('OUTPUT')} ]\n"
    )


@pytest.fixture(scope="module")
def triton_qa(tmp_path_factory):
    """A server on a Triton repository of qa/L0_http's models (on ORT, as Triton's platform
    onnxruntime_onnx says)."""
    from serving import RunningServer

    root = tmp_path_factory.mktemp("triton-qa")
    _zero_entry(root, "onnx_zero_1_float32", "FP32", [-1])
    _zero_entry(root, "onnx_zero_1_float16", "FP16", [-1, -1])
    _zero_entry(root, "onnx_zero_3_float32", "FP32", [-1], count=3)
    _zero_entry(root, "onnx_zero_1_object", "BYTES", [-1])
    _zero_entry(root, "onnx_zero_1_object_1_element", "BYTES", [-1], config_dims=[1])
    with RunningServer("--model-repository", str(root)) as running:
        running.repository = root
        yield running


RAW = {"Inference-Header-Content-Length": "0"}


@pytest.mark.parametrize("count", [8, 32])
def test_triton_raw_binary_and_longer_raw_binary(triton_qa, count):
    """test_raw_binary, test_raw_binary_longer: [-1] with batching takes the body's count."""
    data = np.arange(count, dtype=np.float32).tobytes()
    status, headers, body = _post(triton_qa, "/v2/models/onnx_zero_1_float32/infer", data, RAW)
    assert status == 200, body
    header, out = _binary_outputs(headers, body)
    assert header["outputs"][0]["shape"] == [1, count]
    assert out == data


def test_triton_manually_chunked_raw_binary(triton_qa):
    """test_content_encoding_chunked_manually: a body sent in chunked transfer encoding."""
    data = np.arange(8, dtype=np.float32).tobytes()
    chunked = f"{len(data):X}\r\n".encode() + data + b"\r\n0\r\n\r\n"
    url = urlsplit(triton_qa.http_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.putrequest("POST", "/v2/models/onnx_zero_1_float32/infer")
        connection.putheader("Inference-Header-Content-Length", "0")
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        connection.send(chunked)
        response = connection.getresponse()
        status, headers = response.status, {k.lower(): v for k, v in response.getheaders()}
        body = response.read()
    finally:
        connection.close()
    assert status == 200, body
    assert _binary_outputs(headers, body)[1] == data


@pytest.mark.parametrize("device", ["ORT", "NUMPY"])
def test_triton_raw_bytes_are_the_elements_bytes_unchanged(triton_qa, device):
    """test_byte: the body '427' is the one element's bytes, in what the model saw and in the
    answer, on every device (ORT once answered b"b'427'", the Python repr of the bytes). Bytes
    that are not UTF-8 pass through NUMPY's Identity unchanged; ORT, which reads strings as
    text, refuses them with a 400 that says so."""
    name = "onnx_zero_1_object_1_element"
    if device == "NUMPY":
        from plugserve.client import Client

        with Client(triton_qa.target, timeout=60) as control:
            _, model = _zero_model([(8, 0, [1])], batching=False)  # [1], no batching
            control.load("raw_bytes_numpy", model.SerializeToString(), "NUMPY")
        name = "raw_bytes_numpy"
    for raw in (b"427", b"\xff\x00 not utf-8"):
        status, headers, body = _post(triton_qa, f"/v2/models/{name}/infer", raw, RAW)
        if device == "ORT" and raw != b"427":
            assert status == 400 and b"is not UTF-8 text" in body, body
            continue
        assert status == 200, body
        header, out = _binary_outputs(headers, body)
        assert header["outputs"][0]["shape"] == ([1, 1] if device == "ORT" else [1])
        assert out == struct.pack("<I", len(raw)) + raw  # byte for byte


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (  # test_byte_too_many_elements
            "onnx_zero_1_object",
            b"427",
            "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]",
        ),
        (  # test_multi_variable_dimensions
            "onnx_zero_1_float16",
            np.ones([2, 2], np.float16).tobytes(),
            "The shape of the raw input 'INPUT0' can not be deduced because there are more "
            "than one variable-sized dimension",
        ),
        (  # test_multi_inputs
            "onnx_zero_3_float32",
            np.arange(24, dtype=np.float32).tobytes(),
            "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in",
        ),
    ],
)
def test_triton_raw_binary_refusals(triton_qa, model, body, message):
    status, _, answer = _post(triton_qa, f"/v2/models/{model}/infer", body, RAW)
    assert status == 400, answer
    assert json.loads(answer)["error"].startswith(message), answer


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (2**4, "causes total element count to exceed maximum size of"),
        (2**2, "byte size overflow for input"),
    ],
)
def test_triton_buffer_size_overflow(triton_qa, rows, message):
    """test_buffer_size_overflow: an element count, then a byte size, past an int64."""
    payload = {
        "inputs": [
            {"name": "INPUT0", "shape": [rows, 2**60 + 2], "datatype": "FP32", "data": [1.0]}
        ]
    }
    status, _, answer = _post(
        triton_qa, "/v2/models/onnx_zero_1_float32/infer", json.dumps(payload).encode()
    )
    assert status == 400 and message in json.loads(answer)["error"], answer


def test_triton_negative_dimension_is_a_400(triton_qa):
    """test_negative_dimensions: Triton answers 500 for the caller's mistake; plugserve 400."""
    payload = {"inputs": [{"name": "INPUT0", "shape": [2, -5], "datatype": "FP32", "data": [1]}]}
    status, _, answer = _post(
        triton_qa, "/v2/models/onnx_zero_1_float32/infer", json.dumps(payload).encode()
    )
    assert status == 400 and "negative dimension" in json.loads(answer)["error"], answer


@pytest.mark.parametrize(("depth", "ok"), [(120, False), (50, True)])
@pytest.mark.parametrize(("datatype", "value"), [("BYTES", '"hello"'), ("FP32", "123")])
def test_triton_json_recursion_depth_limit(triton_qa, depth, ok, datatype, value):
    """test_json_recursion_depth_limit: a [1, 1] tensor's data nested 50 deep is read; 120
    deep is refused with Triton's words."""
    model = "onnx_zero_1_object" if datatype == "BYTES" else "onnx_zero_1_float32"
    data = "[" * depth + value + "]" * depth
    body = f'{{"inputs":[{{"name":"INPUT0","datatype":"{datatype}","shape":[1,1],"data":{data}}}]}}'
    status, _, answer = _post(triton_qa, f"/v2/models/{model}/infer", body.encode())
    if ok:
        assert status == 200, answer
    else:
        assert status == 400, answer
        assert (
            "JSON nesting depth exceeds maximum allowed limit (100)" in json.loads(answer)["error"]
        )


@pytest.mark.parametrize(
    "body", [b'{"ready": 1}', b'{"ready": "yes"}', b'{"ready": ' + b"[" * 2000 + b"]" * 2000 + b"}"]
)
def test_repository_index_ready_must_be_a_boolean(triton_qa, body):
    """Triton's words for a 'ready' that is no boolean, even one nested past the depth a JSON
    reader will go (the value is checked first)."""
    status, _, answer = _post(triton_qa, "/v2/repository/index", body)
    assert status == 400, answer
    assert json.loads(answer)["error"].startswith(
        "Invalid value for 'ready': expected a boolean"
    ), answer


def test_an_oversized_body_says_request_json_size(tmp_path):
    """Triton's words for a body over the limit ("request JSON size of N bytes exceeds the
    maximum allowed input size of M bytes"), then the flag that raises it."""
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path)
    with RunningServer("--model-repository", str(repo), "--max-message-bytes", "65536") as running:
        status, _, answer = _post(running, "/v2/models/add/infer", b" " * 70000)
        assert status == 413, answer
        message = json.loads(answer)["error"]
        assert message.startswith("request JSON size of 70000 bytes"), message
        assert "exceeds the maximum allowed input size of 65536 bytes" in message
        assert "--max-message-bytes" in message


# ------------------------------------------- Triton's qa/L0_http/http_test.py, as it is written
# Its cases send with Python's requests, which adds what http.client above does not: a
# Content-Length beside a manual Transfer-Encoding, a whole body sent before the answer is read.


def _requests():
    return pytest.importorskip("requests", reason="pip install requests")


def _raw_binary_helper(server, model, input_bytes, expected_output_bytes, extra_headers=None):
    """http_test.py's _raw_binary_helper: the answer's binary output is the input's bytes."""
    headers = {"Inference-Header-Content-Length": "0", **(extra_headers or {})}
    r = _requests().post(f"{server.http_url}/v2/models/{model}/infer", data=input_bytes,
                         headers=headers, timeout=60)  # fmt: skip
    r.raise_for_status()
    header_size = int(r.headers["Inference-Header-Content-Length"])
    assert r.content[header_size:] == expected_output_bytes
    return r


@pytest.mark.parametrize("count", [8, 32])
def test_l0_raw_binary(triton_qa, count):
    """test_raw_binary, test_raw_binary_longer."""
    input_bytes = np.arange(count, dtype=np.float32).tobytes()
    _raw_binary_helper(triton_qa, "onnx_zero_1_float32", input_bytes, input_bytes)


def test_l0_byte_reads_the_configs_dims(triton_qa):
    """test_byte: the model's config says dims [1] (batching on) where its graph says [-1]:
    Triton's rule reads the config, so '427' is the one element."""
    r = _requests().post(f"{triton_qa.http_url}/v2/models/onnx_zero_1_object_1_element/infer",
                         data="427", headers=RAW, timeout=60)  # fmt: skip
    r.raise_for_status()
    header_size = int(r.headers["Inference-Header-Content-Length"])
    assert r.content[header_size + 4 :].decode() == "427"


def test_l0_content_encoding_chunked_manually(triton_qa):
    """test_content_encoding_chunked_manually: requests sends the chunked body with a
    Content-Length too (the encoded length); the chunks decide, and the connection closes
    after the answer (a pair of framings is how requests are smuggled past proxies)."""
    input_bytes = np.arange(8, dtype=np.float32).tobytes()
    chunk_encoded_input = f"{len(input_bytes):X}\r\n".encode() + input_bytes + b"\r\n0\r\n\r\n"
    r = _raw_binary_helper(
        triton_qa, "onnx_zero_1_float32", chunk_encoded_input, input_bytes,
        {"Transfer-Encoding": "chunked"},
    )  # fmt: skip
    assert r.headers["Connection"] == "close"


def test_l0_content_encoding_unsupported_client(triton_qa):
    """test_content_encoding_unsupported_client: tritonclient refuses the header itself."""
    from tritonclient.utils import InferenceServerException

    for encoding in ["chunked", "compress", "deflate", "gzip"]:
        np_input = np.arange(8, dtype=np.float32).reshape(1, -1)
        inputs = [httpclient_module().InferInput("INPUT0", np_input.shape, "FP32")]
        inputs[0].set_data_from_numpy(np_input)
        with (
            httpclient_module().InferenceServerClient(triton_qa.http_target) as client,
            pytest.raises(InferenceServerException, match="Unsupported HTTP header"),
        ):
            client.infer("onnx_zero_1_float32", inputs, headers={"Transfer-Encoding": encoding})


def httpclient_module():
    return pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[http]'")


def test_l0_inference_header_content_length_out_of_range(triton_qa):
    r = _requests().post(f"{triton_qa.http_url}/v2/models/onnx_zero_1_float32/infer",
                         json={"inputs": []}, timeout=60,
                         headers={"Inference-Header-Content-Length": "99999999999"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert _requests().get(f"{triton_qa.http_url}/v2/health/live", timeout=10).status_code == 200


def test_l0_load_oversized_file_parameter(triton_qa):
    """test_load_oversized_file_parameter: a file name longer than a path component may be is
    refused, the server stays up and ready (Triton answers 500 for the caller's mistake;
    plugserve 400, naming it)."""
    payload = {"parameters": {"file:" + "A" * 256: "YQ==", "config": "{}"}}
    r = _requests().post(f"{triton_qa.http_url}/v2/repository/models/onnx_zero_1_float32/load",
                         json=payload, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert "failed to load 'onnx_zero_1_float32'" in r.json()["error"], r.text
    health = _requests().get(f"{triton_qa.http_url}/v2/health/ready", timeout=10)
    assert health.status_code == 200, health.text


@pytest.fixture(scope="module")
def small_body_server(tmp_path_factory):
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path_factory.mktemp("small-body"))
    with RunningServer("--model-repository", str(repo), "--max-message-bytes", "1048576") as s:
        yield s


@pytest.mark.parametrize("chunked", [False, True])
def test_l0_loading_large_invalid_model(small_body_server, chunked):
    """test_loading_large_invalid_model (its 2.9 GB of base64 over Triton's default limit;
    here 64 MiB over a 1 MiB --max-message-bytes, the same path, and more than the sockets'
    buffers hold): the load request's JSON is refused in Triton's words, and a client that
    sends its whole body before it reads (requests) gets that answer, not a reset (the server
    answers at the headers, then reads what still comes and drops it). Chunked (a generator
    body), it is refused as it arrives."""
    encoded = base64.b64encode(b"A" * (48 << 20)).decode()
    payload = json.dumps(
        {
            "parameters": {
                "config": json.dumps({"backend": "onnxruntime"}),
                "file:1/model.onnx": encoded,
            }
        }
    ).encode()
    data = (
        iter([payload[i : i + 65536] for i in range(0, len(payload), 65536)])
        if chunked
        else payload
    )
    response = _requests().post(
        f"{small_body_server.http_url}/v2/repository/models/invalid_onnx/load",
        headers={"Content-Type": "application/json"}, data=data, timeout=60,
    )  # fmt: skip
    assert response.status_code != 200
    error_message = response.json().get("error", "")
    assert "request JSON size" in error_message, error_message
    assert " exceeds the maximum allowed input size" in error_message, error_message
    live = _requests().get(f"{small_body_server.http_url}/v2/health/live", timeout=10)
    assert live.status_code == 200


def test_a_refused_body_is_drained_so_its_client_reads_the_answer(small_body_server):
    """A client that writes its whole body before reading (a plain socket here; curl, Java's
    HttpURLConnection) reads the 413 sent at the headers: the server reads and drops the rest
    (up to --request-read-timeout) before closing, where a close with the body unread would
    reset the connection under the client's writes and lose the answer."""
    import socket

    body = b"x" * (64 << 20)
    head = (
        b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", small_body_server.http_port), timeout=60) as sock:
        sock.sendall(head)
        sock.sendall(body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"request JSON size of 67108864 bytes" in reply


def test_l0_repository_index_deeply_nested_json(triton_qa):
    """test_repository_index_deeply_nested_json: 'ready' nested 250,000 deep (500 KB)."""
    depth = 250000
    payload = '{"ready":' + "[" * depth + "true" + "]" * depth + "}"
    response = _requests().post(
        f"{triton_qa.http_url}/v2/repository/index",
        data=payload,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400, response.text[:300]
    assert "Invalid value for 'ready': expected a boolean" in response.json()["error"]
    live = _requests().get(f"{triton_qa.http_url}/v2/health/live", timeout=10)
    assert live.status_code == 200
