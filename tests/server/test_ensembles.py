"""Triton ensembles (issue 36) against a real server with tritonclient: Triton's QA ensemble of
``simple`` over its two versions, a partial-output ensemble with a Python step and two branches
over two versions (only the steps the requested outputs need run, as the per-version statistics
show), two Python steps that can only finish when they run at once, a running step cancelled
with the request, the request's parameters handed to its steps, Triton's sequence examples
through an ensemble (the correlation id and flags pass on), the tensors between steps passed by
reference (an in-process check: the answer is the request's own array), and the ensembles whose
steps do not connect (a missing tensor, a cycle, a type mismatch, an ensemble that runs itself,
a step fed by two decoupled steps), each refused at load with what does not connect while the
others serve. Ensembles with a decoupled step: test_ensembles_decoupled.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
pytest.importorskip("onnxruntime", reason="pip install -e '.[ort]'")

SIMPLE = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
version_policy: { all { } }
"""

DOUBLE = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 2)])
            for r in requests
        ]
"""


#: Two Python models that each finish only once the other has started on the same request
#: (marker files in a folder, named by the request's first value): run one after the other,
#: the first gives up after a minute and fails its request.
MEET = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.folder = config["parameters"]["folder"]["string_value"]
        self.me = config["name"]
        self.other = "meet_b" if self.me == "meet_a" else "meet_a"

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            nonce = int(x.flat[0])
            open(os.path.join(self.folder, f"{self.me}-{nonce}"), "w").close()
            other = os.path.join(self.folder, f"{self.other}-{nonce}")
            end = time.monotonic() + 60
            while not os.path.exists(other):
                if time.monotonic() > end:
                    raise pb_utils.TritonModelException(
                        f"{self.other} did not start while {self.me} ran: steps ran in turn")
                time.sleep(0.005)
            add = 1 if self.me == "meet_a" else 2
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", x + add)]))
        return responses
"""


#: A Python model that answers OUTPUT0 only for an odd first value (Triton's python backend
#: lets a response leave an output out; the ensemble then leaves its tensor unset).
SOMETIMES = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            tensors = [pb_utils.Tensor("OUTPUT0", x * 2)] if int(x.flat[0]) % 2 else []
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
"""


#: A Python model that takes a minute over a first value of 7 (else doubles at once).
SLOW = """
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if int(x.flat[0]) == 7:  # a minute, unless its request is cancelled (as Triton's
                end = time.monotonic() + 60  # models stop: the process is never killed for it)
                while time.monotonic() < end and not request.is_cancelled():
                    time.sleep(0.05)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", x * 2)]))
        return responses
"""


#: A Python model scaling its input by the request's "scale" parameter (1 without one).
SCALE = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            scale = int(json.loads(request.parameters()).get("scale", 1))
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", x * scale)]))
        return responses
"""


def _meet_config(name: str, folder: Path) -> str:
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        f'parameters {{ key: "folder" value: {{ string_value: "{folder}" }} }}\n'
    )


OUT = {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"}


def _ensemble(name: str, inputs: str, outputs: str, steps: list[str]) -> str:
    body = ",\n".join(steps)
    return textwrap.dedent(
        f"""
        name: "{name}"
        platform: "ensemble"
        max_batch_size: 8
        input [ {inputs} ]
        output [ {outputs} ]
        ensemble_scheduling {{ step [ {body} ] }}
        """
    )


def _step(model: str, version: int, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version} {ins} {outs} }}'


INT32_IN = (
    '{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, '
    '{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }'
)
INT32_OUT = (
    '{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, '
    '{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }'
)
BOTH = {"INPUT0": "INPUT0", "INPUT1": "INPUT1"}


