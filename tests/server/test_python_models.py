"""Triton python-backend models (issue 36) against a real server, with tritonclient over gRPC
and HTTP: Triton's add_sub example laid out as its README lays it out (our own model.py with
the same API calls, names and client flow), ``async def execute``, and everything a model can
do wrong, each showing the server keeps serving the other models: an exception, a process
that dies, an execute that hangs past the server's bound (MAX_EXECUTE_SECONDS), a model that
fails to import or to initialize, an output missing or of the wrong type, a response count
that does not match."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

ADD_SUB_CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
input [ {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
{extra}
"""

#: Triton's add_sub example, as its README writes it (the same calls; our own text)
ADD_SUB = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = model_config = json.loads(args["model_config"])
        assert args["model_name"] and args["model_instance_kind"] == "CPU"
        output0_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT0")
        output1_config = pb_utils.get_output_config_by_name(model_config, "OUTPUT1")
        self.output0_dtype = pb_utils.triton_string_to_numpy(output0_config["data_type"])
        self.output1_dtype = pb_utils.triton_string_to_numpy(output1_config["data_type"])

    {execute_prefix}def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            {behaviour}
            out_0 = pb_utils.Tensor("OUTPUT0", (in_0 + in_1).astype(self.output0_dtype))
            out_1 = pb_utils.Tensor("OUTPUT1", (in_0 - in_1).astype(self.output1_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out_0, out_1]))
        return responses

    def finalize(self):
        print("Cleaning up...")
"""

#: what a misbehaving model does when INPUT0[0] is this value (else it adds and subtracts)
BEHAVIOURS = {
    "raises": "if in_0[0] == 7: raise ValueError('seven is not allowed here')",
    "dies": "if in_0[0] == 7: import os; os._exit(3)",
    "hangs": "if in_0[0] == 7: import time; time.sleep(600)",
    "wrong_type": (
        "if in_0[0] == 7: responses.append(pb_utils.InferenceResponse("
        "output_tensors=[pb_utils.Tensor('OUTPUT0', in_0.astype(np.int32)), "
        "pb_utils.Tensor('OUTPUT1', in_1)])); continue"
    ),
    "missing": (
        "if in_0[0] == 7: responses.append(pb_utils.InferenceResponse("
        "output_tensors=[pb_utils.Tensor('OUTPUT1', in_1)])); continue"
    ),
    "too_many": "if in_0[0] == 7: responses.append(pb_utils.InferenceResponse([]))",
}


#: a model that keeps 80 MB more at each request (INPUT0[0] == 7), or asks for 4 GB at once
#: (INPUT0[0] == 8), in a process bounded to 300 MB
LEAKS = (
    "if in_0[0] == 7: import builtins; builtins.__dict__.setdefault('kept', []).append("
    "np.ones(10_000_000))\n"
    "            if in_0[0] == 8: np.ones(500_000_000)"
)
#: the hang bound of the model that hangs: its execute is stopped 3 s after it started
HANG_BOUND = 'parameters { key: "MAX_EXECUTE_SECONDS" value: { string_value: "3" } }'
LEAK_LIMIT = 'parameters { key: "MAX_PROCESS_BYTES" value: { string_value: "314572800" } }'


#: Triton's bls example in short: execute calls another model (Python or ONNX) through BLS
BLS = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    {execute_prefix}def execute(self, requests):
        responses = []
        for request in requests:
            in_0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in_1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            target = "no_such_model" if in_0.as_numpy()[0] == 7 else "{target}"
            call = pb_utils.InferenceRequest(
                model_name=target,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[in_0, in_1],
            )
            answer = {await_}call.{method}()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.get_output_tensor_by_name(answer, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(answer, "OUTPUT1"),
            ]))
        return responses
"""


#: BLS into Triton's simple_sequence example: INPUT0 is [value, correlation id, start, end];
#: OUTPUT0 the sequence model's answer, four times
BLS_SEQUENCE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            value, correlation, start, end = (int(v) for v in given)
            flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start else 0) | (
                pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if end else 0)
            answer = pb_utils.InferenceRequest(
                model_name="simple_sequence",
                requested_output_names=["OUTPUT"],
                inputs=[pb_utils.Tensor("INPUT", np.full((1, 1), value, np.int32))],
                correlation_id=correlation,
                flags=flags,
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUTPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", np.full(4, out[0][0], np.float32)),
                pb_utils.Tensor("OUTPUT1", given)]))
        return responses
