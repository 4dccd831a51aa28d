"""OPENVINO as a device: openvino's CPU runtime behind the plugserve plugin API."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from models import _init, _model, encoder_block, mlp, small_cnn, with_custom_op
from onnx import TensorProto, helper

ov = pytest.importorskip("openvino")

from plugserve.plugins import blob  # noqa: E402
from plugserve.plugins.api import (  # noqa: E402
    BackendUnavailable,
    FailedPrecondition,
    InferenceError,
    InvalidArgument,
    InvalidInput,
    InvalidModel,
    NotFound,
    Unsupported,
)
from plugserve.plugins.ir import load_model  # noqa: E402
from plugserve.plugins.openvino.config import precision_name  # noqa: E402
from plugserve.plugins.outputcheck import compare_outputs  # noqa: E402

DEVICE = "OPENVINO"


# --------------------------------------------------------------------------- models


def unnamed(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        node.name = ""
    return copy


def typed_model() -> onnx.ModelProto:
    """int64 and int32 inputs, a bool and an int32 output: the ONNX dtypes must come back."""
    nodes = [
        helper.make_node("Cast", ["a"], ["a32"], name="cast", to=TensorProto.INT32),
        helper.make_node("Add", ["a32", "b"], ["sum"], name="add"),
        helper.make_node("Greater", ["a", "zero"], ["positive"], name="greater"),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("a", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("b", TensorProto.INT32, ["n"]),
        ],
        [
            helper.make_tensor_value_info("sum", TensorProto.INT32, ["n"]),
            helper.make_tensor_value_info("positive", TensorProto.BOOL, ["n"]),
        ],
        [_init("zero", np.array(0, np.int64))],
        name="typed",
    )


def reshape_model() -> onnx.ModelProto:
    """Reshape to a shape given at run time: a bad one fails inside openvino, not before."""
    return _model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        name="reshape",
    )


def _feeds(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    name = model.graph.name
    if name == "small_cnn":
        return {"x": rng.normal(size=(1, 3, 16, 16)).astype(np.float32)}
    if name == "mlp":
        return {"x": rng.normal(size=(batch, 32)).astype(np.float32)}
    if name == "encoder_block":
        return {"x": rng.normal(size=(batch, 5, 16)).astype(np.float32)}
    raise AssertionError(name)


MODELS = {"small_cnn": small_cnn, "mlp": mlp, "encoder_block": encoder_block}


@pytest.fixture
def plugin():
    """A fresh OPENVINO plugin, so config changes do not leak between tests."""
    from plugserve.plugins.openvino import OpenvinoPlugin

    return OpenvinoPlugin()


@pytest.fixture(scope="module")
def numpy_reference():
    from plugserve.plugins.numpy import NumpyPlugin

    reference = NumpyPlugin()

    def run(model, feeds):
        return reference.load_network(model).infer(feeds)

    return run


def _bf16_supported(plugin) -> bool:
    return "BF16" in plugin.get_metric("OPTIMIZATION_CAPABILITIES")


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("name", list(MODELS))
def test_results_match_numpy_in_f32(core, numpy_reference, name):
    """ACCURACY: the model's own precision, the other devices' results at f32 tolerance."""
    model = MODELS[name]()
    net = core.load_network(model, DEVICE, {"EXECUTION_MODE_HINT": "ACCURACY"})
    assert net.device == DEVICE and net.get_config("EXECUTION_MODE_HINT") == "ACCURACY"
    assert net.precision == net.get_metric("INFERENCE_PRECISION") == "f32"
    for batch in (1, 3):
        feeds = _feeds(model, batch)
        got = net.infer(feeds)
        want = numpy_reference(model, feeds)
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_results_are_close(plugin, numpy_reference, name):
    if not _bf16_supported(plugin):
        pytest.skip("this CPU has no bf16 arithmetic")
    model = MODELS[name]()
    net = plugin.load_network(model, {"INFERENCE_PRECISION_HINT": "bf16"})
    assert net.get_config("INFERENCE_PRECISION_HINT") == "bf16"
    assert "bfloat16" in str(net.compiled.get_property("INFERENCE_PRECISION_HINT"))
    feeds = _feeds(model)
    got, want = net.infer(feeds), numpy_reference(model, feeds)
    for key in want:
        assert got[key].dtype == np.float32
        np.testing.assert_allclose(got[key], want[key], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_default_is_openvinos_own_and_close_at_its_precision(plugin, numpy_reference, name):
    """No hint: what openvino itself would run (bf16 on CPUs with bf16 arithmetic), as
    OpenVINO Model Server does; results within that precision's error of NUMPY's."""
    own = ov.Core().compile_model(ov.Core().read_model(MODELS[name]().SerializeToString()), "CPU")
    expected = precision_name(own.get_property("INFERENCE_PRECISION_HINT"))
    model = MODELS[name]()
    net = plugin.load_network(model)
    assert net.get_config("EXECUTION_MODE_HINT") == "PERFORMANCE"
    assert net.get_config("INFERENCE_PRECISION_HINT") == ""
    assert net.precision == net.get_metric("INFERENCE_PRECISION") == expected
    assert expected == ("bf16" if _bf16_supported(plugin) else "f32")
    feeds = _feeds(model)
    got, want = net.infer(feeds), numpy_reference(model, feeds)
    assert compare_outputs(got, want, expected) == ""
    if expected == "bf16":  # it really ran in bf16: not within f32's tolerance
        assert "differs" in compare_outputs(got, want, "f32")


def test_the_precision_known_before_compiling_is_the_compiled_one(plugin):
    """QueryNetwork's checks and AUTO pick tolerances before anything is compiled."""
    for config in (
        {},
        {"EXECUTION_MODE_HINT": "ACCURACY"},
        {"INFERENCE_PRECISION_HINT": "f32"},
        {"INFERENCE_PRECISION_HINT": "bf16"},
        {"INFERENCE_PRECISION_HINT": "f16"},
        {"EXECUTION_MODE_HINT": "ACCURACY", "INFERENCE_PRECISION_HINT": "bf16"},
    ):
        net = plugin.load_network(mlp(), config)
        assert plugin.precision(plugin.merged_config(config)) == net.precision, config


