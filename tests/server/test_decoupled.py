"""Decoupled models (issue 36 item 4): a request answered by zero, one or many responses, as
Triton's decoupled Python models answer, against a real server, over ModelStreamInfer
(tritonclient), Triton's REST generate extension (generate and generate_stream as server-sent
events), and plugserve.v1's InferStream; decoupled BLS calls; Triton's decoupled QA cases (an
error in one response, an exception in execute, a response returned from execute, a send after
the final flag, cancellation seen by the model); and what a decoupled model cannot do to the
server (its process dying mid-stream, a client that goes away)."""

from __future__ import annotations

import http.client
import json
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from serving import wait_for

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
from triton_stream import TritonStream  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

#: Triton's square_int32 example in short: a thread per request sends IN responses of IN
#: (none for 0), then the final flag; our own text with the same calls
SQUARE = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = pb_utils.get_output_config_by_name(json_config(args), "OUT")
        self.dtype = pb_utils.triton_string_to_numpy(config["data_type"])

    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(sender, value), daemon=True).start()
        return None

    def respond(self, sender, value):
        for _ in range(int(value[0])):
            if value[0] == 13:  # dies after its first response
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
                import os, time
                time.sleep(0.2)
                os._exit(9)
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUT", value.astype(self.dtype))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def json_config(args):
    import json
    return json.loads(args["model_config"])
"""

SQUARE_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: True }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
"""

#: Triton's decoupled QA models in short (qa/L0_backend_python/decoupled), keyed by name
QA = {
    # the first request's response carries an error; the others answer
    "execute_error": """
import threading
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for i, request in enumerate(requests):
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            sender = request.get_response_sender()
            error = pb_utils.TritonError("An error occurred during execution") \\
                if value[0] == 7 else None
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUT", value)], error=error))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
    "raise_exception": """
class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            raise Exception("Intentional Error")
        return None
""",
    "return_response_error": """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
            for r in requests]
""",
    "send_after_close": """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        value = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        return None
""",
    # waits IN seconds in execute, checking is_cancelled() each 0.1 s, and says what it saw
    # (and, for a wait of a second or more, that it started)
    "execute_cancel": """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        sender = request.get_response_sender()
        if value[0] >= 1:
            pb_utils.Logger.log_info("[execute_cancel] runs")
        start = time.monotonic()
        while time.monotonic() - start < value[0]:
            if request.is_cancelled():
                pb_utils.Logger.log_info("[execute_cancel] Request cancelled")
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
            time.sleep(0.1)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
    # Triton's bls_decoupled example in short: sums square's responses, sync and async
    "bls_sum": """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        sender = request.get_response_sender()
        call = pb_utils.InferenceRequest(
            model_name="square", inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
            requested_output_names=["OUT"])
        total = np.array([0])
        seen = 0
        for response in call.exec(decoupled=True):
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            if len(response.output_tensors()) > 0:
                total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
                seen += 1
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", total)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
    "bls_sum_async": """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        request = requests[0]
        sender = request.get_response_sender()
        value = pb_utils.get_input_tensor_by_name(request, "IN")
        calls = [pb_utils.InferenceRequest(model_name="square", inputs=[value],
                                           requested_output_names=["OUT"]).async_exec(
                                               decoupled=True) for _ in range(2)]
        total = np.array([0])
        for responses in await asyncio.gather(*calls):
            for response in responses:
                if len(response.output_tensors()) > 0:
                    total += pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", total)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
    # IN responses as fast as it can, until its request is cancelled
    "flood": """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            threading.Thread(target=self.respond, args=(sender, count), daemon=True).start()
        return None

    def respond(self, sender, count):
        value = np.array([7], np.int32)
        for _ in range(count):
            if sender.is_cancelled():
                break
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
""",
    # a decoupled model's request parameters, answered as response parameters
    "parameters": """
import json
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            seen = json.loads(request.parameters())
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", value)], parameters={"echo": seen.get("greeting", "")}),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
""",
}


