"""Ensembles with a decoupled step (issue 36: Triton runs them; a generative model's
tokenizer -> decoder -> detokenizer ensemble is one), against a real server with tritonclient
and REST: each response of the decoupled step runs the steps after it once more and answers as
one response of the ensemble, in the step's order, then the final flag; the ensemble is
decoupled itself (its config says so, a unary call is refused as Triton refuses it); a step
after the decoupled one may also read an ensemble input (which Triton refuses and plugserve
runs); an error response of the step fails the request after the responses before it; a client
that goes away cancels the decoupled step (its model sees ``is_cancelled()``); and a step fed by
two decoupled steps neither of which follows the other is refused at load with Triton's words,
while the other models serve."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
from triton_stream import TritonStream  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

#: a decoupled Python model: one response per element of IN (OUT = [element]) from a thread,
#: then the final flag; 13 answers an error response; -1 sends slowly until cancelled, and
#: says so in the server's log; -3 answers 1 once 20 requests wait for it at once (else 0)
REPEAT = """
import os
import threading
import time
import uuid
import numpy as np
import triton_python_backend_utils as pb_utils

MEETING = 20


class TritonPythonModel:
    def initialize(self, args):
        self.meeting = os.path.join(args["model_repository"], "..", "meeting")

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(
                target=self.respond, args=(request, sender, values), daemon=True).start()
        return None

    def respond(self, request, sender, values):
        for value in values:
            if value == -3:  # answers once MEETING requests wait here at once (30 s at most)
                os.makedirs(self.meeting, exist_ok=True)
                open(os.path.join(self.meeting, uuid.uuid4().hex), "w").close()
                end = time.monotonic() + 30
                while len(os.listdir(self.meeting)) < MEETING and time.monotonic() < end:
                    time.sleep(0.05)
                met = len(os.listdir(self.meeting)) >= MEETING
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([int(met)], np.int32))]))
                break
            if value == -1:
                for _ in range(300):
                    if request.is_cancelled():
                        pb_utils.Logger.log_info("[repeat] request cancelled")
                        break
                    sender.send(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([7], np.int32))]))
                    time.sleep(0.1)
                break
            error = pb_utils.TritonError("thirteen is unlucky") if value == 13 else None
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([value], np.int32))], error=error))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

REPEAT_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""

INPUTS = """
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
        { name: "BIAS" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
OUTPUTS = """
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "DIFF" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(name: str, steps: list[str]) -> str:
    return (
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 0\n{INPUTS}{OUTPUTS}'
        f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}\n"
    )


