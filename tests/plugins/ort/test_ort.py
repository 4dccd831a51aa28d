"""ORT as a device: onnxruntime's CPU provider through the plugserve API and a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import onnx
import pytest
from models import _model, encoder_block, mlp, small_cnn, with_custom_op
from onnx import TensorProto, helper

from plugserve.plugins import blob
from plugserve.plugins.api import (
    FailedPrecondition,
    InvalidArgument,
    InvalidInput,
    InvalidModel,
    NotFound,
    Unsupported,
    available_cores,
)

pytest.importorskip("onnxruntime")


MODELS = {
    "small_cnn": (small_cnn, (2, 3, 16, 16)),
    "mlp": (mlp, (5, 32)),
    "encoder_block": (encoder_block, (3, 6, 16)),
}


@pytest.fixture
def ort_plugin():
    """A fresh ORT plugin, so config changes do not leak between tests."""
    from plugserve.plugins.ort import OrtPlugin

    return OrtPlugin()


def _input(shape, seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("name", sorted(MODELS))
def test_results_equal_numpy(core, name):
    build, shape = MODELS[name]
    model = build(batch=shape[0]) if name == "small_cnn" else build()
    x = _input(shape)
    ort_net = core.load_network(model, "ORT")
    assert ort_net.device == "ORT"
    got = ort_net.infer({"x": x})
    want = core.load_network(model, "NUMPY").infer({"x": x})
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("level", ["DISABLE_ALL", "BASIC", "EXTENDED", "ALL"])
def test_every_optimization_level_gives_the_same_result(core, level):
    model = encoder_block()
    x = _input((2, 6, 16))
    want = core.load_network(model, "NUMPY").infer({"x": x})["y"]
    net = core.load_network(model, "ORT", {"GRAPH_OPTIMIZATION_LEVEL": level})
    np.testing.assert_allclose(net.infer({"x": x})["y"], want, rtol=1e-4, atol=1e-4)


def test_async_requests_with_callbacks(core):
    model = mlp()
    net = core.load_network(model, "ORT", {"NUM_STREAMS": "2"})
    reference = core.load_network(model, "NUMPY")
    requests = [net.create_infer_request() for _ in range(4)]
    inputs = [_input((3, 32), seed) for seed in range(4)]
    done = threading.Event()
    results: dict[int, np.ndarray] = {}
    lock = threading.Lock()

    def callback(i):
        def call(outputs, error):
            assert error is None
            with lock:
                results[i] = outputs["y"]
                if len(results) == len(requests):
                    done.set()

        return call

    for i, (request, x) in enumerate(zip(requests, inputs)):
        request.start_async({"x": x}, callback(i))
    for request, x in zip(requests, inputs):
        np.testing.assert_allclose(
            request.wait()["y"], reference.infer({"x": x})["y"], rtol=1e-4, atol=1e-5
        )
    assert done.wait(60)
    for i, x in enumerate(inputs):
        np.testing.assert_allclose(results[i], reference.infer({"x": x})["y"], rtol=1e-4, atol=1e-5)


def test_wait_before_start_and_bad_inputs(core):
    net = core.load_network(mlp(), "ORT")
    request = net.create_infer_request()
    with pytest.raises(FailedPrecondition):
        request.wait()
    with pytest.raises(InvalidInput, match="element type float64"):
        request.infer({"x": np.zeros((2, 32))})
    with pytest.raises(InvalidInput, match="missing input x"):
        request.infer({})
    with pytest.raises(InvalidInput, match="rank 1"):
        request.start_async({"x": np.zeros(32, np.float32)})


def test_invalid_models_raise_the_same_errors_as_numpy(ort_plugin, numpy_plugin, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    for model in (b"garbage bytes", str(bad), str(tmp_path / "missing.onnx"), 42):
        with pytest.raises(InvalidModel) as ours:
            ort_plugin.load_network(model)
        with pytest.raises(InvalidModel) as theirs:
            numpy_plugin.load_network(model)
        assert str(ours.value) == str(theirs.value)


def test_external_data_is_inlined_before_onnxruntime_sees_it(core, tmp_path):
    model = mlp()
    path = tmp_path / "mlp.onnx"
    onnx.save_model(
        mlp(), str(path), save_as_external_data=True, location="weights.bin", size_threshold=0
    )
    x = _input((2, 32))
    want = core.load_network(model, "NUMPY").infer({"x": x})["y"]
    np.testing.assert_allclose(
        core.load_network(str(path), "ORT").infer({"x": x})["y"], want, rtol=1e-4, atol=1e-5
    )


# --------------------------------------------------------------------------- streams and threads


def test_one_session_per_stream_and_round_robin_requests(ort_plugin):

    net = ort_plugin.load_network(mlp(), {"NUM_STREAMS": "3"})
    assert len(net.sessions) == 3 and net.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS") == 3
    assert net.streams * net.threads <= max(available_cores(), net.streams)
    sessions = [net.create_infer_request().session for _ in range(6)]
    assert sessions[:3] == net.sessions and sessions[3:] == net.sessions
    options = net.sessions[0].get_session_options()
    assert options.inter_op_num_threads == 1
    assert options.intra_op_num_threads == net.threads
    throughput = ort_plugin.load_network(mlp(), {"PERFORMANCE_HINT": "THROUGHPUT"})
    assert len(throughput.sessions) == available_cores()
    assert throughput.threads == 1


def test_inference_num_threads_overrides_the_core_count(ort_plugin):
    net = ort_plugin.load_network(mlp(), {"INFERENCE_NUM_THREADS": "4", "NUM_STREAMS": "2"})
    assert net.threads == 2
    assert net.sessions[0].get_session_options().intra_op_num_threads == 2


def _spin_entries(net) -> tuple[str, str]:
    """(allow_spinning, spin_duration_us or "" when unset) of the network's session."""
    options = net.sessions[0].get_session_options()
    entries = []
    for key in ("session.intra_op.allow_spinning", "session.intra_op.spin_duration_us"):
        try:
            entries.append(options.get_session_config_entry(key))
        except RuntimeError:  # not set
            entries.append("")
    return entries[0], entries[1]


