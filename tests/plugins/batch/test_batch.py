"""BATCH: concurrent requests gathered into batches on one device, split back to their callers.

Batches are made deterministic without timing: the tests set ``BATCH_TIMEOUT_MS`` far above any
test's run time and send a number of same-shape rows that is a multiple of the batch size, so
every batch runs only when it is full and the batch-size statistics are exact. The failing
device (FAULTY, its kernels raise) comes from a third-party package declared by entry point.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
from acme_devices import CLASSES, DEVICES
from models import _model, mlp, small_cnn
from onnx import TensorProto, helper
from serving import RunningServer

from plugserve.client import AsyncClient, Client
from plugserve.plugins.api import InferenceError, InvalidArgument, InvalidInput, NotFound
from plugserve.server import Core

LONG = "60000"  # ms: no batch runs before it is full


def scaled() -> object:
    """y = relu(x) * 2 + sum over the last axis: any [batch, n] shape, rows independent."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "two"], ["m"], name="mul"),
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], name="sum", keepdims=1),
        helper.make_node("Add", ["m", "s"], ["y"], name="add"),
    ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [-1])
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
        [two, axes],
        name="scaled",
    )


def scaled_ref(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) * 2 + x.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "acme_batch_devices.py").write_text(textwrap.dedent(DEVICES))
    dist = site / "acme_batch_devices-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: acme-batch-devices\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\n"
        + "".join(f"{name} = acme_batch_devices:{cls}\n" for name, cls in CLASSES.items())
    )
    return site


@pytest.fixture(scope="module")
def core(site) -> Core:
    sys.path.insert(0, str(site))
    try:
        acme = importlib.import_module("acme_batch_devices")
        yield Core({name: getattr(acme, cls) for name, cls in CLASSES.items()})
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("acme_batch_devices", None)


@pytest.fixture(scope="module")
def reference(core):
    network = core.load_network(mlp(), "NUMPY")
    return lambda x: network.infer({"x": x})["y"]


def rows(seed: int, count: int = 1, width: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, width)).astype(np.float32)


def run_all(network, inputs: list[dict]) -> list:
    """Start every request at once (async), then collect each result or error in order."""
    requests = [network.create_infer_request() for _ in inputs]
    for request, feed in zip(requests, inputs):
        request.start_async(feed)
    results = []
    for request in requests:
        try:
            results.append(request.wait(120))
        except Exception as exc:
            results.append(exc)
    return results


# --------------------------------------------------------------------------- in process


def test_batch_gathers_concurrent_requests(core, reference):
    network = core.load_network(mlp(), "BATCH:NUMPY(4)", {"BATCH_TIMEOUT_MS": LONG})
    assert network.get_metric("EXECUTION_DEVICES") == ["NUMPY"]
    assert core.device_config("BATCH:NUMPY(4)").streams() == 8
    results = run_all(network, [{"x": rows(seed)} for seed in range(16)])
    for seed, result in enumerate(results):
        np.testing.assert_allclose(result["y"], reference(rows(seed)), rtol=1e-5, atol=1e-5)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {4: 4}
    network.close()


def test_batch_splits_requests_of_several_rows_in_order(core, reference):
    network = core.load_network(mlp(), "BATCH:NUMPY(8)", {"BATCH_TIMEOUT_MS": LONG})
    sizes = [1, 3, 2, 2, 4, 4]  # 8 rows, then 8 rows
    results = run_all(network, [{"x": rows(i, n)} for i, n in enumerate(sizes)])
    for i, (n, result) in enumerate(zip(sizes, results)):
        assert result["y"].shape == (n, 10)
        np.testing.assert_allclose(result["y"], reference(rows(i, n)), rtol=1e-5, atol=1e-5)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {8: 2}
    network.close()