def test_a_cpu_without_bf16_computes_in_f32_by_default(plugin, monkeypatch):
    """The logic for the other kind of CPU, with the CPU's capabilities stubbed where the
    plugin reads them (this CPU decides what openvino itself compiles)."""
    monkeypatch.setattr(plugin, "fastest_precision", "f32")
    monkeypatch.setattr(plugin, "capabilities", lambda: ["FP32", "INT8", "EXPORT_IMPORT"])
    assert plugin.precision(plugin.merged_config({})) == "f32"
    assert plugin.precision(plugin.merged_config({"INFERENCE_PRECISION_HINT": "bf16"})) == "f32"
    monkeypatch.setattr(plugin, "fastest_precision", "bf16")
    monkeypatch.setattr(plugin, "capabilities", lambda: ["BF16", "FP32"])
    assert plugin.precision(plugin.merged_config({})) == "bf16"
    assert plugin.precision(plugin.merged_config({"EXECUTION_MODE_HINT": "ACCURACY"})) == "f32"
    assert plugin.precision(plugin.merged_config({"INFERENCE_PRECISION_HINT": "f16"})) == "bf16"


def test_inputs_and_outputs_keep_onnx_names_dtypes_and_dynamic_dims(core):
    net = core.load_network(encoder_block(), DEVICE)
    assert [(s.name, s.dtype, s.shape) for s in net.inputs] == [
        ("x", np.dtype(np.float32), ("batch", "seq", 16))
    ]
    assert [(s.name, s.shape) for s in net.outputs] == [("y", ("batch", "seq", 16))]
    # mlp's last node is an Identity openvino removes: the output keeps the ONNX name
    out = core.load_network(mlp(), DEVICE).infer({"x": np.ones((4, 32), np.float32)})
    assert list(out) == ["y"] and out["y"].shape == (4, 10)


def test_integer_and_bool_dtypes_come_back_as_declared(core):
    net = core.load_network(typed_model(), DEVICE)
    assert [s.dtype for s in net.inputs] == [np.dtype(np.int64), np.dtype(np.int32)]
    a = np.array([-2, 0, 5], np.int64)
    b = np.array([1, 2, 3], np.int32)
    out = net.infer({"a": a, "b": b})
    assert out["sum"].dtype == np.int32 and out["sum"].tolist() == [-1, 2, 8]
    assert out["positive"].dtype == np.bool_ and out["positive"].tolist() == [False, False, True]