def _entry(root: Path, name: str, model: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(SQUARE_CONFIG.format(name=name))
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from models import add_sub
    from serving import RunningServer

    root = tmp_path_factory.mktemp("decoupled-repo")
    _entry(root, "square", SQUARE)
    for name, model in QA.items():
        _entry(root, name, model)
    (root / "add_sub_onnx" / "1").mkdir(parents=True)
    (root / "add_sub_onnx" / "1" / "model.onnx").write_bytes(add_sub().SerializeToString())
    (root / "add_sub_onnx" / "config.json").write_text('{"device": "NUMPY"}')
    with RunningServer(
        "--model-repository", str(root), "--exit-on-error", "0", "--max-request-seconds", "60"
    ) as server:
        yield server


class Stream(TritonStream):
    """A stream of requests with one IN value each."""

    def __init__(self, running) -> None:
        super().__init__(running.target)

    def send(self, model: str, value: int, request_id: str = "", **kwargs) -> None:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        self.client.async_stream_infer(
            model_name=model, inputs=[tensor], request_id=request_id, **kwargs
        )


def test_square_as_triton_example_client(running):
    """square_int32's client: four requests at once on one stream, IN responses each with the
    request's id, none for 0, every value IN."""
    stream = Stream(running)
    try:
        values = [4, 2, 0, 1]
        for i, value in enumerate(values):
            stream.send("square", value, request_id=str(i))
        got: dict[str, list[int]] = {}
        for _ in range(sum(values)):
            result = stream.get()
            assert not isinstance(result, InferenceServerException), result
            got.setdefault(result.get_response().id, []).append(int(result.as_numpy("OUT")[0]))
        assert got == {"0": [4] * 4, "1": [2] * 2, "3": [1]}
        assert stream.results.empty()
    finally:
        stream.close()


def test_final_responses_follow_triton_flags(running):
    """Each response says whether it is the request's last (``triton_final_response``); a
    final flag sent alone becomes an empty response only for a request that asks for it with
    ``triton_enable_empty_final_response``."""
    stream = Stream(running)
    try:
        stream.send("square", 2, request_id="a", enable_empty_final_response=True)
        flags = []
        for _ in range(3):
            response = stream.get().get_response()
            flags.append((len(response.outputs), response.parameters["triton_final_response"]))
        assert [(n, p.bool_param) for n, p in flags] == [(1, False), (1, False), (0, True)]
        stream.send("square", 0, request_id="b", enable_empty_final_response=True)
        response = stream.get().get_response()
        assert response.id == "b" and not response.outputs
        assert response.parameters["triton_final_response"].bool_param
    finally:
        stream.close()


def test_unary_calls_to_a_decoupled_model_are_refused_as_triton_refuses_them(running):
    client = grpcclient.InferenceServerClient(running.target)
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([2], np.int32))
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer("square", [tensor])
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(
            refused.value
        )
    finally:
        client.close()
    status, body = _post(
        running,
        "/v2/models/square/infer",
        {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [2]}]},
    )
    assert status == 400
    assert "HTTP end point doesn't support models with decoupled transaction policy" in body


def _post(running, path: str, body: dict) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", running.http_port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body))
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


def _events(running, path: str, body: dict) -> tuple[int, str, list[dict]]:
    """A generate_stream call: status, content type, and its events' JSON."""
    status, text = _post(running, path, body)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    return status, text, events


def test_generate_stream_sends_each_response_as_an_event(running):
    status, _, events = _events(running, "/v2/models/square/generate_stream", {"IN": 3, "id": "x"})
    assert status == 200
    assert events == [{"model_name": "square", "model_version": "1", "id": "x", "OUT": 3}] * 3
    status, _, events = _events(running, "/v2/models/square/generate_stream", {"IN": 0})
    assert status == 200 and events == []