def _write(root: Path, name: str, config: str, files: dict[str, bytes | str] | None = None):
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    for file, data in (files or {}).items():
        target = root / name / file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data) if isinstance(data, bytes) else target.write_text(data)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    from serving import RunningServer

    root = tmp_path_factory.mktemp("ensembles")
    from models import add_sub
    from onnx import TensorProto

    simple = add_sub(TensorProto.INT32, ("batch", 16)).SerializeToString()
    _write(root, "simple", SIMPLE, {"1/model.onnx": simple, "2/model.onnx": simple})
    _write(
        root,
        "double",
        'name: "double"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n',
        {"1/model.py": DOUBLE},
    )
    # Triton's QA ensemble of simple over its two versions: (a+b, a-b) then (2a, 2b)
    _write(root, "simple_chain", _ensemble("simple_chain", INT32_IN, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "sum", "OUTPUT1": "diff"}),
        _step("simple", 2, {"INPUT0": "sum", "INPUT1": "diff"}, OUT),
    ]))  # fmt: skip
    # two branches: OUTPUT0 from simple, OUTPUT1 from the Python model
    _write(root, "partial", _ensemble("partial", INT32_IN, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "OUTPUT0"}),
        _step("double", 1, {"INPUT0": "INPUT1"}, {"OUTPUT0": "OUTPUT1"}),
    ]))  # fmt: skip
    _write(root, "missing", _ensemble("missing", INT32_IN, INT32_OUT, [
        _step("simple", 1, {"INPUT0": "INPUT0", "INPUT1": "nowhere"}, OUT),
    ]))  # fmt: skip
    _write(root, "cycle", _ensemble("cycle", INT32_IN, INT32_OUT, [
        _step("simple", 1, {"INPUT0": "INPUT0", "INPUT1": "b"}, {"OUTPUT0": "a",
                                                                 "OUTPUT1": "OUTPUT1"}),
        _step("simple", 2, {"INPUT0": "a", "INPUT1": "INPUT1"}, {"OUTPUT0": "b",
                                                                 "OUTPUT1": "OUTPUT0"}),
    ]))  # fmt: skip
    float_in = INT32_IN.replace("TYPE_INT32", "TYPE_FP32")
    _write(root, "mismatch", _ensemble("mismatch", float_in, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "OUTPUT0", "OUTPUT1": "OUTPUT1"}),
    ]))  # fmt: skip
    # qa/L0_simple_ensemble's ensemble_add_sub_int32_int32_int32: six stateless steps over
    # simple's two versions, (INPUT0 + INPUT1, INPUT0 - INPUT1) in the end
    _write(root, "add_sub_6", _ensemble("add_sub_6", INT32_IN, INT32_OUT, [
        _step("simple", -1, {"INPUT0": "INPUT0", "INPUT1": "INPUT0"}, {"OUTPUT0": "twice0"}),
        _step("simple", 1, {"INPUT0": "INPUT1", "INPUT1": "INPUT1"}, {"OUTPUT0": "twice1"}),
        _step("simple", -1, {"INPUT0": "twice0", "INPUT1": "INPUT0"}, {"OUTPUT1": "value0"}),
        _step("simple", 1, {"INPUT0": "twice1", "INPUT1": "INPUT1"}, {"OUTPUT1": "value1"}),
        _step("simple", -1, {"INPUT0": "value0", "INPUT1": "INPUT1"}, {"OUTPUT0": "OUTPUT0"}),
        _step("simple", 1, {"INPUT0": "INPUT0", "INPUT1": "value1"}, {"OUTPUT1": "OUTPUT1"}),
    ]))  # fmt: skip
    # one step over any length: answers large enough that REST writes their JSON in its
    # helper process (over 1 MiB)
    wide_io = "\n".join(
        f'{kind} [ {{ name: "{kind.upper()}0" data_type: TYPE_INT32 dims: [ -1 ] }}, '
        f'{{ name: "{kind.upper()}1" data_type: TYPE_INT32 dims: [ -1 ] }} ]'
        for kind in ("input", "output")
    )
    wide = add_sub(TensorProto.INT32, ("n",)).SerializeToString()
    _write(root, "wide", f'name: "wide"\nplatform: "onnxruntime_onnx"\n{wide_io}\n',
           {"1/model.onnx": wide})  # fmt: skip
    _write(root, "wide_pass", (
        f'name: "wide_pass"\nplatform: "ensemble"\n{wide_io}\n'
        f"ensemble_scheduling {{ step [ {_step('wide', -1, BOTH, OUT)} ] }}\n"
    ))  # fmt: skip
    # two branches over the two versions: OUTPUT0 from version 1, OUTPUT1 from version 2
    _write(root, "versions", _ensemble("versions", INT32_IN, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "OUTPUT0"}),
        _step("simple", 2, BOTH, {"OUTPUT1": "OUTPUT1"}),
    ]))  # fmt: skip
    meeting = root / "meeting"
    meeting.mkdir()
    for name in ("meet_a", "meet_b"):
        _write(root, name, _meet_config(name, meeting), {"1/model.py": MEET})
    _write(root, "meet", _ensemble("meet", INT32_IN, INT32_OUT, [
        _step("meet_a", 1, {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT0"}),
        _step("meet_b", 1, {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT1"}),
    ]))  # fmt: skip
    _write(
        root,
        "sometimes",
        'name: "sometimes"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n',
        {"1/model.py": SOMETIMES},
    )
    _write(root, "optional", _ensemble("optional", INT32_IN, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "OUTPUT0"}),
        _step("sometimes", 1, {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT1"}),
    ]))  # fmt: skip
    _write(
        root,
        "streaming",
        'name: "streaming"\nbackend: "python"\nmax_batch_size: 8\n'
        "model_transaction_policy { decoupled: true }\n"
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n',
        {"1/model.py": DOUBLE},
    )
    # Triton's invalid_decoupled_branching: two decoupled steps' responses meet in one step
    _write(root, "crossed", _ensemble("crossed", INT32_IN, INT32_OUT, [
        _step("streaming", 1, {"INPUT0": "INPUT0"}, {"OUTPUT0": "a"}),
        _step("streaming", 1, {"INPUT0": "INPUT1"}, {"OUTPUT0": "b"}),
        _step("simple", 1, {"INPUT0": "a", "INPUT1": "b"}, OUT),
    ]))  # fmt: skip
    _write(
        root,
        "slow",
        'name: "slow"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n',
        {"1/model.py": SLOW},
    )
    _write(root, "with_slow", _ensemble("with_slow", INT32_IN, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "OUTPUT0"}),
        _step("slow", 1, {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT1"}),
    ]))  # fmt: skip
    _write(
        root,
        "scale",
        'name: "scale"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]\n',
        {"1/model.py": SCALE},
    )
    _write(root, "scaled", _ensemble("scaled", INT32_IN, INT32_OUT, [
        _step("simple", 1, BOTH, {"OUTPUT0": "OUTPUT0"}),
        _step("scale", 1, {"INPUT0": "INPUT0"}, {"OUTPUT0": "OUTPUT1"}),
    ]))  # fmt: skip
    # bytes that are no text, through an ensemble to a step that only moves them
    from plugserve.server.control.examples import echo

    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "1" / "model.onnx").write_bytes(echo().SerializeToString())
    (root / "echo" / "config.json").write_text('{"device": "NUMPY"}')
    _write(root, "bytes_through", _ensemble(
        "bytes_through",
        '{ name: "B" data_type: TYPE_STRING dims: [ -1 ] }',
        '{ name: "B_OUT" data_type: TYPE_STRING dims: [ -1 ] }',
        [_step("echo", 1, {"text": "B"}, {"echo": "B_OUT"})],
    ).replace("max_batch_size: 8", "max_batch_size: 0"))  # fmt: skip
    # Triton's sequence examples, each behind a one-step ensemble
    from sequence_models import triton_examples

    triton_examples(root)
    seq_in = '{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }'
    seq_out = '{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }'
    for model in ("simple_sequence", "simple_dyna_sequence"):
        _write(root, f"{model}_ensemble", _ensemble(f"{model}_ensemble", seq_in, seq_out, [
            _step(model, -1, {"INPUT": "INPUT"}, {"OUTPUT": "OUTPUT"}),
        ]))  # fmt: skip
    # two ensembles that run each other: the second to load is refused
    for name, other in (("loop_a", "loop_b"), ("loop_b", "loop_a")):
        _write(root, name, _ensemble(name, INT32_IN, INT32_OUT, [
            _step(other, -1, BOTH, OUT),
        ]))  # fmt: skip
    # an ensemble whose config names another model and whose step is itself by its folder's
    # name: it ran itself, every request waiting out --max-request-seconds
    _write(root, "named_apart", _ensemble("decoy", INT32_IN, INT32_OUT, [
        _step("named_apart", -1, BOTH, OUT),
    ]))  # fmt: skip
    with RunningServer("--model-repository", str(root), "--exit-on-error", "0") as server:
        yield server


def _inputs(module, a, b):
    made = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = module.InferInput(name, list(value.shape), "INT32")
        tensor.set_data_from_numpy(value)
        made.append(tensor)
    return made


A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def _count(client, model: str, version: str) -> int:
    stats = client.get_inference_statistics(model_name=model, model_version=version)
    return int(stats.model_stats[0].inference_stats.success.count)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_ensemble_of_simple_over_its_two_versions(running, protocol):
    module = grpcclient if protocol == "grpc" else httpclient
    target = running.target if protocol == "grpc" else running.http_target
    client = module.InferenceServerClient(target)
    try:
        result = client.infer("simple_chain", _inputs(module, A, B))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * A)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2 * B)
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_its_metadata_and_config_say_ensemble(running, protocol):
    """As Triton reports them: platform "ensemble", and the steps in ensemble_scheduling."""
    module = grpcclient if protocol == "grpc" else httpclient
    target = running.target if protocol == "grpc" else running.http_target
    client = module.InferenceServerClient(target)
    try:
        metadata = client.get_model_metadata("simple_chain")
        config = client.get_model_config("simple_chain")
        if protocol == "grpc":
            platform = metadata.platform
            steps = [(s.model_name, s.model_version, dict(s.input_map), dict(s.output_map))
                     for s in config.config.ensemble_scheduling.step]  # fmt: skip
        else:
            platform = metadata["platform"]
            steps = [(s["model_name"], int(s["model_version"]), s["input_map"], s["output_map"])
                     for s in config["ensemble_scheduling"]["step"]]  # fmt: skip
        assert platform == "ensemble"
        assert steps == [
            ("simple", 1, BOTH, {"OUTPUT0": "sum", "OUTPUT1": "diff"}),
            ("simple", 2, {"INPUT0": "sum", "INPUT1": "diff"}, OUT),
        ]
    finally:
        client.close()


