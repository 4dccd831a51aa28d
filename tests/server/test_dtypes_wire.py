"""bfloat16 over KServe (``BF16``, with tritonclient) and the other narrow element types over
plugserve.v1 (raw bytes under their ml_dtypes names), through a real server.

Like every module that imports ``tritonclient.grpc``, this one never imports plugserve's own
``inference.*`` modules; plugserve.v1's are distinct symbols.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from plugserve.client import Client

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402


def _save(repo, name: str, model: onnx.ModelProto) -> None:
    folder = repo / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model.SerializeToString())


def _model(nodes, inputs, outputs) -> onnx.ModelProto:
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 25)],
    )
    model.ir_version = 11
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving import RunningServer

    repo = tmp_path_factory.mktemp("repo")
    _save(
        repo,
        "bf16",
        _model(
            [helper.make_node("Mul", ["x", "x"], ["y"])],
            [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["n"])],
        ),
    )
    _save(
        repo,
        "narrow",
        _model(
            [
                helper.make_node("Cast", ["x"], ["f8"], to=TensorProto.FLOAT8E4M3FN),
                helper.make_node("Cast", ["x"], ["i4"], to=TensorProto.INT4),
                helper.make_node("Cast", ["f8"], ["back"], to=TensorProto.FLOAT),
            ],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
            [
                helper.make_tensor_value_info("f8", TensorProto.FLOAT8E4M3FN, ["n"]),
                helper.make_tensor_value_info("i4", TensorProto.INT4, ["n"]),
                helper.make_tensor_value_info("back", TensorProto.FLOAT, ["n"]),
            ],
        ),
    )
    with RunningServer("--model-repository", str(repo), "--default-device", "NUMPY") as running:
        yield running


def test_bf16_through_kserve_with_tritonclient(server):
    x = np.array([0.5, -1.25, 3.0, 100.0, 1e-3], ml_dtypes.bfloat16)
    with grpcclient.InferenceServerClient(server.target) as client:
        meta = client.get_model_metadata("bf16")
        assert [(t.name, t.datatype) for t in meta.inputs] == [("x", "BF16")]
        assert [(t.name, t.datatype) for t in meta.outputs] == [("y", "BF16")]
        config = client.get_model_config("bf16").config
        assert config.input[0].data_type == config.output[0].data_type  # TYPE_BF16
        inp = grpcclient.InferInput("x", list(x.shape), "BF16")
        inp.set_data_from_numpy(x)
        result = client.infer("bf16", [inp])
    y = result.as_numpy("y")
    assert result.get_output("y").datatype == "BF16"
    assert y.dtype == np.dtype(ml_dtypes.bfloat16)
    expected = (x.astype(np.float32) * x.astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(y.astype(np.float32), expected.astype(np.float32))


def test_bf16_through_rest_as_json_numbers_and_as_binary(server):
    """BF16 in a JSON body is numbers, as FP16 is, and a BF16 output is answered as numbers
    (exact: float32 holds every bfloat16); both were a 500 (no JSON kind for ml_dtypes' type)."""
    import json
    import urllib.request

    x = [0.5, -1.25, 3.0, 10.0]
    body = {"inputs": [{"name": "x", "shape": [4], "datatype": "BF16", "data": x}]}
    request = urllib.request.Request(f"{server.http_url}/v2/models/bf16/infer",
                                     json.dumps(body).encode())  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as response:
        reply = json.loads(response.read())
    assert reply["outputs"][0]["datatype"] == "BF16"
    assert reply["outputs"][0]["data"] == [0.25, 1.5625, 9.0, 100.0]

    httpclient = pytest.importorskip("tritonclient.http")
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        for binary in (True, False):
            inp = httpclient.InferInput("x", [4], "BF16")
            inp.set_data_from_numpy(np.array(x, ml_dtypes.bfloat16), binary_data=True)
            out = httpclient.InferRequestedOutput("y", binary_data=binary)
            result = client.infer("bf16", [inp], outputs=[out])
            y = result.as_numpy("y")
            assert np.asarray(y, np.float32).tolist() == [0.25, 1.5625, 9.0, 100.0], binary


def test_kserve_names_the_types_it_cannot_carry(server):
    with grpcclient.InferenceServerClient(server.target) as client:
        inp = grpcclient.InferInput("x", [3], "FP32")
        inp.set_data_from_numpy(np.ones(3, np.float32))
        with pytest.raises(InferenceServerException, match="float8_e4m3fn"):
            client.infer("narrow", [inp])


def test_narrow_types_through_plugserve_v1_as_raw_bytes(server):
    x = np.array([0.3, -2.6, 500.0, 7.0], np.float32)
    with Client(server.target) as client:
        out = client.infer("narrow", {"x": x})
        bf16 = client.infer("bf16", {"x": np.array([1.5, -2.0], ml_dtypes.bfloat16)})
    assert out["f8"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(out["f8"].astype(np.float32), [0.3125, -2.5, 448.0, 7.0])
    np.testing.assert_array_equal(out["back"], out["f8"].astype(np.float32))
    assert out["i4"].dtype == np.dtype(ml_dtypes.int4)
    np.testing.assert_array_equal(
        out["i4"].astype(np.int8), [0, -2, x[2].astype(ml_dtypes.int4).astype(np.int8), 7]
    )
    assert bf16["y"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf16["y"].astype(np.float32), [2.25, 4.0])
