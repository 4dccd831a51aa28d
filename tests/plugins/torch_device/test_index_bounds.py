"""Indices out of range are the request's error, never the device's (plugins/torch/ops/bounds.py,
plugins/torch/request.py): on a GPU, torch's indexing kernels would fire a device-side assert,
a sticky CUDA error that leaves the whole process's GPU unusable. Here, on TORCH: a real server
refuses a Gather, GatherElements, GatherND, ScatterND or ScatterElements index out of range
INVALID_ARGUMENT (400 on REST) naming the node, through the plain path and the lane (the CPU
twin of CUDA graphs), and serves the next request; negative indices in range still work. The
CUDA path's own logic (indices replaced in range, the node's code raised into the request's
device flag with device ops only, read and cleared after the run) runs here on CPU tensors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from serving import RunningServer

torch = pytest.importorskip("torch", reason="the TORCH device needs torch")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

from plugserve.plugins.ir import load_model  # noqa: E402
from plugserve.plugins.torch.ops import bounds  # noqa: E402
from plugserve.plugins.torch.program import Program  # noqa: E402

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)


#: per op: (node name, its attributes, the ids' shape, the output's shape); Scatter* set the
#: rows their ids pick to a 1 x 4 update of -1
SHAPES = {
    "Gather": ("lookup", {"axis": 0}, ["n"], ["n", 4]),
    "GatherElements": ("pick", {"axis": 0}, ["n", 4], ["n", 4]),
    "GatherND": ("cells", {}, ["n", 2], ["n"]),
    "ScatterND": ("put", {}, [1, 1], [10, 4]),
    "ScatterElements": ("set", {}, [1, 4], [10, 4]),
}


def _model(op: str) -> onnx.ModelProto:
    """y = op(table, ids[, upd]) with a 10 x 4 table; ids are the request's."""
    name, attrs, ids_shape, y_shape = SHAPES[op]
    inits = [numpy_helper.from_array(TABLE, "table")]
    inputs = ["table", "ids"]
    if op.startswith("Scatter"):
        inits.append(numpy_helper.from_array(np.full((1, 4), -1.0, np.float32), "upd"))
        inputs.append("upd")
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], name=name, **attrs)],
        op,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ids_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


#: per op: (ids in range with a negative one, their answer, ids out of range, the node's name)
CASES = {
    "Gather": (np.array([1, -1]), TABLE[[1, 9]], np.array([1, 10]), "lookup"),
    "GatherElements": (
        np.array([[0, 9, -1, 2]]), TABLE[[0, 9, 9, 2], [0, 1, 2, 3]][None],
        np.array([[0, 1, 2, 12]]), "pick",
    ),
    "GatherND": (np.array([[2, 3], [-1, 0]]), np.array([11.0, 36.0]), np.array([[2, 4]]), "cells"),
    "ScatterND": (
        np.array([[-1]]), np.concatenate([TABLE[:9], np.full((1, 4), -1.0)]), np.array([[10]]),
        "put",
    ),
    "ScatterElements": (
        np.array([[0, 0, 0, 0]]), np.concatenate([np.full((1, 4), -1.0), TABLE[1:]]),
        np.array([[0, 0, 11, 0]]), "set",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import json

    repo = tmp_path_factory.mktemp("bounds")
    for op in CASES:
        for name, config in ((op.lower(), {}), (f"{op.lower()}_lane", {"CUDA_GRAPHS": "4"})):
            (repo / name / "1").mkdir(parents=True)
            onnx.save(_model(op), str(repo / name / "1" / "model.onnx"))
            settings = {"device": "TORCH", "config": config}
            (repo / name / "config.json").write_text(json.dumps(settings))
    with RunningServer("--model-repository", str(repo)) as running:
        yield running


def _ask(module, client, model: str, ids: np.ndarray) -> np.ndarray:
    inp = module.InferInput("ids", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids.astype(np.int64))
    return client.infer(model, [inp]).as_numpy("y")


@pytest.mark.parametrize("op", list(CASES))
def test_an_index_out_of_range_is_refused_naming_the_node_and_the_next_is_served(server, op):
    good, answer, bad, node = CASES[op]
    clients = (
        (grpcclient, grpcclient.InferenceServerClient(server.target), "INVALID_ARGUMENT"),
        (httpclient, httpclient.InferenceServerClient(server.http_target), "400"),
    )
    try:
        for module, client, status in clients:
            for model in (op.lower(), f"{op.lower()}_lane"):
                for _ in range(2):  # the lane's second sight of a shape is its "capture"
                    np.testing.assert_allclose(_ask(module, client, model, good), answer)
                    with pytest.raises(InferenceServerException) as info:
                        _ask(module, client, model, bad)
                    said = f"{info.value.status()} {info.value.message()}"
                    assert status in said and f"node {node!r} ({op})" in said, said
                    assert "out of range" in said, said
                np.testing.assert_allclose(_ask(module, client, model, good), answer)
        assert clients[0][1].is_server_ready()
    finally:
        for _, client, _ in clients:
            client.close()


def test_the_cuda_paths_flag_on_cpu_tensors(monkeypatch):
    """What a GPU request does, on CPU tensors: no host read and no error while the program
    runs; the out-of-range index is replaced in range; the request's flag names the node;
    taking it clears it; a later clean run leaves it clear."""
    monkeypatch.setattr(bounds, "FLAGGED", frozenset({"cuda", "cpu"}))
    graph = load_model(_model("Gather"))
    program = Program(graph, torch, torch.device("cpu"), torch.float32)
    assert program.checks_bounds
    flag = bounds.BoundsFlag(torch, torch.device("cpu"))
    with bounds.active(flag):
        (out,) = program.compute_tensors([torch.tensor([1, 10])])
    np.testing.assert_allclose(out.numpy(), TABLE[[1, 0]])  # 10 read as 0, never out of range
    taken = flag.take()
    assert taken is not None and "node 'lookup' (Gather)" in taken, taken
    assert int(flag.value) == 0 and flag.take() is None
    with bounds.active(flag):
        program.compute_tensors([torch.tensor([2, -10])])  # -10 wraps to 0: in range
    assert flag.take() is None
    # outside a request (no flag set) the check reads on the host and refuses at once
    with pytest.raises(Exception, match="out of range"):
        program.compute_tensors([torch.tensor([10])])


def test_an_empty_axis_indexed_at_all_is_refused_on_the_host():
    class Ctx:
        graph = type("G", (), {"name": "m"})()
        node = type("N", (), {"name": "g", "op_type": "Gather"})()

    check = bounds.checker(Ctx())
    assert check(torch.zeros(0, dtype=torch.int64), 0).numel() == 0  # nothing indexed: fine
    with pytest.raises(Exception, match="node 'g' \\(Gather\\)"):
        check(torch.zeros(1, dtype=torch.int64), 0)
    with pytest.raises(Exception, match="out of range"):
        check(torch.zeros((1, 2), dtype=torch.int64), (3, 0))
