"""Reading a model is bounded before anything is built (issue 58, point 2).

Small models (a few hundred bytes to 10 KB: ``tests/support/amplifying.py``, ``READING``)
whose reading computes gigabytes (onnx's data propagation, constant folding, a sparse
initializer held dense) are sent three at a time by QueryNetwork (any ``infer`` client) and
LoadNetwork to a real server, on NUMPY and ORT, while both health probes are timed: each
probe's p99 stays within 250 ms, the attacker is refused INVALID_ARGUMENT naming
--max-read-bytes (or, where the read is bounded without refusing, answered: NUMPY leaves the
constants past the read's allowance to run time), the server's peak RSS grows by less than
its memory budget, and a normal model still loads and infers afterwards. Before, one 1 KB
model took 3.6 GB and 19 s of onnx holding the GIL.
"""

from __future__ import annotations

import concurrent.futures

import amplifying
import grpc
import numpy as np
import pytest
from attack import Probe
from onnx import helper

#: --max-inflight-bytes of the server: a read holds a quarter, 128 MiB (--max-read-bytes -1)
BUDGET = 512 << 20
READ_BYTES = 128 << 20
#: reads of one model at once
AT_ONCE = 3
#: what the server may grow beyond the reads' charges (the three reads' requests, glibc's
#: arenas of the handler threads)
MARGIN = 96 << 20
#: --max-model-nodes of the server
MAX_NODES = 5_000

#: (model, device) read without a refusal: NUMPY folds what the read's allowance holds and
#: leaves the rest to run time (onnxruntime would fold them all: refused)
ANSWERED = {("folded_chains", "NUMPY")}


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from serving import RunningServer

    empty = tmp_path_factory.mktemp("empty")
    with RunningServer(
        "--model-repository", str(empty), "--max-inflight-bytes", str(BUDGET),
        "--max-model-nodes", str(MAX_NODES),
    ) as server:  # fmt: skip
        yield server


def _send(running, rpc: str, model: bytes, device: str, label: str) -> grpc.RpcError | None:
    from plugserve.client import Client

    with Client(running.target, timeout=120) as client:
        try:
            if rpc == "query":
                client.query(model, device)
            else:
                client.load(label, model, device)
                client.unload(label)
        except grpc.RpcError as exc:
            return exc
    return None


@pytest.mark.parametrize("device", ["NUMPY", "ORT"])
@pytest.mark.parametrize("rpc", ["query", "load"])
@pytest.mark.parametrize("name", sorted(amplifying.READING))
def test_a_small_model_cannot_make_reading_it_huge(running, name, rpc, device):
    model = amplifying.READING[name]().SerializeToString()
    with Probe(running) as probe, concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        sent = [
            pool.submit(_send, running, rpc, model, device, f"{name}_{rpc}_{i}")
            for i in range(AT_ONCE)
        ]
        errors = [future.result(timeout=120) for future in sent]
    for error in errors:
        if (name, device) in ANSWERED:
            assert error is None, error
            continue
        assert error is not None, f"{name} was read on {device}"
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "--max-read-bytes" in error.details(), error.details()
        assert "Traceback" not in error.details() and ".py" not in error.details()
    assert running.process.poll() is None
    probe.check(body_bytes=AT_ONCE * len(model), fixed_bytes=AT_ONCE * READ_BYTES + MARGIN)
    _normal_model_serves(running, f"after_{name}_{rpc}_{device.lower()}", device)


def _normal_model_serves(running, label: str, device: str) -> None:
    from plugserve.client import Client

    with Client(running.target, timeout=120) as client:
        model = amplifying.tile().SerializeToString()
        assert client.query(model, device).supported
        client.load(label, model, device)
        try:
            out = client.infer(
                label, {"x": np.ones((2, 2), np.float32), "repeats": np.array([2, 3])}
            )
            assert next(iter(out.values())).shape == (4, 6)
        finally:
            client.unload(label)


def test_a_model_of_too_many_nodes_is_refused_before_it_is_read(running):
    from plugserve.client import Client

    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(MAX_NODES + 1)]
    graph = helper.make_graph(
        nodes,
        "many",
        [helper.make_tensor_value_info("v0", 1, [1])],
        [helper.make_tensor_value_info(f"v{MAX_NODES + 1}", 1, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with Client(running.target, timeout=120) as client:
        for call in (
            lambda: client.query(model.SerializeToString(), "NUMPY"),
            lambda: client.load("many", model.SerializeToString(), "NUMPY"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "--max-model-nodes" in refused.value.details(), refused.value.details()
            assert f"{MAX_NODES + 1:,} nodes" in refused.value.details()