def test_each_step_is_counted_on_its_own_version(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        before = [_count(client, "simple", v) for v in ("1", "2")]
        client.infer("simple_chain", _inputs(grpcclient, A, B))
        after = [_count(client, "simple", v) for v in ("1", "2")]
        assert [x - y for x, y in zip(after, before)] == [1, 1]
        assert _count(client, "simple_chain", "1") >= 1
    finally:
        client.close()


def test_only_the_steps_the_requested_outputs_need_run(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        python_before = _count(client, "double", "1")
        simple_before = _count(client, "simple", "1")
        result = client.infer(
            "partial",
            _inputs(grpcclient, A, B),
            outputs=[grpcclient.InferRequestedOutput("OUTPUT0")],
        )
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
        assert result.as_numpy("OUTPUT1") is None
        assert _count(client, "double", "1") == python_before  # the Python step did not run
        assert _count(client, "simple", "1") == simple_before + 1
        both = client.infer("partial", _inputs(grpcclient, A, B))
        np.testing.assert_array_equal(both.as_numpy("OUTPUT1"), 2 * B)
        assert _count(client, "double", "1") == python_before + 1
    finally:
        client.close()


def test_unneeded_branches_do_not_run_per_version(running):
    """Triton prunes the steps no requested output needs: each version's own statistics."""
    client = grpcclient.InferenceServerClient(running.target)
    try:
        before = [_count(client, "simple", v) for v in ("1", "2")]
        one = client.infer(
            "versions",
            _inputs(grpcclient, A, B),
            outputs=[grpcclient.InferRequestedOutput("OUTPUT1")],
        )
        np.testing.assert_array_equal(one.as_numpy("OUTPUT1"), A - B)
        assert one.as_numpy("OUTPUT0") is None
        assert [_count(client, "simple", v) for v in ("1", "2")] == [before[0], before[1] + 1]
        both = client.infer("versions", _inputs(grpcclient, A, B))
        np.testing.assert_array_equal(both.as_numpy("OUTPUT0"), A + B)
        np.testing.assert_array_equal(both.as_numpy("OUTPUT1"), A - B)
        assert [_count(client, "simple", v) for v in ("1", "2")] == [before[0] + 1, before[1] + 2]
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_steps_that_do_not_depend_on_each_other_run_at_once(running, protocol):
    """meet_a and meet_b each wait for the other to start: they answer only when the ensemble
    sent both before either finished."""
    module = grpcclient if protocol == "grpc" else httpclient
    target = running.target if protocol == "grpc" else running.http_target
    client = module.InferenceServerClient(target)
    try:
        for nonce in (101, 102) if protocol == "grpc" else (201, 202):
            a = A + nonce
            result = client.infer("meet", _inputs(module, a, B))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a + 2)
    finally:
        client.close()


def test_an_output_a_step_did_not_produce_is_missing_from_the_answer(running):
    client = grpcclient.InferenceServerClient(running.target)
    try:
        odd = client.infer("optional", _inputs(grpcclient, A + 1, B))
        np.testing.assert_array_equal(odd.as_numpy("OUTPUT1"), (A + 1) * 2)
        even = client.infer("optional", _inputs(grpcclient, A, B))
        np.testing.assert_array_equal(even.as_numpy("OUTPUT0"), A + B)
        assert even.as_numpy("OUTPUT1") is None
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_requests_parameters_reach_its_steps(running, protocol):
    """Triton hands each step the ensemble request's parameters, and a model its own."""
    module = grpcclient if protocol == "grpc" else httpclient
    target = running.target if protocol == "grpc" else running.http_target
    client = module.InferenceServerClient(target)
    try:
        direct = client.infer("scale", _inputs(module, A, B)[:1], parameters={"scale": 3})
        np.testing.assert_array_equal(direct.as_numpy("OUTPUT0"), 3 * A)
        scaled = client.infer("scaled", _inputs(module, A, B), parameters={"scale": 3})
        np.testing.assert_array_equal(scaled.as_numpy("OUTPUT1"), 3 * A)
        plain = client.infer("scaled", _inputs(module, A, B))
        np.testing.assert_array_equal(plain.as_numpy("OUTPUT1"), A)
    finally:
        client.close()


def test_bytes_that_are_not_text_pass_through_to_a_step_that_moves_them(running):
    """An ensemble only moves its BYTES: whether a step takes bytes that are not UTF-8 is the
    step's to say (NUMPY's Identity moves them as they are)."""
    client = grpcclient.InferenceServerClient(running.target)
    try:
        data = np.array([b"\x89PNG\r\n\x1a\n\xff\xfe", b"text"], dtype=object)
        tensor = grpcclient.InferInput("B", [2], "BYTES")
        tensor.set_data_from_numpy(data)
        result = client.infer("bytes_through", [tensor])
        assert result.as_numpy("B_OUT").tolist() == data.tolist()
    finally:
        client.close()


def _failures(client, model: str) -> int:
    stats = client.get_inference_statistics(model_name=model, model_version="1")
    return int(stats.model_stats[0].inference_stats.fail.count)


def test_a_step_running_when_the_request_is_cancelled_stops(running):
    """The client's deadline passes while the slow step runs (a minute): the ensemble's request
    is cancelled, and so is the step's, which its model sees (``is_cancelled()``) and stops
    for, long before its minute is over; the ensemble answers the next request."""
    from serving import wait_for

    client = grpcclient.InferenceServerClient(running.target)
    try:
        before = _failures(client, "slow")
        stuck = np.full((1, 16), 7, np.int32)
        with pytest.raises(Exception, match="Deadline"):
            client.infer("with_slow", _inputs(grpcclient, stuck, B), client_timeout=2)
        assert wait_for(lambda: _failures(client, "slow") > before, timeout=40)
        result = client.infer("with_slow", _inputs(grpcclient, A, B))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2 * A)
    finally:
        client.close()