def test_idle_threads_spin_only_as_long_as_spin_duration_us_says(ort_plugin, tmp_path):
    from plugserve.plugins.ort import backend

    if not backend.SPIN_BOUNDED:
        net = ort_plugin.load_network(mlp(), {"INFERENCE_NUM_THREADS": "2"})
        assert _spin_entries(net)[0] == "0"  # an onnxruntime without the bound never spins
        pytest.skip(f"onnxruntime {backend.ort.__version__} cannot bound its spinning")
    assert ort_plugin.get_config("SPIN_DURATION_US") == 500
    two = {"INFERENCE_NUM_THREADS": "2"}
    assert _spin_entries(ort_plugin.load_network(mlp(), two)) == ("1", "500")
    assert _spin_entries(ort_plugin.load_network(mlp(), {**two, "SPIN_DURATION_US": "0"}))[0] == "0"
    one = ort_plugin.load_network(mlp(), {"INFERENCE_NUM_THREADS": "1"})
    assert _spin_entries(one)[0] == "0"  # one thread: no pool to spin
    with pytest.raises(InvalidArgument, match=r"SPIN_DURATION_US.*0 to 100000"):
        ort_plugin.load_network(mlp(), {"SPIN_DURATION_US": "100001"})

    def idle_cpu(config) -> float:
        """Process CPU seconds spent while the caller sleeps after each of 6 runs.

        Measured in a fresh process: inside the suite, process_time also counts the threads
        that earlier tests left running (servers, pools), which read 10.5 ms once on CI.
        """
        path = str(tmp_path / "mlp.onnx")
        onnx.save(mlp(), path)
        script = textwrap.dedent(
            f"""
            import time, numpy as np, onnx
            from plugserve.plugins.ort import OrtPlugin
            net = OrtPlugin().load_network(onnx.load({path!r}), {{**{two!r}, **{config!r}}})
            request = net.create_infer_request()
            x = {{"x": np.random.default_rng(1).normal(size=(5, 32)).astype(np.float32)}}
            request.infer(x)
            spent = 0.0
            for _ in range(6):
                request.infer(x)
                start = time.process_time()
                time.sleep(0.3)
                spent += time.process_time() - start
            print(spent)
            """
        )
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        return float(run.stdout.split()[-1])

    # up to 100 ms of spinning after each run shows as CPU while nothing runs (onnxruntime
    # backs off: 0.11-0.15 s in all measured alone); none without it (~0.4 ms in all)
    assert idle_cpu({"SPIN_DURATION_US": "100000"}) > 0.02
    assert idle_cpu({"SPIN_DURATION_US": "0"}) < 0.01


