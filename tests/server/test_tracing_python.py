"""A Python model's traces as users see them (issue 43): a real server exports OTLP over HTTP to a
real receiver on 127.0.0.1 (``tests/support/otlp.py``), driven by tritonclient with the W3C
``traceparent`` a traced client sends. The model's ``execute`` is a span of its own under the
request's run (``compute``), timed in the model's process; each BLS call it makes is a ``bls``
span under ``execute``, with the called model's spans (its model span, queue and compute) under
that; a failure is recorded on the span it ended (docs/tracing.md).

The server traces only requests that carry a ``traceparent`` (``rate=0``), so a request sent
without one (and the BLS calls its execute makes) must leave no trace: the tests send a traced
marker after it and wait for the marker's trace, since traces leave in the order their requests
ended.
"""

from __future__ import annotations

import queue
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from models import add_sub
from serving import RunningServer
from traced import grpcclient, otlp
from tritonclient.utils import InferenceServerException

X = np.arange(4, dtype=np.float32)
Y = np.ones(4, dtype=np.float32)
#: how long the caller's execute sleeps before and after its BLS call (a lower bound on the
#: gaps between its spans' times, which the model's process measured)
PAUSE = 0.05

CALLER_CONFIG = """
name: "caller"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "STAMPS" data_type: TYPE_INT64 dims: [ 2 ] } ]
"""

#: calls add_sub (or the model its "target" parameter names) through BLS, PAUSE after its
#: execute starts and PAUSE before it returns; answers add_sub's OUTPUT0 (zeros when the call
#: failed) and its own clock's times at its execute's first and last lines. INPUT0[0] == 7:
#: execute raises.
CALLER = f"""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        first = time.time_ns()
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            if in_0.as_numpy()[0] == 7:
                raise ValueError("seven is not allowed here")
            target = json.loads(request.parameters()).get("target", "add_sub")
            time.sleep({PAUSE})
            call = pb_utils.InferenceRequest(
                model_name=target, requested_output_names=["OUTPUT0"], inputs=[in_0, in_1])
            answer = call.exec()
            if answer.has_error():
                out = np.zeros(4, np.float32)
            else:
                out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            time.sleep({PAUSE})
            stamps = np.array([first, time.time_ns()], np.int64)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", out), pb_utils.Tensor("STAMPS", stamps)]))
        return responses
"""

STREAMER_CONFIG = """
name: "streamer"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

#: a decoupled model: one BLS call to add_sub, then its OUTPUT0 as two responses and the final
#: flag, all from execute
STREAMER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            call = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"],
                inputs=request.inputs())
            out = pb_utils.get_output_tensor_by_name(call.exec(), "OUTPUT0")
            for _ in range(2):
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

LAGGER_CONFIG = STREAMER_CONFIG.replace('name: "streamer"', 'name: "lagger"')

#: a decoupled model whose request of INPUT0[0] == 1 is answered by a thread of its own, which
#: waits for a request of INPUT0[0] == 2 to be in its execute and then makes a BLS call (without
#: ``trace=``); the second request is answered from its execute, which lasts 0.5 s. The first's
#: answer is 1.0 when its call was made and answered while the second's execute ran, else 0.0
LAGGER = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.go = threading.Event()
        self.running = False

    def execute(self, requests):
        for request in requests:
            first = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0]
            if first == 1:
                self.go.clear()
                threading.Thread(target=self._later, args=(request,)).start()
                continue
            self.running = True
            self.go.set()
            time.sleep(0.5)  # the thread's call is made meanwhile
            self.running = False
            out = pb_utils.Tensor("OUTPUT0", request.inputs()[0].as_numpy())
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _later(self, request):
        self.go.wait(30)
        call = pb_utils.InferenceRequest(
            model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=request.inputs())
        call.exec()
        during = np.full(4, 1.0 if self.running else 0.0, np.float32)
        request.get_response_sender().send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUTPUT0", during)]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

BATCHED_CONFIG = """
name: "batched"
backend: "python"
max_batch_size: 2
dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 5000000 }
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "COUNT" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""

