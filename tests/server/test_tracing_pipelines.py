"""Traces through every stage, as users see them (issue 43): a real server exports OTLP over
HTTP to a real receiver on 127.0.0.1 (``tests/support/otlp.py``), driven by real clients with
the W3C ``traceparent`` a traced client sends:

* a Triton ensemble of two ONNX steps (tritonclient gRPC): a span per step under the
  ensemble's model span, each step's model spans under its step's;
* an ensemble with a decoupled step (a Python model answering one response per element, then
  ONNX on each response) over a gRPC stream: the decoupled step's span lasts its stream, the
  step after it has a span per response it ran on, and decoupled requests have their queue
  wait and run as spans;
* an OVMS DAG with a demultiplexer: a span per branch under the fan's step, the nodes of each
  branch under their branch;
* an ensemble whose Python step makes a BLS call: the step's model span, its ``execute``
  timed in the model's process, the ``bls`` call under it and the called model under that;
* plugserve.v1 ``Infer`` (its own gRPC stub), and REST ``generate`` and ``generate_stream``.

Every span of a request carries the client's trace id; a trace's spans reach the receiver in
one export, so waiting for the trace id to arrive is waiting for the whole trace.
"""

from __future__ import annotations

import json
import queue
import textwrap
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
from models import add_sub, chain
from onnx import TensorProto
from serving import RunningServer
from traced import grpcclient, otlp

#: a decoupled Python model: one response per element of IN (OUT = [element]) from a thread,
#: then the final flag
REPEAT = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(sender, values), daemon=True).start()
        return None

    def respond(self, sender, values):
        for value in values:
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([value], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

#: a Python model that adds through a BLS call to add_sub (OUT = IN + BIAS)
CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            bias = pb_utils.get_input_tensor_by_name(request, "BIAS").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", value), pb_utils.Tensor("INPUT1", bias)],
                trace=request.trace(),
            )
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""