def test_batch_never_mixes_shapes(core):
    network = core.load_network(scaled(), "BATCH:NUMPY(4)", {"BATCH_TIMEOUT_MS": LONG})
    inputs = [{"x": rows(i, 1, width=3 if i % 2 else 5)} for i in range(16)]
    results = run_all(network, inputs)
    for feed, result in zip(inputs, results):
        np.testing.assert_allclose(result["y"], scaled_ref(feed["x"]), rtol=1e-5, atol=1e-5)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {4: 4}  # 2 batches of each width
    network.close()


def test_batch_with_the_default_timeout_runs_a_lone_request(core, reference):
    network = core.load_network(mlp(), "BATCH:NUMPY(8)")
    assert network.get_config("BATCH_TIMEOUT_MS") == 2.0
    np.testing.assert_allclose(
        network.infer({"x": rows(1)})["y"], reference(rows(1)), rtol=1e-5, atol=1e-5
    )
    big = rows(2, 11)  # more rows than the batch size: runs alone
    np.testing.assert_allclose(network.infer({"x": big})["y"], reference(big), rtol=1e-5, atol=1e-5)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {1: 1, 11: 1}
    with pytest.raises(InvalidInput, match="expected rank 2"):
        network.infer({"x": np.ones(32, np.float32)})
    network.close()


@pytest.mark.parametrize("timeout", ["inf", "1e300", "1e13", "600001", "-1", "nan"])
def test_a_batch_timeout_past_ten_minutes_is_refused(core, timeout):
    """Past threading's own bound the collector's wait raised OverflowError, the collector no
    longer ran, and every later request of the network waited out its deadline (a red team's
    SetConfig of BATCH did it to every BATCH network of the server)."""
    with pytest.raises(InvalidArgument, match="BATCH_TIMEOUT_MS"):
        core.load_network(mlp(), "BATCH:NUMPY(4)", {"BATCH_TIMEOUT_MS": timeout})
    with pytest.raises(InvalidArgument, match="BATCH_TIMEOUT_MS"):
        core.set_config({"BATCH_TIMEOUT_MS": timeout}, "BATCH")
    network = core.load_network(mlp(), "BATCH:NUMPY(4)", {"BATCH_TIMEOUT_MS": "600000"})
    network.close()


def test_batch_waiting_sets_how_many_callers_wait_in_the_batcher(core):
    """Twice the batch size by default; BATCH_WAITING (the server sets 64 for a model with
    priority levels, so every waiting request reaches the batcher, which orders them) raises
    it, up to 1,024 (each waits on a thread)."""
    network = core.load_network(mlp(), "BATCH:NUMPY(4)")
    assert network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS") == 8
    network.close()
    network = core.load_network(mlp(), "BATCH:NUMPY(4)", {"BATCH_WAITING": "64"})
    assert network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS") == 64
    network.close()
    with pytest.raises(InvalidArgument, match=r"BATCH_WAITING.*to 1024"):
        core.load_network(mlp(), "BATCH:NUMPY(4)", {"BATCH_WAITING": "5000"})


def test_batch_refuses_an_unbatchable_model(core):
    with pytest.raises(InvalidArgument) as info:
        core.load_network(small_cnn(), "BATCH:NUMPY(4)")
    text = str(info.value)
    assert "cannot be batched" in text and "input 'x' has a static first dimension" in text
    assert "dynamic first (batch) dimension" in text


