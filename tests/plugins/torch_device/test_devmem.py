"""A torch device's memory is charged before it is allocated (plugins/torch/devmem.py), on
TORCH as on a GPU (the same code): with DEVICE_MEMORY_BUDGET 16 MiB, a model whose weights
need more is refused at load naming the budget, a request whose activations are estimated over
the budget is refused RESOURCE_EXHAUSTED (503 on REST) before it runs, and the next request is
served. A real server, tritonclient over both protocols; the models are the prepared GPU
check's (tests/gpu/gpuops_check.py), which runs the same on a GPU and adds a real
out-of-memory there."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from serving import RunningServer, graph_events

pytest.importorskip("torch", reason="the TORCH device needs torch")
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
import gpuops_check  # noqa: E402

BUDGET = {"DEVICE_MEMORY_BUDGET": str(gpuops_check.BUDGET)}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("budget")
    settings = {"device": "TORCH", "config": BUDGET}
    gpuops_check.write_model(repo, "outer", gpuops_check.outer_model(), settings=settings)
    lanes = {"device": "TORCH", "config": {**BUDGET, "CUDA_GRAPHS": "2", "NUM_STREAMS": "1"}}
    gpuops_check.write_model(repo, "outer_lanes", gpuops_check.outer_model(), settings=lanes)
    heavy = gpuops_check.weights_model(12 * 2**20)  # 48 MiB of float32 weights
    gpuops_check.write_model(repo, "heavy", heavy, settings=settings)
    gpuops_check.write_model(repo, "filled", gpuops_check.filled_model(), settings=settings)
    with RunningServer("--model-repository", str(repo), "--exit-on-error", "0") as running:
        yield running


def _outer(module, client, n: int, model: str = "outer") -> np.ndarray:
    a = module.InferInput("a", [n, 1], "FP32")
    a.set_data_from_numpy(np.ones((n, 1), np.float32))
    b = module.InferInput("b", [1, n], "FP32")
    b.set_data_from_numpy(np.full((1, n), 2.0, np.float32))
    return client.infer(model, [a, b]).as_numpy("y")


def test_weights_over_the_budget_are_refused_at_load(server):
    client = grpcclient.InferenceServerClient(server.target)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("heavy")
        message = info.value.message()
        assert "48.0 MiB" in message and "DEVICE_MEMORY_BUDGET" in message, message
        assert "RESOURCE_EXHAUSTED" in str(info.value.status()) or "RESOURCE_EXHAUSTED" in message
        assert client.is_server_live() and client.is_model_ready("outer")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_over_the_budget_is_refused_before_it_runs_and_the_next_is_served(
    server, protocol
):
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(
        server.target if protocol == "grpc" else server.http_target
    )
    try:
        with pytest.raises(InferenceServerException) as info:
            _outer(module, client, 4096)  # a 64 MiB output: over 16 MiB
        status, message = str(info.value.status()), info.value.message()
        assert status == ("StatusCode.RESOURCE_EXHAUSTED" if protocol == "grpc" else "503"), status
        assert "activations" in message and "DEVICE_MEMORY_BUDGET" in message, message
        np.testing.assert_allclose(_outer(module, client, 16), np.full((16, 16), 2.0))
        # within the budget a larger one runs too (1 MiB of output)
        np.testing.assert_allclose(_outer(module, client, 512), np.full((512, 512), 2.0))
    finally:
        client.close()


def test_a_lanes_requests_are_charged_where_they_allocate(server):
    """With CUDA_GRAPHS the lane (plugins/torch/graphs.py) takes the request's charge where
    it decides what runs, so that a replay of a captured CUDA graph is not charged again (its
    pool is: the GPU's check ``graphs_replay_charge``). On the CPU every run allocates (the
    twin's "replay" is the eager program over static buffers): a shape over the budget is
    refused at each sight, before it is ever warmed, and one within it is served eagerly,
    captured and replayed; the budget's charges all come back (the big one refused again)."""
    client = grpcclient.InferenceServerClient(server.target)
    try:
        for _ in range(3):
            with pytest.raises(InferenceServerException) as info:
                _outer(grpcclient, client, 4096, "outer_lanes")  # 64 MiB: over 16 MiB
            assert str(info.value.status()) == "StatusCode.RESOURCE_EXHAUSTED", info.value
            assert "activations" in info.value.message(), info.value.message()
        for _ in range(3):  # eager (first sight), captured, replayed: each charged, within it
            np.testing.assert_allclose(_outer(grpcclient, client, 512, "outer_lanes"),
                                       np.full((512, 512), 2.0))  # fmt: skip
        events = graph_events(server, "outer_lanes")
        assert events["captured"] == 1 and events["replayed"] == 1, events  # 4096: never seen
        with pytest.raises(InferenceServerException, match="activations"):
            _outer(grpcclient, client, 4096, "outer_lanes")
        np.testing.assert_allclose(_outer(grpcclient, client, 16, "outer"),
                                   np.full((16, 16), 2.0))  # fmt: skip
    finally:
        client.close()


def _overcommit_refuses_the_impossible() -> bool:
    """Linux's heuristic (0) or strict (2) overcommit refuses an allocation larger than the
    machine outright; with 1 (always) it would be granted and the fill killed by the OOM
    killer, so the test does not run there."""
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() in ("0", "2")
    except OSError:
        return False


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_that_runs_out_of_memory_fails_alone(server, protocol):
    """A size only the request's data decides (ConstantOfShape of 400,000 x 400,000: 640 GB),
    which the estimate cannot see: the allocation fails, that request is answered
    RESOURCE_EXHAUSTED / 503 saying the device ran out, and the next one is served. The GPU's
    twin (torch.cuda.OutOfMemoryError) is the prepared check's gpuops.memory."""
    if not _overcommit_refuses_the_impossible():
        pytest.skip("vm.overcommit_memory is 1: a 640 GB allocation would be granted")
    module = grpcclient if protocol == "grpc" else httpclient
    client = module.InferenceServerClient(
        server.target if protocol == "grpc" else server.http_target
    )
    try:
        answer = gpuops_check.out_of_memory(module, client)
        want = "StatusCode.RESOURCE_EXHAUSTED" if protocol == "grpc" else "503"
        assert answer.startswith(want) and "ran out of memory" in answer, answer
        np.testing.assert_allclose(_outer(module, client, 16), np.full((16, 16), 2.0))
        assert client.is_server_live()
    finally:
        client.close()


def test_the_estimate_is_the_largest_set_of_values_alive_at_once():
    """Two chained ops on [n, m]: the input, the first result and the second are alive at the
    second step (the first is freed after it); the dims come from the request's inputs."""
    import onnx
    import torch
    from onnx import TensorProto, helper

    from plugserve.plugins.ir import load_model
    from plugserve.plugins.torch.devmem import Activations

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "m"])],
    )
    model = helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    activations = Activations(load_model(model), torch.float32.itemsize)
    x = np.zeros((10, 20), np.float32)
    assert activations.estimate([x]) == 3 * x.nbytes
    half = Activations(load_model(model), torch.float16.itemsize)
    assert half.estimate([x]) == x.nbytes + 2 * x.nbytes // 2
