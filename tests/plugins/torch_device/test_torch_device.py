"""The TORCH device (torch on the CPU; the GPU device's code) in process: how the Core lists it
with and without torch, its metrics and config, results against NUMPY at each precision,
QueryNetwork exact per node with HETERO taking the rest to NUMPY, export/import and the model
cache. GPU: listed unavailable here with its reason (no CUDA device in CI)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import mlp, small_cnn
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins.api import InvalidArgument, Unsupported

torch = pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)


def _image(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(1, 3, 16, 16)).astype(np.float32)


def _det_model() -> onnx.ModelProto:
    """x -> Relu -> Det (no converter on TORCH) -> Mul(2) -> y: TORCH claims Relu and Mul."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Det", ["r"], ["d"], name="det"),
        helper.make_node("Mul", ["d", "two"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array([2.0], np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_the_core_lists_torch_with_its_version_and_gpu_with_why_not(core):
    devices = {d.name: d for d in core.devices()}
    assert devices["TORCH"].available, devices["TORCH"].reason
    full = core.get_metric("TORCH", "FULL_DEVICE_NAME")
    assert f"torch {torch.__version__}" in full and "CPU" in full
    if not torch.cuda.is_available():
        assert not devices["GPU"].available
        assert "CUDA" in devices["GPU"].reason or "no CUDA device" in devices["GPU"].reason


def test_metrics_and_config_keys(core):
    metrics = core.get_metric("TORCH", "SUPPORTED_METRICS")
    for name in ("AVAILABLE_DEVICES", "OPTIMIZATION_CAPABILITIES", "DEVICE_ARCHITECTURE",
                 "IMPORT_EXPORT_SUPPORT", "RANGE_FOR_STREAMS", "SUPPORTED_OPS"):  # fmt: skip
        assert name in metrics
    assert "FP32" in core.get_metric("TORCH", "OPTIMIZATION_CAPABILITIES")
    assert core.get_metric("TORCH", "IMPORT_EXPORT_SUPPORT") is True
    assert "torch" in core.get_metric("TORCH", "DEVICE_ARCHITECTURE")
    ops = core.get_metric("TORCH", "SUPPORTED_OPS")
    assert {"Conv", "LSTM", "GRU", "DequantizeLinear", "GlobalMaxPool", "LessOrEqual"} <= set(ops)
    keys = core.get_metric("TORCH", "SUPPORTED_CONFIG_KEYS")
    assert {"INFERENCE_PRECISION_HINT", "EXECUTION_MODE_HINT", "PERF_COUNT"} <= set(keys)
    with pytest.raises(InvalidArgument, match="INFERENCE_PRECISION_HINT"):
        core.load_network(mlp(), "TORCH", {"INFERENCE_PRECISION_HINT": "f8"})


def test_a_cnn_and_an_mlp_match_numpy_in_f32(core):
    vector = np.random.default_rng(2).normal(size=(1, 32)).astype(np.float32)
    for model, feed in [(small_cnn(), _image()), (mlp(), vector)]:
        name = model.graph.input[0].name
        want = core.load_network(model, "NUMPY").infer({name: feed})
        network = core.load_network(model, "TORCH")
        assert network.get_metric("INFERENCE_PRECISION") == "f32"
        got = network.infer({name: feed})
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("hint", "tolerance"), [("f16", 2e-2), ("bf16", 6e-2)])
def test_reduced_precision_is_used_when_asked_and_accuracy_overrides_it(core, hint, tolerance):
    model, feed = small_cnn(), _image()
    want = core.load_network(model, "NUMPY").infer({"x": feed})
    network = core.load_network(model, "TORCH", {"INFERENCE_PRECISION_HINT": hint})
    assert network.get_metric("INFERENCE_PRECISION") == hint
    got = network.infer({"x": feed})
    for key in want:
        assert got[key].dtype == np.float32  # the declared type, widened back
        np.testing.assert_allclose(got[key], want[key], rtol=tolerance, atol=tolerance)
    differs = any(not np.array_equal(got[k], want[k]) for k in want)
    assert differs, f"{hint} gave f32's exact answer: the hint was not used"
    accurate = core.load_network(
        model, "TORCH", {"INFERENCE_PRECISION_HINT": hint, "EXECUTION_MODE_HINT": "ACCURACY"}
    )
    assert accurate.get_metric("INFERENCE_PRECISION") == "f32"
    exact = accurate.infer({"x": feed})
    for key in want:
        np.testing.assert_allclose(exact[key], want[key], rtol=1e-5, atol=1e-6)


def test_query_is_exact_per_node_and_hetero_runs_the_rest_on_numpy(core):
    model = _det_model()
    claimed = core.query_network(model, "TORCH")
    assert set(claimed) == {"relu", "mul"}
    why = core.plugin("TORCH").unsupported_nodes(model)
    assert set(why) == {"det"} and "Det" in why["det"]
    with pytest.raises(Unsupported, match="det"):
        core.load_network(model, "TORCH")
    x = np.random.default_rng(3).normal(size=(2, 3, 3)).astype(np.float32)
    want = core.load_network(model, "NUMPY").infer({"x": x})["y"]
    network = core.load_network(model, "HETERO:TORCH,NUMPY")
    placed = core.query_network(model, "HETERO:TORCH,NUMPY")
    assert placed == {"relu": "TORCH", "det": "NUMPY", "mul": "TORCH"}
    np.testing.assert_allclose(network.infer({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_export_import_and_the_model_cache(core, tmp_path):
    model, feed = small_cnn(), _image()
    network = core.load_network(model, "TORCH", {"INFERENCE_PRECISION_HINT": "bf16"})
    blob = network.export()
    again = core.import_network(blob, "TORCH")
    assert again.get_metric("INFERENCE_PRECISION") == "bf16"
    out = network.outputs[0].name
    np.testing.assert_array_equal(again.infer({"x": feed})[out], network.infer({"x": feed})[out])
    with pytest.raises(InvalidArgument):
        core.import_network(blob, "NUMPY")
    path = tmp_path / "cnn.onnx"
    onnx.save(model, str(path))
    cache = {"CACHE_DIR": str(tmp_path / "cache")}
    first = core.load_network(str(path), "TORCH", cache)
    second = core.load_network(str(path), "TORCH", cache)
    assert not first.loaded_from_cache and second.loaded_from_cache
    np.testing.assert_array_equal(second.infer({"x": feed})[out], first.infer({"x": feed})[out])


def test_async_requests_run_on_the_streams(core):
    model = mlp()
    feeds = [np.random.default_rng(i).normal(size=(1, 32)).astype(np.float32) for i in range(4)]
    network = core.load_network(model, "TORCH", {"NUM_STREAMS": "2"})
    requests = [network.create_infer_request() for _ in feeds]
    for request, feed in zip(requests, feeds):
        request.start_async({"x": feed})
    numpy = core.load_network(model, "NUMPY")
    for request, feed in zip(requests, feeds):
        np.testing.assert_allclose(
            request.wait(timeout=60)["y"], numpy.infer({"x": feed})["y"], rtol=1e-5, atol=1e-6
        )


def test_a_failing_run_fails_that_request_and_the_device_keeps_serving(core):
    # Reshape to a shape the data cannot take: an error of this run, not of the device
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")]
    graph = helper.make_graph(
        nodes,
        "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    network = core.load_network(model, "TORCH")
    from plugserve.plugins.api import InferenceError

    with pytest.raises(InferenceError, match="reshape"):
        network.infer({"x": np.ones(6, np.float32), "shape": np.array([4, 4])})
    got = network.infer({"x": np.arange(6, dtype=np.float32), "shape": np.array([2, 3])})
    np.testing.assert_array_equal(got["y"], np.arange(6, dtype=np.float32).reshape(2, 3))
