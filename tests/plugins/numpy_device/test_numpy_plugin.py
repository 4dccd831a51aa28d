"""NUMPY as a device: QueryNetwork, export/import, extensions."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import pytest
from models import mlp, small_cnn, with_custom_op

from plugserve.plugins import blob
from plugserve.plugins.api import InvalidArgument, Unsupported
from plugserve.plugins.numpy import Extension


def test_query_reports_every_original_node_even_after_fusion(numpy_plugin):
    model = small_cnn()
    result = numpy_plugin.query_network(model)
    assert result == {n.name: "NUMPY" for n in model.graph.node}


def test_query_with_an_unsupported_custom_op(numpy_plugin):
    model = with_custom_op()
    result = numpy_plugin.query_network(model)
    assert result == {"relu": "NUMPY", "add": "NUMPY"}  # 'scale' has no kernel
    why = numpy_plugin.unsupported_nodes(model)
    assert set(why) == {"scale"} and "Scale" in why["scale"]
    with pytest.raises(Unsupported, match=r"'scale'.*Scale.*com\.example"):
        numpy_plugin.load_network(model)


def _scale_extension(calls=None):
    def build(ctx):
        factor = np.float32(ctx.attr("factor"))

        def run(x):
            if calls is not None:
                calls.append(x.shape)
            return x * factor

        return run

    return Extension("com.example", "Scale", build, builder=True, infer=lambda x: (x[0], x[1]))


def test_extension_makes_the_custom_op_supported_and_runnable(numpy_plugin):
    calls = []
    numpy_plugin.add_extension(_scale_extension(calls))
    model = with_custom_op()
    assert set(numpy_plugin.query_network(model)) == {"relu", "scale", "add"}
    net = numpy_plugin.load_network(model)
    x = np.array([[-1, 0, 1], [2, -3, 4]], np.float32)
    out = net.infer({"x": x})["y"]
    np.testing.assert_allclose(out, np.maximum(x, 0) * 2.5 + 1)
    assert calls == [(2, 3)]
    assert "com.example::Scale" in numpy_plugin.get_metric("SUPPORTED_OPS")


def test_extension_as_a_plain_function(numpy_plugin):
    numpy_plugin.add_extension(Extension("com.example", "Scale", lambda x: x * 3))
    out = numpy_plugin.load_network(with_custom_op()).infer({"x": np.ones((2, 3), np.float32)})
    assert np.array_equal(out["y"], np.full((2, 3), 4, np.float32))


def test_extension_output_type_rule_feeds_shape_inference(numpy_plugin):
    numpy_plugin.add_extension(_scale_extension())
    net = numpy_plugin.load_network(with_custom_op())
    assert net.transformed.spec("s").shape == (2, 3)


def test_extensions_stay_with_their_plugin(numpy_plugin):
    from plugserve.plugins.numpy import NumpyPlugin

    numpy_plugin.add_extension(_scale_extension())
    with pytest.raises(Unsupported):
        NumpyPlugin().load_network(with_custom_op())


def test_add_extension_refuses_other_objects(numpy_plugin):
    with pytest.raises(InvalidArgument, match="Extension"):
        numpy_plugin.add_extension(lambda x: x)


def test_export_import_round_trip(numpy_plugin):
    model = small_cnn()
    net = numpy_plugin.load_network(model, {"PERF_COUNT": "YES"})
    data = net.export()
    assert data.startswith(blob.MAGIC)
    again = numpy_plugin.import_network(data)
    assert again.get_config("PERF_COUNT") is True  # the exported config comes back
    assert [i.name for i in again.inputs] == ["x"] and again.name == net.name
    x = np.random.default_rng(0).normal(size=(1, 3, 16, 16)).astype(np.float32)
    assert np.array_equal(net.infer({"x": x})["probs"], again.infer({"x": x})["probs"])
    assert [n.fused_names for n in again.transformed.nodes] == [
        n.fused_names for n in net.transformed.nodes
    ]


def _reheader(data: bytes, **changes) -> bytes:
    (length,) = struct.unpack_from("<I", data, len(blob.MAGIC))
    start = len(blob.MAGIC) + 4
    header = json.loads(data[start : start + length])
    header.update(changes)
    raw = json.dumps(header).encode()
    return blob.MAGIC + struct.pack("<I", len(raw)) + raw + data[start + length :]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"plugin": "ORT"}, "made by device 'ORT', not 'NUMPY'"),
        ({"device_architecture": "riscv64-numpy1"}, "architecture 'riscv64-numpy1'"),
        ({"format_version": 99}, "format version 99"),
    ],
)
def test_import_refuses_foreign_blobs(numpy_plugin, change, message):
    data = numpy_plugin.load_network(mlp()).export()
    with pytest.raises(InvalidArgument, match=message):
        numpy_plugin.import_network(_reheader(data, **change))


def test_import_refuses_garbage_and_truncation(numpy_plugin):
    data = numpy_plugin.load_network(mlp()).export()
    with pytest.raises(InvalidArgument, match="magic"):
        numpy_plugin.import_network(b"hello world, not a blob")
    with pytest.raises(InvalidArgument, match=r"truncated|corrupt"):
        numpy_plugin.import_network(data[:20])
    with pytest.raises(InvalidArgument, match="corrupt"):
        numpy_plugin.import_network(data[: len(data) - 100] + b"\xff" * 7)


def _constant_model(consumer_domain: str):
    from onnx import TensorProto, helper

    consumer = (
        helper.make_node("Scale", ["x", "c"], ["y"], name="consumer", domain="com.example")
        if consumer_domain
        else helper.make_node("Add", ["x", "c"], ["y"], name="consumer")
    )
    graph = helper.make_graph(
        [
            helper.make_node(
                "Constant",
                [],
                ["c"],
                name="const",
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [2.0]),
            ),
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


@pytest.mark.parametrize("transformations", ["YES", "NO"])
def test_query_housekeeping_constants_follow_their_reader(numpy_plugin, transformations):
    config = {"DISABLE_TRANSFORMATIONS": "NO" if transformations == "YES" else "YES"}
    assert set(numpy_plugin.query_network(_constant_model(""), config)) == {
        "const",
        "consumer",
        "other",
    }
    # the Constant's only reader is unsupported: the Constant is pruned, not left alone
    assert set(numpy_plugin.query_network(_constant_model("com.example"), config)) == {"other"}


def test_streams_share_out_the_cores_as_gemm_threads(core):
    """THROUGHPUT's streams split their GEMMs over cores // streams threads each, a LATENCY
    network over all the cores, INFERENCE_NUM_THREADS=1 over none (by NUMPY's own split, or
    OpenBLAS's threads where the load timed those faster), and the results are the same
    every way."""
    from plugserve.plugins.api import available_cores
    from plugserve.plugins.numpy import blas

    cores = available_cores()
    model = mlp(seed=3, sizes=(256, 512, 512, 10)).SerializeToString()
    x = np.random.default_rng(0).random((64, 256), dtype=np.float32)
    throughput = core.load_network(model, "NUMPY", {"NUM_STREAMS": "2"})
    latency = core.load_network(model, "NUMPY", {"PERFORMANCE_HINT": "LATENCY"})
    budget = core.load_network(model, "NUMPY", {"INFERENCE_NUM_THREADS": "1"})
    assert latency.gemm_threads == cores
    assert throughput.gemm_threads == max(1, cores // 2)
    assert budget.gemm_threads == 1
    expected = budget.create_infer_request().infer({"x": x})["y"]
    requests = [throughput.create_infer_request() for _ in range(4)]
    for r in requests:
        r.start_async({"x": x})
    for r in requests:
        np.testing.assert_allclose(r.wait()["y"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        latency.create_infer_request().infer({"x": x})["y"], expected, rtol=1e-5, atol=1e-6
    )
    if blas.openblas is not None:  # the last run was the LATENCY network's, either way
        assert blas.thread_count() in (1, latency.gemm_threads)


def test_a_network_without_gemms_it_splits_leaves_openblas_its_threads(core):
    """NUMPY pins OpenBLAS to one thread only for networks whose GEMMs it splits itself: one
    with none of those (an LSTM's GEMMs, Einsum, or none at all) runs OpenBLAS on its width,
    as before NUMPY split anything (it ran on one thread after a split network had run)."""
    from models import chain

    from plugserve.plugins.api import available_cores
    from plugserve.plugins.numpy import blas

    if blas.openblas is None or available_cores() < 2:
        pytest.skip("needs numpy on OpenBLAS and 2 cores")
    config = {"INFERENCE_NUM_THREADS": "2"}
    split = core.load_network(mlp(), "NUMPY", {**config, "KERNEL_TUNING": "NO"})
    plain = core.load_network(chain([("Relu", {})]).SerializeToString(), "NUMPY", config)
    split.create_infer_request().infer({"x": np.ones((5, 32), np.float32)})
    assert blas.thread_count() == 1  # the split network's own GEMMs are split by NUMPY
    plain.create_infer_request().infer({"x": np.ones((2, 3, 4), np.float32)})
    assert blas.thread_count() == 2


def test_ieee_results_are_not_warnings(numpy_plugin):
    """log(0) = -inf and a cast of -inf to int64 are ONNX results (T5's position buckets compute
    both, then mask them with Where); neither may warn, top level or inside a Loop body."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c"], ["c_out"]),
            helper.make_node("Log", ["x_in"], ["logged"]),
            helper.make_node("Cast", ["logged"], ["as_int"], to=TensorProto.INT64),
            helper.make_node("Cast", ["as_int"], ["x_out"], to=TensorProto.FLOAT),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, [2]),
        ],
        [
            helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, [2]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Loop", ["n", "", "x"], ["looped"], body=body),
            helper.make_node("Div", ["x", "x"], ["ratio"]),
        ],
        "ieee",
        [
            helper.make_tensor_value_info("n", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
        ],
        [
            helper.make_tensor_value_info("looped", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("ratio", TensorProto.FLOAT, [2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    net = numpy_plugin.load_network(model)
    feeds = {"n": np.array(1, np.int64), "x": np.array([0.0, 1.0], np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = net.infer(feeds)
    assert out["looped"][0] == np.float32(np.iinfo(np.int64).min) and out["looped"][1] == 0
    assert np.isnan(out["ratio"][0]) and out["ratio"][1] == 1
