"""BYTES are bytes: an element that is not UTF-8 crosses every protocol byte for byte through
a model that only moves it, a model that reads its strings as text refuses it by name, and
the per-tensor string cap is a setting that answers INVALID_ARGUMENT, through a real server.

Like every module that imports ``tritonclient.grpc``, this one never imports plugserve's own
``inference.*`` modules; plugserve.v1's are distinct symbols.
"""

from __future__ import annotations

import http.client
import json
import struct

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from plugserve.client import Client

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

RAW = b"\xff\x00\x80"
ELEMENTS = [RAW, "caf\u00e9".encode(), b""]
CAP = 8


def _save(repo, name: str, model: onnx.ModelProto, device: str) -> None:
    folder = repo / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    (repo / name / "config.json").write_text(json.dumps({"device": device}))


def _strings(op: str, **attrs) -> onnx.ModelProto:
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node(op, ["x"], ["y"], **attrs)],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.STRING, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.STRING, ["n"])],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving import RunningServer

    repo = tmp_path_factory.mktemp("repo")
    _save(repo, "echo", _strings("Identity"), "NUMPY")
    _save(repo, "lower", _strings("StringNormalizer", case_change_action="LOWER"), "NUMPY")
    _save(repo, "ort_echo", _strings("Identity"), "ORT")
    with RunningServer(
        "--model-repository", str(repo), "--max-string-elements", str(CAP)
    ) as running:
        yield running


def _framed(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def _array(elements: list[bytes]) -> np.ndarray:
    array = np.empty(len(elements), dtype=object)
    array[:] = elements
    return array


def _as_bytes(values) -> list[bytes]:
    return [v if isinstance(v, bytes) else v.encode() for v in values]


def test_kserve_grpc_raw_and_contents_carry_bytes_as_they_are(server):
    with grpcclient.InferenceServerClient(server.target) as client:
        inp = grpcclient.InferInput("x", [len(ELEMENTS)], "BYTES")
        inp.set_data_from_numpy(_array(ELEMENTS))
        result = client.infer("echo", [inp])
    assert _as_bytes(result.as_numpy("y")) == ELEMENTS
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="echo")
        tensor = request.inputs.add(name="x", datatype="BYTES", shape=[len(ELEMENTS)])
        tensor.contents.bytes_contents.extend(ELEMENTS)
        response = stub.ModelInfer(request, timeout=30)
    assert response.raw_output_contents[0] == _framed(ELEMENTS)


def test_rest_binary_in_and_json_out_keep_the_bytes(server):
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        inp = httpclient.InferInput("x", [len(ELEMENTS)], "BYTES")
        inp.set_data_from_numpy(_array(ELEMENTS), binary_data=True)
        # the output asked for as JSON: JSON strings cannot carry it, so it comes as binary
        out = httpclient.InferRequestedOutput("y", binary_data=False)
        result = client.infer("echo", [inp], outputs=[out])
    assert result.get_output("y")["parameters"]["binary_data_size"] == len(_framed(ELEMENTS))
    assert _as_bytes(result.as_numpy("y")) == ELEMENTS
    # text stays JSON when JSON is asked for
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["caf\u00e9"]}]}
    ).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", "/v2/models/echo/infer", body)
        reply = connection.getresponse()
        answer = json.loads(reply.read())
    finally:
        connection.close()
    assert reply.status == 200
    assert answer["outputs"][0]["data"] == ["caf\u00e9"]


def test_plugserve_v1_carries_bytes_as_they_are(server):
    with Client(server.target) as client:
        out = client.infer("echo", {"x": _array(ELEMENTS)})
    assert _as_bytes(out["y"]) == ELEMENTS
    assert out["y"][0] == RAW  # not U+FFFD replacements


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("lower", "takes that input as text only"),  # NUMPY StringNormalizer reads text
        ("ort_echo", "takes that input as text only"),  # onnxruntime's API carries text only
    ],
)
def test_a_model_that_reads_text_refuses_bytes_it_cannot_decode(server, model, why):
    with grpcclient.InferenceServerClient(server.target) as client:
        inp = grpcclient.InferInput("x", [2], "BYTES")
        inp.set_data_from_numpy(_array([b"fine", RAW]))
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, [inp])
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "input 'x' element 1 is not UTF-8 text" in caught.value.message()
        assert why in caught.value.message()
        inp.set_data_from_numpy(_array([b"Fine", "Caf\u00c9".encode()]))
        result = client.infer(model, [inp])
    lowered = [b"fine", "caf\u00e9".encode()]
    expected = lowered if model == "lower" else [b"Fine", "Caf\u00c9".encode()]
    assert _as_bytes(result.as_numpy("y")) == expected


def test_the_string_cap_is_a_setting_and_invalid_argument(server):
    over = [b"a"] * (CAP + 1)
    with grpc.insecure_channel(server.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="echo")
        tensor = request.inputs.add(name="x", datatype="BYTES", shape=[CAP + 1])
        tensor.contents.bytes_contents.extend(over)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"over the limit of {CAP}" in caught.value.details()
        assert "--max-string-elements" in caught.value.details()
        raw = service_pb2.ModelInferRequest(model_name="echo")
        raw.inputs.add(name="x", datatype="BYTES", shape=[CAP + 1])
        raw.raw_input_contents.append(_framed(over))
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(raw, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "BYTES", "shape": [CAP + 1], "data": ["a"] * 9}]}
    ).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", "/v2/models/echo/infer", body)
        reply = connection.getresponse()
        answer = json.loads(reply.read())
    finally:
        connection.close()
    assert reply.status == 400
    assert f"over the limit of {CAP}" in answer["error"]