"""


def _bls(target: str, asynchronous: bool = False) -> str:
    return BLS.format(
        target=target,
        execute_prefix="async " if asynchronous else "",
        await_="await " if asynchronous else "",
        method="async_exec" if asynchronous else "exec",
    )


def _entry(root: Path, name: str, model: str, count: int = 1, extra: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        ADD_SUB_CONFIG.format(name=name, count=count, extra=extra)
    )
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))


def _niceness(value: str) -> str:
    return f'parameters {{ key: "PROCESS_NICENESS" value: {{ string_value: "{value}" }} }}'


def _add_sub(behaviour: str = "pass", execute_prefix: str = "") -> str:
    return ADD_SUB.format(behaviour=behaviour, execute_prefix=execute_prefix)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from models import add_sub
    from serving import RunningServer

    root = tmp_path_factory.mktemp("python-repo")
    _entry(root, "add_sub", _add_sub(), count=2)
    _entry(root, "add_sub_async", _add_sub(execute_prefix="async "))
    for name, behaviour in BEHAVIOURS.items():
        _entry(root, name, _add_sub(behaviour), extra=HANG_BOUND if name == "hangs" else "")
    _entry(root, "leaks", _add_sub(LEAKS), extra=LEAK_LIMIT)
    _entry(root, "bls_python", _bls("add_sub"))
    _entry(root, "bls_onnx_async", _bls("add_sub_onnx", asynchronous=True))
    (root / "add_sub_onnx" / "1").mkdir(parents=True)
    (root / "add_sub_onnx" / "1" / "model.onnx").write_bytes(add_sub().SerializeToString())
    (root / "add_sub_onnx" / "config.json").write_text('{"device": "NUMPY"}')
    _entry(root, "bls_sequence", BLS_SEQUENCE)
    from sequence_models import triton_examples

    triton_examples(root)
    _entry(root, "nice_3", _add_sub(), extra=_niceness("3"))
    _entry(root, "nice_25", _add_sub(), extra=_niceness("25"))
    _entry(root, "fails_import", "import no_such_module_anywhere\n")
    _entry(root, "fails_initialize", _add_sub().replace(
        "self.model_config = model_config", "raise RuntimeError('no GPU here'); model_config"
    ))  # fmt: skip
    _entry(
        root,
        "own_python",
        _add_sub(),
        extra=f'parameters {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: '
        f'"{sys.executable}" }} }}',
    )
    with RunningServer(
        "--model-repository", str(root), "--exit-on-error", "0", "--max-request-seconds", "60"
    ) as server:
        server.repository = root
        yield server


def _inputs(module, a: np.ndarray, b: np.ndarray):
    i0 = module.InferInput("INPUT0", [4], "FP32")
    i0.set_data_from_numpy(a)
    i1 = module.InferInput("INPUT1", [4], "FP32")
    i1.set_data_from_numpy(b)
    return [i0, i1]


def _client(running, protocol: str):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(running.target)
    return httpclient, httpclient.InferenceServerClient(running.http_target)


def _serves(running, model: str = "add_sub", protocol: str = "grpc") -> None:
    module, client = _client(running, protocol)
    try:
        a = np.random.default_rng(0).random(4, dtype=np.float32)
        b = np.random.default_rng(1).random(4, dtype=np.float32)
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        result = client.infer(model, _inputs(module, a, b), outputs=outputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b)
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["add_sub", "add_sub_async", "own_python"])
def test_add_sub_as_triton_serves_it(running, model, protocol):
    """Triton's add_sub example client flow (INPUT0 + INPUT1, INPUT0 - INPUT1), plain and
    ``async def execute``, and under a Python the model names (EXECUTION_ENV_PATH)."""
    _serves(running, model, protocol)
    _module, client = _client(running, protocol)
    try:
        assert client.is_model_ready(model)
        metadata = client.get_model_metadata(model)
        names = (
            [i["name"] for i in metadata["inputs"]]
            if protocol == "http"
            else [i.name for i in metadata.inputs]
        )
        assert names == ["INPUT0", "INPUT1"]
    finally:
        client.close()


def _refused(running, model: str, protocol: str = "grpc", timeout: float | None = None):
    module, client = _client(running, protocol)
    try:
        a = np.full(4, 7, np.float32)
        with pytest.raises(InferenceServerException) as refused:
            if timeout is not None and protocol == "grpc":
                client.infer(model, _inputs(module, a, a), client_timeout=timeout)
            else:
                client.infer(model, _inputs(module, a, a))
        return refused.value
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_exception_answers_its_request_with_its_message(running, protocol):
    error = _refused(running, "raises", protocol)
    assert "seven is not allowed here" in str(error), error
    assert "ValueError" in str(error)
    # the traceback names the file from the repository, not where the server keeps it
    assert "raises/1/model.py" in str(error), error
    assert str(running.repository) not in str(error) and sys.prefix not in str(error), error
    _serves(running, "raises", protocol)  # the same process answers the next request
    _serves(running)


def test_a_process_that_dies_fails_its_request_and_is_started_again(running):
    error = _refused(running, "dies")
    assert "its process ended while running the request" in str(error), error
    assert "exit code 3" in str(error)
    _serves(running)  # other models meanwhile
    _serves(running, "dies")  # and it again, in a new process
    assert running.process.poll() is None


def test_a_model_loaded_with_a_config_override_is_started_again_after_it_dies(running):
    """A load with a ``config`` override (Triton's RepositoryModelLoad) loads the repository's
    version folders from a private override folder. A Python model's process, started again
    after it died, imports its model.py from there: the folder was removed when the load
    returned, and the model was broken for good, every request INTERNAL with an import
    traceback (a red team's). The folder lives as long as the model."""
    import json

    config = {
        "name": "dies",
        "backend": "python",
        "input": [{"name": f"INPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)],
        "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_FP32", "dims": [4]} for i in (0, 1)],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    }
    _module, client = _client(running, "grpc")
    try:
        client.load_model("dies", config=json.dumps(config))
    finally:
        client.close()
    for _ in range(2):  # dies, and is started again from the override folder, twice
        error = _refused(running, "dies")
        assert "its process ended while running the request" in str(error), error
        _serves(running, "dies")
    _module, client = _client(running, "grpc")
    try:
        client.load_model("dies")  # the repository's own configuration again
    finally:
        client.close()


def test_an_execute_that_hangs_is_stopped_past_the_servers_bound(running):
    """The client's deadline (2 s) answers the client and leaves the process be; the
    operator's bound (MAX_EXECUTE_SECONDS 3) stops the hung execute: the request queued behind
    it is answered by a new process, and the log says why."""
    error = _refused(running, "hangs", timeout=2.0)
    assert "DEADLINE_EXCEEDED" in str(error.status()), error
    _serves(running)
    _serves(running, "hangs")  # waits for the bound, then a new process answers
    assert "past MAX_EXECUTE_SECONDS (3 s): taken as hung" in running.log


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("wrong_type", ["output 'OUTPUT0' is int32", "config.pbtxt says float32"]),
        ("missing", ["has no output 'OUTPUT0'"]),
        ("too_many", ["execute returned 2 responses for 1 requests"]),
    ],
)
def test_bad_responses_name_the_model_and_the_tensor(running, model, words):
    error = _refused(running, model)
    assert f"python model '{model}'" in str(error), error
    for word in words:
        assert word in str(error), error
    _serves(running, model)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("fails_import", "No module named 'no_such_module_anywhere'"),
        ("fails_initialize", "RuntimeError: no GPU here"),
    ],
)
def test_a_model_that_cannot_load_says_why_and_the_others_serve(running, model, reason):
    _module, client = _client(running, "http")
    try:
        assert not client.is_model_ready(model)
    finally:
        client.close()
    assert reason in running.log, running.log[-3000:]
    _serves(running)


