"""KServe v2 (``inference.GRPCInferenceService``) through a real server, with tritonclient.

Requests tritonclient's high-level API cannot make (typed ``contents``, malformed raw bytes) are
built with tritonclient's own ``service_pb2``, as a user of tritonclient would build them.
"""

from __future__ import annotations

import queue
import struct

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper

from plugserve.plugins.version import plugserve_version

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

BUNDLED = ("add", "cnn", "echo", "mlp")


@pytest.fixture(scope="module")
def client(server):
    with grpcclient.InferenceServerClient(server.target) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def ints(server, client):
    """A model with INT64 and BOOL tensors and two outputs, added to the server's repository."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["i", "i"], ["doubled"], name="double"),
            helper.make_node("Not", ["flag"], ["negated"], name="negate"),
        ],
        "ints",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, ["n"]),
        ],
        [
            helper.make_tensor_value_info("doubled", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("negated", TensorProto.BOOL, ["n"]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder = server.repository / "ints" / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    client.load_model("ints")
    return "ints"


def _input(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _add_inputs(a, b):
    return [
        _input("a", np.asarray(a, np.float32), "FP32"),
        _input("b", np.asarray(b, np.float32), "FP32"),
    ]


def _status(info) -> str:
    return info.value.status()


def _mlp_expected(x: np.ndarray) -> np.ndarray:
    from plugserve.server import Core
    from plugserve.server.control.examples import mlp

    return Core().load_network(mlp(), "NUMPY").infer({"input": x})["probabilities"]


# ------------------------------------------------------------------ health and metadata


def test_server_live_ready_and_metadata(client):
    assert client.is_server_live() is True
    assert client.is_server_ready() is True
    meta = client.get_server_metadata()
    assert meta.name == "plugserve"
    assert meta.version == plugserve_version()
    assert {"model_repository", "model_configuration", "statistics"} <= set(meta.extensions)
    assert client.get_server_metadata(as_json=True)["name"] == "plugserve"


def test_model_ready(client):
    for name in BUNDLED:
        assert client.is_model_ready(name) is True
    assert client.is_model_ready("mlp", "1") is True
    assert client.is_model_ready("mlp", "2") is False
    assert client.is_model_ready("no-such-model") is False
    with pytest.raises(InferenceServerException) as info:
        client.is_model_ready("mlp", "latest")
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"
    assert "'latest' is not an integer" in info.value.message()


def test_model_metadata(client):
    meta = client.get_model_metadata("mlp")
    assert (meta.name, list(meta.versions), meta.platform) == ("mlp", ["1"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("input", "FP32", [-1, 16])
    ]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("probabilities", "FP32", [-1, 4])
    ]
    echo = client.get_model_metadata("echo", "1", as_json=True)
    assert echo["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]
    cnn = client.get_model_metadata("cnn")
    assert list(cnn.inputs[0].shape) == [-1, 1, 28, 28]


def test_model_metadata_errors(client):
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert _status(info) == "StatusCode.NOT_FOUND"
    unknown = "Request for unknown model: 'no-such-model' is not found"
    assert info.value.message().startswith(unknown)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("mlp", "9")
    assert _status(info) == "StatusCode.NOT_FOUND"
    unknown = "Request for unknown model: 'mlp' version 9 is not found"
    assert info.value.message().startswith(unknown)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("mlp", "v1")
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"


def test_model_config(client):
    config = client.get_model_config("mlp").config
    assert (config.name, config.platform, config.max_batch_size) == ("mlp", "onnxruntime_onnx", 8)
    assert config.backend
    # max_batch_size > 0: the batch dimension is left out of dims, as Triton does
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("input", model_config_pb2.TYPE_FP32, [16])
    ]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("probabilities", model_config_pb2.TYPE_FP32, [4])
    ]
    add = client.get_model_config("add", "1").config
    assert add.max_batch_size == 0
    assert [(i.name, list(i.dims)) for i in add.input] == [("a", [-1]), ("b", [-1])]
    echo = client.get_model_config("echo", as_json=True)["config"]
    assert echo["input"][0]["data_type"] == "TYPE_STRING"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_config("no-such-model")
    assert _status(info) == "StatusCode.NOT_FOUND"


# ------------------------------------------------------------------ inference


def test_infer_raw_add(client):
    result = client.infer("add", _add_inputs([1, 2, 3], [10, 20, 30.5]))
    assert result.as_numpy("sum").tolist() == [11, 22, 33.5]
    response = result.get_response()
    assert (response.model_name, response.model_version) == ("add", "1")
    assert response.outputs[0].datatype == "FP32"
    assert list(response.outputs[0].shape) == [3]


def test_infer_mlp_matches_local_inference(client):
    x = np.random.default_rng(3).normal(size=(5, 16)).astype(np.float32)
    result = client.infer("mlp", [_input("input", x, "FP32")], model_version="1")
    probabilities = result.as_numpy("probabilities")
    assert probabilities.shape == (5, 4)
    np.testing.assert_allclose(probabilities, _mlp_expected(x), rtol=1e-6)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)


def test_infer_bytes_round_trip(client):
    text = np.array(["héllo".encode(), b"", b"w\x00rld", "日本".encode()], dtype=np.object_)
    result = client.infer("echo", [_input("text", text, "BYTES")])
    assert result.get_output("echo").datatype == "BYTES"
    assert result.as_numpy("echo").tolist() == text.tolist()


def test_request_id_parameters_and_output_subset(client, ints):
    i = np.array([1, -2, 2**40], np.int64)
    flag = np.array([True, False, True])
    inputs = [_input("i", i, "INT64"), _input("flag", flag, "BOOL")]
    result = client.infer(
        ints,
        inputs,
        request_id="req-7",
        outputs=[grpcclient.InferRequestedOutput("negated")],
        priority=1,
        parameters={"custom": "value", "n": 2},
    )
    response = result.get_response()
    assert response.id == "req-7"
    assert [o.name for o in response.outputs] == ["negated"]
    assert result.as_numpy("negated").tolist() == [False, True, False]
    assert result.as_numpy("doubled") is None
    both = client.infer(ints, inputs)
    assert both.as_numpy("doubled").tolist() == [2, -4, 2**41]
    assert both.get_output("doubled").datatype == "INT64"
    assert both.get_output("negated").datatype == "BOOL"


def _typed_request(model, *inputs, request_id=""):
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, datatype, shape, field, values in inputs:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        getattr(tensor.contents, field).extend(values)
    return request


def test_infer_typed_contents(stub, ints):
    request = _typed_request(
        "add",
        ("a", "FP32", [1], "fp32_contents", [1.5]),
        ("b", "FP32", [1], "fp32_contents", [0.25]),
        request_id="typed",
    )
    result = grpcclient.InferResult(stub.ModelInfer(request))
    assert result.as_numpy("sum").tolist() == [1.75]
    assert result.get_response().id == "typed"

    words = [b"abc", b"", "ünï".encode()]
    echo = stub.ModelInfer(_typed_request("echo", ("text", "BYTES", [3], "bytes_contents", words)))
    assert grpcclient.InferResult(echo).as_numpy("echo").tolist() == words

    result = grpcclient.InferResult(
        stub.ModelInfer(
            _typed_request(
                ints,
                ("i", "INT64", [2], "int64_contents", [-(2**62), 21]),
                ("flag", "BOOL", [2], "bool_contents", [False, True]),
            )
        )
    )
    assert result.as_numpy("doubled").tolist() == [-(2**63), 42]
    assert result.as_numpy("negated").tolist() == [True, False]


def test_async_infer(client):
    done: queue.Queue = queue.Queue()
    for k in range(4):
        client.async_infer(
            "add",
            _add_inputs([k], [100]),
            callback=lambda result, error: done.put((result, error)),
            request_id=f"async-{k}",
        )
    seen = {}
    for _ in range(4):
        result, error = done.get(timeout=30)
        assert error is None
        seen[result.get_response().id] = result.as_numpy("sum").tolist()
    assert seen == {f"async-{k}": [100 + k] for k in range(4)}


def test_stream_infer(client):
    done: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: done.put((result, error)))
    try:
        for k in range(3):
            client.async_stream_infer("add", _add_inputs([k, k], [1, 2]), request_id=f"s{k}")
        client.async_stream_infer("no-such-model", _add_inputs([1], [1]), request_id="bad")
        wrong = [_input("a", np.ones(1, np.float64), "FP64"), _add_inputs([1], [1])[1]]
        client.async_stream_infer("add", wrong, request_id="bad-dtype")
        results, errors = {}, []
        for _ in range(5):
            result, error = done.get(timeout=30)
            if error is not None:
                errors.append(error.message())
            else:
                results[result.get_response().id] = result.as_numpy("sum").tolist()
    finally:
        client.stop_stream()
    assert results == {f"s{k}": [k + 1, k + 2] for k in range(3)}
    assert len(errors) == 2
    assert any("Request for unknown model: 'no-such-model' is not found" in e for e in errors)
    assert any("element type float64, expected float32" in e for e in errors)


def test_stream_errors_echo_the_request_id(stub):
    good = _typed_request(
        "add", ("a", "FP32", [1], "fp32_contents", [1]), ("b", "FP32", [1], "fp32_contents", [2])
    )
    good.id = "ok"
    bad = service_pb2.ModelInferRequest(model_name="add", model_version="x", id="bad")
    responses = list(stub.ModelStreamInfer(iter([good, bad]), timeout=30))
    by_id = {r.infer_response.id: r for r in responses}
    assert set(by_id) == {"ok", "bad"}
    assert by_id["ok"].error_message == ""
    assert grpcclient.InferResult(by_id["ok"].infer_response).as_numpy("sum").tolist() == [3]
    assert "'x' is not an integer" in by_id["bad"].error_message


# ------------------------------------------------------------------ bad requests


def _raw_request(model, inputs, raw):
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    request.raw_input_contents.extend(raw)
    return request


F4 = np.float32(1).tobytes()
AB = [("a", "FP32", [1]), ("b", "FP32", [1])]

BAD_RAW = {
    "short raw bytes": (
        _raw_request("add", [("a", "FP32", [2]), ("b", "FP32", [2])], [F4, F4 * 2]),
        "4 bytes of data, but shape [2] of float32 needs 8",
    ),
    "raw count differs from inputs": (
        _raw_request("add", AB, [F4]),
        "1 raw_input_contents for 2 inputs",
    ),
    "negative dimension": (
        _raw_request("add", [("a", "FP32", [-1]), ("b", "FP32", [1])], [F4, F4]),
        "negative dimension",
    ),
    "unknown datatype": (
        _raw_request("add", [("a", "FP8", [1]), ("b", "FP32", [1])], [F4, F4]),
        "datatype 'FP8' is not supported",
    ),
    "malformed BYTES": (
        _raw_request("echo", [("text", "BYTES", [2])], [struct.pack("<I", 9) + b"abc"]),
        "claims 9 bytes",
    ),
    "duplicate input": (
        _raw_request("add", [("a", "FP32", [1]), ("a", "FP32", [1])], [F4, F4]),
        "given more than once",
    ),
    "typed count differs from shape": (
        _typed_request(
            "add",
            ("a", "FP32", [3], "fp32_contents", [1, 2]),
            ("b", "FP32", [3], "fp32_contents", [1, 2, 3]),
        ),
        "2 values in contents.fp32_contents, but shape [3] needs 3",
    ),
    "typed wrong field": (
        _typed_request(
            "add",
            ("a", "FP32", [1], "int64_contents", [1]),
            ("b", "FP32", [1], "fp32_contents", [1]),
        ),
        "0 values in contents.fp32_contents",
    ),
    "no data at all": (
        service_pb2.ModelInferRequest(
            model_name="add",
            inputs=[
                service_pb2.ModelInferRequest.InferInputTensor(name="a", datatype="FP32", shape=[1])
            ],
        ),
        "0 values in contents.fp32_contents",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_RAW))
def test_malformed_requests_are_invalid_argument(stub, client, case):
    request, message = BAD_RAW[case]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert client.infer("add", _add_inputs([1], [1])).as_numpy("sum").tolist() == [2]


def test_raw_and_typed_contents_mixed_is_invalid_argument(stub):
    request = _typed_request(
        "add", ("a", "FP32", [1], "fp32_contents", [1]), ("b", "FP32", [1], "fp32_contents", [1])
    )
    request.raw_input_contents.extend([F4, F4])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "both raw_input_contents and contents" in info.value.details()


@pytest.mark.parametrize(
    ("model", "version", "inputs", "code", "message"),
    [
        ("no-such-model", "", lambda: _add_inputs([1], [1]), "NOT_FOUND", "is not found"),
        ("add", "5", lambda: _add_inputs([1], [1]), "NOT_FOUND", "'add' version 5"),
        ("add", "one", lambda: _add_inputs([1], [1]), "INVALID_ARGUMENT", "not an integer"),
        (
            "add",
            "",
            lambda: [_input("a", np.ones(1, np.float32), "FP32")],
            "INVALID_ARGUMENT",
            "missing input b",
        ),
        (
            "add",
            "",
            lambda: [*_add_inputs([1], [1]), _input("c", np.ones(1, np.float32), "FP32")],
            "INVALID_ARGUMENT",
            "unknown input(s) ['c']",
        ),
        (
            "add",
            "",
            lambda: [
                _input("a", np.ones(1, np.float64), "FP64"),
                _input("b", np.ones(1, np.float64), "FP64"),
            ],
            "INVALID_ARGUMENT",
            "element type float64, expected float32",
        ),
        (
            "mlp",
            "",
            lambda: [_input("input", np.ones((2, 8), np.float32), "FP32")],
            "INVALID_ARGUMENT",
            "dimension 1 must be 16",
        ),
        (
            "mlp",
            "",
            lambda: [_input("input", np.ones(16, np.float32), "FP32")],
            "INVALID_ARGUMENT",
            "expected rank 2",
        ),
    ],
)
def test_bad_inputs_have_exact_codes(client, model, version, inputs, code, message):
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs(), model_version=version)
    assert _status(info) == f"StatusCode.{code}"
    assert message in info.value.message()


def test_unknown_outputs_and_a_bad_class_count(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer(
            "add", _add_inputs([1], [1]), outputs=[grpcclient.InferRequestedOutput("nope")]
        )
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"
    assert "unknown output(s) ['nope']" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer(
            "mlp",
            [_input("input", np.ones((1, 16), np.float32), "FP32")],
            outputs=[grpcclient.InferRequestedOutput("probabilities", class_count=-2)],
        )
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"
    assert "class count from 1" in info.value.message()


# ------------------------------------------------------------------ statistics


def _add_stats(client):
    stats = client.get_inference_statistics("add").model_stats
    assert [(s.name, s.version) for s in stats] == [("add", "1")]
    return stats[0]


def test_statistics_count_the_requests(client):
    before = _add_stats(client)
    for k in range(3):
        client.infer("add", _add_inputs([k], [k]))
    with pytest.raises(InferenceServerException):
        client.infer("add", _add_inputs([1], [1])[:1])  # refused before it runs: a failure
    after = _add_stats(client)
    assert after.inference_stats.success.count - before.inference_stats.success.count == 3
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 3
    assert after.inference_stats.fail.count == before.inference_stats.fail.count + 1
    # perf_analyzer refuses statistics whose compute counts differ
    inference = after.inference_stats
    assert inference.queue.count == inference.success.count
    assert inference.compute_input.count == inference.compute_infer.count
    assert inference.compute_output.count == inference.compute_infer.count
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert after.inference_stats.queue.ns >= before.inference_stats.queue.ns
    assert after.inference_stats.success.ns == (
        after.inference_stats.queue.ns + after.inference_stats.compute_infer.ns
    )
    assert after.last_inference >= before.last_inference and after.last_inference > 0


def test_statistics_all_models_and_errors(client):
    stats = client.get_inference_statistics(as_json=True)["model_stats"]
    assert set(BUNDLED) <= {s["name"] for s in stats}
    assert client.get_inference_statistics("mlp", "1").model_stats[0].version == "1"
    for name, version, code in [
        ("no-such-model", "", "NOT_FOUND"),
        ("mlp", "3", "NOT_FOUND"),
        ("mlp", "x", "INVALID_ARGUMENT"),
    ]:
        with pytest.raises(InferenceServerException) as info:
            client.get_inference_statistics(name, version)
        assert _status(info) == f"StatusCode.{code}"


# ------------------------------------------------------------------ repository


def test_repository_index_lists_the_bundled_models(client):
    index = {m.name: m for m in client.get_model_repository_index().models}
    for name in BUNDLED:
        assert (index[name].version, index[name].state, index[name].reason) == ("1", "READY", "")
    as_json = client.get_model_repository_index(as_json=True)["models"]
    assert set(BUNDLED) <= {m["name"] for m in as_json}


def test_unload_and_load_change_readiness(client):
    client.unload_model("cnn")
    assert client.is_model_ready("cnn") is False
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert (index["cnn"].state, index["cnn"].reason) == ("UNAVAILABLE", "unloaded")
    ready_only = {
        m.name
        for m in client._client_stub.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(ready=True)
        ).models
    }
    assert "cnn" not in ready_only and "mlp" in ready_only
    image = np.ones((1, 1, 28, 28), np.float32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("cnn", [_input("image", image, "FP32")])
    assert _status(info) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.unload_model("cnn")
    assert _status(info) == "StatusCode.NOT_FOUND"

    client.load_model("cnn")  # the files are still there: unload never deletes
    assert client.is_model_ready("cnn") is True
    logits = client.infer("cnn", [_input("image", image, "FP32")]).as_numpy("logits")
    assert logits.shape == (1, 10)
    client.load_model("cnn")  # already loaded: reloaded, still ready, same version
    assert client.is_model_ready("cnn", "1") is True
    assert client.get_model_metadata("cnn").versions == ["1"]
    # the same answer from the reloaded network, within float32 rounding: NUMPY times its
    # convolution kernels at load (plugins/numpy/tuning.py), and on a loaded machine the
    # reload may keep another one (Winograd against GEMM: 9e-7 apart seen in CI's suite)
    np.testing.assert_allclose(
        client.infer("cnn", [_input("image", image, "FP32")]).as_numpy("logits"),
        logits,
        rtol=0,
        atol=1e-4 * float(np.abs(logits).max()),
    )


def test_load_errors(client):
    with pytest.raises(InferenceServerException) as info:
        client.load_model("no-such-model")
    assert _status(info) == "StatusCode.NOT_FOUND"
    assert info.value.message().startswith("failed to load 'no-such-model': ")
    assert "not in the repository" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.load_model("../etc")
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("mlp", config='{"max_batch_size": "eight"}')
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"
    assert "'config' override" in info.value.message()
    for config in ("[]", '"x"', "1"):  # protobuf's JSON reader took "[]" for an empty config
        with pytest.raises(InferenceServerException) as info:
            client.load_model("mlp", config=config)
        assert _status(info) == "StatusCode.INVALID_ARGUMENT"
        assert "must be a JSON object" in info.value.message()
    with pytest.raises(InferenceServerException) as info:  # files only inside the model
        client.load_model("mlp", config="{}", files={"file:1/../../x.onnx": b"x"})
    assert _status(info) == "StatusCode.INVALID_ARGUMENT"
    assert "plain file name" in info.value.message()
    assert client.is_model_ready("mlp") is True


# ------------------------------------------------------------------ what we do not offer


@pytest.mark.parametrize(
    ("call", "feature"),
    [
        (lambda c: c.get_log_settings(), "log settings"),
        (lambda c: c.update_log_settings({"log_verbose_level": 1}), "log settings"),
    ],
)
def test_unoffered_calls_are_unimplemented(client, call, feature):
    with pytest.raises(InferenceServerException) as info:
        call(client)
    assert _status(info) == "StatusCode.UNIMPLEMENTED"
    assert f"does not support {feature}" in info.value.message()


def test_sequence_parameters_are_refused(client):
    """No network has a sequence batcher: Triton's stateful-request parameters are refused,
    not silently run without their state; zero means no sequence, as in Triton."""
    for kwargs in (
        {"sequence_id": 7},
        {"sequence_id": "s-1"},
        {"sequence_id": 3, "sequence_end": True},
    ):
        with pytest.raises(InferenceServerException) as info:
            client.infer("add", _add_inputs([1], [2]), **kwargs)
        assert _status(info) == "StatusCode.INVALID_ARGUMENT"
        assert "no sequence batching" in info.value.message()
    out = client.infer("add", _add_inputs([1], [2]), sequence_id=0)
    assert out.as_numpy("sum").tolist() == [3]
