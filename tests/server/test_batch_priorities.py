"""Triton's dynamic batcher honours priority levels for an ONNX model (issue 52, finding 10: 8
of 16 pairs of a low and a high priority request ran low first).

A Triton repository's ONNX model with ``max_batch_size: 4``, one instance and
``dynamic_batching { priority_levels: 2 }`` is served through BATCH on ORT. Its run takes as
long as its batch's largest ``WORK`` (a Loop of 256 x 256 MatMuls), and it answers each row with
the ids of every request in its batch (``IDS``: one-hot rows, summed over the batch), so the
test knows exactly which requests shared a batch and, from when their answers came, the order
the batches ran in. Behind a busy request, sixteen requests at the default level (2) then
sixteen at priority 1 wait; Triton forms each batch when its instance is free, from the
highest priority first: all sixteen of priority 1 run before any of the earlier ones.
"""

from __future__ import annotations

import statistics
import textwrap
import threading
import time

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
pytest.importorskip("onnxruntime", reason="pip install 'plugserve[ort]'")

MODEL = "priority_onnx"
IDS = 64  # one-hot width: the most requests one round tells apart
SIDE = 256  # the Loop's square matrix
LOW = HIGH = 16
BATCH = 4

CONFIG = f"""
name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: {BATCH}
input [
  {{ name: "IDS" data_type: TYPE_FP32 dims: [ {IDS} ] }},
  {{ name: "WORK" data_type: TYPE_FP32 dims: [ 1 ] }}
]
output [ {{ name: "MEMBERS" data_type: TYPE_FP32 dims: [ {IDS} ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
dynamic_batching {{ priority_levels: 2 default_priority_level: 2 }}
"""


