"""The seed's rules for configuration, metrics and per-call overrides, on the NUMPY plugin."""

from __future__ import annotations

import numpy as np
import pytest
from models import mlp, small_cnn

from plugserve.plugins.api import (
    Configuration,
    FailedPrecondition,
    InvalidArgument,
    InvalidInput,
    NotFound,
)


def test_unknown_config_key_raises_on_set_and_get(numpy_plugin):
    with pytest.raises(InvalidArgument, match="unsupported config key 'NO_SUCH_KEY'"):
        numpy_plugin.set_config({"NO_SUCH_KEY": "1"})
    with pytest.raises(InvalidArgument, match="NO_SUCH_KEY"):
        numpy_plugin.get_config("NO_SUCH_KEY")


def test_bad_config_value_names_key_and_value(numpy_plugin):
    with pytest.raises(InvalidArgument, match=r"PERF_COUNT.*'maybe'"):
        numpy_plugin.set_config({"PERF_COUNT": "maybe"})
    with pytest.raises(InvalidArgument, match="NUM_STREAMS"):
        numpy_plugin.set_config({"NUM_STREAMS": "-2"})
    assert numpy_plugin.get_config("PERF_COUNT") is False  # a refused set changes nothing


def test_set_then_get_config(numpy_plugin):
    numpy_plugin.set_config({"PERF_COUNT": "YES", "NUM_STREAMS": "3"})
    assert numpy_plugin.get_config("PERF_COUNT") is True
    assert numpy_plugin.get_config("NUM_STREAMS") == 3


def test_unknown_metric_raises(numpy_plugin):
    with pytest.raises(NotFound, match="unsupported metric 'NOPE'"):
        numpy_plugin.get_metric("NOPE")


def test_metrics_have_real_values(numpy_plugin):
    metrics = numpy_plugin.get_metric("SUPPORTED_METRICS")
    for name in (
        "FULL_DEVICE_NAME",
        "SUPPORTED_CONFIG_KEYS",
        "IMPORT_EXPORT_SUPPORT",
        "DEVICE_ARCHITECTURE",
        "OPTIMIZATION_CAPABILITIES",
        "RANGE_FOR_ASYNC_INFER_REQUESTS",
        "RANGE_FOR_STREAMS",
        "AVAILABLE_DEVICES",
    ):
        assert name in metrics
        numpy_plugin.get_metric(name)
    full = numpy_plugin.get_metric("FULL_DEVICE_NAME")
    assert "numpy" in full and np.__version__ in full
    keys = numpy_plugin.get_metric("SUPPORTED_CONFIG_KEYS")
    assert {"PERF_COUNT", "NUM_STREAMS", "PERFORMANCE_HINT", "CACHE_DIR", "DEVICE_ID"} <= set(keys)
    assert numpy_plugin.get_metric("IMPORT_EXPORT_SUPPORT") is True


def test_per_call_config_overrides_plugin_config(numpy_plugin):
    numpy_plugin.set_config({"PERF_COUNT": "NO", "NUM_STREAMS": "1"})
    net = numpy_plugin.load_network(mlp(), {"PERF_COUNT": "YES"})
    assert net.get_config("PERF_COUNT") is True
    assert net.get_config("NUM_STREAMS") == 1  # not overridden: the plugin's value
    assert numpy_plugin.get_config("PERF_COUNT") is False  # the plugin is unchanged


def test_load_with_unknown_key_raises_but_query_ignores_it(numpy_plugin):
    with pytest.raises(InvalidArgument, match="BOGUS"):
        numpy_plugin.load_network(mlp(), {"BOGUS": "1"})
    result = numpy_plugin.query_network(mlp(), {"BOGUS": "1"})
    assert result and set(result.values()) == {"NUMPY"}


def test_configuration_defaults_chain():
    base = Configuration({"NUM_STREAMS": "2"})
    child = Configuration({"PERF_COUNT": "YES"}, base)
    assert child.get("NUM_STREAMS") == 2 and child.get("PERF_COUNT") is True
    assert Configuration({"BOGUS": "1"}, throw_on_unsupported=False).get("NUM_STREAMS") == 0
    assert Configuration({"PERFORMANCE_HINT": "THROUGHPUT"}).streams(cores=4) == 4
    assert Configuration({"PERFORMANCE_HINT": "LATENCY"}).streams(cores=4) == 1


