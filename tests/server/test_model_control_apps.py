"""Model control for Python models and ensembles (issue 42, item 5), through tritonclient's
repository API as Triton's users drive it: with ``--model-control-mode explicit`` nothing is
loaded until asked; a Python model loads, answers, reloads with its changed ``model.py`` (a
new process, the old one gone) and unloads (its process gone, its requests NOT_FOUND); an
ensemble of a Python step and an ONNX step loads once its steps are, answers, reloads, and
unloads; a model loaded again after its unload serves as before."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
httpclient = pytest.importorskip("tritonclient.http", reason="pip install 'tritonclient[all]'")
from tritonclient.utils import InferenceServerException  # noqa: E402

#: OUTPUT0 = INPUT0 * FACTOR; PID = the process's id
PYTHON = """
import os

import numpy as np
import triton_python_backend_utils as pb_utils

FACTOR = {factor}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (x * FACTOR).astype(np.float32)),
                pb_utils.Tensor("PID", np.array([os.getpid()], np.int64)),
            ]))
        return responses
"""

PYTHON_CONFIG = """
name: "scale"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
         { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""

ENSEMBLE_CONFIG = """
name: "chain"
platform: "ensemble"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "scale" model_version: -1
    input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "scaled" } },
  { model_name: "double" model_version: -1
    input_map { key: "x" value: "scaled" } output_map { key: "y" value: "Y" } }
] }
"""


def _double(root: Path) -> None:
    """An ONNX step: y = x + x."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (root / "double" / "1").mkdir(parents=True)
    onnx.save(model, root / "double" / "1" / "model.onnx")
    (root / "double" / "config.json").write_text('{"device": "NUMPY"}')


def _scale(root: Path, factor: float) -> None:
    (root / "scale" / "1").mkdir(parents=True, exist_ok=True)
    (root / "scale" / "config.pbtxt").write_text(PYTHON_CONFIG)
    (root / "scale" / "1" / "model.py").write_text(textwrap.dedent(PYTHON.format(factor=factor)))


@pytest.fixture
def repo(tmp_path):
    _scale(tmp_path, 3.0)
    _double(tmp_path)
    (tmp_path / "chain" / "1").mkdir(parents=True)
    (tmp_path / "chain" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    return tmp_path


X = np.array([1, 2, 3, 4], np.float32)


def _scale_answer(client, module) -> tuple[np.ndarray, int]:
    given = module.InferInput("INPUT0", [4], "FP32")
    given.set_data_from_numpy(X)
    answer = client.infer("scale", [given])
    return answer.as_numpy("OUTPUT0"), int(answer.as_numpy("PID")[0])


def _chain_answer(client, module) -> np.ndarray:
    given = module.InferInput("X", [4], "FP32")
    given.set_data_from_numpy(X)
    return client.infer("chain", [given]).as_numpy("Y")


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_explicit_mode_loads_reloads_and_unloads_python_models_and_ensembles(repo, protocol):
    from serving import RunningServer

    module = grpcclient if protocol == "grpc" else httpclient
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    with RunningServer(*args) as server:
        client = module.InferenceServerClient(
            server.target if protocol == "grpc" else server.http_target
        )
        try:
            assert not client.is_model_ready("scale") and not client.is_model_ready("chain")
            client.load_model("scale")
            assert client.is_model_ready("scale")
            out, pid = _scale_answer(client, module)
            np.testing.assert_array_equal(out, X * 3)

            client.load_model("double")
            client.load_model("chain")
            assert client.is_model_ready("chain")
            np.testing.assert_array_equal(_chain_answer(client, module), X * 6)

            _scale(repo, 5.0)  # a changed model.py: a reload serves it, in a new process
            client.load_model("scale")
            out, new_pid = _scale_answer(client, module)
            np.testing.assert_array_equal(out, X * 5)
            assert new_pid != pid and _gone(pid), "the old process outlived its reload"
            np.testing.assert_array_equal(_chain_answer(client, module), X * 10)
            client.load_model("chain")  # an ensemble reloads too
            np.testing.assert_array_equal(_chain_answer(client, module), X * 10)

            client.unload_model("chain")
            assert not client.is_model_ready("chain")
            with pytest.raises(InferenceServerException):
                _chain_answer(client, module)
            client.unload_model("scale")
            assert not client.is_model_ready("scale")
            assert _gone(new_pid), "the unloaded model's process outlived it"
            with pytest.raises(InferenceServerException) as refused:
                _scale_answer(client, module)
            assert "scale" in refused.value.message()

            client.load_model("scale")  # loaded again after its unload
            client.load_model("chain")
            out, _ = _scale_answer(client, module)
            np.testing.assert_array_equal(out, X * 5)
            np.testing.assert_array_equal(_chain_answer(client, module), X * 10)
            index = {m["name"] if isinstance(m, dict) else m.name: m for m in _index(client)}
            assert {"scale", "chain", "double"} <= set(index)
        finally:
            client.close()


def _index(client):
    index = client.get_model_repository_index()
    return index if isinstance(index, list) else list(index.models)