# --------------------------------------------------------------------------- QueryNetwork


def test_query_supports_every_node_of_the_test_models(ort_plugin):
    for build in (small_cnn, mlp, encoder_block):
        model = build()
        assert ort_plugin.query_network(model) == {n.name: "ORT" for n in model.graph.node}


def test_query_with_an_unsupported_custom_op(ort_plugin):
    model = with_custom_op()
    assert ort_plugin.query_network(model) == {"relu": "ORT", "add": "ORT"}
    why = ort_plugin.unsupported_nodes(model)
    assert set(why) == {"scale"} and "com.example::Scale" in why["scale"]
    with pytest.raises(Unsupported, match=r"'scale'.*com\.example::Scale"):
        ort_plugin.load_network(model)


def test_query_checks_input_types_against_the_kernels(ort_plugin):
    """ONNX allows Relu on int64; onnxruntime's CPU provider has no int64 Relu (it has Abs)."""
    model = _model(
        [
            helper.make_node("Abs", ["x"], ["a"], name="abs"),
            helper.make_node("Relu", ["a"], ["y"], name="relu"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
        name="int_relu",
    )
    assert ort_plugin.query_network(model) == {"abs": "ORT"}
    assert "tensor(int64)" in ort_plugin.unsupported_nodes(model)["relu"]
    with pytest.raises(Unsupported, match="'relu'"):
        ort_plugin.load_network(model)


def test_float16_runs_through_onnxruntime_casts(core, ort_plugin):
    """Sin has no float16 CPU kernel, but onnxruntime casts around it: supported."""
    model = _model(
        [helper.make_node("Sin", ["x"], ["y"], name="sin")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4])],
        name="half_sin",
    )
    assert ort_plugin.query_network(model) == {"sin": "ORT"}
    x = np.linspace(-2, 2, 4).astype(np.float16)
    y = core.load_network(model, "ORT").infer({"x": x})["y"]
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, np.sin(x.astype(np.float32)), atol=1e-3)


def test_query_names_unnamed_nodes_like_numpy(ort_plugin, numpy_plugin):
    model = mlp()
    for node in model.graph.node:
        node.name = ""
    assert set(ort_plugin.query_network(model)) == set(numpy_plugin.query_network(model))


def _with_local_function(body_op: str, body_domain: str = "") -> onnx.ModelProto:
    body = [
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node(body_op, ["r"], ["b"], domain=body_domain),
    ]
    opsets = [helper.make_opsetid("", 17)]
    if body_domain:
        opsets.append(helper.make_opsetid(body_domain, 1))
    function = helper.make_function("local", "Block", ["a"], ["b"], body, opsets)
    nodes = [
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Block", ["n"], ["y"], name="block", domain="local"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        name="with_function",
        functions=[function],
        extra_opsets=[helper.make_opsetid("local", 1), *opsets[1:]],
    )


def test_query_counts_a_model_local_function_by_its_calling_node(core, ort_plugin):
    model = _with_local_function("Sigmoid")
    assert ort_plugin.query_network(model) == {"neg": "ORT", "block": "ORT"}
    x = _input((2, 3))
    out = core.load_network(model, "ORT").infer({"x": x})["y"]
    np.testing.assert_allclose(out, 1 / (1 + np.exp(-np.maximum(-x, 0))), rtol=1e-5)
    assert ort_plugin.query_network(_with_local_function("Scale", "com.example")) == {"neg": "ORT"}