CALLER_CONFIG = """
name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "BIAS" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

REPEAT_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(name: str, dims: str, steps: list[str]) -> str:
    return textwrap.dedent(f"""
        name: "{name}"
        platform: "ensemble"
        max_batch_size: 0
        input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ {dims} ] }},
                {{ name: "BIAS" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        output [ {{ name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }},
                 {{ name: "DIFF" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
        """)


def _repository(root: Path) -> Path:
    """add_sub (INPUT0 +- INPUT1 over [1] int32, ONNX on NUMPY); ``chain``: add_sub twice
    (SUM = 2 IN, DIFF = 2 BIAS); ``repeat`` (decoupled, Python); ``stream_add``: repeat, then
    add_sub on each response (SUM = element + BIAS, DIFF = element - BIAS)."""
    (root / "add_sub" / "1").mkdir(parents=True)
    model = add_sub(TensorProto.INT32, (1,)).SerializeToString()
    (root / "add_sub" / "1" / "model.onnx").write_bytes(model)
    (root / "add_sub" / "config.json").write_text('{"device": "NUMPY"}')
    (root / "repeat" / "1").mkdir(parents=True)
    (root / "repeat" / "config.pbtxt").write_text(REPEAT_CONFIG)
    (root / "repeat" / "1" / "model.py").write_text(REPEAT)
    chain = _ensemble("chain", "1", [
        _step("add_sub", {"INPUT0": "IN", "INPUT1": "BIAS"}, {"OUTPUT0": "s", "OUTPUT1": "d"}),
        _step("add_sub", {"INPUT0": "s", "INPUT1": "d"}, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
    ])  # fmt: skip
    stream_add = _ensemble("stream_add", "-1", [
        _step("repeat", {"IN": "IN"}, {"OUT": "token"}),
        _step("add_sub", {"INPUT0": "token", "INPUT1": "BIAS"},
              {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
    ])  # fmt: skip
    (root / "caller" / "1").mkdir(parents=True)
    (root / "caller" / "config.pbtxt").write_text(CALLER_CONFIG)
    (root / "caller" / "1" / "model.py").write_text(CALLER)
    # the Python step's BLS call adds BIAS to IN, then add_sub adds and subtracts BIAS again
    with_bls = _ensemble("with_bls", "1", [
        _step("caller", {"IN": "IN", "BIAS": "BIAS"}, {"OUT": "added"}),
        _step("add_sub", {"INPUT0": "added", "INPUT1": "BIAS"},
              {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
    ])  # fmt: skip
    for name, config in (("chain", chain), ("stream_add", stream_add), ("with_bls", with_bls)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    return root


def _traced_flags(receiver) -> list[str]:
    return otlp.server_flags(receiver.url)


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver):
    repo = _repository(tmp_path_factory.mktemp("tracing-pipelines"))
    with RunningServer("--model-repository", str(repo), *_traced_flags(receiver)) as running:
        yield running


def _traceparent() -> tuple[str, str, str]:
    """A client's W3C header: (header, its trace id, its span id)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _spans(receiver, trace_id: str) -> list:
    assert receiver.wait(lambda r: trace_id in r.traces()), "the trace never arrived"
    return receiver.traces()[trace_id]


def _named(spans: list, name: str) -> list:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


def _children(spans: list, parent, name: str | None = None) -> list:
    return sorted(
        (s for s in spans if s.parent_span_id == parent.span_id and name in (None, s.name)),
        key=lambda s: s.start_ns,
    )


def _int32(name: str, values: list[int]):
    tensor = grpcclient.InferInput(name, [len(values)], "INT32")
    tensor.set_data_from_numpy(np.array(values, np.int32))
    return tensor


def test_an_ensembles_steps_are_spans_under_its_model_span(server, receiver):
    """chain's two ONNX steps, called with a traceparent: the ensemble's model span has a
    span per step (Triton's "step N", naming the step's model), one after the other, and
    each step's own request (its model span and run) opens under its step's span; every
    span carries the client's trace id and the request's id."""
    header, trace_id, parent = _traceparent()
    with grpcclient.InferenceServerClient(server.target) as triton:
        result = triton.infer(
            "chain",
            [_int32("IN", [5]), _int32("BIAS", [3])],
            request_id="chain-1",
            headers={"traceparent": header},
        )
    assert result.as_numpy("SUM").tolist() == [10] and result.as_numpy("DIFF").tolist() == [6]
    spans = _spans(receiver, trace_id)
    (root,) = _named(spans, "InferRequest")
    assert root.parent_span_id == parent
    (ensemble,) = _children(spans, root, "chain")
    steps = _children(spans, ensemble, "step 0") + _children(spans, ensemble, "step 1")
    assert [s.attributes["plugserve.step_model"] for s in steps] == ["add_sub", "add_sub"]
    assert [s.attributes["plugserve.step"] for s in steps] == [0, 1]
    assert steps[0].end_ns <= steps[1].start_ns  # step 1 reads what step 0 wrote
    assert ensemble.start_ns <= steps[0].start_ns and steps[1].end_ns <= ensemble.end_ns
    for step in steps:
        assert step.attributes["triton.model_name"] == "chain"  # the ensemble's stage
        (model,) = _children(spans, step, "add_sub")
        assert model.attributes["triton.model_name"] == "add_sub"
        assert model.attributes["plugserve.device"] == "NUMPY"
        assert model.attributes["plugserve.inputs"] == 2
        assert [c.name for c in _children(spans, model, "compute")] == ["compute"]
        assert step.start_ns <= model.start_ns and model.end_ns <= step.end_ns
    assert [c.name for c in _children(spans, ensemble, "compute")] == ["compute"]
    assert {s.attributes["triton.request_id"] for s in spans} == {"chain-1"}
    assert not any(s.failed for s in spans)


def test_an_ensembles_python_step_and_its_bls_call_are_in_the_clients_trace(server, receiver):
    """with_bls over KServe gRPC with a traceparent: the ensemble's model span has a span per
    step; under the Python step's model span its run's ``execute`` (timed in the model's own
    process), under that the BLS call's ``bls`` span and the called model's spans; the ONNX
    step after it is a step of its own; one trace, the client's, from root to the BLS call."""
    header, trace_id, parent = _traceparent()
    with grpcclient.InferenceServerClient(server.target) as triton:
        result = triton.infer(
            "with_bls",
            [_int32("IN", [5]), _int32("BIAS", [3])],
            request_id="bls-1",
            headers={"traceparent": header},
        )
    assert result.as_numpy("SUM").tolist() == [11] and result.as_numpy("DIFF").tolist() == [5]
    spans = _spans(receiver, trace_id)
    by_id = {s.span_id: s for s in spans}

    def path(span) -> list[str]:
        names = []
        while span is not None:
            names.append(span.name)
            span = by_id.get(span.parent_span_id)
        return names[::-1]

    (root,) = _named(spans, "InferRequest")
    assert root.parent_span_id == parent
    (ensemble,) = _children(spans, root, "with_bls")
    step0, step1 = _children(spans, ensemble, "step 0"), _children(spans, ensemble, "step 1")
    assert len(step0) == len(step1) == 1
    (caller,) = _children(spans, step0[0], "caller")
    (execute,) = _named(spans, "execute")
    assert "caller" in path(execute) and path(execute)[:3] == ["InferRequest", "with_bls", "step 0"]
    (bls,) = _named(spans, "bls")
    assert bls.parent_span_id == execute.span_id
    assert bls.attributes["plugserve.bls_model"] == "add_sub"
    called = [s for s in _named(spans, "add_sub") if "bls" in path(s)]
    assert len(called) == 1 and _children(spans, called[0], "compute")
    assert execute.start_ns <= bls.start_ns and bls.end_ns <= execute.end_ns
    (after,) = _children(spans, step1[0], "add_sub")
    assert "bls" not in path(after)
    assert caller.start_ns <= execute.start_ns
    assert not any(s.failed for s in spans)


def test_a_decoupled_steps_span_lasts_its_stream(server, receiver):
    """stream_add over ModelStreamInfer with a traceparent: the decoupled step (repeat) has
    one span, from its request to its last response, with the step's model span under it
    (its queue wait and its run too, as every decoupled request now has); the ONNX step after
    it has a span per response it ran on, each under the ensemble's model span; the model
    spans count the responses."""
    header, trace_id, _ = _traceparent()
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.target) as triton:
        triton.start_stream(lambda result, error: answers.put((result, error)),
                            headers={"traceparent": header})  # fmt: skip
        triton.async_stream_infer(
            "stream_add",
            [_int32("IN", [1, 2, 3]), _int32("BIAS", [10])],
            request_id="stream-1",
            enable_empty_final_response=True,
        )
        sums = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                break
            sums.append(int(result.as_numpy("SUM")[0]))
        triton.stop_stream()
    assert sums == [11, 12, 13]
    spans = _spans(receiver, trace_id)
    (ensemble,) = _named(spans, "stream_add")
    assert ensemble.attributes["plugserve.responses"] == 3
    assert [s.name for s in _children(spans, ensemble) if s.name in ("queue", "compute")] == [
        "queue",
        "compute",
    ]
    (first,) = _children(spans, ensemble, "step 0")
    assert first.attributes["plugserve.step_model"] == "repeat"
    (repeat,) = _children(spans, first, "repeat")
    assert repeat.attributes["plugserve.responses"] == 3
    assert [s.name for s in _children(spans, repeat) if s.name in ("queue", "compute")] == [
        "queue",
        "compute",
    ]
    assert first.start_ns <= repeat.start_ns and repeat.end_ns <= first.end_ns
    after = _children(spans, ensemble, "step 1")
    assert len(after) == 3  # one per response of repeat
    for step in after:
        (model,) = _children(spans, step, "add_sub")
        assert model.attributes["plugserve.outputs"] == 2
    assert {s.attributes.get("triton.request_id") for s in spans} == {"stream-1"}
    assert not any(s.failed for s in spans)


def _float32(name: str, values: np.ndarray):
    tensor = grpcclient.InferInput(name, list(values.shape), "FP32")
    tensor.set_data_from_numpy(values)
    return tensor


def test_a_dags_demultiplexer_has_a_span_per_branch(tmp_path, receiver):
    """An OVMS pipeline whose node 'split' demultiplexes into 3 branches of node 'each': the
    fan is a step span under the pipeline's model span, each branch a span under it, and
    each branch's node a step span (its model's spans under it) under its branch; a node's
    step span is named as messages name it (node 'split')."""
    pytest.importorskip("openvino", reason="pip install -e '.[openvino]'")
    # split: Neg over [3, 1, 4], each: Abs over [1, 4] (x -> y, as models.chain names them)
    for name, model in (("split3", chain([("Neg", {})], shape=(3, 1, 4), name="split3")),
                        ("mul", chain([("Abs", {})], shape=(1, 4), name="mul"))):  # fmt: skip
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.onnx").write_bytes(model.SerializeToString())

    def node(name, model, inputs, outputs, **extra):
        return {
            "name": name,
            "model_name": model,
            "type": "DL model",
            "inputs": [{k: {"node_name": n, "data_item": i}} for k, (n, i) in inputs.items()],
            "outputs": [{"data_item": k, "alias": v} for k, v in outputs.items()],
            **extra,
        }

    pipeline = {
        "name": "branches",
        "inputs": ["x"],
        "nodes": [
            node("split", "split3", {"x": ("request", "x")}, {"y": "items"}, demultiply_count=3),
            node("each", "mul", {"x": ("split", "items")}, {"y": "product"}),
        ],
        "outputs": [{"y": {"node_name": "each", "data_item": "product"}}],
    }
    config = {
        "model_config_list": [{"config": {"name": n, "base_path": n}} for n in ("split3", "mul")],
        "pipeline_config_list": [pipeline],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    header, trace_id, _ = _traceparent()
    x = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    flags = _traced_flags(receiver)
    with (
        RunningServer("--model-repository", str(tmp_path / "config.json"), *flags) as running,
        grpcclient.InferenceServerClient(running.target) as triton,
    ):
        result = triton.infer("branches", [_float32("x", x)], headers={"traceparent": header})
        np.testing.assert_allclose(result.as_numpy("y"), np.abs(-x))
        spans = _spans(receiver, trace_id)
    (pipeline_span,) = _named(spans, "branches")
    (split,) = _children(spans, pipeline_span, "node 'split'")
    assert [s.name for s in _children(spans, split)] == ["split3"]
    (fan,) = _children(spans, pipeline_span, "the branches of node 'split'")
    assert fan.attributes["plugserve.branches"] == 3
    assert split.end_ns <= fan.start_ns
    branches = _children(spans, fan)
    assert sorted(b.name for b in branches) == ["branch 0", "branch 1", "branch 2"]
    for branch in branches:
        (each,) = _children(spans, branch, "node 'each'")
        (mul,) = _children(spans, each, "mul")
        assert mul.attributes["triton.model_name"] == "mul"
        assert branch.start_ns <= each.start_ns and each.end_ns <= branch.end_ns
        assert fan.start_ns <= branch.start_ns and branch.end_ns <= fan.end_ns


def test_plugserve_v1_infer_is_traced(server, receiver):
    """plugserve.v1 Infer with a traceparent in its metadata (the service's own stub):
    InferRequest under the client's span, the network's span and run under it."""
    import grpc

    from plugserve.proto import plugserve_pb2 as pb
    from plugserve.proto import plugserve_pb2_grpc as pb_grpc

    header, trace_id, parent = _traceparent()
    request = pb.InferRequest(network="add_sub", id="v1-1")
    for name, value in (("INPUT0", 7), ("INPUT1", 2)):
        request.inputs.add(name=name, dtype="int32", shape=[1],
                           data=np.array([value], np.int32).tobytes())  # fmt: skip
    with grpc.insecure_channel(server.target) as channel:
        answer = pb_grpc.PlugserveStub(channel).Infer(
            request, metadata=[("traceparent", header)], timeout=60
        )
    outputs = {t.name: np.frombuffer(t.data, np.int32).tolist() for t in answer.outputs}
    assert outputs == {"OUTPUT0": [9], "OUTPUT1": [5]}
    spans = _spans(receiver, trace_id)
    (root,) = _named(spans, "InferRequest")
    assert root.parent_span_id == parent
    assert root.attributes["plugserve.protocol"] == "GRPC"
    assert root.attributes["triton.request_id"] == "v1-1"
    assert root.attributes["plugserve.request_bytes"] > 0
    assert root.attributes["plugserve.response_bytes"] > 0
    (model,) = _children(spans, root, "add_sub")
    assert model.attributes["plugserve.device"] == "NUMPY"
    assert [s.name for s in _children(spans, model, "compute")] == ["compute"]


def _post(server, path: str, body: dict, header: str) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://{server.http_target}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "traceparent": header},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status, answer.read()


def test_rest_generate_is_traced(server, receiver):
    """Triton's generate extension: /generate with a traceparent header is an InferRequest
    span (HTTP, the reply's bytes) with the model's spans under it."""
    header, trace_id, parent = _traceparent()
    body = {"INPUT0": [4], "INPUT1": [1], "id": "gen-1"}
    status, data = _post(server, "/v2/models/add_sub/generate", body, header)
    assert status == 200 and json.loads(data)["OUTPUT0"] == 5
    spans = _spans(receiver, trace_id)
    (root,) = _named(spans, "InferRequest")
    assert root.parent_span_id == parent
    assert root.attributes["plugserve.protocol"] == "HTTP"
    assert root.attributes["triton.request_id"] == "gen-1"
    assert root.attributes["plugserve.response_bytes"] == len(data)
    (model,) = _children(spans, root, "add_sub")
    assert model.attributes["plugserve.outputs"] == 2


def test_rest_generate_stream_is_traced_to_its_last_response(server, receiver):
    """/generate_stream of a decoupled model: one event per response, and a trace whose
    model span counts them, with the model's queue wait and run under it."""
    header, trace_id, _ = _traceparent()
    status, data = _post(server, "/v2/models/repeat/generate_stream", {"IN": [4, 5]}, header)
    events = [
        json.loads(line[5:]) for line in data.decode().splitlines() if line.startswith("data:")
    ]
    assert status == 200 and [e["OUT"] for e in events] == [4, 5]
    spans = _spans(receiver, trace_id)
    (root,) = _named(spans, "InferRequest")
    (model,) = _children(spans, root, "repeat")
    assert model.attributes["plugserve.responses"] == 2
    assert [s.name for s in _children(spans, model) if s.name in ("queue", "compute")] == [
        "queue",
        "compute",
    ]
    assert model.end_ns <= root.end_ns and not root.failed
