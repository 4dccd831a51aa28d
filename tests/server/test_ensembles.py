"""Triton ensembles (issue 36) against a real server with tritonclient: Triton's QA ensemble of
``simple`` over its two versions, a partial-output ensemble with a Python step (only the steps
the requested outputs need run, as the per-version statistics show), and the ensembles whose
steps do not connect, each refused at load with what does not connect while the others
serve."""

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


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("missing", "reads tensor 'nowhere', which no step writes"),
        ("cycle", "its steps form a cycle"),
        ("mismatch", "tensor 'INPUT0' is float32 where step 0 (model 'simple') takes"),
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
