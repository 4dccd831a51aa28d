"""Random requests at a real server: it never dies and always answers with a status.

hypothesis builds inference requests (random networks, input names, dtypes, shapes, byte strings,
outputs, parameters) and LoadNetwork requests (random bytes, mutated models, names, devices,
config) for both protocols, plugserve.v1 and KServe v2. Every call must either succeed or fail
with a gRPC status other than UNKNOWN, and nothing may reach the server's catch-all handler; at
the end the server still serves correct results.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import mlp
from serving import RunningServer, examples_repository

from plugserve.client import Client
from plugserve.proto import plugserve_pb2 as pb

tc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as kpb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as kgrpc  # noqa: E402

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
# statuses a well-behaved server may give a random request (INTERNAL only for a failing kernel)
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
MODEL = mlp(seed=9).SerializeToString()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    repo = examples_repository(tmp_path_factory.mktemp("fuzz"))
    with RunningServer(
        "--model-repository", str(repo), "--max-message-bytes", str(4 << 20)
    ) as running:
        running.repository = repo
        with grpc.insecure_channel(running.target) as channel:
            running.kserve = kgrpc.GRPCInferenceServiceStub(channel)
            with Client(running.target, timeout=30) as client:
                running.client = client
                yield running
        assert running.process.poll() is None, running.log
    assert running.process.returncode == 0, running.log


def call(fn, *args, **kwargs):
    """Run one RPC: the result, or the status it failed with (which must be an allowed one)."""
    try:
        return fn(*args, timeout=30, **kwargs)
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, (exc.code(), exc.details())
        assert exc.details(), exc.code()
        return exc.code()


NETWORKS = st.sampled_from(["add", "echo", "mlp", "cnn", "nope", ""])
NAMES = st.one_of(st.sampled_from(["a", "b", "text", "input", "image", "x"]), st.text(max_size=8))
V1_DTYPES = st.one_of(
    st.sampled_from(
        ["float32", "float64", "float16", "int8", "int32", "int64", "uint8", "bool", "string"]
    ),
    st.text(max_size=10),
)
KS_DTYPES = st.one_of(
    st.sampled_from(["FP32", "FP64", "FP16", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES"]),
    st.text(max_size=6),
)
DIMS = st.one_of(
    st.integers(0, 6),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([-1, 1 << 31, 1 << 40, 2**62]),
)
SHAPES = st.lists(DIMS, max_size=5) | st.lists(st.integers(1, 2), min_size=30, max_size=40)


@st.composite
def tensor_data(draw, shape, itemsize=4):
    """Mostly bytes that fit the shape (so requests get past decoding), sometimes anything."""
    count = 1
    for dim in shape:
        count *= dim
    if draw(st.booleans()) and all(d >= 0 for d in shape) and count <= 64:
        return draw(st.binary(min_size=count * itemsize, max_size=count * itemsize))
    return draw(st.binary(max_size=256))


@st.composite
def v1_requests(draw):
    request = pb.InferRequest(
        network=draw(NETWORKS),
        version=draw(st.sampled_from([0, 0, 1, 2, 2**63 - 1])),
        id=draw(st.text(max_size=8)),
        outputs=draw(st.lists(st.sampled_from(["sum", "echo", "y", "nope"]), max_size=2)),
    )
    for _ in range(draw(st.integers(0, 3))):
        shape = draw(SHAPES)
        request.inputs.add(
            name=draw(NAMES), dtype=draw(V1_DTYPES), shape=shape, data=draw(tensor_data(shape))
        )
    return request


def _parameter(draw, message):
    kind = draw(st.sampled_from(["bool", "int64", "string", "uint64", "double"]))
    value = {
        "bool": st.booleans(),
        "int64": st.integers(-(2**63), 2**63 - 1),
        "uint64": st.integers(0, 2**64 - 1),
        "string": st.text(max_size=8),
        "double": st.floats(allow_nan=True),
    }[kind]
    setattr(message, f"{kind}_param", draw(value))


@st.composite
def kserve_requests(draw):
    request = kpb.ModelInferRequest(
        model_name=draw(NETWORKS),
        model_version=draw(st.sampled_from(["", "1", "2", "x", "-1", "99999999999999999999"])),
        id=draw(st.text(max_size=8)),
    )
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "sequence_id", "x"]))):
        _parameter(draw, request.parameters[key])
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        shape = draw(SHAPES)
        tensor = request.inputs.add(name=draw(NAMES), datatype=draw(KS_DTYPES), shape=shape)
        if draw(st.booleans()):
            _parameter(draw, tensor.parameters["binary_data_size"])
        if raw:
            request.raw_input_contents.append(draw(tensor_data(shape)))
        else:
            field = draw(st.sampled_from(["fp32", "int", "bytes", "bool", "int64", "uint"]))
            values = {
                "fp32": st.floats(width=32, allow_nan=True),
                "int": st.integers(-(2**31), 2**31 - 1),
                "int64": st.integers(-(2**63), 2**63 - 1),
                "uint": st.integers(0, 2**32 - 1),
                "bytes": st.binary(max_size=8),
                "bool": st.booleans(),
            }[field]
            getattr(tensor.contents, f"{field}_contents").extend(draw(st.lists(values, max_size=8)))
    if draw(st.booleans()) and request.raw_input_contents:
        request.raw_input_contents.append(draw(st.binary(max_size=8)))  # one too many
    for name in draw(st.lists(st.sampled_from(["sum", "echo", "nope"]), max_size=2)):
        output = request.outputs.add(name=name)
        if draw(st.booleans()):
            _parameter(draw, output.parameters[draw(st.sampled_from(["classification", "x"]))])
    return request


@st.composite
def models(draw):
    kind = draw(st.sampled_from(["random", "mutated", "truncated", "good"]))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "truncated":
        return MODEL[: draw(st.integers(0, len(MODEL)))]
    if kind == "good":
        return MODEL
    data = bytearray(MODEL)
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


CONFIG = st.dictionaries(
    st.one_of(
        st.sampled_from(["NUM_STREAMS", "PERF_COUNT", "PERFORMANCE_HINT", "CACHE_DIR", "X"]),
        st.text(max_size=6),
    ),
    st.text(max_size=6),
    max_size=3,
)
DEVICES = st.one_of(
    st.sampled_from(["", "NUMPY", "GPU", "HETERO:NUMPY", "MULTI:NUMPY", "BATCH:NUMPY(2)"]),
    st.text(max_size=12),
)
LOAD_NAMES = st.one_of(st.sampled_from(["fz", "fz2", "add"]), st.text(max_size=10))


def check_still_serving(running) -> None:
    assert running.process.poll() is None, running.log
    a, b = np.arange(4, dtype=np.float32), np.full(4, 0.5, np.float32)
    assert running.client.infer("add", {"a": a, "b": b})["sum"].tolist() == (a + b).tolist()


@FUZZ
@given(request=v1_requests())
def test_fuzz_infer_plugserve_v1(fuzzed, request):
    call(fuzzed.client.stub.Infer, request)


@FUZZ
@given(request=kserve_requests())
def test_fuzz_infer_kserve(fuzzed, request):
    call(fuzzed.kserve.ModelInfer, request)


@FUZZ
@given(name=LOAD_NAMES, model=models(), device=DEVICES, config=CONFIG, version=st.integers(0, 3))
def test_fuzz_load_plugserve_v1(fuzzed, name, model, device, config, version):
    request = pb.LoadNetworkRequest(
        name=name, model=pb.ModelSource(onnx=model), device=device, config=config, version=version
    )
    response = call(fuzzed.client.stub.LoadNetwork, request)
    if isinstance(response, pb.LoadNetworkResponse):
        loaded = response.network
        call(
            fuzzed.client.stub.UnloadNetwork,
            pb.UnloadNetworkRequest(name=loaded.name, version=loaded.version),
        )


@FUZZ
@given(
    name=st.one_of(st.sampled_from(["add", "mlp", "nope", "add/1", "../add"]), st.text(max_size=8)),
    parameters=st.lists(st.sampled_from(["config", "file:1/model.onnx", "x"]), max_size=2),
    unload=st.booleans(),
)
def test_fuzz_repository_load_kserve(fuzzed, name, parameters, unload):
    request = kpb.RepositoryModelLoadRequest(model_name=name)
    for key in parameters:
        request.parameters[key].string_param = "{}"
    call(fuzzed.kserve.RepositoryModelLoad, request)
    if unload:
        call(fuzzed.kserve.RepositoryModelUnload, kpb.RepositoryModelUnloadRequest(model_name=name))
        call(fuzzed.kserve.RepositoryModelLoad, kpb.RepositoryModelLoadRequest(model_name=name))


def test_the_server_survived_with_correct_results(fuzzed):
    check_still_serving(fuzzed)
    x = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)
    got = fuzzed.client.infer("mlp", {"input": x})["probabilities"]
    assert got.shape == (2, 4) and np.allclose(got.sum(axis=1), 1, atol=1e-5)
    text = np.array(["fuzz", "é"], dtype=object)
    assert fuzzed.client.infer("echo", {"text": text})["echo"].tolist() == ["fuzz", "é"]
    assert "unexpected error" not in fuzzed.log, fuzzed.log
