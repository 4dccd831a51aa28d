"""BYTES are bytes: an element that is not UTF-8 crosses every protocol byte for byte through
a model that only moves it (NUMPY's Identity, a Python model as Triton's simple_identity), a
model that reads its strings as text gets the text its bytes encode and refuses one that is
not UTF-8, naming who reads it (onnxruntime's binding, NUMPY's node), and the per-tensor
string cap is a setting that answers INVALID_ARGUMENT, through a real server.

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

#: a Python model that answers its input as it is, as Triton's simple_identity example does
IDENTITY_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            kinds = {type(item).__name__ for item in given.ravel()}
            assert kinds <= {"bytes"}, kinds  # Triton's models get bytes, never str
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", given)]))
        return responses
"""

#: simple_identity's configuration (Triton's docs/examples/model_repository)
IDENTITY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {batch}
input [ {{ name: "INPUT0" data_type: TYPE_STRING dims: [ {dims} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_STRING dims: [ {dims} ] }} ]
"""

#: a Python model that hands its input to ORT's Identity through a BLS call (bytes, as every
#: Python model's tensors are) and answers what comes back
BLS_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            answer = pb_utils.InferenceRequest(
                model_name="ort_echo", requested_output_names=["y"],
                inputs=[pb_utils.Tensor("x", given)],
            ).exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            out = pb_utils.get_output_tensor_by_name(answer, "y").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        return responses
"""


def _python_model(repo, name: str, code: str, dims: str = "-1", batch: int = 0) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(code)
    config = IDENTITY_CONFIG.format(name=name, dims=dims, batch=batch)
    (repo / name / "config.pbtxt").write_text(config)


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
    _python_model(repo, "simple_identity", IDENTITY_MODEL, batch=8)
    _python_model(repo, "identity_one", IDENTITY_MODEL, dims="1")
    _python_model(repo, "bls_ort", BLS_MODEL)
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
        ("lower", "NUMPY's StringNormalizer node"),  # NUMPY's StringNormalizer reads text
        ("ort_echo", "onnxruntime (its Python binding carries string elements as text)"),
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
        assert "takes that input as text only" in caught.value.message()
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


def _random_elements(seed: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [RAW, b"\x00", *(rng.bytes(int(rng.integers(0, 64))) for _ in range(count - 2))]


@pytest.mark.parametrize("model", ["simple_identity", "echo"])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritonclient_round_trips_any_bytes(server, model, protocol):
    """b'\\xff\\x00\\x80', a NUL and random bytes through Triton's simple_identity (a Python
    model, which gets ``bytes``) and an ONNX Identity on NUMPY, each way tritonclient sends
    them: gRPC raw contents, REST binary data with the output as binary data or as JSON
    (which cannot carry them: they come as binary data), and REST JSON for text."""
    module = grpcclient if protocol == "grpc" else httpclient
    url = server.target if protocol == "grpc" else f"127.0.0.1:{server.http_port}"
    batched = model == "simple_identity"
    with module.InferenceServerClient(url) as client:
        for seed in range(3):
            elements = _random_elements(seed, 6)
            array = _array(elements).reshape(1, -1) if batched else _array(elements)
            inp = module.InferInput("INPUT0" if batched else "x", list(array.shape), "BYTES")
            output = "OUTPUT0" if batched else "y"
            if protocol == "grpc":
                inp.set_data_from_numpy(array)
                result = client.infer(model, [inp])
                assert _as_bytes(result.as_numpy(output).ravel()) == elements
                continue
            for binary_out in (True, False):
                inp.set_data_from_numpy(array, binary_data=True)
                out = httpclient.InferRequestedOutput(output, binary_data=binary_out)
                result = client.infer(model, [inp], outputs=[out])
                assert _as_bytes(result.as_numpy(output).ravel()) == elements, binary_out
        # JSON data is text: its UTF-8 bytes reach the model
        text = ["caf\u00e9", "\u65e5\u672c", ""]
        array = _array([t.encode() for t in text])
        array = array.reshape(1, -1) if batched else array
        if protocol == "http":
            inp = module.InferInput("INPUT0" if batched else "x", list(array.shape), "BYTES")
            inp.set_data_from_numpy(array, binary_data=False)
            out = httpclient.InferRequestedOutput(output, binary_data=False)
            result = client.infer(model, [inp], outputs=[out])
            assert _as_bytes(result.as_numpy(output).ravel()) == [t.encode() for t in text]


def test_raw_binary_request_carries_the_bytes_to_a_python_model(server):
    """Triton's raw binary request (Inference-Header-Content-Length: 0): the body is the one
    BYTES element, unchanged, and comes back as binary data."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request(
            "POST", "/v2/models/identity_one/infer", RAW,
            {"Inference-Header-Content-Length": "0"},
        )  # fmt: skip
        reply = connection.getresponse()
        body = reply.read()
    finally:
        connection.close()
    assert reply.status == 200, body
    header = int(reply.getheader("Inference-Header-Content-Length"))
    assert body[header:] == _framed([RAW])


def test_bytes_from_a_python_model_reach_onnxruntime_as_their_text(server):
    """A Python model's tensors are bytes; its BLS call to ORT's Identity gets the text they
    encode (before, onnxruntime's binding turned b'Fine' into the text "b'Fine'"), and one that
    is not UTF-8 fails the call with onnxruntime and the element named."""
    with grpcclient.InferenceServerClient(server.target) as client:
        inp = grpcclient.InferInput("INPUT0", [2], "BYTES")
        inp.set_data_from_numpy(_array([b"Fine", "Caf\u00c9".encode()]))
        result = client.infer("bls_ort", [inp])
        assert _as_bytes(result.as_numpy("OUTPUT0")) == [b"Fine", "Caf\u00c9".encode()]
        inp.set_data_from_numpy(_array([b"Fine", RAW]))
        with pytest.raises(InferenceServerException) as caught:
            client.infer("bls_ort", [inp])
    assert "input 'x' element 1 is not UTF-8 text" in caught.value.message()
    assert "onnxruntime" in caught.value.message()