def _dynamic_quantization(inside_loop: bool) -> object:
    """y = dequantize(dynamic_quantize(x)): one scale over the whole [batch, 4] tensor, as
    onnxruntime's quantize_dynamic writes before every MatMulInteger."""
    quantize = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "scale", "zero"], name="dql"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"], name="deq"),
    ]
    if inside_loop:
        body = helper.make_graph(
            [helper.make_node("Identity", ["c"], ["c_out"]), *quantize],
            "body",
            [
                helper.make_tensor_value_info("i", TensorProto.INT64, []),
                helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            ],
            [
                helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
                helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
            ],
        )
        one = helper.make_tensor("one", TensorProto.INT64, [], [1])
        nodes = [
            helper.make_node("Loop", ["one", ""], ["stacked"], body=body, name="loop"),
            helper.make_node("Squeeze", ["stacked", "zero_axis"], ["y"], name="squeeze"),
        ]
        axis = helper.make_tensor("zero_axis", TensorProto.INT64, [1], [0])
        initializers = [one, axis]
    else:
        nodes, initializers = quantize, []
    graph = helper.make_graph(
        nodes,
        "dynamic_quantization",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("inside_loop", [False, True])
def test_batch_refuses_a_model_whose_rows_change_each_other(core, inside_loop):
    """Batched, a row's quantization scale would come from its neighbours' values too: a
    request [1, 1, 1, 1] beside [100, 0, 0, 0] would come back as multiples of 100/255."""
    model = _dynamic_quantization(inside_loop)
    row = np.ones((1, 4), np.float32)
    alone = core.load_network(model, "NUMPY").infer({"x": row})["y"]
    np.testing.assert_allclose(alone, row, atol=0.01)
    with pytest.raises(InvalidArgument) as info:
        core.load_network(model, "BATCH:NUMPY(2)")
    text = str(info.value)
    assert "cannot be batched" in text and "'dql' (DynamicQuantizeLinear)" in text
    assert "serve it without BATCH" in text


def test_a_failing_batch_fails_each_of_its_requests(core):
    """A device that fails every run: the batch fails, then each request alone (below)."""
    network = core.load_network(mlp(), "BATCH:FAULTY(4)", {"BATCH_TIMEOUT_MS": LONG})
    results = run_all(network, [{"x": rows(seed)} for seed in range(4)])
    assert all(isinstance(r, InferenceError) for r in results), results
    for result in results:
        assert "a run on FAULTY failed" in str(result) and "request(s)" not in str(result)
        assert "acme kernel failure" in str(result)
        assert isinstance(result.__cause__, InferenceError)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {}
    network.close()


def _embedding(rows_: int = 10, width: int = 3):
    table = np.arange(rows_ * width, dtype=np.float32).reshape(rows_, width)
    weights = helper.make_tensor("table", TensorProto.FLOAT, table.shape, table.ravel().tolist())
    return _model(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, width])],
        initializers=[weights],
        name="embedding",
    ), table


@pytest.mark.parametrize("device", ["NUMPY", "ORT"])
def test_one_requests_bad_input_fails_only_that_request(core, device):
    """A red team's tenant sent an index past an embedding's rows beside another tenant's good
    request: the batch failed, both got its error (a 500), and each error held the bad
    request's index and how many requests shared the batch. Now a failed batch of several
    runs each of its requests alone: the good ones are answered, the bad one gets its own
    error, which says nothing of the others."""
    if device == "ORT":
        pytest.importorskip("onnxruntime")
    model, table = _embedding()
    network = core.load_network(model, f"BATCH:{device}(4)", {"BATCH_TIMEOUT_MS": LONG})
    good = [np.array([[i, 1, 2, 3]], np.int64) for i in range(3)]
    bad = np.array([[31337, 0, 0, 0]], np.int64)
    results = run_all(network, [{"ids": good[0]}, {"ids": bad}, {"ids": good[1]}, {"ids": good[2]}])
    for ids, result in zip(good, [results[0], *results[2:]]):
        assert isinstance(result, dict), result
        np.testing.assert_array_equal(result["y"], table[ids])
    failure = results[1]
    assert isinstance(failure, InferenceError), failure
    assert "31337" in str(failure) and "request(s)" not in str(failure)
    assert "batch #" not in str(failure)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {1: 3}  # the three good ones, alone
    network.close()