#: dynamically batched: each request of the execute calls add_sub under its own trace
#: (``trace=request.trace()``), and answers how many requests its execute had
BATCHED = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            assert request.trace().get_context() is not None
            call = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", a[0]), pb_utils.Tensor("INPUT1", b[0])],
                trace=request.trace())
            out = pb_utils.get_output_tensor_by_name(call.exec(), "OUTPUT0").as_numpy()
            count = np.array([[len(requests)]], np.int64)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", out[None]), pb_utils.Tensor("COUNT", count)]))
        return responses
"""


def _repository(folder: Path) -> Path:
    repo = folder / "repo"
    (repo / "add_sub" / "1").mkdir(parents=True)
    (repo / "add_sub" / "1" / "model.onnx").write_bytes(add_sub().SerializeToString())
    (repo / "add_sub" / "config.json").write_text('{"device": "NUMPY"}')
    for name, config, model in (
        ("caller", CALLER_CONFIG, CALLER),
        ("streamer", STREAMER_CONFIG, STREAMER),
        ("batched", BATCHED_CONFIG, BATCHED),
        ("lagger", LAGGER_CONFIG, LAGGER),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(model))
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    repo = _repository(tmp_path_factory.mktemp("tracing-python"))
    args = [
        "--model-repository", str(repo),
        *otlp.server_flags(receiver.url),  # only requests with a traceparent
    ]  # fmt: skip
    with RunningServer(*args) as running:
        yield running


@pytest.fixture
def triton(server, receiver):
    with grpcclient.InferenceServerClient(server.target) as client:
        yield client
    receiver.clear()


def _traceparent() -> tuple[str, str, str]:
    """A client's W3C header: (header, its trace id, its span id)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _inputs(first: float = 0.0, batch: bool = False) -> list:
    shape = [1, 4] if batch else [4]
    inputs = [grpcclient.InferInput(n, shape, "FP32") for n in ("INPUT0", "INPUT1")]
    inputs[0].set_data_from_numpy((X + first).reshape(shape))
    inputs[1].set_data_from_numpy(Y.reshape(shape))
    return inputs


def _spans(receiver, trace_id: str, names: list[str]) -> dict[str, list]:
    """The trace's spans by name, once each of ``names`` has arrived."""
    assert receiver.wait(lambda r: {s.name for s in r.traces().get(trace_id, [])} >= set(names)), (
        f"{names} did not all arrive: {[s.name for s in receiver.traces().get(trace_id, [])]}"
    )
    found: dict[str, list] = {}
    for span in receiver.traces()[trace_id]:
        found.setdefault(span.name, []).append(span)
    return found


def _one(spans: dict[str, list], name: str, parent) -> object:
    """The span ``name`` under ``parent`` (one of them)."""
    (span,) = [s for s in spans.get(name, []) if s.parent_span_id == parent.span_id]
    return span


def _within(inner, outer) -> None:
    assert outer.start_ns <= inner.start_ns <= inner.end_ns <= outer.end_ns