def _model():
    """MEMBERS = every row's IDS summed over the batch (+ 0 x the Loop's result, so the Loop
    runs): ReduceMax(WORK) iterations of S = Tanh(S @ W)."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = helper.make_tensor(
        "W",
        TensorProto.FLOAT,
        [SIDE, SIDE],
        (rng.standard_normal((SIDE, SIDE)) / SIDE**0.5).astype(np.float32).ravel().tolist(),
    )
    s0 = helper.make_tensor(
        "S0", TensorProto.FLOAT, [SIDE, SIDE], np.full(SIDE * SIDE, 0.5, np.float32).tolist()
    )
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["s_in", "W"], ["product"]),
            helper.make_node("Tanh", ["product"], ["s_out"]),
        ],
        "step",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [SIDE, SIDE]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [SIDE, SIDE]),
        ],
    )
    nodes = [
        helper.make_node("ReduceMax", ["WORK"], ["most"], keepdims=0),
        helper.make_node("Cast", ["most"], ["trips"], to=TensorProto.INT64),
        helper.make_node(
            "Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])
        ),
        helper.make_node("Loop", ["trips", "true", "S0"], ["S"], body=body),
        helper.make_node("ReduceSum", ["S"], ["total"], keepdims=0),
        helper.make_node(
            "Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])
        ),
        helper.make_node("Mul", ["total", "zero"], ["nothing"]),
        helper.make_node(
            "Constant", [], ["rows"], value=helper.make_tensor("a", TensorProto.INT64, [1], [0])
        ),
        helper.make_node("ReduceSum", ["IDS", "rows"], ["batch"], keepdims=1),
        helper.make_node("Mul", ["IDS", "zero"], ["blank"]),
        helper.make_node("Add", ["blank", "batch"], ["spread"]),
        helper.make_node("Add", ["spread", "nothing"], ["MEMBERS"]),
    ]
    graph = helper.make_graph(
        nodes,
        "priorities",
        [
            helper.make_tensor_value_info("IDS", TensorProto.FLOAT, ["B", IDS]),
            helper.make_tensor_value_info("WORK", TensorProto.FLOAT, ["B", 1]),
        ],
        [helper.make_tensor_value_info("MEMBERS", TensorProto.FLOAT, ["B", IDS])],
        [w, s0],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import onnx
    from serving import RunningServer

    root = tmp_path_factory.mktemp("batch-priorities")
    (root / MODEL / "1").mkdir(parents=True)
    onnx.save(_model(), root / MODEL / "1" / "model.onnx")
    (root / MODEL / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    with RunningServer("--model-repository", str(root)) as running:
        yield running


class _Round:
    """One round's requests on one client: each answer's batch (the ids in it) and when it
    came."""

    def __init__(self, client) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.answers: dict[int, tuple[float, frozenset[int]] | Exception] = {}
        self.done = threading.Condition(self.lock)

    def send(self, ident: int, work: int, priority: int = 0) -> None:
        ids = np.zeros((1, IDS), np.float32)
        ids[0, ident] = 1.0
        given = [grpcclient.InferInput("IDS", [1, IDS], "FP32")]
        given[0].set_data_from_numpy(ids)
        given.append(grpcclient.InferInput("WORK", [1, 1], "FP32"))
        given[1].set_data_from_numpy(np.array([[work]], np.float32))

        def answered(result, error) -> None:
            now = time.monotonic()
            with self.lock:
                if error is not None:
                    self.answers[ident] = error
                else:
                    row = result.as_numpy("MEMBERS")[0]
                    self.answers[ident] = (now, frozenset(int(i) for i in np.flatnonzero(row)))
                self.done.notify_all()

        self.client.async_infer(MODEL, given, answered, priority=priority)

    def wait(self, count: int, timeout: float = 180) -> dict:
        with self.lock:
            assert self.done.wait_for(lambda: len(self.answers) >= count, timeout), self.answers
            return dict(self.answers)


def _timed(server, work: int) -> float:
    """Seconds one request with ``work`` iterations takes, answered."""
    with grpcclient.InferenceServerClient(server.target) as client:
        one = _Round(client)
        start = time.monotonic()
        one.send(0, work)
        answer = one.wait(1)[0]
    assert not isinstance(answer, Exception), answer
    return answer[0] - start


def _round(server, busy_work: int, work: int) -> tuple[int, float]:
    """Behind a busy request, LOW at the default level then HIGH at priority 1: the pairs
    (a low one, a high one sent after it) whose low one ran in an earlier batch, and how long
    the busy one still ran after the last request was sent."""
    with grpcclient.InferenceServerClient(server.target) as client:
        run = _Round(client)
        run.send(0, busy_work)
        time.sleep(0.3)  # the busy one's batch is formed and runs
        low = list(range(1, 1 + LOW))
        high = list(range(1 + LOW, 1 + LOW + HIGH))
        for ident in low:
            run.send(ident, work)
        time.sleep(0.3)  # every low one arrived before the first high one
        for ident in high:
            run.send(ident, work, priority=1)
        sent = time.monotonic()
        answers = run.wait(1 + LOW + HIGH)
    failed = {i: a for i, a in answers.items() if isinstance(a, Exception)}
    assert not failed, failed
    for ident, (_, members) in answers.items():
        assert ident in members and len(members) <= BATCH, (ident, members)
    # the batches, in the order they ran (each one's answers came together; batches run one
    # after another on the one instance, each for `work` iterations)
    batches = {members for _, members in answers.values()}
    when = {b: statistics.median(answers[i][0] for i in b) for b in batches}
    rank = {i: n for n, b in enumerate(sorted(batches, key=when.get)) for i in b}
    inverted = sum(1 for lo in low for hi in high if rank[lo] < rank[hi])
    return inverted, answers[0][0] - sent


@pytest.mark.slow  # 15-30 s on a loaded 2-core machine
def test_a_batch_takes_the_highest_priority_first_when_the_instance_is_free(server):
    """Behind a busy request, 16 at the default level (2) then 16 at priority 1: none of the
    256 pairs (a low one, a high one sent after it) runs the low one first, as Triton's
    batcher (before, batches were formed as soon as four had come and queued on the device,
    and only eight requests could wait in the batcher: 32 of the 256 pairs ran the low one
    first). The busy request runs long enough that all 32 are waiting when it ends (measured;
    the round is run again, longer, if a loaded machine sent them too slowly)."""
    _timed(server, 1)  # loaded and warm
    per_iteration = _timed(server, 200) / 200
    work = max(10, int(0.15 / per_iteration))  # ~0.15 s a batch
    busy = max(100, int(2.0 / per_iteration))  # ~2 s
    for _ in range(3):
        inverted, margin = _round(server, busy, work)
        if margin > 0.5:  # every request had arrived well before the busy one ended
            break
        busy *= 2
    else:
        pytest.fail(f"the busy request never outlasted the sending (last margin {margin:.2f} s)")
    assert inverted == 0, f"{inverted} of {LOW * HIGH} pairs ran the low priority first"