def test_batch_bad_devices_and_config(core):
    with pytest.raises(NotFound, match="NOPE"):
        core.load_network(mlp(), "BATCH:NOPE(4)")
    with pytest.raises(NotFound, match="BROKEN"):
        core.load_network(mlp(), "BATCH:BROKEN(4)")
    with pytest.raises(InvalidArgument, match="NOT_A_KEY"):
        core.load_network(mlp(), "BATCH:NUMPY(4)", {"NOT_A_KEY": "1"})
    with pytest.raises(InvalidArgument, match="BATCH_TIMEOUT_MS"):
        core.load_network(mlp(), "BATCH:NUMPY(4)", {"BATCH_TIMEOUT_MS": "-1"})
    # a key only the device knows goes to the device
    network = core.load_network(mlp(), "BATCH:NUMPY(2)", {"DISABLE_TRANSFORMATIONS": "YES"})
    assert network.network.get_config("DISABLE_TRANSFORMATIONS") is True
    network.close()


def test_batch_export_imports_on_the_device_or_batched_again(core, reference):
    network = core.load_network(mlp(), "BATCH:NUMPY(4)")
    blob = network.export()
    plain = core.import_network(blob, "NUMPY")
    again = core.import_network(blob, "BATCH:NUMPY(2)")
    for copy in (plain, again):
        np.testing.assert_allclose(
            copy.infer({"x": rows(3)})["y"], reference(rows(3)), rtol=1e-5, atol=1e-5
        )
    assert again.get_metric("BATCH_SIZE_COUNTS") == {1: 1}
    network.close()
    again.close()


def test_batch_on_ort(core, reference):
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available here")
    network = core.load_network(mlp(), "BATCH:ORT(4)", {"BATCH_TIMEOUT_MS": LONG})
    results = run_all(network, [{"x": rows(seed)} for seed in range(16)])
    for seed, result in enumerate(results):
        np.testing.assert_allclose(result["y"], reference(rows(seed)), rtol=1e-4, atol=1e-5)
    assert network.get_metric("BATCH_SIZE_COUNTS") == {4: 4}
    network.close()


# --------------------------------------------------------------------------- through a server


@pytest.fixture(scope="module")
def running(site, tmp_path_factory):
    """A server with a repository: one model with max_batch_size 8, one unbatchable one."""
    repo = tmp_path_factory.mktemp("repo")
    for name, model, settings in (
        (
            "bmlp",
            mlp(),
            {"device": "NUMPY", "config": {"BATCH_TIMEOUT_MS": LONG}, "max_batch_size": 8},
        ),
        ("bcnn", small_cnn(), {"device": "NUMPY", "max_batch_size": 4}),
        ("bset", mlp(), {"device": "BATCH:NUMPY(4)", "max_batch_size": 8}),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(model.SerializeToString())
        (repo / name / "config.json").write_text(json.dumps(settings))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    serve = ("--model-repository", str(repo), "--exit-timeout", "5", "--exit-on-error", "0")
    with RunningServer(*serve, env=env) as s:  # bcnn fails to load, the others serve
        yield s


async def _infer_all(target: str, network: str, inputs: list[np.ndarray]) -> list:
    async with AsyncClient(target) as client:
        calls = [client.infer(network, {"x": x}) for x in inputs]
        return await asyncio.gather(*calls, return_exceptions=True)


def test_server_repository_max_batch_size_batches_requests(running, reference):
    with Client(running.target) as client:
        devices = {n.name: n.device for n in client.networks()}
        assert devices["bmlp"] == "BATCH:NUMPY(8)"
        assert devices["bset"] == "BATCH:NUMPY(4)"  # already a BATCH device: kept
        assert "bcnn" not in devices  # unbatchable: refused at load, reported
        assert "cannot be batched" in running.log
        inputs = [rows(seed) for seed in range(64)]
        results = asyncio.run(_infer_all(running.target, "bmlp", inputs))
        for x, result in zip(inputs, results):
            np.testing.assert_allclose(result["y"], reference(x), rtol=1e-5, atol=1e-5)
        assert client.get_metric("", "BATCH_SIZE_COUNTS", network="bmlp") == {"8": 8}

    pytest.importorskip("tritonclient.grpc")
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(running.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name="bmlp"), timeout=30)
        model = stats.model_stats[0]
        assert model.inference_count == 64 and model.execution_count == 8
        assert [(b.batch_size, b.compute_infer.count) for b in model.batch_stats] == [(8, 8)]
        config = stub.ModelConfig(service_pb2.ModelConfigRequest(name="bmlp"), timeout=30).config
        assert config.max_batch_size == 8
        assert list(config.dynamic_batching.preferred_batch_size) == [8]
        assert config.dynamic_batching.max_queue_delay_microseconds == int(LONG) * 1000


