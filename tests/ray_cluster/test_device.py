"""The RAY device on a real three-node Ray cluster (issue 44, items 2 and 4).

One cluster for the module (tests/support/ray_cluster.py): a head and two workers, w1 and
w2, each in its own network namespace. ``plugserve serve`` runs on the head as a Ray driver
(RAY_ADDRESS), its repository holding the same small MLP on several devices:

* ``mlp``: NUMPY in the server's own process, the reference;
* ``mlp_multi``: ``MULTI:RAY.w1,RAY.w2`` (RUNTIME_FALLBACK=YES): one network per node;
* ``mlp_hetero``: ``HETERO:RAY.w1,NUMPY``, its first Gemm and Relu pinned on w1 and the rest
  here, so one request crosses the network twice;
* ``mlp_w2``: ``RAY.w2`` alone, a call bounded by RAY_CALL_TIMEOUT_S=3;
* ``mlp_w2_first``: ``MULTI:RAY.w2,RAY.w1`` without fallback, RAY_CALL_TIMEOUT_S=3: every
  request goes to w2 while it has room;
* ``mlp_placed``: ``RAY`` with no node: Ray places it;
* ``spin``: ``RAY.w1``, a Loop whose trip count the request sets (tests/support/models.py),
  to show a request's deadline stopping its run on the node;
* ``grow``: ``RAY.w1``, a ConstantOfShape whose output's size the request sets, to show the
  run's context (its room, its network's name) reaching the node's device.

Clients are tritonclient over gRPC from outside the cluster. Where requests ran is read from
each node's own metrics (Ray's exporter on the node, port 8080), not from the server. A test
cuts w2 off the others (its link down) and asserts that its requests fail UNAVAILABLE within
their deadline while MULTI goes on serving on w1, even where w2 comes first and nothing
retries a request (w2 set aside after its first failure). The last kills w2 and starts it
again: its network is compiled there again.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request

import numpy as np
import onnx
import pytest
import ray_cluster
from conftest import make_cluster
from models import FOREVER, spin_loop
from serving import wait_for

pytestmark = pytest.mark.slow

grpcclient = pytest.importorskip("tritonclient.grpc")

AFFINITY = {"dense0": "RAY.w1", "relu0": "RAY.w1", "dense1": "NUMPY", "softmax": "NUMPY"}
DEVICES = {
    "mlp": ("NUMPY", {}),
    "mlp_multi": ("MULTI:RAY.w1,RAY.w2", {"RUNTIME_FALLBACK": "YES"}),
    "mlp_hetero": ("HETERO:RAY.w1,NUMPY", {"AFFINITY": json.dumps(AFFINITY)}),
    "mlp_w2": ("RAY.w2", {"RAY_CALL_TIMEOUT_S": "3"}),
    "mlp_w2_first": ("MULTI:RAY.w2,RAY.w1", {"RAY_CALL_TIMEOUT_S": "3"}),
    "mlp_placed": ("RAY", {}),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from plugserve.server.control.examples import build_examples

    root = tmp_path_factory.mktemp("ray-device")
    examples = build_examples(root / "examples")
    repository = root / "models"
    for name, (device, config) in DEVICES.items():
        shutil.copytree(examples / "mlp" / "1", repository / name / "1")
        (repository / name / "config.json").write_text(
            json.dumps({"device": device, "config": config})
        )
    (repository / "spin" / "1").mkdir(parents=True)
    onnx.save(spin_loop(), repository / "spin" / "1" / "model.onnx")
    (repository / "spin" / "config.json").write_text(json.dumps({"device": "RAY.w1"}))
    (repository / "grow" / "1").mkdir(parents=True)
    onnx.save(_grow(), repository / "grow" / "1" / "model.onnx")
    (repository / "grow" / "config.json").write_text(json.dumps({"device": "RAY.w1"}))
    cluster = make_cluster()
    server = ray_cluster.NodeServer(cluster, "head", "--model-repository", str(repository))
    try:
        server.start(timeout=300)
        yield cluster, server
    finally:
        server.stop()
        cluster.close()


def _inputs(seed: int):
    array = np.random.default_rng(seed).random((2, 16), np.float32)
    item = grpcclient.InferInput("input", list(array.shape), "FP32")
    item.set_data_from_numpy(array)
    return [item]


def _runs(cluster, node: str, network: str = "", outcome: str = "") -> float:
    """Runs of RAY networks counted on ``node`` by its own metrics exporter (those of
    ``network`` that ended with ``outcome``: ok, cancelled, failed)."""
    url = f"http://{cluster.nodes[node].ip}:{ray_cluster.METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    total = 0.0
    for line in text.splitlines():
        mine = line.startswith("ray_plugserve_ray_device_runs") and f'node="{node}"' in line
        if (
            mine
            and (not network or f'network="{network}"' in line)
            and (not outcome or f'outcome="{outcome}"' in line)
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_device_lists_the_nodes_and_loads_on_each(setup):
    _, server = setup
    client = grpcclient.InferenceServerClient(server.target)
    index = {
        m["name"]: m["state"] for m in client.get_model_repository_index(as_json=True)["models"]
    }
    assert index == dict.fromkeys([*DEVICES, "spin", "grow"], "READY"), server.log[-3000:]
    from plugserve.client import Client

    with Client(server.target) as plugserve_client:
        devices = {d.name: d for d in plugserve_client.devices()}
        assert devices["RAY"].available, devices["RAY"]
        assert sorted(plugserve_client.get_metric("RAY", "AVAILABLE_DEVICES")) == [
            "head",
            "w1",
            "w2",
        ]


def test_multi_over_two_nodes_answers_as_numpy_and_runs_on_both(setup):
    cluster, server = setup
    before = {node: _runs(cluster, node, "mlp", "ok") for node in ("w1", "w2")}
    results: dict[int, tuple] = {}
    errors: list = []

    def client_loop(worker: int) -> None:
        client = grpcclient.InferenceServerClient(server.target)
        for i in range(40):
            seed = worker * 1000 + i
            try:
                got = client.infer("mlp_multi", _inputs(seed)).as_numpy("probabilities")
                want = client.infer("mlp", _inputs(seed)).as_numpy("probabilities")
                results[seed] = (got, want)
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert errors == [] and len(results) == 160, errors[:3]
    for got, want in results.values():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # each node counted runs of its own: requests landed on both machines, and every one ran
    # on one of them (the nodes' exporters see a run within a second or so)
    def ran() -> dict[str, float]:
        return {n: _runs(cluster, n, "mlp", "ok") - before[n] for n in ("w1", "w2")}

    assert wait_for(lambda: min(ran().values()) > 0 and sum(ran().values()) >= 160, 30, 1), ran()


def test_hetero_split_between_a_node_and_here_equals_numpy(setup):
    cluster, server = setup
    client = grpcclient.InferenceServerClient(server.target)
    before = _runs(cluster, "w1")
    for seed in range(20):
        want = client.infer("mlp", _inputs(seed)).as_numpy("probabilities")
        for model in ("mlp_hetero", "mlp_placed"):
            got = client.infer(model, _inputs(seed)).as_numpy("probabilities")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=model)
    assert wait_for(lambda: _runs(cluster, "w1") >= before + 20, 30, 1)


def _spin(trips: int):
    m = grpcclient.InferInput("M", [], "INT64")
    m.set_data_from_numpy(np.array(trips, np.int64))
    x = grpcclient.InferInput("x", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))
    return [m, x]


def test_a_deadline_stops_the_run_on_the_node(setup):
    """A run of 10^12 trips past its client's 2 s deadline: the client hears
    DEADLINE_EXCEEDED, the node's own metrics count the run cancelled there (not left
    spinning), and the network serves the next request."""
    from tritonclient.utils import InferenceServerException

    cluster, server = setup
    client = grpcclient.InferenceServerClient(server.target)
    np.testing.assert_array_equal(client.infer("spin", _spin(3)).as_numpy("y"), np.full(4, 3.0))
    before = _runs(cluster, "w1", "spin", "cancelled")
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as failed:
        client.infer("spin", _spin(FOREVER), client_timeout=2)
    assert failed.value.status() == "StatusCode.DEADLINE_EXCEEDED", failed.value
    assert wait_for(lambda: _runs(cluster, "w1", "spin", "cancelled") > before, 30, 0.5)
    assert time.monotonic() - started < 30
    np.testing.assert_array_equal(client.infer("spin", _spin(5)).as_numpy("y"), np.full(4, 5.0))


def _grow():
    """``y = zeros(s)``: a float tensor of the shape the request sends."""
    from onnx import TensorProto, helper

    node = helper.make_node(
        "ConstantOfShape", ["s"], ["y"], name="zeros",
        value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]),
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "grow",
        [helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_run_context_crosses_to_the_node(setup):
    """The RAY device sends its run context with the inputs (``run_context.to_wire``): the
    node's NUMPY refuses a 4 TB output against the room the server's budget gave the request,
    before allocating it, naming the network as the server named it (a node told nothing
    would try the allocation and fail INTERNAL); a small one is answered."""
    from tritonclient.utils import InferenceServerException

    cluster, server = setup
    client = grpcclient.InferenceServerClient(server.target)

    def grow(a: int, b: int):
        s = grpcclient.InferInput("s", [2], "INT64")
        s.set_data_from_numpy(np.array([a, b], np.int64))
        return client.infer("grow", [s])

    np.testing.assert_array_equal(grow(2, 3).as_numpy("y"), np.zeros((2, 3), np.float32))
    before = _runs(cluster, "w1", "grow", "failed")
    with pytest.raises(InferenceServerException) as refused:
        grow(10**6, 10**6)
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
    message = refused.value.message()
    assert "network 'grow': node 'zeros' (ConstantOfShape)" in message, message
    assert "4,000,000,000,000 bytes" in message, message
    assert wait_for(lambda: _runs(cluster, "w1", "grow", "failed") > before, 30, 0.5)


def test_a_node_cut_off_fails_its_requests_unavailable_within_their_deadline(setup):
    """w2 stays cut off until the next test."""
    from tritonclient.utils import InferenceServerException

    cluster, server = setup
    client = grpcclient.InferenceServerClient(server.target)
    client.infer("mlp_w2", _inputs(0))  # it serves before
    client.infer("mlp_w2_first", _inputs(0))
    cluster.partition("w2")
    deadline = 10.0
    outcomes = []
    for seed in range(3):
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as failed:
            client.infer("mlp_w2", _inputs(seed), client_timeout=deadline)
        outcomes.append((failed.value.status(), time.monotonic() - started, str(failed.value)))
    for status, took, message in outcomes:
        assert status == "StatusCode.UNAVAILABLE", message
        assert took < deadline, (took, message)
    # MULTI goes on serving on the node that is left
    for seed in range(10):
        got = client.infer("mlp_multi", _inputs(seed), client_timeout=deadline)
        want = client.infer("mlp", _inputs(seed))
        np.testing.assert_allclose(
            got.as_numpy("probabilities"), want.as_numpy("probabilities"), rtol=1e-5, atol=1e-6
        )
    # without fallback, w2 first: its one request fails UNAVAILABLE, then w2 is set aside
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as failed:
        client.infer("mlp_w2_first", _inputs(0), client_timeout=deadline)
    assert failed.value.status() == "StatusCode.UNAVAILABLE", str(failed.value)
    assert time.monotonic() - started < deadline
    for seed in range(10):
        got = client.infer("mlp_w2_first", _inputs(seed), client_timeout=deadline)
        want = client.infer("mlp", _inputs(seed))
        np.testing.assert_allclose(
            got.as_numpy("probabilities"), want.as_numpy("probabilities"), rtol=1e-5, atol=1e-6
        )


def test_a_network_whose_node_comes_back_is_compiled_there_again(setup):
    """After the cut (healed first), w2 killed (every process of its namespace, a machine
    losing power): its network's
    requests fail UNAVAILABLE; w2 started again (a new node under the same name): the first
    request that finds the actor dead has the network compiled there again (in the
    background), and the requests after it are answered from w2, as before."""
    from tritonclient.utils import InferenceServerException

    cluster, server = setup
    client = grpcclient.InferenceServerClient(server.target)
    want = client.infer("mlp", _inputs(5)).as_numpy("probabilities")
    cluster.heal("w2")
    cluster.kill_node("w2")
    with pytest.raises(InferenceServerException) as failed:
        client.infer("mlp_w2", _inputs(5), client_timeout=10)
    assert failed.value.status() == "StatusCode.UNAVAILABLE", str(failed.value)
    cluster.restart_node("w2")

    answers = []

    def answered():
        try:
            answers.append(client.infer("mlp_w2", _inputs(5), client_timeout=10))
        except InferenceServerException as exc:  # UNAVAILABLE until it is compiled there
            assert exc.status() == "StatusCode.UNAVAILABLE", str(exc)
        return bool(answers)

    assert wait_for(answered, 120, 1), server.log[-3000:]
    np.testing.assert_allclose(answers[0].as_numpy("probabilities"), want, rtol=1e-5, atol=1e-6)
    assert "compiled there again" in server.log
    # the restarted node's own exporter counts the run (its counters start at 0)
    assert wait_for(lambda: _runs(cluster, "w2", "mlp", "ok") >= 1, 30, 1)