def test_execute_and_its_bls_call_are_spans_under_the_request(server, receiver, triton):
    """A traced request to a Python model making a BLS call: the client's trace id; the
    model's execute under the request's run, with the times its process measured (its first
    and last lines, which the model answers, fall within them; its pauses around the call
    separate them from the call's span); the call's span under execute, and under it the
    called model's own spans: model span, queue, compute."""
    header, trace_id, parent = _traceparent()
    result = triton.infer("caller", _inputs(), request_id="py-1", headers={"traceparent": header})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X + Y)
    first, last = (int(t) for t in result.as_numpy("STAMPS"))
    spans = _spans(
        receiver, trace_id, ["InferRequest", "caller", "execute", "bls", "add_sub", "compute"]
    )
    (root,) = spans["InferRequest"]
    assert root.parent_span_id == parent
    model = _one(spans, "caller", root)
    compute = _one(spans, "compute", model)
    execute = _one(spans, "execute", compute)
    bls = _one(spans, "bls", execute)
    called = _one(spans, "add_sub", bls)
    called_queue = _one(spans, "queue", called)
    called_compute = _one(spans, "compute", called)
    for span in (execute, bls, called, called_queue, called_compute):
        assert span.trace_id == trace_id and not span.failed
    assert execute.attributes["triton.model_name"] == "caller"
    assert execute.attributes["plugserve.device"] == "PYTHON"
    assert execute.attributes["plugserve.instance"] == "python model 'caller' (instance 0)"
    assert execute.attributes["triton.request_id"] == "py-1"
    assert bls.attributes["plugserve.bls_model"] == "add_sub"
    assert called.attributes["triton.model_name"] == "add_sub"
    assert called.attributes["plugserve.device"] == "NUMPY"
    assert called.attributes["plugserve.inputs"] == 2
    _within(execute, compute)
    _within(bls, execute)
    _within(called, bls)
    _within(called_queue, called)
    _within(called_compute, called)
    assert execute.start_ns <= first and last <= execute.end_ns  # the process's own clock
    pause = int(PAUSE * 1e9)
    assert bls.start_ns - execute.start_ns >= pause
    assert execute.end_ns - bls.end_ns >= pause


def test_a_failed_bls_call_and_a_failed_execute_are_recorded(server, receiver, triton):
    """A BLS call to a model the server does not have: its span says why (the model goes on
    and answers); an execute that raises: its span and the request's fail with the model's
    reason."""
    header, trace_id, _ = _traceparent()
    result = triton.infer(
        "caller", _inputs(), parameters={"target": "nowhere"}, headers={"traceparent": header}
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.zeros(4, np.float32))
    spans = _spans(receiver, trace_id, ["InferRequest", "execute", "bls"])
    (execute,) = spans["execute"]
    (bls,) = spans["bls"]
    assert (
        bls.parent_span_id == execute.span_id and bls.attributes["plugserve.bls_model"] == "nowhere"
    )
    assert bls.failed and "nowhere" in bls.status_message
    (event,) = [attributes for name, attributes in bls.events if name == "exception"]
    assert event["exception.type"] == "NotFound"
    assert not execute.failed and "add_sub" not in spans and "caller" in spans

    header, trace_id, _ = _traceparent()
    with pytest.raises(InferenceServerException, match="seven is not allowed"):
        triton.infer("caller", _inputs(first=7.0), headers={"traceparent": header})
    spans = _spans(receiver, trace_id, ["InferRequest", "execute"])
    (execute,) = spans["execute"]
    (root,) = spans["InferRequest"]
    assert execute.failed and "seven is not allowed here" in execute.status_message
    assert root.failed and "bls" not in spans


def test_a_decoupled_models_execute_and_bls_call_are_traced(server, receiver, triton):
    """A decoupled Python model answering over a gRPC stream: its execute is a span of the
    request's trace, and the BLS call it makes goes under it with the called model's spans."""
    header, trace_id, _ = _traceparent()
    answers: queue.Queue = queue.Queue()
    triton.start_stream(lambda result, error: answers.put(error), headers={"traceparent": header})
    try:
        triton.async_stream_infer("streamer", _inputs(), request_id="stream-1")
        assert [answers.get(timeout=30) for _ in range(2)] == [None, None]
        spans = _spans(receiver, trace_id, ["InferRequest", "streamer", "execute", "bls"])
    finally:
        triton.stop_stream()
    ids = {s.span_id for group in spans.values() for s in group}
    (execute,) = spans["execute"]
    assert execute.parent_span_id in ids and not execute.failed
    bls = _one(spans, "bls", execute)
    _one(spans, "add_sub", bls)
    _within(bls, execute)


