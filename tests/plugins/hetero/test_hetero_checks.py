"""HETERO checks its devices (issue 22): a device's wrong answer is never passed on.

openvino 2026.4 computes ``ReduceLogSumExp(axes=[1], keepdims=1)`` of a [2, 3] input as
[1, 1], and ``ReduceSum(keepdims=0) -> Mul -> Sub`` wrongly although each op alone is right;
a scikit-learn GaussianNB pipeline on HETERO:OPENVINO,NUMPY answered with status OK and the
wrong class (the zoo's sk_gaussian_nb now checks it end to end). Each case here is the
smallest model that shows one of them.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from reference import ort_run

from plugserve.plugins.api import InferenceError
from plugserve.plugins.numpy import NumpyPlugin
from plugserve.plugins.numpy.compiled import NumpyCompiledNetwork
from plugserve.plugins.numpy.request import NumpyInferRequest


@pytest.fixture(scope="module")
def openvino(core):
    if "OPENVINO" not in core.available_devices:
        pytest.skip("OPENVINO is not available: pip install openvino")
    return core


def reduce_log_sum_exp() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("ReduceLogSumExp", ["x"], ["y"], axes=[1], keepdims=1, name="rlse"),
            helper.make_node("Relu", ["y"], ["z"], name="relu"),
        ],
        "rlse",
        [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("z", T.FLOAT, [2, 1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def fused_chain() -> onnx.ModelProto:
    """GaussianNB's log-likelihood: each op right on openvino, the three together wrong."""
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["d", "axis"], ["r"], keepdims=0, name="sum"),
            helper.make_node("Mul", ["r", "half"], ["m"], name="mul"),
            helper.make_node("Sub", ["offset", "m"], ["y"], name="sub"),
        ],
        "chain",
        [helper.make_tensor_value_info("d", T.FLOAT, ["n", 3, 3])],
        [helper.make_tensor_value_info("y", T.FLOAT, ["n", 3])],
        [
            numpy_helper.from_array(np.array([2], np.int64), "axis"),
            numpy_helper.from_array(np.array(0.5, np.float32), "half"),
            numpy_helper.from_array(rng.normal(size=(1, 3)).astype(np.float32), "offset"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_openvino_does_not_claim_an_op_it_computes_wrongly(openvino):
    model = reduce_log_sum_exp()
    assert "rlse" not in openvino.query_network(model, "OPENVINO")
    why = openvino.plugin("OPENVINO").unsupported_nodes(model)["rlse"]
    assert "computes ReduceLogSumExp here wrongly" in why and "[2, 1]" in why
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    got = openvino.load_network(model, "HETERO:OPENVINO,NUMPY").infer({"x": x})["z"]
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-5)
    with pytest.raises(Exception, match="computes ReduceLogSumExp here wrongly"):
        openvino.load_network(model, "OPENVINO")  # asked for by name: refused, never wrong


def test_a_piece_that_disagrees_with_numpy_moves_to_numpy(openvino, caplog):
    model = fused_chain()
    assert set(openvino.query_network(model, "OPENVINO")) == {"sum", "mul", "sub"}
    d = np.random.default_rng(0).normal(size=(5, 3, 3)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="plugserve.plugins.hetero.plugin"):
        network = openvino.load_network(model, "HETERO:OPENVINO,NUMPY")
    assert "OPENVINO computes the piece of node(s)" in caplog.text
    assert network.get_metric("EXECUTION_DEVICES") == ["NUMPY"]
    got = network.infer({"d": d})["y"]
    np.testing.assert_allclose(got, ort_run(model, {"d": d})[0], rtol=1e-5, atol=1e-6)


class _RowDroppingRequest(NumpyInferRequest):
    """A third-party device's bug: every output loses its rows but the first."""

    def _run(self, arrays):
        return {k: v[:1] for k, v in super()._run(arrays).items()}


class _RowDroppingNetwork(NumpyCompiledNetwork):
    def create_infer_request(self):
        return _RowDroppingRequest(self)


class RowDroppingPlugin(NumpyPlugin):
    name = "ROWDROP"

    def load_network(self, model, config=None):
        network = super().load_network(model, config)
        network.__class__ = _RowDroppingNetwork
        return network


def test_a_wrong_value_handed_on_at_run_time_is_an_error_naming_device_and_node():
    """Without NUMPY among its devices HETERO cannot compare at load; the shape of every value
    a piece hands on is still checked when it runs."""
    from plugserve.server import Core

    core = Core(plugins={"ROWDROP": RowDroppingPlugin})
    if "ORT" not in core.available_devices:
        pytest.skip("ORT is not available: pip install onnxruntime")
    model = reduce_log_sum_exp()
    network = core.load_network(
        model, "HETERO:ROWDROP,ORT", {"AFFINITY": json.dumps({"rlse": "ROWDROP", "relu": "ORT"})}
    )
    with pytest.raises(InferenceError) as failed:
        network.infer({"x": np.ones((2, 3), np.float32)})
    message = str(failed.value)
    assert "ROWDROP answered 'y' (made by node 'rlse')" in message
    assert "shape [1, 1] where the model says [2,1]" in message