def _sequence(client, model: str, sequence_id: int, values: list[int]) -> list[int]:
    answers = []
    for i, value in enumerate(values):
        tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
        result = client.infer(
            model,
            [tensor],
            sequence_id=sequence_id,
            sequence_start=i == 0,
            sequence_end=i == len(values) - 1,
        )
        answers.append(int(result.as_numpy("OUTPUT")[0][0]))
    return answers


@pytest.mark.parametrize("model", ["simple_sequence", "simple_dyna_sequence"])
def test_sequence_requests_pass_through_an_ensemble(running, model):
    """Triton's sequence examples, sent to an ensemble of the sequence model, answer as the
    model itself does: the ensemble hands its requests' correlation id and start/end flags on
    (the dyna model adds the correlation id at the end)."""
    values = [0, 11, 7, 5, 3, 2, 0, 1]
    client = grpcclient.InferenceServerClient(running.target)
    try:
        direct = _sequence(client, model, 4242, values)
        through = _sequence(client, f"{model}_ensemble", 4242, values)
        assert through == direct
        assert direct != values  # the model accumulates: the flags did reach it
        with pytest.raises(Exception, match="must specify a non-zero or non-empty correlation"):
            tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.ones((1, 1), np.int32))
            client.infer(f"{model}_ensemble", [tensor])
    finally:
        client.close()


