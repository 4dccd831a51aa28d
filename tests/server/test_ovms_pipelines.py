"""OVMS's DAG pipelines (issue 36): a real server loads an OVMS ``config.json`` whose
``pipeline_config_list`` chains its ``model_config_list`` models (OPENVINO, as OVMS serves
them), and KServe clients (tritonclient, gRPC and HTTP) call the pipeline as any model:
metadata from the connected models, a diamond of nodes, per-node versions, an output read
from the middle of the graph, only the nodes the requested outputs need. Pipelines that are
wrong (a custom node, demultiplexing, a node reading what nothing writes, a cycle) are refused
naming the node, while the others serve."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
pytest.importorskip("openvino", reason="pip install -e '.[openvino]'")


def _unary(op: str, constant: float, name: str, shape=(1, 4)) -> onnx.ModelProto:
    """``out = in <op> constant`` over float32 ``shape``, input and output named for it."""
    graph = helper.make_graph(
        [helper.make_node(op, [f"{name}_in", "c"], [f"{name}_out"])],
        name,
        [helper.make_tensor_value_info(f"{name}_in", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor("c", TensorProto.FLOAT, [1], [constant])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _sub() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Sub", ["a", "b"], ["d"])],
        "sub",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _total() -> onnx.ModelProto:
    """The sum over the first dimension: [n, 1, 4] -> [1, 4]."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["parts", "axis"], ["total"], keepdims=0)],
        "total",
        [helper.make_tensor_value_info("parts", TensorProto.FLOAT, ["n", 1, 4])],
        [helper.make_tensor_value_info("total", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("axis", TensorProto.INT64, [1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _source(node: str, item: str) -> dict:
    return {"node_name": node, "data_item": item}


def _node(name: str, model: str, inputs: dict, outputs: dict, **extra) -> dict:
    return {
        "name": name,
        "model_name": model,
        "type": "DL model",
        "inputs": [{k: v} for k, v in inputs.items()],
        "outputs": [{"data_item": k, "alias": v} for k, v in outputs.items()],
        **extra,
    }


#: request -> plus (x+1), times (x*2) at once -> minus (plus - times); also plus's own output
DIAMOND = {
    "name": "diamond",
    "inputs": ["x"],
    "nodes": [
        _node("plus", "add", {"add_in": _source("request", "x")}, {"add_out": "sum"}),
        _node(
            "times", "mul", {"mul_in": _source("request", "x")}, {"mul_out": "product"},
            version=1,
        ),
        _node(
            "minus", "sub",
            {"a": _source("plus", "sum"), "b": _source("times", "product")}, {"d": "diff"},
        ),
    ],
    "outputs": [{"difference": _source("minus", "diff")}, {"plus_one": _source("plus", "sum")}],
}  # fmt: skip


#: OVMS's demultiplexing: split (x + 1 over [3, 1, 4]) runs per branch "each" (mul at version
#: 1: x * 2 over [1, 4]), gathered at the response into [3, 1, 4]
BRANCHES = {
    "name": "branches",
    "inputs": ["x"],
    "nodes": [
        _node("split", "split3", {"split3_in": _source("request", "x")}, {"split3_out": "items"},
              demultiply_count=3),
        _node("each", "mul", {"mul_in": _source("split", "items")}, {"mul_out": "product"},
              version=1),
    ],
    "outputs": [{"y": _source("each", "product")}],
}  # fmt: skip
#: as many branches as the request's first dimension (-1), gathered by a node that sums them
GATHERED = {
    "name": "gathered",
    "inputs": ["x"],
    "nodes": [
        _node("split", "split_any", {"split_any_in": _source("request", "x")},
              {"split_any_out": "items"}, demultiply_count=-1),
        _node("each", "mul", {"mul_in": _source("split", "items")}, {"mul_out": "product"},
              version=1),
        _node("sum", "total", {"parts": _source("each", "product")}, {"total": "total"},
              gather_from_node="split"),
    ],
    "outputs": [{"total": _source("sum", "total")}, {"items": _source("split", "items")}],
}  # fmt: skip


def _refused(name: str, node: dict) -> dict:
    return {
        "name": name,
        "inputs": ["x"],
        "nodes": [node],
        "outputs": [{"y": _source(node["name"], "y")}],
    }


REFUSED = [
    (
        _refused(
            "custom",
            {
                "name": "resize",
                "library_name": "lib",
                "type": "custom",
                "params": {"a": "1"},
                "inputs": [{"image": _source("request", "x")}],
                "outputs": [{"data_item": "image", "alias": "y"}],
            },
        ),
        "node 'resize': type 'custom': custom nodes are C++ libraries",
    ),
    (
        _refused(
            "demux",
            _node(
                "n",
                "add",
                {"add_in": _source("request", "x")},
                {"add_out": "y"},
                demultiply_count=4,
            ),
        ),
        "node 'n': demultiply_count, but no node reads its outputs",
    ),
    (
        _refused(
            "dangling", _node("n", "add", {"add_in": _source("ghost", "z")}, {"add_out": "y"})
        ),
        "node 'n': input 'add_in': reads node 'ghost', which the pipeline does not have",
    ),
    (
        _refused(
            "unknown_model", _node("n", "nowhere", {"x": _source("request", "x")}, {"y": "y"})
        ),
        "model_name 'nowhere' is not a model of model_config_list",
    ),
    (
        _refused(
            "gather_nothing",
            _node(
                "n",
                "add",
                {"add_in": _source("request", "x")},
                {"add_out": "y"},
                gather_from_node="request",
            ),
        ),
        "node 'n': gather_from_node 'request' names no node with demultiply_count",
    ),
    (
        {
            "name": "loop",
            "inputs": ["x"],
            "nodes": [
                _node(
                    "a",
                    "sub",
                    {"a": _source("request", "x"), "b": _source("b", "out")},
                    {"d": "out"},
                ),
                _node("b", "add", {"add_in": _source("a", "out")}, {"add_out": "out"}),
            ],
            "outputs": [{"y": _source("b", "out")}],
        },
        "pipeline 'loop': its steps form a cycle",
    ),
]


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from serving import RunningServer

    root: Path = tmp_path_factory.mktemp("ovms")
    models = {"add": [_unary("Add", 1.0, "add")], "sub": [_sub()], "total": [_total()]}
    models["split3"] = [_unary("Add", 1.0, "split3", (3, 1, 4))]
    models["split_any"] = [_unary("Add", 1.0, "split_any", ("n", 1, 4))]
    # two versions of mul: the pipeline pins version 1 (x*2), the latest is version 2 (x*3)
    models["mul"] = [_unary("Mul", 2.0, "mul"), _unary("Mul", 3.0, "mul")]
    config_list = []
    for name, versions in models.items():
        for number, model in enumerate(versions, start=1):
            (root / name / str(number)).mkdir(parents=True)
            onnx.save(model, root / name / str(number) / "model.onnx")
        policy = {"model_version_policy": {"all": {}}} if len(versions) > 1 else {}
        config_list.append({"config": {"name": name, "base_path": name, **policy}})
    pipelines = [DIAMOND, BRANCHES, GATHERED, *(p for p, _ in REFUSED)]
    config = {"model_config_list": config_list, "pipeline_config_list": pipelines}
    (root / "config.json").write_text(json.dumps(config, indent=1))
    with RunningServer("--model-repository", str(root / "config.json"),
                       "--exit-on-error", "0") as server:  # fmt: skip
        yield server


X = np.array([[1, 2, 3, 4]], np.float32)


def _client(running, protocol):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(running.target)
    return httpclient, httpclient.InferenceServerClient(running.http_target)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_pipeline_answers_as_its_nodes_compute(running, protocol):
    module, client = _client(running, protocol)
    try:
        assert client.is_model_ready("diamond")
        tensor = module.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(X)
        result = client.infer("diamond", [tensor])
        # minus = (x + 1) - x * 2 with mul pinned at version 1 (version 2 would give x * 3)
        np.testing.assert_allclose(result.as_numpy("difference"), (X + 1) - X * 2)
        np.testing.assert_allclose(result.as_numpy("plus_one"), X + 1)
    finally:
        client.close()


def test_its_metadata_comes_from_the_connected_models(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        meta = client.get_model_metadata("diamond")
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [1, 4])]
        assert sorted((t.name, t.datatype) for t in meta.outputs) == [
            ("difference", "FP32"),
            ("plus_one", "FP32"),
        ]
    finally:
        client.close()


def _count(client, model: str, version: str = "") -> int:
    stats = client.get_inference_statistics(model_name=model, model_version=version)
    return sum(int(s.inference_stats.success.count) for s in stats.model_stats)


def test_only_the_nodes_the_requested_outputs_need_run(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        before = {m: _count(client, m) for m in ("add", "sub")}
        mul_before = [_count(client, "mul", v) for v in ("1", "2")]
        tensor = grpcclient.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(X)
        result = client.infer(
            "diamond", [tensor], outputs=[grpcclient.InferRequestedOutput("plus_one")]
        )
        np.testing.assert_allclose(result.as_numpy("plus_one"), X + 1)
        assert result.as_numpy("difference") is None
        assert _count(client, "add") == before["add"] + 1
        assert _count(client, "sub") == before["sub"]  # minus did not run
        assert [_count(client, "mul", v) for v in ("1", "2")] == mul_before  # nor times
        client.infer("diamond", [tensor])
        assert [_count(client, "mul", v) for v in ("1", "2")] == [mul_before[0] + 1, mul_before[1]]
    finally:
        client.close()


@pytest.mark.parametrize(("pipeline", "reason"), REFUSED, ids=[p["name"] for p, _ in REFUSED])
def test_a_wrong_pipeline_is_refused_naming_what_is_wrong(running, pipeline, reason):
    client = httpclient.InferenceServerClient(running.http_target)
    try:
        assert not client.is_model_ready(pipeline["name"])
        assert client.is_model_ready("diamond")
    finally:
        client.close()
    assert reason in running.log, running.log[-3000:]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_demultiplexer_runs_the_nodes_after_it_per_item(running, protocol):
    """OVMS's demultiply_count: the node after the split runs once per item (its model's
    statistics count each), and the response gathers the branches along a new dimension."""
    module, client = _client(running, protocol)
    grpc = grpcclient.InferenceServerClient(running.target)
    try:
        x = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
        before = _count(grpc, "mul", "1")
        tensor = module.InferInput("x", [3, 1, 4], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("branches", [tensor])
        np.testing.assert_allclose(result.as_numpy("y"), (x + 1) * 2)
        assert result.as_numpy("y").shape == (3, 1, 4)
        assert _count(grpc, "mul", "1") == before + 3
    finally:
        client.close()
        grpc.close()


@pytest.mark.parametrize("items", [1, 5])
def test_a_gathering_node_sums_the_branches(running, items):
    """demultiply_count -1: as many branches as the request brings; gather_from_node: the sum
    node runs once over the branches' stacked results."""
    client = grpcclient.InferenceServerClient(running.target)
    try:
        x = np.random.default_rng(items).random((items, 1, 4), dtype=np.float32)
        before = _count(client, "mul", "1")
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("gathered", [tensor])
        np.testing.assert_allclose(result.as_numpy("total"), ((x + 1) * 2).sum(axis=0), rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("items"), x + 1)
        assert _count(client, "mul", "1") == before + items
    finally:
        client.close()


def test_a_demultiplexer_with_too_few_dimensions_is_the_clients_error(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        tensor = grpcclient.InferInput("x", [0, 1, 4], "FP32")
        tensor.set_data_from_numpy(np.zeros((0, 1, 4), np.float32))
        with pytest.raises(Exception, match="a demultiplexer runs 1 to"):
            client.infer("gathered", [tensor])
        assert client.is_model_ready("gathered")
    finally:
        client.close()