def test_generate_takes_one_response_and_names_the_mistake_otherwise(running):
    status, body = _post(running, "/v2/models/square/generate", {"IN": 1})
    assert status == 200
    assert json.loads(body) == {"model_name": "square", "model_version": "1", "OUT": 1}
    status, body = _post(running, "/v2/models/square/generate", {"IN": 3})
    assert status == 400 and "generate expects model to produce exactly 1 response" in body
    # refused at the second response, the request cancelled: not after the model's last
    assert "answered more than one" in body, body
    # an ordinary model through the generate extension: inputs by name, outputs by name
    status, body = _post(
        running,
        "/v2/models/add_sub_onnx/generate",
        {"INPUT0": [1, 2, 3, 4], "INPUT1": [1, 1, 1, 1], "parameters": {"temperature": 0}},
    )
    assert status == 200
    answer = json.loads(body)
    assert answer["OUTPUT0"] == [2, 3, 4, 5] and answer["OUTPUT1"] == [0, 1, 2, 3]
    status, body = _post(running, "/v2/models/square/generate", {"IN": "seven"})
    assert status == 400 and "'IN'" in body
    status, body = _post(running, "/v2/models/square/generate", {"IN": 1, "parameters": [1]})
    assert status == 400 and "parameters" in body


def test_request_parameters_reach_the_model_and_response_parameters_come_back(running):
    _, _, events = _events(
        running, "/v2/models/parameters/generate_stream", {"IN": 5, "greeting": "hello"}
    )
    assert events == [{"model_name": "parameters", "model_version": "1", "echo": "hello", "OUT": 5}]
    stream = Stream(running)
    try:
        stream.send("parameters", 5, parameters={"greeting": "grpc"})
        response = stream.get().get_response()
        assert response.parameters["echo"].string_param == "grpc"
    finally:
        stream.close()


def test_large_parameters_reach_the_model_and_too_large_ones_are_refused(running):
    """A Python model's request travels to its process in one socket message, at most the
    socket's send buffer (~208 KiB): a red team's 213 KB request parameter failed the send,
    which the server took for the process's death (restarted, a 500, another client's stream
    cut). A header that large now travels in a memfd; a request's own parameters past
    MAX_PARAMETER_BYTES are refused before they are admitted."""
    from plugserve.server.protocols.kserve.codec import MAX_PARAMETER_BYTES

    restarts = running.log.count("starting its process again")
    greeting = "g" * 240_000
    stream = Stream(running)
    try:
        stream.send("parameters", 5, parameters={"greeting": greeting})
        response = stream.get().get_response()
        assert response.parameters["echo"].string_param == greeting  # and back
        stream.send("parameters", 5, parameters={"greeting": "g" * (MAX_PARAMETER_BYTES + 1)})
        refused = stream.get()
        assert isinstance(refused, InferenceServerException)
        assert "the request's parameters hold" in refused.message()
        stream.send("parameters", 6, parameters={"greeting": "after"})
        assert stream.get().get_response().parameters["echo"].string_param == "after"
    finally:
        stream.close()
    assert running.log.count("starting its process again") == restarts