def test_query_counts_ops_onnxruntime_expands_as_functions():
    """An op without a kernel but with a function body is supported when its parts are."""
    from plugserve.plugins.ort.query import KernelIndex

    index = KernelIndex()
    index.kernels.pop(("", "Softsign"), None)  # as if onnxruntime had no Softsign kernel
    node = helper.make_node("Softsign", ["x"], ["y"], name="softsign")
    assert index.check(node, {"": 22}, {}) is None
    index.kernels.pop(("", "Abs"), None)  # the body uses Abs: now it cannot be expanded
    assert "Softsign" in index.check(node, {"": 22}, {})


def test_query_ignores_unknown_config_keys(ort_plugin):
    assert ort_plugin.query_network(mlp(), {"NO_SUCH_KEY": "1"})


# --------------------------------------------------------------------------- export and import


def test_export_import_round_trip(core, ort_plugin):
    model = encoder_block()
    net = ort_plugin.load_network(model, {"NUM_STREAMS": "2"})
    data = net.export()
    header, payload = blob.unpack(data, "ORT", ort_plugin.architecture)
    assert header["network_name"] == "encoder_block" and header["config"]["NUM_STREAMS"] == "2"
    onnx.load_from_string(payload)  # the optimized model is plain ONNX
    imported = ort_plugin.import_network(data)
    assert imported.name == net.name and imported.config.get("NUM_STREAMS") == 2
    assert imported.inputs == net.inputs and imported.outputs == net.outputs
    x = _input((2, 6, 16))
    np.testing.assert_allclose(
        imported.infer({"x": x})["y"], net.infer({"x": x})["y"], rtol=1e-5, atol=1e-6
    )
    overridden = ort_plugin.import_network(data, {"NUM_STREAMS": "1"})
    assert overridden.config.get("NUM_STREAMS") == 1 and len(overridden.sessions) == 1
    # the blob also goes through Core (and its cache) unchanged
    assert core.import_network(data, "ORT").infer({"x": x})["y"].shape == (2, 6, 16)


def test_a_network_reads_its_model_file_again_to_export_and_refuses_a_changed_one(
    ort_plugin, tmp_path
):
    """A network holds no copy of its model: an export reads the file again, and a file that
    is no longer what was loaded is refused (the export would not be the network that runs);
    the payload is the model optimized at EXTENDED, as when the network kept it."""
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    net = ort_plugin.load_network(str(path))
    assert not hasattr(net, "model") and all(s._model_bytes is None for s in net.sessions)
    _, payload = blob.unpack(net.export(), "ORT", ort_plugin.architecture)
    assert len(onnx.load_from_string(payload).graph.node) < len(net.node_names)  # fused
    onnx.save(mlp(seed=1), path)
    with pytest.raises(FailedPrecondition, match="changed since the network was loaded"):
        net.export()
    path.unlink()
    with pytest.raises(FailedPrecondition, match="cannot be read again"):
        net.export()
    x = _input((2, 32))
    assert net.infer({"x": x})["y"].shape == (2, 10)  # running needs no file


