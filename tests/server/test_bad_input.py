"""The bad-input matrix: hostile or broken requests through a real server, both protocols.

Each case sends something wrong through plugserve.v1 (our ``Client`` or its stub, for bytes the
client would never produce) and, where the case exists there, through KServe v2 with
``tritonclient.grpc``; it checks the exact status code and that the message names the problem,
then that the server still serves the same network with correct results.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from models import mlp
from onnx import TensorProto, helper, numpy_helper
from serving import RunningServer, examples_repository

from plugserve.client import Client
from plugserve.proto import plugserve_pb2 as pb
from plugserve.server import Core

tc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED

A = np.array([1.5, -2.0, 3.25], np.float32)
B = np.array([0.5, 4.0, -1.0], np.float32)


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def triton(server):
    with tc.InferenceServerClient(server.target) as c:
        yield c


def still_serving(client: Client, triton) -> None:
    """The same network still answers correctly through both protocols."""
    assert client.infer("add", {"a": A, "b": B})["sum"].tolist() == (A + B).tolist()
    inputs = [tc.InferInput("a", [3], "FP32"), tc.InferInput("b", [3], "FP32")]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    assert triton.infer("add", inputs).as_numpy("sum").tolist() == (A + B).tolist()


def ours(client: Client, network: str, tensors, version: int = 0, outputs=()):
    """Send a hand-built plugserve.v1 request: tensors are (name, dtype, shape, data bytes)."""
    request = pb.InferRequest(network=network, version=version, outputs=list(outputs))
    for name, dtype, shape, data in tensors:
        request.inputs.add(name=name, dtype=dtype, shape=shape, data=data)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Infer(request, timeout=60)
    return info.value.code(), info.value.details()


def kserve(triton, model: str, tensors, version: str = "", outputs=()):
    """The same through tritonclient: tensors are (name, datatype, shape, raw bytes)."""
    inputs = []
    for name, datatype, shape, data in tensors:
        tensor = tc.InferInput(name, [1], datatype)
        tensor.set_shape(list(shape))  # any shape, even one numpy would refuse
        tensor._raw_content = data  # any bytes, even ones that do not fit the shape
        inputs.append(tensor)
    wanted = [tc.InferRequestedOutput(o) for o in outputs] or None
    with pytest.raises(InferenceServerException) as info:
        triton.infer(model, inputs, model_version=version, outputs=wanted)
    return info.value.status(), info.value.message()


def f32(values) -> bytes:
    return np.asarray(values, np.float32).tobytes()


def strings(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


# (id, network, tensors for plugserve.v1, tensors for KServe or None, code, message parts)
# dtype names differ by protocol: plugserve.v1 says float32/string, KServe FP32/BYTES.
_V1 = {"FP32": "float32", "FP64": "float64", "BYTES": "string", "INT32": "int32"}
GOOD_B = ("b", "FP32", [3], f32(B))
INFER_CASES = [
    (
        "wrong input name",
        "add",
        [("a", "FP32", [3], f32(A)), ("c", "FP32", [3], f32(B))],
        INVALID,
        ["unknown input(s) ['c']"],
    ),
    ("missing input", "add", [("a", "FP32", [3], f32(A))], INVALID, ["missing input b"]),
    (
        "extra input",
        "add",
        [("a", "FP32", [3], f32(A)), GOOD_B, ("z", "FP32", [1], f32([0]))],
        INVALID,
        ["unknown input(s) ['z']"],
    ),
    (
        "dtype mismatch",
        "add",
        [("a", "FP64", [3], np.asarray(A, np.float64).tobytes()), GOOD_B],
        INVALID,
        ["'a'", "element type float64", "expected float32"],
    ),
    (
        "wrong rank",
        "add",
        [("a", "FP32", [1, 3], f32(A)), GOOD_B],
        INVALID,
        ["'a'", "rank 2", "expected rank 1"],
    ),
    (
        "negative dim",
        "add",
        [("a", "FP32", [-3], f32(A)), GOOD_B],
        INVALID,
        ["'a'", "negative dimension"],
    ),
    (
        "huge dim",
        "add",
        [("a", "FP32", [1 << 40], f32(A)), GOOD_B],
        INVALID,
        ["'a'", "12 bytes of data", str(1 << 40)],
    ),
    (
        "huge dims overflowing int64",
        "add",
        [("a", "FP32", [1 << 32, 1 << 32], b""), GOOD_B],
        INVALID,
        ["'a'", "more than an int64 counts"],
    ),
    (
        "zero and huge dims",
        "add",
        [("a", "FP32", [0, 1 << 62], b""), GOOD_B],
        INVALID,
        ["'a'", "[0, 4611686018427387904] cannot be held"],
    ),
    (
        "rank over the limit",
        "add",
        [("a", "FP32", [1] * 40, f32([1])), GOOD_B],
        INVALID,
        ["'a'", "rank 40 is over the limit"],
    ),
    (
        "raw byte count",
        "add",
        [("a", "FP32", [3], f32(A)[:-1]), GOOD_B],
        INVALID,
        ["'a'", "11 bytes of data", "needs 12"],
    ),
    (
        "bytes: no length prefix",
        "echo",
        [("text", "BYTES", [2], strings(b"ok") + b"\x01\x00")],
        INVALID,
        ["'text'", "string element 1 has no length prefix"],
    ),
    (
        "bytes: length past the end",
        "echo",
        [("text", "BYTES", [1], struct.pack("<I", 1000) + b"short")],
        INVALID,
        ["'text'", "string element 0 claims 1000 bytes, only 5 remain"],
    ),
    (
        "bytes: length prefix 2**32-1",
        "echo",
        [("text", "BYTES", [1], b"\xff\xff\xff\xff" + b"x")],
        INVALID,
        ["'text'", "claims 4294967295 bytes"],
    ),
    (
        "bytes: trailing garbage",
        "echo",
        [("text", "BYTES", [1], strings(b"ok") + b"junk")],
        INVALID,
        ["'text'", "4 bytes left after 1 strings"],
    ),
    (
        "unknown output",
        "add",
        [("a", "FP32", [3], f32(A)), GOOD_B],
        INVALID,
        ["unknown output(s) ['nope']", "sum"],
    ),
]


@pytest.mark.parametrize(
    ("network", "tensors", "code", "parts"),
    [case[1:] for case in INFER_CASES],
    ids=[case[0] for case in INFER_CASES],
)
def test_bad_infer_requests(client, triton, network, tensors, code, parts):
    outputs = ["nope"] if "unknown output(s) ['nope']" in parts else []
    v1 = [(n, _V1[d], s, data) for n, d, s, data in tensors]
    got_code, message = ours(client, network, v1, outputs=outputs)
    assert got_code == code, message
    for part in parts:
        assert part in message, (part, message)
    status, message = kserve(triton, network, tensors, outputs=outputs)
    assert status == str(code), message
    for part in parts:
        assert part in message, (part, message)
    still_serving(client, triton)


def test_unknown_dtypes(client, triton):
    code, message = ours(client, "add", [("a", "complex64", [3], b"\0" * 24), GOOD_B])
    assert code == INVALID and "unknown dtype 'complex64'" in message
    status, message = kserve(triton, "add", [("a", "FP8", [3], b"\0" * 3), GOOD_B])
    assert status == str(INVALID) and "datatype 'FP8' is not supported" in message
    # BF16 is a KServe datatype (bfloat16); "add" takes float32
    status, message = kserve(triton, "add", [("a", "BF16", [3], b"\0" * 6), GOOD_B])
    assert status == str(INVALID) and "bfloat16" in message and "float32" in message, message
    still_serving(client, triton)


def test_kserve_duplicate_input_and_raw_count(client, triton, server):
    status, message = kserve(triton, "add", [("a", "FP32", [3], f32(A))] * 2 + [GOOD_B])
    assert status == str(INVALID) and "input 'a' is given more than once" in message
    from tritonclient.grpc import service_pb2 as kpb  # ours clashes with it in one process
    from tritonclient.grpc import service_pb2_grpc as kgrpc

    request = kpb.ModelInferRequest(model_name="add")
    for name in "ab":
        request.inputs.add(name=name, datatype="FP32", shape=[3])
    request.raw_input_contents.append(f32(A))  # one raw entry for two inputs
    with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as info:
        kgrpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    assert info.value.code() == INVALID
    assert "1 raw_input_contents for 2 inputs" in info.value.details()
    still_serving(client, triton)


def test_unknown_model_version_device(client, triton, server):
    feeds = {"a": A, "b": B}
    with pytest.raises(grpc.RpcError) as info:
        client.infer("nope", feeds)
    assert info.value.code() == NOT_FOUND
    # Triton's words first (its clients match on them), then what is loaded
    assert info.value.details().startswith("Request for unknown model: 'nope' is not found; ")
    assert "loaded networks: " in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.infer("add", feeds, version=7)
    assert info.value.code() == NOT_FOUND
    assert info.value.details().startswith(
        "Request for unknown model: 'add' version 7 is not found; its loaded versions: "
    )
    with pytest.raises(grpc.RpcError) as info:
        client.load("m", mlp().SerializeToString(), device="NPU")
    assert info.value.code() == NOT_FOUND and "unknown device 'NPU'" in info.value.details()

    tensors = [("a", "FP32", [3], f32(A)), GOOD_B]
    status, message = kserve(triton, "nope", tensors)
    assert status == str(NOT_FOUND) and "'nope'" in message
    status, message = kserve(triton, "add", tensors, version="7")
    assert status == str(NOT_FOUND) and "version 7" in message
    status, message = kserve(triton, "add", tensors, version="latest")
    assert status == str(INVALID) and "'latest' is not an integer" in message
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("not_in_repository")
    assert info.value.status() == str(NOT_FOUND) and "'not_in_repository'" in info.value.message()
    folder = Path(server.repository) / "on_gpu"  # a repository model naming an unknown device
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(mlp().SerializeToString())
    (folder / "config.json").write_text(json.dumps({"device": "NPU"}))
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("on_gpu")
    assert info.value.status() == str(NOT_FOUND) and "unknown device 'NPU'" in info.value.message()
    still_serving(client, triton)


def test_nan_and_inf_pass_through(client, triton, server):
    a = np.array([np.nan, np.inf, -np.inf, 1.0, np.inf], np.float32)
    b = np.array([1.0, -np.inf, np.inf, np.nan, np.inf], np.float32)
    with np.errstate(invalid="ignore"):
        want = a + b
    np.testing.assert_array_equal(client.infer("add", {"a": a, "b": b})["sum"], want)
    inputs = [tc.InferInput("a", [5], "FP32"), tc.InferInput("b", [5], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    np.testing.assert_array_equal(triton.infer("add", inputs).as_numpy("sum"), want)
    # through a whole network: the served result equals the in-process one, NaN for NaN
    model = mlp(seed=3)
    client.load("nan_mlp", model.SerializeToString())
    try:
        x = np.random.default_rng(3).normal(size=(4, 32)).astype(np.float32)
        x[0, 0], x[1, 5], x[2, 7] = np.nan, np.inf, -np.inf
        with np.errstate(all="ignore"):
            expected = Core().load_network(model, "NUMPY").infer({"x": x})["y"]
        assert np.isnan(expected).any()
        np.testing.assert_array_equal(client.infer("nan_mlp", {"x": x})["y"], expected)
    finally:
        client.unload("nan_mlp")
    still_serving(client, triton)


# --------------------------------------------------------------------------- models


def _cycle() -> bytes:
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "t2"], ["t1"], name="first"),
            helper.make_node("Relu", ["t1"], ["t2"], name="second"),
            helper.make_node("Identity", ["t2"], ["y"], name="out"),
        ],
        "cycle",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _one_node(op: str, domain: str = "", **attrs) -> bytes:
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], name="the_node", domain=domain, **attrs)],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


GOOD_MODEL = mlp(seed=1).SerializeToString()
MODEL_CASES = [
    ("not onnx", b"\x00\x01 definitely not onnx \xff" * 10, INVALID, ["not an ONNX model"]),
    ("empty", b"", INVALID, ["not an ONNX model"]),
    ("truncated", GOOD_MODEL[: len(GOOD_MODEL) // 2], INVALID, ["not an ONNX model"]),
    ("cycle", _cycle(), INVALID, ["cycle", "first", "second"]),
    ("unknown op", _one_node("NoSuchOp"), INVALID, ["No Op registered for NoSuchOp"]),
    (
        "op without a kernel",
        _one_node("Scale", "com.example"),
        UNIMPLEMENTED,
        ["no kernel for op 'Scale' of domain 'com.example'", "the_node"],
    ),
    (
        "attribute of the wrong type",
        _one_node("Softmax", axis="last"),
        INVALID,
        ["Mismatched attribute type", "the_node : axis"],
    ),
    (
        "unknown attribute",
        _one_node("Softmax", bogus=1),
        INVALID,
        ["Unrecognized attribute: bogus"],
    ),
]


@pytest.mark.parametrize(
    ("data", "code", "parts"),
    [case[1:] for case in MODEL_CASES],
    ids=[case[0] for case in MODEL_CASES],
)
def test_bad_models(client, triton, server, data, code, parts):
    name = "bad_" + "".join(c if c.isalnum() else "_" for c in parts[0])[:20]
    with pytest.raises(grpc.RpcError) as info:
        client.load(name, data)
    assert info.value.code() == code, info.value.details()
    for part in parts:
        assert part in info.value.details(), (part, info.value.details())
    # KServe loads from the repository: the same bytes as a repository model
    folder = Path(server.repository) / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(data)
    with pytest.raises(InferenceServerException) as exc:
        triton.load_model(name)
    assert exc.value.status() == str(code), exc.value.message()
    for part in parts:
        assert part in exc.value.message(), (part, exc.value.message())
    assert name not in {n.name for n in client.networks()}
    assert not triton.is_model_ready(name)
    still_serving(client, triton)


def test_attribute_out_of_range_is_refused_at_load_naming_the_node(client, triton):
    """Softmax(axis=9) on a rank-2 input passes ONNX's checker; strict shape inference at load
    refuses it, naming the node and the valid range, instead of a network whose every
    inference would fail."""
    name = "bad_axis"
    with pytest.raises(grpc.RpcError) as info:
        client.load(name, _one_node("Softmax", axis=9))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert "node 'the_node' (Softmax)" in details, details
    assert "'axis' must be in [-2 , 1]" in details and "9" in details, details
    assert name not in {n.name for n in client.networks()}
    still_serving(client, triton)


def _external_data_model(location: str) -> onnx.ModelProto:
    model = mlp(seed=2)
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "8192")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return model


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "../add/1/model.onnx"])
def test_external_data_outside_the_model_folder(client, triton, server, location):
    name = "outside"
    folder = Path(server.repository) / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(_external_data_model(location).SerializeToString())
    with pytest.raises(grpc.RpcError) as info:
        client.load(name, repository_path=name)
    assert info.value.code() == INVALID
    assert f"points at external data {location!r} outside the model's folder" in (
        info.value.details()
    )
    with pytest.raises(InferenceServerException) as exc:
        triton.load_model(name)
    assert exc.value.status() == str(INVALID) and "outside the model's folder" in (
        exc.value.message()
    )
    # sent as bytes, a model cannot read files at all
    with pytest.raises(grpc.RpcError) as info:
        client.load(name, _external_data_model(location).SerializeToString())
    assert info.value.code() == INVALID and "cannot read files" in info.value.details()
    assert name not in {n.name for n in client.networks()}
    still_serving(client, triton)


def test_external_data_inside_the_folder_loads(client, triton, server):
    model = mlp(seed=2)
    weights = numpy_helper.to_array(model.graph.initializer[0])
    name = "inside"
    folder = Path(server.repository) / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "w0.bin").write_bytes(weights.tobytes())
    external = _external_data_model("w0.bin")
    external.graph.initializer[0].external_data[2].value = str(weights.nbytes)
    (folder / "model.onnx").write_bytes(external.SerializeToString())
    triton.load_model(name)
    x = np.ones((2, 32), np.float32)
    expected = Core().load_network(model, "NUMPY").infer({"x": x})["y"]
    np.testing.assert_allclose(client.infer(name, {"x": x})["y"], expected, rtol=1e-6)
    triton.unload_model(name)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize(
    "name", ["a/b", "../escape", "..", "a..b", "bad\x01name", "nl\n", "x\x7f", "/abs", "", "a b"]
)
def test_bad_model_names_refused_before_touching_the_filesystem(client, triton, server, name):
    repo = Path(server.repository)
    before = _tree(repo)
    with pytest.raises(grpc.RpcError) as info:
        client.load(name, GOOD_MODEL, persist=True)
    assert info.value.code() == INVALID and "invalid model name" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.import_network(name, client.export("add"), "NUMPY")
    assert info.value.code() == INVALID and "invalid model name" in info.value.details()
    if name:  # KServe: an empty model name is a different error
        with pytest.raises(InferenceServerException) as exc:
            triton.load_model(name)
        assert exc.value.status() == str(INVALID), exc.value.message()
        assert "invalid model name" in exc.value.message() or "NAME/VERSION" in (
            exc.value.message()
        )
    assert _tree(repo) == before
    still_serving(client, triton)


CONFIG_CASES = [
    ({"NUM_STREAMS": "many"}, "NUM_STREAMS"),
    ({"PERF_COUNT": "maybe"}, "PERF_COUNT"),
    ({"NUM_STREAMS": "-2"}, "NUM_STREAMS"),
    ({"PERFORMANCE_HINT": "FASTEST"}, "PERFORMANCE_HINT"),
]


@pytest.mark.parametrize(("config", "key"), CONFIG_CASES, ids=[c[1] + "=" for c in CONFIG_CASES])
def test_config_values_of_the_wrong_type(client, triton, server, config, key):
    with pytest.raises(grpc.RpcError) as info:
        client.load("conf", GOOD_MODEL, config=config)
    assert info.value.code() == INVALID and key in info.value.details(), info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.set_config(config, "NUMPY")
    assert info.value.code() == INVALID and key in info.value.details(), info.value.details()
    # a repository model's config.json with the same value, loaded through KServe
    folder = Path(server.repository) / "conf"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(GOOD_MODEL)
    (folder / "config.json").write_text(json.dumps({"config": config}))
    with pytest.raises(InferenceServerException) as exc:
        triton.load_model("conf")
    assert exc.value.status() == str(INVALID) and key in exc.value.message()
    assert client.get_config("NUMPY", "PERF_COUNT") == {"PERF_COUNT": "NO"}
    still_serving(client, triton)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"max_batch_size": "two"}, "'max_batch_size' must be an integer >= 0"),
        ({"max_batch_size": True}, "'max_batch_size' must be an integer >= 0"),
        ({"device": 3}, "'device' must be a string"),
        ({"config": ["PERF_COUNT"]}, "'config' must be an object"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_repository_config_json_of_the_wrong_type(client, triton, server, settings, problem):
    folder = Path(server.repository) / "conf_json"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.onnx").write_bytes(GOOD_MODEL)
    (folder / "config.json").write_text(json.dumps(settings))
    with pytest.raises(InferenceServerException) as exc:
        triton.load_model("conf_json")
    assert exc.value.status() == str(INVALID) and problem in exc.value.message()
    assert "config.json" in exc.value.message()
    with pytest.raises(grpc.RpcError) as info:
        client.load("conf_json", repository_path="conf_json")
    assert info.value.code() == INVALID and problem in info.value.details()
    still_serving(client, triton)


def test_messages_over_the_size_limit(tmp_path):
    limit = 64 * 1024
    repo = examples_repository(tmp_path)
    big = np.ones(limit // 4 + 100, np.float32)  # over the limit on its own
    with (
        RunningServer(
            "--model-repository", str(repo), "--max-message-bytes", str(limit)
        ) as running,
        Client(running.target, timeout=60) as client,
        tc.InferenceServerClient(running.target) as triton,
    ):
        with pytest.raises(grpc.RpcError) as info:
            client.infer("add", {"a": big, "b": big})
        assert info.value.code() == EXHAUSTED
        assert "larger than max" in info.value.details(), info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.load("big", mlp(sizes=(32, 256, 256, 10)).SerializeToString())
        assert info.value.code() == EXHAUSTED
        inputs = [tc.InferInput("a", list(big.shape), "FP32"), tc.InferInput("b", [3], "FP32")]
        inputs[0].set_data_from_numpy(big)
        inputs[1].set_data_from_numpy(B)
        with pytest.raises(InferenceServerException) as exc:
            triton.infer("add", inputs)
        assert exc.value.status() == str(EXHAUSTED) and "larger than max" in exc.value.message()
        still_serving(client, triton)
    assert running.process.returncode == 0


def _filler(folder: Path, device: str) -> Path:
    """A model whose output size is its input's value: ConstantOfShape(n) of ones."""
    graph = helper.make_graph(
        [
            helper.make_node(
                "ConstantOfShape",
                ["n"],
                ["y"],
                value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
            )
        ],
        "filler",
        [helper.make_tensor_value_info("n", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["count"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "filler" / "1").mkdir(parents=True)
    onnx.save(model, folder / "filler" / "1" / "model.onnx")
    (folder / "filler" / "config.json").write_text(json.dumps({"device": device}))
    return folder


@pytest.mark.parametrize("device", ["NUMPY", "ORT"])
def test_an_answer_over_the_message_limit_is_refused_before_it_is_encoded(tmp_path, device):
    """A 20-byte input asking for 4 MB of outputs under a 1 MiB --max-message-bytes: refused
    with RESOURCE_EXHAUSTED naming the flag on gRPC (tritonclient, plugserve.v1, a stream) and
    429 on REST. Before, gRPC copied the outputs into an answer grpcio then refused to send
    ("Sent message larger than max") and REST sent all 4 MB."""
    if device not in Core().available_devices:
        pytest.skip(f"{device} is not available here")
    import urllib.error
    import urllib.request

    limit = 1 << 20
    repo = _filler(tmp_path, device)
    with (
        RunningServer(
            "--model-repository", str(repo), "--max-message-bytes", str(limit)
        ) as running,
        Client(running.target, timeout=60) as client,
        tc.InferenceServerClient(running.target) as triton,
    ):

        def ask(count: int) -> list:
            tensor = tc.InferInput("n", [1], "INT64")
            tensor.set_data_from_numpy(np.array([count], np.int64))
            return [tensor]

        with pytest.raises(InferenceServerException) as exc:
            triton.infer("filler", ask(limit))  # 4 MB of float32 ones
        assert exc.value.status() == str(EXHAUSTED), exc.value.message()
        assert "--max-message-bytes" in exc.value.message(), exc.value.message()
        assert "filler" in exc.value.message()
        with pytest.raises(grpc.RpcError) as info:
            client.infer("filler", {"n": np.array([limit], np.int64)})
        assert info.value.code() == EXHAUSTED and "--max-message-bytes" in info.value.details()
        answers: list = []
        triton.start_stream(callback=lambda result, error: answers.append((result, error)))
        try:
            triton.async_stream_infer("filler", ask(limit))
            triton.async_stream_infer("filler", ask(3))
        finally:
            triton.stop_stream()
        errors = [e for _, e in answers if e is not None]
        assert len(answers) == 2 and len(errors) == 1, answers
        assert "--max-message-bytes" in str(errors[0])
        body = json.dumps(
            {"inputs": [{"name": "n", "shape": [1], "datatype": "INT64", "data": [limit]}]}
        ).encode()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{running.http_url}/v2/models/filler/infer", body, timeout=60)
        assert refused.value.code == 429
        assert b"--max-message-bytes" in refused.value.read()
        # what fits is answered, and the server goes on
        result = triton.infer("filler", ask(limit // 8))  # 0.5 MB
        assert result.as_numpy("y").shape == (limit // 8,)
        assert client.infer("filler", {"n": np.array([5], np.int64)})["y"].tolist() == [1.0] * 5


def test_no_unexpected_errors_were_logged(server):
    """Every bad input above was a typed error: nothing reached the catch-all handler."""
    assert server.process.poll() is None
    assert "unexpected error" not in server.log, server.log
    assert "Traceback" not in server.log, server.log
