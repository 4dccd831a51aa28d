"""HETERO: affinity, the seed's split, tensors passed between devices, errors, export."""

from __future__ import annotations

import json

import numpy as np
import pytest
from models import _init, _model, mlp, small_cnn, with_custom_op
from onnx import TensorProto, helper

from plugserve.plugins.api import FailedPrecondition, InvalidArgument, NotFound
from plugserve.plugins.numpy import Extension, NumpyPlugin
from plugserve.server import Core


class SecondPlugin(NumpyPlugin):
    """A second real device: NUMPY's kernels under another name."""

    name = "SECOND"


@pytest.fixture(scope="module")
def core():
    return Core(plugins={"SECOND": SecondPlugin})


def seed_graph():
    """The graph of seed 000: 1-2, 2-3, 2-4, 3-5, 4-5, 5-6, 6-7 (node names are the numbers)."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a1"], name="1"),
        helper.make_node("Sigmoid", ["a1"], ["a2"], name="2"),
        helper.make_node("Relu", ["a2"], ["a3"], name="3"),
        helper.make_node("Neg", ["a2"], ["a4"], name="4"),
        helper.make_node("Add", ["a3", "a4"], ["a5"], name="5"),
        helper.make_node("Tanh", ["a5"], ["a6"], name="6"),
        helper.make_node("Mul", ["a6", "two"], ["y"], name="7"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [_init("two", np.full((1,), 2, np.float32))],
        name="seed",
    )


def test_the_seed_example_splits_exactly_as_the_seed_says(core):
    net = core.load_network(
        seed_graph(), "HETERO:NUMPY,SECOND", {"AFFINITY": json.dumps({"4": "SECOND"})}
    )
    subgraphs = net.get_metric("HETERO_SUBGRAPHS")
    by_device = {}
    for s in subgraphs:
        by_device.setdefault(s["device"], []).append(sorted(s["nodes"]))
    assert sorted(by_device["NUMPY"]) == [["1", "2"], ["3", "5", "6", "7"]]
    assert by_device["SECOND"] == [["4"]]
    assert [s["device"] for s in subgraphs] == ["NUMPY", "SECOND", "NUMPY"]  # execution order
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    single = core.load_network(seed_graph(), "NUMPY").infer({"x": x})["y"]
    np.testing.assert_allclose(net.infer({"x": x})["y"], single, rtol=1e-6)


def test_affinity_from_node_metadata(core):
    model = seed_graph()
    entry = model.graph.node[3].metadata_props.add()
    entry.key, entry.value = "affinity", "SECOND"
    net = core.load_network(model, "HETERO:NUMPY,SECOND")
    assert {"device": "SECOND", "nodes": ["4"]} in net.get_metric("HETERO_SUBGRAPHS")


@pytest.mark.parametrize("model_fn", [small_cnn, mlp])
def test_forced_splits_give_single_device_results(core, model_fn):
    model = model_fn()
    names = [n.name for n in model.graph.node]
    affinity = {name: ("SECOND" if i % 2 else "NUMPY") for i, name in enumerate(names)}
    net = core.load_network(model, "HETERO:NUMPY,SECOND", {"AFFINITY": json.dumps(affinity)})
    assert len(net.get_metric("HETERO_SUBGRAPHS")) == len(names)
    shape = [d.dim_value or 2 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    name = model.graph.input[0].name
    expected = core.load_network(model, "NUMPY").infer({name: x})
    got = net.infer({name: x})
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6)
    request = net.create_infer_request()
    request.start_async({name: x})
    for key, value in request.wait(timeout=60).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-5, atol=1e-6)


def test_query_by_priority_and_custom_op_on_the_device_that_has_it(core):
    second = core.plugin("SECOND")
    second.add_extension(Extension("com.example", "Scale", lambda x: x * 2.5, infer=lambda x: x))
    model = with_custom_op()
    assert core.query_network(model, "HETERO:NUMPY,SECOND") == {
        "relu": "NUMPY",
        "scale": "SECOND",
        "add": "NUMPY",
    }
    net = core.load_network(model, "HETERO:NUMPY,SECOND")
    assert [s["device"] for s in net.get_metric("HETERO_SUBGRAPHS")] == ["NUMPY", "SECOND", "NUMPY"]
    x = np.array([[-1, 0, 1], [2, -3, 4]], np.float32)
    np.testing.assert_allclose(net.infer({"x": x})["y"], np.maximum(x, 0) * 2.5 + 1)


def test_node_supported_by_no_device_is_refused_by_name(core):
    with pytest.raises(InvalidArgument, match=r"no device in NUMPY supports node\(s\) 'scale'"):
        core.load_network(with_custom_op("org.unknown"), "HETERO:NUMPY")


def test_affinity_naming_a_missing_node_or_device(core):
    with pytest.raises(NotFound, match="'nope'"):
        core.load_network(seed_graph(), "HETERO:NUMPY,SECOND", {"AFFINITY": '{"nope": "NUMPY"}'})
    with pytest.raises(NotFound, match="GPU"):
        core.load_network(seed_graph(), "HETERO:NUMPY,SECOND", {"AFFINITY": '{"4": "GPU"}'})
    with pytest.raises(InvalidArgument, match="AFFINITY"):
        core.load_network(seed_graph(), "HETERO:NUMPY", {"AFFINITY": "[1, 2]"})
    with pytest.raises(NotFound, match="GPU"):
        core.load_network(seed_graph(), "HETERO:NUMPY,GPU")


def test_perf_counts_name_the_device_of_each_node(core):
    net = core.load_network(
        seed_graph(),
        "HETERO:NUMPY,SECOND",
        {"AFFINITY": json.dumps({"4": "SECOND"}), "PERF_COUNT": "YES"},
    )
    request = net.create_infer_request()
    request.infer({"x": np.ones((2, 3), np.float32)})
    counts = request.get_performance_counts()
    subgraphs = [c for c in counts if c.op_type == "Subgraph"]
    assert [c.device for c in subgraphs] == ["NUMPY", "SECOND", "NUMPY"]
    nodes = {n: c.device for c in counts if c.op_type != "Subgraph" for n in c.original_names}
    assert nodes["4"] == "SECOND" and nodes["1"] == "NUMPY" and nodes["7"] == "NUMPY"
    plain = core.load_network(seed_graph(), "HETERO:NUMPY").create_infer_request()
    with pytest.raises(FailedPrecondition):
        plain.get_performance_counts()


def test_export_import(core):
    affinity = {"AFFINITY": json.dumps({"4": "SECOND"})}
    net = core.load_network(seed_graph(), "HETERO:NUMPY,SECOND", affinity)
    again = core.import_network(net.export(), "HETERO")
    x = np.ones((2, 3), np.float32)
    assert np.array_equal(net.infer({"x": x})["y"], again.infer({"x": x})["y"])
    assert again.get_metric("HETERO_SUBGRAPHS") == net.get_metric("HETERO_SUBGRAPHS")
    with pytest.raises(InvalidArgument, match="made by device 'NUMPY'"):
        core.import_network(core.load_network(mlp(), "NUMPY").export(), "HETERO")


def _need(core, *devices):
    missing = [d for d in devices if d not in core.available_devices]
    if missing:
        pytest.skip(f"device(s) {missing} not available here")


@pytest.mark.parametrize("model_fn", [small_cnn, mlp])
def test_split_across_numpy_ort_and_openvino_matches_single_device(core, model_fn):
    _need(core, "ORT", "OPENVINO")
    model = model_fn()
    devices = ["NUMPY", "ORT", "OPENVINO"]
    affinity = {n.name: devices[i % 3] for i, n in enumerate(model.graph.node)}
    config = {"AFFINITY": json.dumps(affinity), "EXECUTION_MODE_HINT": "ACCURACY"}
    net = core.load_network(model, "HETERO:NUMPY,ORT,OPENVINO", config)
    used = {s["device"] for s in net.get_metric("HETERO_SUBGRAPHS")}
    assert used == set(devices)
    name = model.graph.input[0].name
    shape = [d.dim_value or 3 for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    expected = core.load_network(model, "NUMPY").infer({name: x})
    for key, value in net.infer({name: x}).items():
        np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-5)


def test_custom_op_runs_on_numpy_and_the_rest_on_ort():
    core = Core()
    _need(core, "ORT")
    core.add_extension(
        Extension("com.example", "Scale", lambda x: x * 2.5, infer=lambda x: x), "NUMPY"
    )
    model = with_custom_op()
    assert core.query_network(model, "HETERO:ORT,NUMPY") == {
        "relu": "ORT",
        "scale": "NUMPY",
        "add": "ORT",
    }
    net = core.load_network(model, "HETERO:ORT,NUMPY")
    assert net.get_metric("HETERO_SUBGRAPHS") == [
        {"device": "ORT", "nodes": ["relu"]},
        {"device": "NUMPY", "nodes": ["scale"]},
        {"device": "ORT", "nodes": ["add"]},
    ]
    x = np.array([[-1, 0, 1], [2, -3, 4]], np.float32)
    np.testing.assert_allclose(net.infer({"x": x})["y"], np.maximum(x, 0) * 2.5 + 1)