def test_a_network_loaded_from_bytes_keeps_its_model_in_an_unnamed_file_until_closed(
    ort_plugin, tmp_path, monkeypatch
):
    """No name in any folder: a server killed with such networks loaded leaves nothing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    net = ort_plugin.load_network(mlp().SerializeToString())
    again = ort_plugin.import_network(net.export())
    assert list(tmp_path.iterdir()) == []
    spilled = net.source._file.fileno()
    assert os.readlink(f"/proc/self/fd/{spilled}").endswith("(deleted)")
    x = _input((2, 32))
    np.testing.assert_allclose(again.infer({"x": x})["y"], net.infer({"x": x})["y"], rtol=1e-6)
    net.close()
    with pytest.raises(FailedPrecondition, match="copy of its model cannot be read"):
        net.export()
    again.close()


def test_import_refuses_foreign_blobs(ort_plugin, numpy_plugin):
    numpy_blob = numpy_plugin.load_network(mlp()).export()
    with pytest.raises(InvalidArgument, match="made by device 'NUMPY', not 'ORT'"):
        ort_plugin.import_network(numpy_blob)
    ours = ort_plugin.load_network(mlp()).export()
    header, payload = blob.unpack(ours, "ORT", ort_plugin.architecture)
    other_arch = blob.pack("ORT", "riscv64-ort1", header["config"], payload, {})
    with pytest.raises(InvalidArgument, match="architecture 'riscv64-ort1'"):
        ort_plugin.import_network(other_arch)
    old_format = blob.MAGIC + ours[len(blob.MAGIC) :].replace(
        b'"format_version": 1', b'"format_version": 9', 1
    )
    with pytest.raises(InvalidArgument, match="format version 9"):
        ort_plugin.import_network(old_format)
    with pytest.raises(InvalidArgument, match="bad magic"):
        ort_plugin.import_network(b"not a blob at all")
    extra = {k: header[k] for k in ("network_name", "inputs", "outputs")}
    corrupt = blob.pack("ORT", ort_plugin.architecture, header["config"], b"\x00junk", extra)
    with pytest.raises(InvalidArgument, match="corrupt"):
        ort_plugin.import_network(corrupt)


# --------------------------------------------------------------------------- performance counts


def test_perf_counts(core):
    net = core.load_network(small_cnn(), "ORT", {"PERF_COUNT": "YES"})
    request = net.create_infer_request()
    assert request.get_performance_counts() == []
    x = _input((1, 3, 16, 16))
    request.infer({"x": x})
    request.infer({"x": x})
    counts = request.get_performance_counts()
    ops = [c.op_type for c in counts]
    assert "Gemm" in ops and "Softmax" in ops and len(ops) == len(set(c.node_name for c in counts))
    assert all(c.status == "EXECUTED" and c.device == "ORT" and c.real_time_s >= 0 for c in counts)
    assert ("softmax",) in [c.original_names for c in counts]
    assert ("conv1",) in [c.original_names for c in counts]  # a renamed NCHWc Conv
    assert request.get_performance_counts() == counts  # no run since: the same counts
    profiles = [n for n in os.listdir(tempfile.gettempdir()) if "ort-profile" in n]
    assert not profiles  # the profile file and its folder are removed once read
    request.start_async({"x": x})  # the profiling session is rebuilt for the next run
    request.wait()
    again = request.get_performance_counts()
    assert again is not counts and {c.node_name for c in again} == {c.node_name for c in counts}


def test_perf_counts_off_by_default(core):
    request = core.load_network(mlp(), "ORT").create_infer_request()
    request.infer({"x": _input((1, 32))})
    with pytest.raises(FailedPrecondition, match="PERF_COUNT=YES"):
        request.get_performance_counts()


def test_parse_profile_keeps_the_last_run_only():
    from plugserve.plugins.ort.request import parse_profile

    events = [
        {"cat": "Node", "name": "a_kernel_time", "ts": 10, "dur": 5, "args": {"op_name": "Relu"}},
        {"cat": "Session", "name": "model_run", "ts": 9, "dur": 20},
        {
            "cat": "Node",
            "name": "a_kernel_time",
            "ts": 40,
            "dur": 7,
            "args": {"op_name": "Relu", "provider": "CPUExecutionProvider"},
        },
        {"cat": "Node", "name": "a_fence_before", "ts": 41, "dur": 1, "args": {}},
        {"cat": "Session", "name": "model_run", "ts": 39, "dur": 20},
    ]
    (count,) = parse_profile(events, lambda name: (name,) if name == "a" else ())
    assert count.node_name == "a" and count.op_type == "Relu" and count.original_names == ("a",)
    assert count.real_time_s == pytest.approx(7e-6)


# --------------------------------------------------------------------------- config and metrics


def test_seed_config_and_metric_rules(ort_plugin):
    with pytest.raises(InvalidArgument, match="unsupported config key 'NO_SUCH_KEY'"):
        ort_plugin.set_config({"NO_SUCH_KEY": "1"})
    with pytest.raises(InvalidArgument, match=r"GRAPH_OPTIMIZATION_LEVEL.*'MAX'"):
        ort_plugin.set_config({"GRAPH_OPTIMIZATION_LEVEL": "MAX"})
    with pytest.raises(InvalidArgument, match=r"PERF_COUNT.*'maybe'"):
        ort_plugin.set_config({"PERF_COUNT": "maybe"})
    assert ort_plugin.get_config("PERF_COUNT") is False
    assert ort_plugin.get_config("GRAPH_OPTIMIZATION_LEVEL") == "ALL"
    with pytest.raises(InvalidArgument, match="NO_SUCH_KEY"):
        ort_plugin.get_config("NO_SUCH_KEY")
    with pytest.raises(InvalidArgument, match="NO_SUCH_KEY"):
        ort_plugin.load_network(mlp(), {"NO_SUCH_KEY": "1"})
    with pytest.raises(NotFound, match="unsupported metric 'NO_SUCH_METRIC'"):
        ort_plugin.get_metric("NO_SUCH_METRIC")
    net = ort_plugin.load_network(mlp())
    with pytest.raises(NotFound, match="NO_SUCH_METRIC"):
        net.get_metric("NO_SUCH_METRIC")
    with pytest.raises(InvalidArgument):
        net.get_config("NO_SUCH_KEY")


def test_metrics_have_real_values(ort_plugin):
    import onnxruntime

    metrics = ort_plugin.get_metric("SUPPORTED_METRICS")
    for name in metrics:
        ort_plugin.get_metric(name)
    full = ort_plugin.get_metric("FULL_DEVICE_NAME")
    assert f"onnxruntime {onnxruntime.__version__} CPUExecutionProvider" in full
    arch = ort_plugin.get_metric("DEVICE_ARCHITECTURE")
    assert arch.endswith(f"-ort{onnxruntime.__version__.split('.')[0]}")
    keys = ort_plugin.get_metric("SUPPORTED_CONFIG_KEYS")
    assert {"PERF_COUNT", "NUM_STREAMS", "GRAPH_OPTIMIZATION_LEVEL", "CACHE_DIR"} <= set(keys)
    assert ort_plugin.get_metric("IMPORT_EXPORT_SUPPORT") is True
    assert ort_plugin.get_metric("RANGE_FOR_STREAMS") == (1, available_cores())
    assert "LayerNormalization" in ort_plugin.get_metric("SUPPORTED_OPS")
    assert "FP32" in ort_plugin.get_metric("OPTIMIZATION_CAPABILITIES")
    net = ort_plugin.load_network(mlp())
    assert net.get_metric("NETWORK_NAME") == "mlp"


def test_per_call_config_overrides_plugin_config(ort_plugin):
    ort_plugin.set_config({"PERF_COUNT": "NO", "NUM_STREAMS": "2", "INFERENCE_NUM_THREADS": "2"})
    net = ort_plugin.load_network(mlp(), {"PERF_COUNT": "YES", "NUM_STREAMS": "1"})
    assert net.get_config("PERF_COUNT") is True and net.get_config("NUM_STREAMS") == 1
    assert len(net.sessions) == 1 and net.threads == 2  # the plugin's thread budget is kept
    assert ort_plugin.get_config("PERF_COUNT") is False  # the plugin is unchanged
    assert ort_plugin.get_config("NUM_STREAMS") == 2
    assert len(ort_plugin.load_network(mlp()).sessions) == 2


# --------------------------------------------------------------------------- availability


def _devices_with_fake_onnxruntime(tmp_path, body: str) -> dict:
    fake = tmp_path / "fake" / "onnxruntime"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent(body))
    script = (
        "import json; from plugserve.server import Core; "
        "print(json.dumps({d.name: [d.available, d.reason] for d in Core().devices()}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_unavailable_when_onnxruntime_cannot_be_imported(tmp_path):
    devices = _devices_with_fake_onnxruntime(
        tmp_path, 'raise ImportError("onnxruntime is broken here")\n'
    )
    available, reason = devices["ORT"]
    assert not available
    assert "BackendUnavailable" in reason and "onnxruntime is broken here" in reason
    assert devices["NUMPY"][0]


def test_unavailable_without_the_cpu_provider(tmp_path):
    devices = _devices_with_fake_onnxruntime(
        tmp_path,
        """
        __version__ = "0.0.1"

        def get_available_providers():
            return ["AzureExecutionProvider"]
        """,
    )
    available, reason = devices["ORT"]
    assert not available and "no CPUExecutionProvider" in reason


# --------------------------------------------------------------------------- through a server


def test_load_and_infer_through_a_real_server(server):
    from plugserve.client import Client

    model = encoder_block()
    x = _input((2, 6, 16))
    with Client(server.target, timeout=120) as client:
        devices = {d.name: d for d in client.devices()}
        assert devices["ORT"].available and "onnxruntime" in devices["ORT"].full_name
        response = client.load("ort_encoder", model.SerializeToString(), device="ORT")
        assert response.network.device == "ORT" and response.network.inputs[0].name == "x"
        from plugserve.server import Core

        want = Core().load_network(model, "NUMPY").infer({"x": x})["y"]
        np.testing.assert_allclose(
            client.infer("ort_encoder", {"x": x})["y"], want, rtol=1e-4, atol=1e-4
        )
        client.unload("ort_encoder")


def test_cache_dir_reuses_the_export(core, tmp_path):
    model = small_cnn()
    x = _input((1, 3, 16, 16))
    first = core.load_network(model, "ORT", {"CACHE_DIR": str(tmp_path)})
    assert not first.loaded_from_cache and os.listdir(tmp_path)
    second = core.load_network(model, "ORT", {"CACHE_DIR": str(tmp_path)})
    assert second.loaded_from_cache
    np.testing.assert_allclose(second.infer({"x": x})["probs"], first.infer({"x": x})["probs"])


def test_the_plugin_imports_no_server_code():
    script = (
        "import sys, plugserve.plugins.ort as o; o.OrtPlugin(); "
        "print(sorted(m for m in sys.modules if m.startswith('plugserve.server')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _normalizer(**attrs) -> bytes:
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("StringNormalizer", ["x"], ["y"], name="norm", **attrs)],
            "text",
            [helper.make_tensor_value_info("x", TensorProto.STRING, ["n"])],
            [helper.make_tensor_value_info("y", TensorProto.STRING, ["n"])],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize("attrs", [{}, {"locale": "xx_XX.UTF-8"}])
def test_a_string_normalizer_whose_locale_is_missing_still_loads(core, attrs, caplog):
    """onnxruntime fails the whole load when the node's locale (default en_US.UTF-8) is not
    generated, as on a fresh Debian image; ORT runs it with C.UTF-8 and says how to install
    the real one. (xx_XX exists nowhere, so that case runs on every machine.)"""
    from plugserve.plugins.ort import locales

    wanted = attrs.get("locale", locales.DEFAULT)
    if locales.available(wanted):
        pytest.skip(f"this machine has {wanted}: nothing to fall back from")
    if not locales.available(locales.FALLBACK):
        with pytest.raises(Unsupported, match="locale-gen"):
            core.load_network(_normalizer(case_change_action="LOWER", **attrs), "ORT")
        return
    with caplog.at_level("WARNING", logger="plugserve.plugins.ort.locales"):
        network = core.load_network(_normalizer(case_change_action="LOWER", **attrs), "ORT")
    try:
        out = network.create_infer_request().infer(
            {"x": np.array(["\u00c9COLE", "\u0391\u0392\u0393", "Cat"], dtype=object)}
        )
        assert out["y"].tolist() == ["\u00e9cole", "\u03b1\u03b2\u03b3", "cat"]
        # an export carries the fallback; importing it needs no locale either
        again = core.import_network(network.export(), "ORT")
        assert (
            again.create_infer_request().infer({"x": np.array(["A"], dtype=object)})["y"][0] == "a"
        )
        again.close()
    finally:
        network.close()
    assert f"asks for the {wanted} locale" in caplog.text and "locale-gen" in caplog.text