def test_compiled_network_metrics(numpy_plugin):
    net = numpy_plugin.load_network(mlp(), {"NUM_STREAMS": "2"})
    assert net.get_metric("NETWORK_NAME") == "mlp"
    assert net.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS") == 2
    with pytest.raises(NotFound):
        net.get_metric("NOPE")


def test_infer_sync_async_and_callback(numpy_plugin):
    net = numpy_plugin.load_network(small_cnn(), {"NUM_STREAMS": "2"})
    x = np.random.default_rng(1).normal(size=(1, 3, 16, 16)).astype(np.float32)
    sync = net.create_infer_request().infer({"x": x})["probs"]
    request = net.create_infer_request()
    request.start_async({"x": x})
    assert np.array_equal(request.wait(timeout=30)["probs"], sync)
    seen = []
    other = net.create_infer_request()
    other.start_async({"x": x}, callback=lambda out, err: seen.append((out, err)))
    other.wait(timeout=30)
    assert seen and seen[0][1] is None and np.array_equal(seen[0][0]["probs"], sync)
    with pytest.raises(FailedPrecondition):
        net.create_infer_request().wait()


def test_async_failure_reaches_wait_and_callback(numpy_plugin):
    from onnx import TensorProto, helper

    # Reshape to a shape that does not fit the data fails at run time, inside the stream.
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape")],
        "bad",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    net = numpy_plugin.load_network(model)
    errors = []
    request = net.create_infer_request()
    request.start_async(
        {"x": np.ones(5, np.float32), "s": np.array([3])},
        callback=lambda out, err: errors.append(err),
    )
    from plugserve.plugins.api import InferenceError

    with pytest.raises(InferenceError, match="reshape"):
        request.wait(timeout=30)
    assert isinstance(errors[0], InferenceError)
    # the network still works for good input
    out = net.create_infer_request().infer({"x": np.ones(6, np.float32), "s": np.array([6])})
    assert out["y"].shape == (6,)


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        ({}, "missing input x: float32"),
        ({"x": np.zeros((1, 3, 16, 16), np.float32), "z": np.zeros(1)}, "unknown input"),
        ({"x": np.zeros((1, 3, 16, 16), np.float64)}, "element type float64, expected float32"),
        ({"x": np.zeros((1, 3, 16), np.float32)}, r"rank 3\), expected rank 4"),
        ({"x": np.zeros((1, 3, 16, 15), np.float32)}, "dimension 3 must be 16"),
    ],
)
def test_bad_inputs_raise_invalid_input_naming_the_problem(numpy_plugin, feeds, message):
    net = numpy_plugin.load_network(small_cnn())
    with pytest.raises(InvalidInput, match=message):
        net.create_infer_request().infer(feeds)
    assert net.infer({"x": np.zeros((1, 3, 16, 16), np.float32)})["probs"].shape == (1, 10)


def test_performance_counts(numpy_plugin):
    model = small_cnn()
    net = numpy_plugin.load_network(model, {"PERF_COUNT": "YES"})
    request = net.create_infer_request()
    request.infer({"x": np.zeros((1, 3, 16, 16), np.float32)})
    counts = request.get_performance_counts()
    assert counts and all(c.status == "EXECUTED" and c.real_time_s >= 0 for c in counts)
    originals = {n for c in counts for n in c.original_names}
    assert {"conv1", "bn1", "relu1", "fc", "softmax"} <= originals
    fused = next(c for c in counts if "bn1" in c.original_names)
    assert fused.op_type == "FusedConvPool"
    assert set(fused.original_names) == {"conv1", "bn1", "relu1", "pool1"}
    plain = numpy_plugin.load_network(model).create_infer_request()
    plain.infer({"x": np.zeros((1, 3, 16, 16), np.float32)})
    with pytest.raises(FailedPrecondition, match="PERF_COUNT=YES"):
        plain.get_performance_counts()