def test_sequence_flags_come_back_on_each_response_of_a_stream(running):
    """qa/L0_simple_ensemble's test_ensemble_sequence_flags: three requests of one sequence to
    an ensemble of stateless steps, on one gRPC stream; each response carries its request's
    sequence_start and sequence_end back, as Triton's ensembles answer (its steps, which keep
    no sequence, run them as any request)."""
    import queue

    a = np.random.default_rng(1).integers(0, 100, (1, 16), dtype=np.int32)
    b = np.random.default_rng(2).integers(0, 100, (1, 16), dtype=np.int32)
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(running.target)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for count in range(3):
            client.async_stream_infer(
                "add_sub_6", _inputs(grpcclient, a, b), request_id=f"7_{count}",
                sequence_id=7, sequence_start=count == 0, sequence_end=count == 2,
            )  # fmt: skip
        flags = {}
        for _ in range(3):
            result, error = answers.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            flags[response.id] = [
                response.parameters["sequence_start"].bool_param,
                response.parameters["sequence_end"].bool_param,
            ]
            assert response.parameters["sequence_id"].int64_param == 7
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert [flags[f"7_{i}"] for i in range(3)] == [[True, False], [False, False], [False, True]]
    finally:
        client.stop_stream()
        client.close()


def test_sequence_flags_come_back_over_rest_and_a_plain_request_carries_none(running):
    """The same over REST (Triton's JSON ``parameters``); a request naming no sequence gets
    none back."""
    import requests as http

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    body = {
        "inputs": [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": a.ravel().tolist()}
            for n in ("INPUT0", "INPUT1")
        ]
    }
    url = f"http://127.0.0.1:{running.http_port}/v2/models/add_sub_6/infer"
    with http.Session() as session:
        plain = session.post(url, json=body, timeout=60)
        assert plain.status_code == 200, plain.text
        assert "parameters" not in plain.json()
        ended = session.post(
            url, json={**body, "parameters": {"sequence_id": 9, "sequence_end": True}}, timeout=60
        )
        assert ended.status_code == 200, ended.text
        assert ended.json()["parameters"] == {
            "sequence_id": 9, "sequence_start": False, "sequence_end": True,
        }  # fmt: skip


