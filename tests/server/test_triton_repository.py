"""A Triton model repository (config.pbtxt) and an OpenVINO Model Server config.json, served as
those servers read them (issue 14, item 3), driven with tritonclient over gRPC and HTTP."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import add_constant
from serving import RunningServer

from plugserve.plugins.api import InvalidArgument
from plugserve.server.control.triton_config import read_ovms

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


def plus(constant: float) -> onnx.ModelProto:
    """y = x + constant, x: [batch, 4]."""
    return add_constant(constant, ["batch", 4])


def write(root: Path, name: str, config: str | None, versions: dict[int, float], file: str):
    folder = root / name
    for version, constant in versions.items():
        (folder / str(version)).mkdir(parents=True)
        onnx.save(plus(constant), str(folder / str(version) / file))
    if config is not None:
        (folder / "config.pbtxt").write_text(textwrap.dedent(config))


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    write(
        root,
        "every",
        """
        name: "every"
        backend: "onnxruntime"
        max_batch_size: 8
        version_policy: { all: {} }
        input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]
        output [ { name: "y", data_type: TYPE_FP32, dims: [ 4 ] } ]
        """,
        {1: 1.0, 2: 2.0},
        "model.onnx",
    )
    write(root, "latest", 'platform: "onnxruntime_onnx"\n', {1: 1.0, 2: 2.0, 3: 3.0}, "model.onnx")
    write(
        root,
        "batched",
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 16
        dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 3000 }
        instance_group [ { count: 2, kind: KIND_CPU } ]
        """,
        {1: 10.0},
        "model.onnx",
    )
    write(
        root,
        "named",
        """
        backend: "openvino"
        default_model_filename: "net.onnx"
        parameters: { key: "PERFORMANCE_HINT" value: { string_value: "LATENCY" } }
        parameters: { key: "execution_mode" value: { string_value: "sequential" } }
        response_cache { enable: true }
        """,
        {1: 5.0},
        "net.onnx",
    )
    with RunningServer("--model-repository", str(root)) as server:
        yield server


CLIENTS = {"grpc": grpcclient, "http": httpclient}


@pytest.fixture(params=["grpc", "http"])
def client(request, triton):
    module = CLIENTS[request.param]
    url = triton.target if request.param == "grpc" else triton.http_target
    client = module.InferenceServerClient(url)
    client.module = module
    yield client
    client.close()


def infer(client, model: str, x: np.ndarray, version: str = "") -> np.ndarray:
    request = client.module.InferInput("x", list(x.shape), "FP32")
    request.set_data_from_numpy(x)
    return client.infer(model, [request], model_version=version).as_numpy("y")


def config_of(client, model: str) -> dict:
    config = client.get_model_config(model)
    if isinstance(config, dict):  # http
        return config
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(config.config, preserving_proto_field_name=True)


X = np.ones((3, 4), np.float32)


def test_version_policy_all_loads_every_version_and_is_reported(client):
    np.testing.assert_allclose(infer(client, "every", X, "1"), X + 1)
    np.testing.assert_allclose(infer(client, "every", X, "2"), X + 2)
    config = config_of(client, "every")
    assert "all" in config["version_policy"], config
    assert int(config["max_batch_size"]) == 8
    assert config["parameters"]["device"]["string_value"] == "ORT"


def test_max_batch_size_is_enforced(client):
    np.testing.assert_allclose(infer(client, "every", np.ones((8, 4), np.float32)), 3.0)
    with pytest.raises(InferenceServerException) as info:
        infer(client, "every", np.ones((9, 4), np.float32))
    assert "max_batch_size 8" in info.value.message()
    assert info.value.status() in ("StatusCode.INVALID_ARGUMENT", "400")


def test_the_default_policy_is_the_latest_version(client):
    np.testing.assert_allclose(infer(client, "latest", X), X + 3)
    ready = {(m["name"], m.get("version")) for m in _index(client) if m.get("state") == "READY"}
    assert ("latest", "3") in ready and ("latest", "1") not in ready, ready
    assert config_of(client, "latest")["version_policy"]["latest"]["num_versions"] == 1


def _index(client) -> list[dict]:
    index = client.get_model_repository_index()
    if isinstance(index, list):
        return index
    from google.protobuf.json_format import MessageToDict

    return [MessageToDict(m) for m in index.models]


def test_dynamic_batching_and_instance_groups(client, triton):
    np.testing.assert_allclose(infer(client, "batched", X[:1]), X[:1] + 10)
    config = config_of(client, "batched")
    assert config["parameters"]["device"]["string_value"] == "BATCH:ORT(4)"
    batching = config["dynamic_batching"]
    assert [int(s) for s in batching["preferred_batch_size"]] == [4]
    assert int(batching["max_queue_delay_microseconds"]) == 3000
    assert "the other preferred sizes are not used" in triton.log


