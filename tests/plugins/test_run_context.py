"""What a device is told of the request it runs (``plugins/run_context.py``), handed down by the
virtual devices: HETERO's pieces and BATCH's batches see the request's room, answer bound,
outputs and network name, each as it applies to them, on real NUMPY kernels.

The bounds are observed where a device acts on them: an output whose size the request's values
decide is refused before it is allocated (``plugins/amplify.py``) when it outgrows the room,
or the answer's bound where the answer carries it."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
from models import _init, _model
from onnx import TensorProto, helper

from plugserve.plugins import run_context
from plugserve.plugins.api import Cancelled, ResourceExhausted, RunContext
from plugserve.plugins.cancel import Token
from plugserve.plugins.numpy import NumpyPlugin
from plugserve.server import Core


class SecondPlugin(NumpyPlugin):
    """A second real device: NUMPY's kernels under another name."""

    name = "SECOND"


@pytest.fixture(scope="module")
def core():
    return Core(plugins={"SECOND": SecondPlugin})


def _expand_then_sum():
    """``y = sum(expand(1.0, s))``: a [s0, s1] float tensor the request sizes, made on NUMPY
    and handed to SECOND, which sums it; the answer is one float."""
    nodes = [
        helper.make_node("Expand", ["one", "s"], ["big"], name="expand"),
        helper.make_node("ReduceSum", ["big"], ["y"], name="sum", keepdims=0),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [_init("one", np.ones((1,), np.float32))],
        name="expand_then_sum",
    )