def test_bad_models_and_inputs_fail_as_on_numpy(core):
    for model in (b"\x00\x01 not onnx", "/nonexistent/model.onnx"):
        with pytest.raises(InvalidModel) as ov_error:
            core.load_network(model, DEVICE)
        with pytest.raises(InvalidModel) as np_error:
            core.load_network(model, "NUMPY")
        assert str(ov_error.value) == str(np_error.value)
    feeds = [
        {"x": np.zeros((2, 32), np.float64)},
        {"x": np.zeros((2, 31), np.float32)},
        {"x": np.zeros((2, 32), np.float32), "z": np.zeros(1)},
        {},
    ]
    ov_net, np_net = core.load_network(mlp(), DEVICE), core.load_network(mlp(), "NUMPY")
    for bad in feeds:
        with pytest.raises(InvalidInput) as ov_error:
            ov_net.infer(bad)
        with pytest.raises(InvalidInput) as np_error:
            np_net.infer(bad)
        assert str(ov_error.value) == str(np_error.value)


def test_a_custom_op_is_unsupported_and_named(core):
    with pytest.raises(Unsupported, match=r"'scale'.*com\.example::Scale"):
        core.load_network(with_custom_op(), DEVICE)


# --------------------------------------------------------------------------- requests


def test_sync_and_async_requests_with_callbacks_several_in_flight(core):
    model = encoder_block()
    net = core.load_network(model, DEVICE, {"PERFORMANCE_HINT": "THROUGHPUT"})
    feeds = [_feeds(model, batch=1 + i % 3, seed=i) for i in range(8)]
    expected = [net.infer(f)["y"] for f in feeds]
    requests = [net.create_infer_request() for _ in feeds]
    done = threading.Event()
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def callback(i):
        def on_done(outputs, error):
            with lock:
                if error is not None:
                    errors.append(error)
                else:
                    results[i] = outputs["y"]
                if len(results) + len(errors) == len(feeds):
                    done.set()

        return on_done

    for i, (request, f) in enumerate(zip(requests, feeds)):
        request.start_async(f, callback(i))
    waited = [request.wait() for request in requests]
    assert done.wait(60)
    assert not errors
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(waited[i]["y"], want)
        np.testing.assert_array_equal(results[i], want)
    # a request runs again after wait(); wait() without start_async() is refused
    requests[0].start_async(feeds[1])
    np.testing.assert_array_equal(requests[0].wait()["y"], expected[1])
    with pytest.raises(FailedPrecondition):
        requests[0].wait()


def test_async_failure_reaches_wait_and_callback(core):
    # fresh networks: openvino 2026.4 remembers a failed shape and then repeats the last good
    # output for the same bad input without an error, so each failure is tested first
    good = {"x": np.arange(6, dtype=np.float32), "shape": np.array([2, 3], np.int64)}
    bad = {"x": np.arange(6, dtype=np.float32), "shape": np.array([4, 4], np.int64)}
    with pytest.raises(InferenceError, match=r"network reshape: openvino failed.*'reshape'"):
        core.load_network(reshape_model(), DEVICE).infer(bad)
    request = core.load_network(reshape_model(), DEVICE).create_infer_request()
    seen: list[tuple] = []
    called = threading.Event()
    request.start_async(bad, lambda out, err: (seen.append((out, err)), called.set()))
    with pytest.raises(InferenceError, match="network reshape: openvino failed"):
        request.wait()
    assert called.wait(60)
    assert seen[0][0] is None and isinstance(seen[0][1], InferenceError)
    request.start_async(good)  # the request still works afterwards
    assert request.wait()["y"].tolist() == [[0, 1, 2], [3, 4, 5]]


# --------------------------------------------------------------------------- QueryNetwork


@pytest.mark.parametrize("name", list(MODELS))
def test_query_reports_every_original_node(core, name):
    model = MODELS[name]()
    assert core.query_network(model, DEVICE) == {n.name: DEVICE for n in model.graph.node}


@pytest.mark.parametrize("name", list(MODELS))
def test_query_maps_unnamed_nodes_to_their_plugserve_names(core, name):
    model = unnamed(MODELS[name]())
    expected = {n.name for n in load_model(model).nodes}  # e.g. "MatMul_0", as NUMPY names them
    assert set(core.query_network(model, DEVICE)) == expected
    assert set(core.query_network(model, "NUMPY")) == expected


def test_query_with_an_unsupported_custom_op(core, plugin):
    assert core.query_network(with_custom_op(), DEVICE) == {"relu": DEVICE, "add": DEVICE}
    result = core.query_network(unnamed(with_custom_op()), DEVICE)
    assert set(result) == {"Relu_0", "Add_2"}
    why = plugin.unsupported_nodes(with_custom_op())
    assert set(why) == {"scale"} and "com.example::Scale" in why["scale"]