def test_sequence_flags_come_back_on_a_rest_answer_written_by_the_helper_process(running):
    """A JSON answer over 1 MiB is encoded in REST's helper process (as is a body over 1 MiB
    decoded there): it carries the request's sequence flags back too."""
    import requests as http

    a = np.arange(150_000, dtype=np.int32)
    body = {
        "inputs": [
            {"name": n, "shape": [a.size], "datatype": "INT32", "data": a.tolist()}
            for n in ("INPUT0", "INPUT1")
        ],
        "parameters": {"sequence_id": 11, "sequence_start": True},
    }
    url = f"http://127.0.0.1:{running.http_port}/v2/models/wide_pass/infer"
    answer = http.post(url, json=body, timeout=120)
    assert answer.status_code == 200, answer.text[:500]
    got = answer.json()
    assert got["parameters"] == {
        "sequence_id": 11, "sequence_start": True, "sequence_end": False,
    }  # fmt: skip
    outputs = {o["name"]: o["data"] for o in got["outputs"]}
    np.testing.assert_array_equal(outputs["OUTPUT0"], a + a)


def test_tensors_between_steps_are_passed_by_reference(tmp_path):
    """Three NUMPY Identity steps over 4 MB: the answer is the request's own array, so no step
    boundary copied it (the scheduler, the data plane and the device pass references)."""
    import onnx
    from onnx import TensorProto, helper

    from plugserve.server.plane.request import Request
    from plugserve.server.process.app import Server
    from plugserve.server.process.settings import Settings

    root = tmp_path / "models"
    shape = [1024, 1024]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    names = ["x", "a", "b", "y"]
    steps = []
    for i in range(3):
        (root / f"s{i}" / "1").mkdir(parents=True)
        onnx.save(model, root / f"s{i}" / "1" / "model.onnx")
        (root / f"s{i}" / "config.json").write_text('{"device": "NUMPY"}')
        steps.append(_step(f"s{i}", -1, {"x": names[i]}, {"y": names[i + 1]}))
    spec = '{ name: "%s" data_type: TYPE_FP32 dims: [ 1024, 1024 ] }'
    text = _ensemble("chain", spec % "x", spec % "y", steps).replace("max_batch_size: 8", "")
    _write(root, "chain", text)
    server = Server(
        Settings(model_repository=str(root), host="127.0.0.1", grpc_port=0, http_port=-1,
                 metrics_port=-1, health_port=-1)
    )  # fmt: skip
    server.start()
    try:
        plane = server.plane
        x = np.random.default_rng(0).random(shape, dtype=np.float32)
        for inline in (False, True):  # on the ensemble's stream, and on the caller's thread
            answer = plane.infer(Request(plane.get("chain"), {"x": x}, inline=inline)).result()
            assert answer["y"] is x
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("missing", "reads tensor 'nowhere', which no step writes"),
        ("cycle", "its steps form a cycle"),
        ("mismatch", "tensor 'INPUT0' is float32 where step 0 (model 'simple') takes"),
        ("loop_b", "it runs itself: step 0 (model 'loop_a') -> step 0 (model 'loop_b')"),
        ("named_apart", "its config.pbtxt names it 'decoy'; an ensemble's name is its folder's"),
        (
            "crossed",
            "step 2 (model 'simple') receives inputs originated from different decoupled models",
        ),
    ],
)
def test_an_ensemble_whose_steps_do_not_connect_is_refused_at_load(running, model, reason):
    client = httpclient.InferenceServerClient(running.http_target)
    try:
        assert not client.is_model_ready(model)
        assert client.is_model_ready("simple_chain")
    finally:
        client.close()
    assert reason in running.log, running.log[-3000:]