def _write(root: Path, name: str, config: str, files: dict[str, bytes | str]) -> None:
    (root / name / "1").mkdir(parents=True)  # an ensemble's version folder is empty
    (root / name / "config.pbtxt").write_text(config)
    for relative, content in files.items():
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(textwrap.dedent(content))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from models import add_sub
    from onnx import TensorProto
    from serving import RunningServer

    root = tmp_path_factory.mktemp("ensembles-decoupled")
    for name in ("repeat", "repeat_too"):
        _write(root, name, REPEAT_CONFIG.format(name=name), {"1/model.py": REPEAT})
    # INPUT0 + INPUT1, INPUT0 - INPUT1 on [1] int32, an ONNX graph on NUMPY
    (root / "add_sub" / "1").mkdir(parents=True)
    add = add_sub(TensorProto.INT32, (1,)).SerializeToString()
    (root / "add_sub" / "1" / "model.onnx").write_bytes(add)
    (root / "add_sub" / "config.json").write_text('{"device": "NUMPY"}')
    # each element of IN, plus and minus BIAS, one response each
    _write(root, "stream_add", _ensemble("stream_add", [
        _step("repeat", {"IN": "IN"}, {"OUT": "token"}),
        _step("add_sub", {"INPUT0": "token", "INPUT1": "BIAS"},
              {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
    ]), {})  # fmt: skip
    # two decoupled steps whose responses meet in one step: no response pairs with another
    _write(root, "crossed", _ensemble("crossed", [
        _step("repeat", {"IN": "IN"}, {"OUT": "a"}),
        _step("repeat_too", {"IN": "IN"}, {"OUT": "b"}),
        _step("add_sub", {"INPUT0": "a", "INPUT1": "b"}, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
    ]), {})  # fmt: skip
    with RunningServer("--model-repository", str(root), "--exit-on-error", "0") as server:
        yield server


class Stream(TritonStream):
    """A stream of requests to ``stream_add``."""

    def __init__(self, running) -> None:
        super().__init__(running.target)

    def send(self, values: list[int], bias: int = 10, outputs: list[str] | None = None) -> None:
        given = grpcclient.InferInput("IN", [len(values)], "INT32")
        given.set_data_from_numpy(np.array(values, np.int32))
        shift = grpcclient.InferInput("BIAS", [1], "INT32")
        shift.set_data_from_numpy(np.array([bias], np.int32))
        asked = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        self.client.async_stream_infer(
            "stream_add", [given, shift], outputs=asked, enable_empty_final_response=True
        )


def _values(result, name: str) -> int:
    return int(result.as_numpy(name)[0])


def test_each_response_of_the_decoupled_step_runs_the_steps_after_it(running):
    """IN [1, 2, 3] with BIAS 10: three responses in the decoupled step's order, each from the
    ONNX step run on that response's token and the ensemble's BIAS, then the empty final one;
    a request asking for SUM alone gets SUM alone; IN [] gets the final flag only."""
    stream = Stream(running)
    try:
        stream.send([1, 2, 3])
        got = stream.responses()
        assert [(_values(r, "SUM"), _values(r, "DIFF")) for r in got[:-1]] == [
            (11, -9), (12, -8), (13, -7)
        ]  # fmt: skip
        assert not got[-1].get_response().outputs
        stream.send([5, 6], bias=1, outputs=["SUM"])
        got = stream.responses()
        assert [[o.name for o in r.get_response().outputs] for r in got[:-1]] == [["SUM"]] * 2
        assert [_values(r, "SUM") for r in got[:-1]] == [6, 7]
        stream.send([])
        got = stream.responses()
        assert len(got) == 1 and not got[0].get_response().outputs
    finally:
        stream.close()


def test_each_run_of_a_step_is_counted_on_its_model(running):
    client = grpcclient.InferenceServerClient(running.target)

    def count() -> int:
        stats = client.get_inference_statistics("add_sub").model_stats[0]
        return stats.inference_stats.success.count

    try:
        before = count()
        stream = Stream(running)
        try:
            stream.send([4, 5, 6, 7])
            assert len(stream.responses()) == 5
        finally:
            stream.close()
        assert count() - before == 4
    finally:
        client.close()


def test_the_ensemble_is_decoupled_and_refuses_unary_calls_as_triton(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        config = client.get_model_config("stream_add").config
        assert config.model_transaction_policy.decoupled
        given = grpcclient.InferInput("IN", [1], "INT32")
        given.set_data_from_numpy(np.array([1], np.int32))
        shift = grpcclient.InferInput("BIAS", [1], "INT32")
        shift.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("stream_add", [given, shift])
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "decoupled" in str(refused.value)
    finally:
        client.close()


def test_generate_stream_sends_each_response_as_an_event(running):
    import http.client
    import json

    connection = http.client.HTTPConnection("127.0.0.1", running.http_port, timeout=60)
    try:
        body = {"IN": [2, 4], "BIAS": 1}
        connection.request("POST", "/v2/models/stream_add/generate_stream", json.dumps(body))
        response = connection.getresponse()
        text = response.read().decode()
        assert response.status == 200, text
    finally:
        connection.close()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [(e["SUM"], e["DIFF"]) for e in events] == [(3, 1), (5, 3)], events


def test_an_error_response_fails_the_request_after_the_ones_before_it(running):
    stream = Stream(running)
    try:
        stream.send([1, 13, 2])
        got = stream.responses()
        assert _values(got[0], "SUM") == 11
        error = got[-1]
        assert isinstance(error, InferenceServerException), got
        assert "ensemble 'stream_add'" in str(error) and "thirteen is unlucky" in str(error)
        stream.send([3])  # the ensemble and its steps serve the next request
        assert _values(stream.responses()[0], "SUM") == 13
    finally:
        stream.close()


def test_a_client_that_goes_away_cancels_the_decoupled_step(running):
    """IN [-1]: the decoupled step streams every 0.1 s for 30 s; the client cancels its stream
    after a few responses, and the step's model sees its request cancelled."""
    stream = Stream(running)
    stream.send([-1])
    for _ in range(3):
        result = stream.get()
        assert _values(result, "SUM") == 17
    stream.close(cancel=True)
    deadline = time.monotonic() + 15
    while not any("[repeat] request cancelled" in line for line in running.lines):
        assert time.monotonic() < deadline, "the decoupled step never saw its request cancelled"
        time.sleep(0.1)
    after = Stream(running)
    try:
        after.send([1])
        assert _values(after.responses()[0], "SUM") == 11
    finally:
        after.close()


def test_more_streams_than_an_ensembles_default_run_at_once(running):
    """20 streams at once, each waiting in the decoupled step until all 20 are there: a
    decoupled ensemble's request holds its thread for its whole stream, so it runs more at
    once than an ordinary ensemble's 16 (DECOUPLED_STREAMS), and all 20 meet."""
    streams = [Stream(running) for _ in range(20)]
    try:
        for stream in streams:
            stream.send([-3], bias=0)
        met = [_values(stream.responses(timeout=60)[0], "SUM") for stream in streams]
        assert met == [1] * 20
    finally:
        for stream in streams:
            stream.close()


def test_a_step_fed_by_two_decoupled_steps_is_refused_at_load(running):
    client = httpclient.InferenceServerClient(running.http_target)
    try:
        assert not client.is_model_ready("crossed")
        assert client.is_model_ready("stream_add")
    finally:
        client.close()
    assert "receives inputs originated from different decoupled models" in running.log
    # a Python model's transaction policy is acted on (it is what makes it decoupled)
    assert "not acted on: model_transaction_policy" not in running.log