def test_query_housekeeping_constants_follow_their_reader(core):
    def model(custom: bool):
        consumer = (
            helper.make_node("Scale", ["x", "c"], ["y"], name="consumer", domain="com.example")
            if custom
            else helper.make_node("Add", ["x", "c"], ["y"], name="consumer")
        )
        value = helper.make_tensor("v", TensorProto.FLOAT, [1], [2.0])
        graph = helper.make_graph(
            [
                helper.make_node("Constant", [], ["c"], name="const", value=value),
                consumer,
                helper.make_node("Relu", ["x"], ["z"], name="other"),
            ],
            "housekeeping",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
            [
                helper.make_tensor_value_info("y", TensorProto.FLOAT, [3]),
                helper.make_tensor_value_info("z", TensorProto.FLOAT, [3]),
            ],
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
        return helper.make_model(graph, opset_imports=opsets)

    assert set(core.query_network(model(False), DEVICE)) == {"const", "consumer", "other"}
    assert set(core.query_network(model(True), DEVICE)) == {"other"}


# --------------------------------------------------------------------------- export / import


def test_export_import_round_trip(core, plugin):
    model = encoder_block()
    net = plugin.load_network(model, {"PERF_COUNT": "YES"})
    data = net.export()
    assert data.startswith(blob.MAGIC)
    again = core.import_network(data, DEVICE)
    assert again.name == net.name and again.get_config("PERF_COUNT") is True
    assert again.inputs == net.inputs and again.outputs == net.outputs
    feeds = _feeds(model, batch=3)
    np.testing.assert_array_equal(again.infer(feeds)["y"], net.infer(feeds)["y"])
    request = again.create_infer_request()
    request.infer(feeds)
    assert request.get_performance_counts()
    # per-call config at import overrides the exported one
    quiet = core.import_network(data, DEVICE, {"PERF_COUNT": "NO"})
    with pytest.raises(FailedPrecondition):
        quiet.create_infer_request().get_performance_counts()


def test_import_refuses_a_numpy_blob_and_garbage(core, plugin):
    numpy_blob = core.load_network(mlp(), "NUMPY").export()
    with pytest.raises(InvalidArgument, match="made by device 'NUMPY', not 'OPENVINO'"):
        plugin.import_network(numpy_blob)
    with pytest.raises(InvalidArgument, match="magic"):
        plugin.import_network(b"hello world, not a blob")
    data = plugin.load_network(mlp()).export()
    with pytest.raises(InvalidArgument, match=r"truncated|corrupt"):
        plugin.import_network(data[:20])
    header_end = len(data) - len(plugin.load_network(mlp()).compiled.export_model().getvalue())
    with pytest.raises(InvalidArgument, match="corrupt"):
        plugin.import_network(data[:header_end] + b"\xff" * 64)


# --------------------------------------------------------------------------- performance counts


@pytest.mark.parametrize("name", ["small_cnn", "mlp"])
def test_performance_counts_map_back_to_onnx_nodes(core, name):
    model = MODELS[name]()
    net = core.load_network(model, DEVICE, {"PERF_COUNT": "YES"})
    request = net.create_infer_request()
    assert request.get_performance_counts() == []  # nothing ran yet
    request.infer(_feeds(model))
    counts = request.get_performance_counts()
    assert counts and {c.status for c in counts} <= {"EXECUTED", "NOT_RUN", "OPTIMIZED_OUT"}
    executed = [c for c in counts if c.status == "EXECUTED"]
    assert executed and all(c.exec_type and c.op_type and c.real_time_s >= 0 for c in executed)
    covered = {n for c in counts for n in c.original_names}
    assert covered == {n.name for n in model.graph.node}
    # and after an async run
    request.start_async(_feeds(model, seed=1))
    request.wait()
    assert {n for c in request.get_performance_counts() for n in c.original_names} == covered


def test_performance_counts_are_off_by_default(core):
    request = core.load_network(mlp(), DEVICE).create_infer_request()
    request.infer(_feeds(mlp()))
    with pytest.raises(FailedPrecondition, match="PERF_COUNT=YES"):
        request.get_performance_counts()


# --------------------------------------------------------------------------- config and metrics


def test_unknown_config_keys_and_bad_values_raise(plugin):
    with pytest.raises(InvalidArgument, match="NOPE"):
        plugin.set_config({"NOPE": "1"})
    with pytest.raises(InvalidArgument, match="NOPE"):
        plugin.get_config("NOPE")
    with pytest.raises(InvalidArgument, match="INFERENCE_PRECISION_HINT"):
        plugin.set_config({"INFERENCE_PRECISION_HINT": "i8"})
    with pytest.raises(InvalidArgument, match="NOPE"):
        plugin.load_network(mlp(), {"NOPE": "1"})
    # QueryNetwork ignores keys it does not know (a virtual device passes one config to all)
    assert set(plugin.query_network(mlp(), {"NOPE": "1"})) == {n.name for n in mlp().graph.node}
    assert plugin.get_config("INFERENCE_PRECISION_HINT") == ""
    with pytest.raises(InvalidArgument, match="PERFORMANCE or ACCURACY"):
        plugin.load_network(mlp(), {"EXECUTION_MODE_HINT": "FAST"})


def test_unknown_metrics_raise(plugin):
    with pytest.raises(NotFound, match="NOPE"):
        plugin.get_metric("NOPE")
    with pytest.raises(NotFound, match="NOPE"):
        plugin.load_network(mlp()).get_metric("NOPE")


def test_metrics_come_from_openvino(plugin):
    core = ov.Core()
    assert set(plugin.get_metric("SUPPORTED_METRICS")) >= {
        "FULL_DEVICE_NAME",
        "DEVICE_ARCHITECTURE",
        "OPTIMIZATION_CAPABILITIES",
        "RANGE_FOR_STREAMS",
        "IMPORT_EXPORT_SUPPORT",
    }
    full = plugin.get_metric("FULL_DEVICE_NAME")
    assert core.get_property("CPU", "FULL_DEVICE_NAME") in full
    assert f"OpenVINO {ov.get_version().split('-')[0]}" in full
    assert plugin.get_metric("OPTIMIZATION_CAPABILITIES") == list(
        core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    )
    assert plugin.get_metric("RANGE_FOR_STREAMS") == tuple(
        core.get_property("CPU", "RANGE_FOR_STREAMS")
    )
    assert core.get_property("CPU", "DEVICE_ARCHITECTURE") in plugin.get_metric(
        "DEVICE_ARCHITECTURE"
    )
    assert "INFERENCE_PRECISION_HINT" in plugin.get_metric("SUPPORTED_CONFIG_KEYS")
    net = plugin.load_network(mlp(), {"PERFORMANCE_HINT": "THROUGHPUT"})
    assert net.get_metric("NETWORK_NAME") == "mlp"
    optimal = net.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
    assert optimal == net.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS") >= 1


def test_per_call_config_overrides_plugin_config(plugin):
    plugin.set_config({"PERF_COUNT": "YES", "INFERENCE_PRECISION_HINT": "bf16"})
    net = plugin.load_network(mlp(), {"INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": "2"})
    assert net.get_config("INFERENCE_PRECISION_HINT") == "f32"
    assert net.get_config("PERF_COUNT") is True  # the plugin's own value where not overridden
    assert "float32" in str(net.compiled.get_property("INFERENCE_PRECISION_HINT"))
    assert net.compiled.get_property("PERF_COUNT") in (True, "YES")
    assert int(net.compiled.get_property("NUM_STREAMS")) == 2
    assert plugin.get_config("INFERENCE_PRECISION_HINT") == "bf16"  # the plugin's is unchanged


def test_threads_and_hint_reach_openvino(plugin):
    net = plugin.load_network(mlp(), {"INFERENCE_NUM_THREADS": "1", "PERFORMANCE_HINT": "LATENCY"})
    assert int(net.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    assert "LATENCY" in str(net.compiled.get_property("PERFORMANCE_HINT"))


def test_constructor_raises_backend_unavailable_without_openvino(monkeypatch):
    from plugserve.plugins.openvino import plugin as module

    monkeypatch.setattr(module, "ov", None)
    with pytest.raises(BackendUnavailable, match="openvino"):
        module.OpenvinoPlugin()


# --------------------------------------------------------------------------- a real server


def test_load_and_infer_through_a_real_server(server):
    from plugserve.client import Client
    from plugserve.server import Core

    model = encoder_block()
    feeds = _feeds(model, batch=2)
    expected = Core().load_network(model, "NUMPY").infer(feeds)["y"]
    with Client(server.target, timeout=60) as client:
        devices = {d.name: d for d in client.devices()}
        assert devices[DEVICE].available and "OpenVINO" in devices[DEVICE].full_name
        response = client.load(
            "ov_encoder",
            model.SerializeToString(),
            device=DEVICE,
            config={"EXECUTION_MODE_HINT": "ACCURACY"},
        )
        assert response.network.device == DEVICE
        assert response.network.inputs[0].name == "x"
        np.testing.assert_allclose(
            client.infer("ov_encoder", feeds)["y"], expected, rtol=1e-4, atol=1e-4
        )
        query = client.query(with_custom_op().SerializeToString(), DEVICE)
        assert set(query.supported) == {"relu", "add"}
        client.unload("ov_encoder")