@pytest.mark.parametrize("model", ["bls_python", "bls_onnx_async"])
def test_bls_calls_a_python_or_onnx_model(running, model):
    """Triton's bls example: execute runs another model through InferenceRequest.exec (or
    ``await async_exec``), a Python model or an ONNX one on NUMPY, and an error that model
    answers comes back as the response's error, as Triton returns it."""
    _serves(running, model, "grpc")
    _serves(running, model, "http")
    error = _refused(running, model)
    assert "Request for unknown model: 'no_such_model' is not found" in str(error), error
    assert str(running.repository) not in str(error) and sys.prefix not in str(error), error
    _serves(running, model)


def test_bls_calls_carry_their_sequence(running):
    """A BLS call with ``correlation_id`` and the sequence flags reaches Triton's
    simple_sequence as a client's sequence request does: the same answers as the model sends
    a client, and a call naming no sequence is refused as the model refuses a client's."""
    values = [0, 11, 7, 5, 3, 2, 0, 1]
    module, client = _client(running, "grpc")
    try:
        direct, through = [], []
        for i, value in enumerate(values):
            start, end = i == 0, i == len(values) - 1
            tensor = module.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
            result = client.infer(
                "simple_sequence", [tensor], sequence_id=31, sequence_start=start,
                sequence_end=end,
            )  # fmt: skip
            direct.append(int(result.as_numpy("OUTPUT")[0][0]))
            given = np.array([value, 32, start, end], np.float32)
            result = client.infer("bls_sequence", _inputs(module, given, given))
            through.append(int(result.as_numpy("OUTPUT0")[0]))
        assert through == direct
        assert direct != values  # it accumulates: the flags reached the sequence model
        given = np.array([1, 0, 0, 0], np.float32)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("bls_sequence", _inputs(module, given, given))
        assert "must specify a non-zero or non-empty correlation" in str(refused.value)
    finally:
        client.close()