def test_default_model_filename_parameters_and_what_is_not_acted_on(client, triton):
    np.testing.assert_allclose(infer(client, "named", X), X + 5)
    assert config_of(client, "named")["parameters"]["device"]["string_value"] == "OPENVINO"
    line = next(line for line in triton.log.splitlines() if "not acted on" in line)
    assert "named" in line and "response_cache" in line and "execution_mode" in line


def test_an_unknown_backend_is_a_startup_problem_naming_the_file(tmp_path):
    write(tmp_path, "tf", 'platform: "tensorflow_savedmodel"\n', {1: 1.0}, "model.onnx")
    with RunningServer("--model-repository", str(tmp_path), "--exit-on-error", "0") as server:
        assert "config.pbtxt: platform/backend 'tensorflow_savedmodel' is not served" in server.log


def test_an_ovms_config_json(tmp_path):
    models = tmp_path / "models"
    write(models, "ov", None, {1: 7.0, 2: 8.0}, "whatever.onnx")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_config_list": [
                    {
                        "config": {
                            "name": "ovms_plus",
                            "base_path": "models/ov",
                            "model_version_policy": {"all": {}},
                            "plugin_config": {"PERFORMANCE_HINT": "LATENCY"},
                            "target_device": "CPU",
                            "nireq": 4,
                        }
                    }
                ]
            }
        )
    )
    with RunningServer("--model-repository", str(tmp_path / "config.json")) as server:
        client = grpcclient.InferenceServerClient(server.target)
        client.module = grpcclient
        try:
            np.testing.assert_allclose(infer(client, "ovms_plus", X, "1"), X + 7)
            np.testing.assert_allclose(infer(client, "ovms_plus", X), X + 8)
            config = config_of(client, "ovms_plus")
            assert config["parameters"]["device"]["string_value"] == "OPENVINO"
            assert "all" in config["version_policy"]
        finally:
            client.close()
        assert "not acted on: nireq" in server.log


@pytest.mark.parametrize(
    "policy, message",
    [
        ({"latest": {"num_versions": "two"}}, "num_versions 'two' must be a whole number >= 1"),
        ({"latest": {"num_versions": 1.5}}, "num_versions 1.5 must be a whole number >= 1"),
        ({"latest": {"num_versions": 0}}, "num_versions 0 must be a whole number >= 1"),
        ({"specific": {}}, "versions None must be a list of version numbers >= 1"),
        ({"specific": {"versions": ["1"]}}, "versions ['1'] must be a list of version numbers"),
        ({"specific": {"versions": [10**19]}}, "must be a list of version numbers >= 1"),
        ({"newest": {}}, "expected {'all': {}}"),
    ],
)
def test_an_ovms_version_policy_it_cannot_read_is_refused_naming_it(tmp_path, policy, message):
    """As a clear INVALID_ARGUMENT naming the file and the model's entry, not a crash."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_config_list": [
                    {"config": {"name": "m", "base_path": "m", "model_version_policy": policy}}
                ]
            }
        )
    )
    with pytest.raises(InvalidArgument, match="model_config_list\\[0\\].*" + re.escape(message)):
        read_ovms(tmp_path / "config.json")


def test_reshape_refuses_the_model_format_is_reported_and_labels_name_classes(tmp_path):
    """A reshape would change the shapes clients send: the model is refused, naming it; a
    format changes nothing here and is logged as not acted on; an output's label file names
    the classes of a classified answer (Triton's quickstart asks densenet for them); an
    input's format is reported in ModelConfig, where image clients read the layout."""
    write(
        tmp_path,
        "reshaped",
        """
        input [{ name: "x", data_type: TYPE_FP32, dims: [3], reshape: { shape: [1, 3] } }]
        """,
        {1: 1.0},
        "model.onnx",
    )
    write(
        tmp_path,
        "labelled",
        """
        max_batch_size: 8
        input [{ name: "x", data_type: TYPE_FP32, dims: [4], format: FORMAT_NCHW }]
        output [{ name: "y", data_type: TYPE_FP32, dims: [4], label_filename: "labels.txt" }]
        """,
        {1: 2.0},
        "model.onnx",
    )
    (tmp_path / "labelled" / "labels.txt").write_text("cat\ndog\nfox\nowl\n")
    with RunningServer("--model-repository", str(tmp_path), "--exit-on-error", "0") as server:
        assert "input 'x' has reshape [1, 3], which plugserve does not apply" in server.log
        assert not [line for line in server.log.splitlines() if "not acted on" in line]
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(server.http_target)
        try:
            assert client.is_model_ready("labelled") and not client.is_model_ready("reshaped")
            (x_config,) = client.get_model_config("labelled")["input"]
            assert x_config["format"] == "FORMAT_NCHW"
            x = httpclient.InferInput("x", [1, 4], "FP32")
            x.set_data_from_numpy(np.array([[0.0, 3.0, 1.0, 2.0]], np.float32))
            asked = httpclient.InferRequestedOutput("y", class_count=2)
            got = client.infer("labelled", [x], outputs=[asked]).as_numpy("y")
        finally:
            client.close()
    assert [item.decode() for item in got[0]] == ["5.000000:1:dog", "4.000000:3:owl"]