def test_plugserve_v1_infer_stream_marks_responses_that_more_follow(running):
    import grpc

    from plugserve.proto import plugserve_pb2 as pb
    from plugserve.proto import plugserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.PlugserveStub(channel)
        data = np.array([3], np.int32).tobytes()
        request = pb.InferRequest(
            network="square",
            id="q",
            inputs=[pb.Tensor(name="IN", dtype="int32", shape=[1], data=data)],
        )
        answers = list(stub.InferStream(iter([request]), timeout=60))
        assert [a.more for a in answers] == [True, True, True, False]
        assert [len(a.response.outputs) for a in answers] == [1, 1, 1, 0]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Infer(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("model", ["bls_sum", "bls_sum_async"])
def test_decoupled_bls_sums_the_called_models_responses(running, model):
    """Triton's bls_decoupled example: a decoupled BLS call's responses, ending with an empty
    final one; the async model makes two calls at once with asyncio.gather."""
    stream = Stream(running)
    try:
        stream.send(model, 4)
        result = stream.get()
        assert not isinstance(result, InferenceServerException), result
        assert int(result.as_numpy("OUT")[0]) == (16 if model == "bls_sum" else 32)
    finally:
        stream.close()


def test_an_error_in_one_response_leaves_the_others(running):
    """QA decoupled_execute_error: the response with the error reaches its client as an
    error; the other requests answer."""
    stream = Stream(running)
    try:
        for value in (7, 1, 2):
            stream.send("execute_error", value)
        results = [stream.get() for _ in range(3)]
        errors = [r for r in results if isinstance(r, InferenceServerException)]
        assert len(errors) == 1 and "An error occurred during execution" in errors[0].message()
        values = sorted(int(r.as_numpy("OUT")[0]) for r in results if r not in errors)
        assert values == [1, 2]
    finally:
        stream.close()


def test_exceptions_and_returned_responses_fail_each_request(running):
    """QA decoupled_raise_exception (ten requests, ten errors, the model still ready) and
    decoupled_return_response_error (execute must return None)."""
    stream = Stream(running)
    try:
        for _ in range(10):
            stream.send("raise_exception", 1)
        for _ in range(10):
            result = stream.get()
            assert isinstance(result, InferenceServerException)
            assert "Intentional Error" in result.message()
        stream.send("return_response_error", 1)
        result = stream.get()
        assert isinstance(result, InferenceServerException)
        assert "is using the decoupled mode and the execute function must return None" in (
            result.message()
        )
        assert stream.client.is_model_ready("raise_exception")
    finally:
        stream.close()


def test_a_send_after_the_final_flag_reaches_no_client(running):
    """QA decoupled_send_after_close_error: the model's send after its final flag raises in
    the model; the client gets nothing more, the model keeps serving."""
    stream = Stream(running)
    try:
        stream.send("send_after_close", 1)
        time.sleep(2)
        assert stream.results.empty()
        stream.send("square", 1)
        assert int(stream.get().as_numpy("OUT")[0]) == 1
    finally:
        stream.close()


def test_a_cancelled_request_is_seen_by_the_model(running):
    """QA execute_cancel: the client cancels its stream while execute runs; the model's
    ``is_cancelled()`` turns true, it says so (the server's log) and returns."""
    stream = Stream(running)
    started = running.log.count("[execute_cancel] runs")
    stream.send("execute_cancel", 30)
    assert wait_for(lambda: running.log.count("[execute_cancel] runs") > started), "no execute"
    stream.close(cancel=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any("[execute_cancel] Request cancelled" in line for line in running.lines):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the model never saw its request cancelled")
    after = Stream(running)
    try:
        after.send("execute_cancel", 0)
        assert int(after.get().as_numpy("OUT")[0]) == 0
    finally:
        after.close()


def test_a_process_that_dies_mid_stream_fails_its_request_and_comes_back(running):
    stream = Stream(running)
    try:
        stream.send("square", 13)
        first = stream.get()
        assert not isinstance(first, InferenceServerException)
        failed = stream.get()
        assert isinstance(failed, InferenceServerException)
        assert "process ended" in failed.message()
        stream.send("square", 2)
        assert [int(stream.get().as_numpy("OUT")[0]) for _ in range(2)] == [2, 2]
    finally:
        stream.close()


def test_unread_responses_hold_no_descriptors(running):
    """A red team's clients asked a decoupled model for endless small responses over REST
    generate_stream and read none: each response came from the model's process in a memfd of
    its own, whose mapping held a descriptor (Python's mmap keeps a duplicate) while it waited
    unread, and the stream kept them after its clients had gone: four such streams took the
    server from 36 to 16,504 open files, and the next round to its limit (then a Python model's
    request failed, "its process ended"). Now a small response is copied out of its memfd,
    and a cancelled stream drops what waits unread."""
    import os
    import socket

    def descriptors() -> int:
        return len(os.listdir(f"/proc/{running.process.pid}/fd"))

    before = descriptors()
    body = json.dumps({"IN": [1_000_000]}).encode()
    request = (
        b"POST /v2/models/flood/generate_stream HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    clients = []
    for _ in range(3):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", running.http_port))
        sock.sendall(request)  # and never read
        clients.append(sock)
    try:
        time.sleep(3)
        during = descriptors()
    finally:
        for sock in clients:
            sock.close()
    assert during < before + 100, (before, during)
    assert wait_for(lambda: descriptors() < before + 20, timeout=20), (before, descriptors())
    code, text = _post(running, "/v2/models/square/generate", {"IN": [1]})
    assert code == 200, text