def _abs_then_expand():
    """``y = expand(1.0, abs(s))``: the request's sizes pass NUMPY's piece, and SECOND's piece
    makes the network's output from them."""
    nodes = [
        helper.make_node("Abs", ["s"], ["sizes"], name="abs"),
        helper.make_node("Expand", ["one", "sizes"], ["y"], name="expand"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
        [_init("one", np.ones((1,), np.float32))],
        name="abs_then_expand",
    )


def _hetero(core, model, affinity):
    net = core.load_network(model, "HETERO:NUMPY,SECOND", {"AFFINITY": json.dumps(affinity)})
    devices = {s["device"] for s in net.get_metric("HETERO_SUBGRAPHS")}
    assert devices == {"NUMPY", "SECOND"}  # two pieces, or the test shows nothing
    return net


SIZES = np.array([100, 100], np.int64)  # 10,000 floats: 40,000 bytes


def test_a_tensor_one_piece_hands_the_next_is_not_held_to_the_answers_bound(core):
    """The request's answer may carry 1,000 bytes; the 40,000-byte tensor between the pieces
    is never sent, so the run answers. (Before, the piece saw the request's outputs as its
    own, none named meaning every one, and refused its hand-over as an output too large to
    send.)"""
    net = _hetero(core, _expand_then_sum(), {"expand": "NUMPY", "sum": "SECOND"})
    request = net.create_infer_request()
    out = request.infer_checked([SIZES], RunContext(answer=1000, network="net"))
    assert float(out["y"]) == 10000.0  # the bound on an output the answer carries: below


def test_a_piece_is_held_to_the_requests_room_and_named_by_its_network(core):
    net = _hetero(core, _expand_then_sum(), {"expand": "NUMPY", "sum": "SECOND"})
    request = net.create_infer_request()
    with pytest.raises(ResourceExhausted) as caught:
        request.infer_checked([SIZES], RunContext(room=1000, network="net"))
    message = str(caught.value)
    assert "network 'net'" in message and "'expand' (Expand)" in message
    # its size and the room's rule (what is free is not told: other requests' bytes)
    assert "40,000 bytes" in message and "more than this request may hold" in message
    # a room that holds it: the same request answers
    out = request.infer_checked([SIZES], RunContext(room=1 << 20, network="net"))
    assert float(out["y"]) == 10000.0


def test_the_piece_that_makes_a_requested_output_is_held_to_the_answers_bound(core):
    net = _hetero(core, _abs_then_expand(), {"abs": "NUMPY", "expand": "SECOND"})
    request = net.create_infer_request()
    told = RunContext(answer=1000, outputs=("y",), network="net")
    with pytest.raises(ResourceExhausted, match=r"network 'net': node 'expand'.*output 'y'"):
        request.infer_checked([SIZES], told)
    small = request.infer_checked([np.array([2, 3], np.int64)], told)
    np.testing.assert_array_equal(small["y"], np.ones((2, 3), np.float32))


def test_a_cancelled_token_stops_every_piece_before_it_starts(core):
    net = _hetero(core, _expand_then_sum(), {"expand": "NUMPY", "sum": "SECOND"})
    token = Token()
    token.cancel()
    with pytest.raises(Cancelled):
        net.create_infer_request().infer_checked([SIZES], RunContext(token=token))


def test_multi_hands_its_device_the_requests_context(core):
    net = core.load_network(_abs_then_expand(), "MULTI:SECOND,NUMPY")
    request = net.create_infer_request()
    with pytest.raises(ResourceExhausted, match=r"network 'net': node 'expand'.*may hold"):
        request.infer_checked([SIZES], RunContext(room=1000, network="net"))
    out = request.infer_checked([np.array([2, 3], np.int64)], RunContext(room=1000))
    np.testing.assert_array_equal(out["y"], np.ones((2, 3), np.float32))


def _widened():
    """``y = expand(x, shape(x) * [1, 1000])``: each row of x ([batch, 1]) made 1,000 wide,
    4,000 bytes a row, a size its caller's input decides."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Mul", ["shape", "wide"], ["target"], name="mul"),
        helper.make_node("Expand", ["x", "target"], ["y"], name="expand"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1000])],
        [_init("wide", np.array([1, 1000], np.int64))],
        name="widened",
    )


def test_a_batch_of_several_requests_is_held_to_their_room(core):
    """Two requests gathered into one batch (BATCH_SIZE 2, a timeout far above the test's
    run: the batch runs only once both are in it), each told a room of 1,000 bytes: the
    batch's 8,000-byte output is refused for both. (Before, a batch of several ran under a
    token that kept the answers' bound but not the room, and made it.)"""
    net = core.load_network(_widened(), "BATCH:NUMPY(2)", {"BATCH_TIMEOUT_MS": "60000"})
    errors: list[BaseException | None] = [None, None]

    def one(index: int) -> None:
        request = net.create_infer_request()
        x = np.full((1, 1), float(index), np.float32)
        try:
            request.infer_checked([x], RunContext(room=1000, network="widened"))
        except BaseException as exc:
            errors[index] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    for error in errors:
        assert isinstance(error, ResourceExhausted), error
        message = str(error)
        # the two ran as one batch (it forms only once both are in), which was refused;
        # then each alone (a failed batch's requests run one by one), refused too
        assert "a run on NUMPY failed" in message
        assert "network 'widened': node 'expand' (Expand)" in message
        assert "4,000 bytes" in message and "more than this request may hold" in message
    net.close()


def test_a_batchs_context_is_its_requests_together_and_a_pieces_is_what_it_sends():
    token = Token()
    a = RunContext(network="n", outputs=("y",), room=100, answer=10, request_id="a")
    b = RunContext(network="n", outputs=("z",), room=300, answer=20, request_id="b")
    both = run_context.for_batch([a, b], token)
    assert both.token is token and both.network == "n"
    assert (both.outputs, both.room, both.answer) == (("y", "z"), 300, 30)
    assert both.request_id == ""  # no one request's id, parameters or sequence
    unbounded = run_context.for_batch([a, dataclasses.replace(b, answer=0, outputs=None)], token)
    assert (unbounded.outputs, unbounded.answer) == (None, 0)
    one = run_context.for_batch([a], token)  # a batch of one is that request, under the token
    assert one == dataclasses.replace(a, token=token)

    piece = run_context.for_piece(a, ["mid", "y"], ["y", "z"])
    assert piece.outputs == ("y",) and piece.room == 100 and piece.request_id == "a"
    assert run_context.for_piece(RunContext(), ["mid", "z"], ["y", "z"]).outputs == ("z",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.room = 0  # type: ignore[misc]


def test_a_branch_is_told_what_its_request_was_told_under_its_own_token():
    """A demultiplexed pipeline's branch (OVMS's demultiply_count) carries its request's
    parameters, priority, timeout, tenant and id to its steps, as an ensemble's step does
    (before, it carried the parameters only: its steps queued at no priority and a generative
    step's prefix cache saw the server's one tenant); not the request's bounds, which its
    gathered answer is held to."""
    request = RunContext(
        network="branches", outputs=("y",), room=100, answer=10, parameters={"k": 1},
        request_id="r1", priority=2, timeout=0.5, tenant="a", cuda_outputs={"y": object()},
    )  # fmt: skip
    token = Token()
    branch = run_context.for_branch(request, token, ("product",), None)
    assert branch.token is token and branch.outputs == ("product",)
    told = ("network", "parameters", "request_id", "priority", "timeout", "tenant")
    assert {k: getattr(branch, k) for k in told} == {k: getattr(request, k) for k in told}
    assert (branch.room, branch.answer, branch.cuda_outputs) == (0, 0, None)
    alone = run_context.for_branch(None, token, ("product",), None)
    assert (alone.token, alone.tenant, alone.priority) == (token, "", 0)


def test_a_request_class_written_without_the_run_is_refused_naming_the_signature_to_write():
    """No shim calls an old-style device without its request: the class is refused when it is
    made, and the message is the signature to write; the new-style one is made and runs."""
    from plugserve.plugins.numpy.request import NumpyInferRequest

    with pytest.raises(TypeError, match=r"_infer\(self, arrays: list\[Any\], run: RunContext\)"):

        class NoRun(NumpyInferRequest):
            def _infer(self, arrays):
                return super()._infer(arrays, RunContext())

    with pytest.raises(TypeError, match="overrides infer alone, which the server never calls"):

        class InferAlone(NumpyInferRequest):
            def infer(self, inputs, run=None):
                return super().infer(inputs, run)

    seen: list[RunContext] = []

    class Told(NumpyInferRequest):
        def _infer(self, arrays, run):
            seen.append(run)
            return super()._infer(arrays, run)

    net = Core().load_network(_abs_then_expand(), "NUMPY")
    told = RunContext(network="net", request_id="7")
    out = Told(net).infer_checked([np.array([2, 3], np.int64)], told)
    assert out["y"].shape == (2, 3) and seen == [told]
    net.close()


def test_a_run_context_crosses_a_process_as_plain_values_and_is_rebuilt_there():
    """What RAY sends its actor (``to_wire``, pickled as Ray pickles it) and what the actor
    runs under (``from_wire``): the request's description as it was, its cancellation as the
    id, its trace continuing the caller's span; never the caller's token or GPU pointers."""
    import pickle

    from plugserve.plugins.tracing import Trace

    root = Trace(lambda _t: None)
    span = root.span("compute")
    run = RunContext(
        network="net", outputs=("y",), room=1000, answer=500, parameters={"k": 1},
        partial_outputs=True, request_id="r1", sequence=(7, 1), trace=span, priority=2,
        timeout=1.5, cuda_outputs={"y": object()}, warmup=True, tenant="acme",
    )  # fmt: skip
    wire = pickle.loads(pickle.dumps(run_context.to_wire(run, "run-9")))
    assert wire["cancel"] == "run-9" and "cuda_outputs" not in wire and "token" not in wire
    token = Token()
    there = run_context.from_wire(wire, token)
    assert there.token is token and there.cuda_outputs is None
    assert dataclasses.replace(there, token=run.token, trace=span, cuda_outputs=None) == (
        dataclasses.replace(run, cuda_outputs=None)
    )
    assert there.trace is not None and there.trace.traceparent().split("-")[1] == (
        f"{root.ids_of_trace():032x}"
    )
    assert there.trace.parent_span_id == span.ids()
    untraced = run_context.from_wire(run_context.to_wire(RunContext(), "run-10"), Token())
    assert untraced.trace is None and untraced.outputs is None and untraced.sequence is None