def test_a_process_that_leaks_is_started_again_and_its_requests_answered(running):
    """Each request keeps 80 MB in the model's process: once it holds more than 80 % of its
    MAX_PROCESS_BYTES (300 MB) after a request, the process is started again, and every
    request is answered; one request asking for 4 GB at once gets MemoryError from the
    process's own bound (the server's memory is never the model's to take)."""
    module, client = _client(running, "grpc")
    try:
        a = np.full(4, 7, np.float32)
        for _ in range(8):  # 640 MB kept in all, if nothing stopped it
            result = client.infer("leaks", _inputs(module, a, a))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    finally:
        client.close()
    assert any("of its MAX_PROCESS_BYTES" in line for line in running.lines)
    huge = np.full(4, 8, np.float32)
    module, client = _client(running, "grpc")
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer("leaks", _inputs(module, huge, huge))
        assert "MemoryError" in str(refused.value), refused.value
        a = np.ones(4, np.float32)
        result = client.infer("leaks", _inputs(module, a, a))  # the same process goes on
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    finally:
        client.close()
    _serves(running)


def _workers(server_pid: int) -> dict[int, tuple[int, int]]:
    """The server's model processes: pid -> (the niceness it was started with, its own)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name
        if int(fields[1]) == server_pid and argv[1:2] and argv[1].endswith(b"sandbox.py"):
            found[int(entry.name)] = (int(argv[4]), int(fields[16]))  # stat's 19th: nice
    return found


def test_model_processes_run_below_the_servers_priority(running):
    """Each model process runs PROCESS_NICENESS (default 10) below the server, so a model busy
    on every core leaves the server the core it needs to route requests; a model may set its
    own (0 to 19), and a value outside that fails its load with the key named."""
    _serves(running, "nice_3")
    workers = _workers(running.process.pid)
    assert workers, "no model process found under the server"
    for pid, (asked, niceness) in workers.items():
        assert niceness == asked, (pid, asked, niceness)
    assert {asked for asked, _ in workers.values()} == {10, 3}, workers
    _module, client = _client(running, "http")
    try:
        assert not client.is_model_ready("nice_25")
    finally:
        client.close()
    assert "PROCESS_NICENESS" in running.log, running.log[-3000:]
    _serves(running)
