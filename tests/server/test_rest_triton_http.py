"""Triton's HTTP behaviour that clients rely on, over a real server: the raw binary request, and
the refusals Triton makes (duplicate outputs, JSON nested too deep, element counts that
overflow), each with a message a person can act on and the server unharmed."""

from __future__ import annotations

import http.client
import json
import struct
from urllib.parse import urlsplit

import grpc
import numpy as np
import pytest

#: Triton's limit, which plugserve.server.rest_convert.MAX_JSON_DEPTH keeps (not imported here:
#: plugserve's KServe protobuf module must not load before tritonclient's in this process)
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
    """Inference-Header-Content-Length: 0: the body is the input's bytes, the varying
    dimension worked out from their count; every output comes back as binary data."""
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    status, headers, body = _post(
        server, "/v2/models/mlp/infer", x.tobytes(), {"Inference-Header-Content-Length": "0"}
    )
    assert status == 200, body
    header, data = _binary_outputs(headers, body)
    (output,) = header["outputs"]
    assert output["shape"][0] == 3 and output["parameters"]["binary_data_size"] == len(data)
    from plugserve.server import Core

    model = server.repository / "mlp" / "1" / "model.onnx"
    want = Core().load_network(str(model), "NUMPY").infer({"input": x})[output["name"]]
    np.testing.assert_allclose(np.frombuffer(data, np.float32).reshape(want.shape), want, 1e-5)


def test_a_raw_binary_request_for_bytes_is_one_element(server):
    raw = b"\xff\x00 not utf-8"
    status, headers, body = _post(
        server, "/v2/models/echo/infer", raw, {"Inference-Header-Content-Length": "0"}
    )
    assert status == 200, body
    header, data = _binary_outputs(headers, body)
    assert header["outputs"][0]["shape"] == [1]
    assert data == struct.pack("<I", len(raw)) + raw  # byte for byte


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        ("add", np.ones(4, np.float32).tobytes(), "is for a model with one input; this one has 2"),
        ("mlp", b"\x00" * 7, "is not a whole number of float32"),
        ("mlp", np.ones(17, np.float32).tobytes(), "do not make the model's shape"),
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
        assert f"nested more than {MAX_JSON_DEPTH} levels" in json.loads(answer)["error"]


def test_an_output_requested_twice_is_refused_on_both_protocols(server):
    status, _, answer = _post(
        server, "/v2/models/add/infer", _add("[1]", ',"outputs":[{"name":"sum"},{"name":"sum"}]')
    )
    assert status == 400 and "requested more than once" in json.loads(answer)["error"]
    request = _grpc_add()
    request.outputs.add(name="sum")
    request.outputs.add(name="sum")
    _refused_over_grpc(server, request, "requested more than once")


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
    assert status == 400 and "more than an int64 counts" in json.loads(answer)["error"]
    _refused_over_grpc(server, _grpc_add((1 << 32, 1 << 32, 4)), "more than an int64 counts")
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