def test_requests_batched_into_one_execute_keep_their_own_traces(server, receiver, triton):
    """Two traced requests that the dynamic batcher hands to one execute: each trace has an
    execute span of that execute (the same times), and the BLS call each request's part made
    with ``trace=request.trace()`` goes under its own request's execute, in its own trace."""
    answers: queue.Queue = queue.Queue()
    traces = [_traceparent() for _ in range(2)]
    for header, _, _ in traces:
        triton.async_infer(
            "batched", _inputs(batch=True), lambda result, error: answers.put((result, error)),
            headers={"traceparent": header},
        )  # fmt: skip
    for _ in traces:
        result, error = answers.get(timeout=30)
        assert error is None
        assert result.as_numpy("COUNT").tolist() == [[2]]  # one execute for both
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), (X + Y)[None])
    executes = []
    for _, trace_id, _ in traces:
        spans = _spans(receiver, trace_id, ["InferRequest", "execute", "bls", "add_sub"])
        (execute,) = spans["execute"]
        bls = _one(spans, "bls", execute)
        _one(spans, "add_sub", bls)
        executes.append(execute)
    first, second = executes
    assert (first.start_ns, first.end_ns) == (second.start_ns, second.end_ns)
    assert first.span_id != second.span_id


def test_an_untraced_request_and_its_bls_call_leave_no_trace(server, receiver, triton):
    """Without a traceparent (the server traces no other request here), neither the Python
    model's request nor the BLS call its execute makes is traced."""
    result = triton.infer("caller", _inputs(), request_id="untraced")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X + Y)
    header, trace_id, _ = _traceparent()
    triton.infer("add_sub", _inputs(), request_id="marker", headers={"traceparent": header})
    _spans(receiver, trace_id, ["InferRequest", "add_sub"])
    assert set(receiver.traces()) == {trace_id}


def test_a_decoupled_models_thread_does_not_take_another_requests_trace(server, receiver):
    """An untraced request that a decoupled model answers from its own thread: the BLS call
    the thread makes while a traced request's execute runs is not traced under that execute
    (a thread is outside any execute). Before, the traced execute's span was the process's,
    so the first request's call went into the second request's trace."""
    for _ in range(3):  # until the call was made during the traced execute (their order)
        header, trace_id, _ = _traceparent()
        during = _held_then_traced(server, header)
        if during:
            break
    assert during, "the thread's call was never made while the traced execute ran"
    marker, marker_id, _ = _traceparent()
    with grpcclient.InferenceServerClient(server.target) as client:
        client.infer("add_sub", _inputs(), request_id="marker", headers={"traceparent": marker})
    _spans(receiver, marker_id, ["InferRequest", "add_sub"])
    spans = _spans(receiver, trace_id, ["InferRequest", "lagger", "execute"])
    assert "bls" not in spans and "add_sub" not in spans, sorted(spans)
    receiver.clear()


def _held_then_traced(server, header: str) -> bool:
    """The lagger's untraced request, then (once it is likely in) a traced one: whether the
    first one's call was made while the second one's execute ran."""
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.target) as held, \
            grpcclient.InferenceServerClient(server.target) as traced:  # fmt: skip
        held.start_stream(lambda result, error: answers.put(("held", result, error)))
        traced.start_stream(lambda result, error: answers.put(("traced", result, error)),
                            headers={"traceparent": header})  # fmt: skip
        held.async_stream_infer("lagger", _inputs(first=1.0))
        time.sleep(0.2)
        traced.async_stream_infer("lagger", _inputs(first=2.0))
        got = {who: (result, error) for who, result, error in
               (answers.get(timeout=30) for _ in range(2))}  # fmt: skip
        held.stop_stream()
        traced.stop_stream()
    assert got["held"][1] is None and got["traced"][1] is None, got
    return bool(got["held"][0].as_numpy("OUTPUT0")[0] == 1.0)