def test_the_repository_index_says_an_ensemble_missing_a_step_is_unavailable(running):
    """Triton's repository index: an ensemble is READY only while it can serve. One whose step
    was unloaded was listed READY (with ModelReady false and every request UNAVAILABLE, a red
    team's); it is UNAVAILABLE naming the step, and READY again once the step is back. A
    model that failed to load says why, not "unloaded"."""
    client = grpcclient.InferenceServerClient(running.target)
    try:

        def index() -> dict:
            return {m.name: m for m in client.get_model_repository_index().models}

        assert (index()["partial"].state, index()["partial"].reason) == ("READY", "")
        client.unload_model("double")
        try:
            partial = index()["partial"]
            assert partial.state == "UNAVAILABLE", partial
            assert "runs model 'double'" in partial.reason and "not loaded" in partial.reason
            assert not client.is_model_ready("partial")
            ready = client._client_stub.RepositoryIndex(
                grpcclient.service_pb2.RepositoryIndexRequest(ready=True)
            )
            assert "partial" not in {m.name for m in ready.models}
        finally:
            client.load_model("double")
        assert (index()["partial"].state, index()["partial"].reason) == ("READY", "")
        cycle = index()["cycle"]
        assert cycle.state == "UNAVAILABLE" and cycle.reason not in ("", "unloaded"), cycle
    finally:
        client.close()