def test_server_batch_never_mixes_shapes(running):
    with Client(running.target) as client:
        client.load(
            "mixed",
            scaled().SerializeToString(),
            device="BATCH:NUMPY(4)",
            config={"BATCH_TIMEOUT_MS": LONG},
        )
        inputs = [rows(i, 1, width=3 if i % 2 else 5) for i in range(32)]
        results = asyncio.run(_infer_all(running.target, "mixed", inputs))
        for x, result in zip(inputs, results):
            np.testing.assert_allclose(result["y"], scaled_ref(x), rtol=1e-5, atol=1e-5)
        assert client.get_metric("", "BATCH_SIZE_COUNTS", network="mixed") == {"4": 8}
        client.unload("mixed")


def test_server_failing_batch_fails_every_request(running):
    with Client(running.target) as client:
        client.load(
            "faulty",
            mlp().SerializeToString(),
            device="BATCH:FAULTY(4)",
            config={"BATCH_TIMEOUT_MS": LONG},
        )
        results = asyncio.run(_infer_all(running.target, "faulty", [rows(i) for i in range(8)]))
        for result in results:
            assert isinstance(result, grpc.RpcError), result
            assert result.code() == grpc.StatusCode.INTERNAL
            assert "a run on FAULTY failed" in result.details()
            assert "acme kernel failure" in result.details()
        client.unload("faulty")


def test_server_refuses_bad_batch_devices_and_models(running):
    with Client(running.target) as client:
        for device, model, code, text in (
            ("BATCH:NOPE(4)", mlp(), grpc.StatusCode.NOT_FOUND, "NOPE"),
            ("BATCH:BROKEN(4)", mlp(), grpc.StatusCode.NOT_FOUND, "BROKEN"),
            ("BATCH:NUMPY(4)", small_cnn(), grpc.StatusCode.INVALID_ARGUMENT, "cannot be batched"),
            ("BATCH:NUMPY(0)", mlp(), grpc.StatusCode.INVALID_ARGUMENT, "at least 1"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                client.load("bad", model.SerializeToString(), device=device)
            assert info.value.code() == code, (device, info.value.details())
            assert text in info.value.details()


def test_server_batch_on_ort(running, reference):
    with Client(running.target) as client:
        if "ORT" not in {d.name for d in client.devices() if d.available}:
            pytest.skip("ORT is not available here")
        client.load(
            "ortb",
            mlp().SerializeToString(),
            device="BATCH:ORT(8)",
            config={"BATCH_TIMEOUT_MS": LONG},
        )
        inputs = [rows(seed) for seed in range(32)]
        results = asyncio.run(_infer_all(running.target, "ortb", inputs))
        for x, result in zip(inputs, results):
            np.testing.assert_allclose(result["y"], reference(x), rtol=1e-4, atol=1e-5)
        assert client.get_metric("", "BATCH_SIZE_COUNTS", network="ortb") == {"8": 4}
        client.unload("ortb")


def test_max_batch_size_device_rule():
    from plugserve.server.control.model_control import batch_device

    assert batch_device("NUMPY", 0) == "NUMPY"
    assert batch_device("ort.1", 16) == "BATCH:ORT.1(16)"
    assert batch_device("BATCH:ORT(4)", 16) == "BATCH:ORT(4)"
    assert batch_device("MULTI:ORT,NUMPY", 16) == "MULTI:ORT,NUMPY"
