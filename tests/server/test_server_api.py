"""plugserve.v1 through a real server process and our own client."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from models import mlp

from plugserve.client import Client


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def test_devices_and_bundled_models(client):
    devices = {d.name: d for d in client.devices()}
    assert devices["NUMPY"].available and "numpy" in devices["NUMPY"].full_name
    names = {n.name for n in client.networks()}
    assert {"mlp", "cnn", "add", "echo"} <= names


def test_infer_add_and_echo(client):
    out = client.infer(
        "add", {"a": np.array([1, 2], np.float32), "b": np.array([3, 4], np.float32)}
    )
    assert out["sum"].tolist() == [4, 6]
    text = np.array(["héllo", "", "wörld"], dtype=object)
    assert client.infer("echo", {"text": text})["echo"].tolist() == ["héllo", "", "wörld"]


def test_load_infer_unload_a_model_sent_as_bytes(client):
    model = mlp()
    response = client.load("sent", model.SerializeToString())
    assert response.network.device == "NUMPY" and response.network.inputs[0].name == "x"
    x = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
    from plugserve.server import Core

    expected = Core().load_network(model, "NUMPY").infer({"x": x})["y"]
    np.testing.assert_allclose(client.infer("sent", {"x": x})["y"], expected, rtol=1e-6)
    client.unload("sent")
    with pytest.raises(grpc.RpcError) as info:
        client.infer("sent", {"x": x})
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'sent'" in info.value.details()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"b": np.zeros(2, np.float32)}, "missing input a"),
        ({"a": np.zeros(2, np.float64), "b": np.zeros(2, np.float64)}, "element type float64"),
        ({"a": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}, "rank 2"),
        (
            {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32), "c": np.zeros(1)},
            "unknown input",
        ),
    ],
)
def test_bad_inputs_are_invalid_argument(client, inputs, message):
    with pytest.raises(grpc.RpcError) as info:
        client.infer("add", inputs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    ok = client.infer("add", {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)})
    assert ok["sum"].tolist() == [2, 2]


def test_garbage_model_is_invalid_argument_and_server_stays_up(client):
    with pytest.raises(grpc.RpcError) as info:
        client.load("junk", b"\x00\x01 definitely not onnx")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert {"mlp", "add"} <= {n.name for n in client.networks()}


def test_unknown_device_and_metric(client):
    with pytest.raises(grpc.RpcError) as info:
        client.load("m", mlp().SerializeToString(), device="GPU")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "GPU" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        client.get_metric("NUMPY", "NOPE")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        client.set_config({"NOPE": "1"}, "NUMPY")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_and_config_round_trip(client):
    assert "numpy" in client.get_metric("NUMPY", "FULL_DEVICE_NAME")
    assert client.get_metric("", "NETWORK_NAME", network="mlp") == "mlp"
    assert client.get_config("NUMPY", "PERF_COUNT") == {"PERF_COUNT": "NO"}
    assert "NUM_STREAMS" in client.get_config("NUMPY")


def test_query_network(client):
    response = client.query(mlp().SerializeToString(), "NUMPY")
    assert set(response.supported) == {n.name for n in mlp().graph.node}
    assert not response.unsupported


def test_export_import(client):
    blob = client.export("mlp")
    response = client.import_network("mlp_copy", blob, "NUMPY")
    x = np.ones((2, 16), np.float32)
    a = client.infer("mlp", {"input": x})["probabilities"]
    b = client.infer("mlp_copy", {"input": x})["probabilities"]
    assert np.array_equal(a, b) and response.network.name == "mlp_copy"
    with pytest.raises(grpc.RpcError) as info:
        client.import_network("bad", b"garbage", "NUMPY")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.unload("mlp_copy")


def test_performance_counts(client):
    client.load("counted", mlp().SerializeToString(), config={"PERF_COUNT": "YES"})
    client.infer("counted", {"x": np.ones((1, 32), np.float32)})
    counts = client.performance_counts("counted")
    assert counts and all(c.count >= 1 for c in counts)
    assert {"matmul0", "add0", "relu0"} <= {n for c in counts for n in c.original_names}
    with pytest.raises(grpc.RpcError) as info:
        client.performance_counts("mlp")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    client.unload("counted")


def test_infer_stream_pairs_responses_by_id(client):
    rng = np.random.default_rng(1)
    requests = []
    for i in range(20):
        a, b = rng.normal(size=4).astype(np.float32), rng.normal(size=4).astype(np.float32)
        requests.append((f"r{i}", "add", {"a": a, "b": b}))
    requests.append(("bad", "nope", {"a": np.zeros(1, np.float32)}))
    results = {rid: (out, msg) for rid, out, msg in client.infer_stream(requests)}
    assert set(results) == {r[0] for r in requests}
    for rid, _, inputs in requests[:-1]:
        assert np.array_equal(results[rid][0]["sum"], inputs["a"] + inputs["b"])
    assert results["bad"][0] == grpc.StatusCode.NOT_FOUND


def test_a_network_gets_the_streams_its_config_asks_for(client):
    """NUM_STREAMS or PERFORMANCE_HINT given at load is honoured, not only the device's."""
    client.load("wide", mlp().SerializeToString(), config={"NUM_STREAMS": "2"})
    try:
        assert client.get_metric("", "OPTIMAL_NUMBER_OF_INFER_REQUESTS", network="wide") == 2
        assert client.get_metric("", "OPTIMAL_NUMBER_OF_INFER_REQUESTS", network="add") == 1
        x = np.ones((2, 32), np.float32)
        assert client.infer("wide", {"x": x})["y"].shape == (2, 10)
    finally:
        client.unload("wide")


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
def test_reflection_answers_under_v1_and_v1alpha(server, package):
    """Current tools (grpcurl, Postman, grpc-java) ask v1 first; older ones v1alpha. v1 has the
    same messages as v1alpha under another package, so v1alpha's classes read the answers."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as r

    with grpc.insecure_channel(server.target) as channel:
        call = channel.stream_stream(
            f"/{package}.ServerReflection/ServerReflectionInfo",
            request_serializer=r.ServerReflectionRequest.SerializeToString,
            response_deserializer=r.ServerReflectionResponse.FromString,
        )
        requests = [
            r.ServerReflectionRequest(list_services=""),
            r.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService"),
            r.ServerReflectionRequest(file_containing_symbol=f"{package}.ServerReflection"),
        ]
        listed, kserve, itself = list(call(iter(requests), timeout=30))
    names = {s.name for s in listed.list_services_response.service}
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
            "inference.GRPCInferenceService", "plugserve.v1.Plugserve"} <= names  # fmt: skip
    for answer in (kserve, itself):
        assert not answer.HasField("error_response"), answer.error_response
    files = [descriptor_pb2.FileDescriptorProto.FromString(f)
             for f in itself.file_descriptor_response.file_descriptor_proto]  # fmt: skip
    assert package in {f.package for f in files}
