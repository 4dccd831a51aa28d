"""Training-mode Dropout on NUMPY: a seeded mask is reproducible, an unseeded one is random.

Expected values come from onnx's reference evaluator, an implementation independent of ours.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from plugserve.plugins.api import InvalidInput
from plugserve.server.control.core import Core

SHAPE = [4, 8, 16]


@pytest.fixture(scope="module")
def core():
    return Core()


def _dropout(seed: int | None, constant_mode: bool | None = None) -> onnx.ModelProto:
    """Dropout-13 with ratio and training_mode as graph inputs, or as initializers."""
    attrs = {} if seed is None else {"seed": seed}
    node = helper.make_node("Dropout", ["x", "ratio", "training"], ["y", "mask"], **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)]
    initializers = []
    if constant_mode is None:
        inputs += [
            helper.make_tensor_value_info("ratio", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("training", TensorProto.BOOL, []),
        ]
    else:
        initializers = [
            helper.make_tensor("ratio", TensorProto.FLOAT, [], [0.75]),
            helper.make_tensor("training", TensorProto.BOOL, [], [constant_mode]),
        ]
    graph = helper.make_graph(
        [node],
        "dropout",
        inputs,
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, SHAPE),
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    return model


def _feeds(ratio: float = 0.75, training: bool = True) -> dict[str, np.ndarray]:
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    return {"x": x, "ratio": np.float32(ratio), "training": np.bool_(training)}


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_training_dropout_matches_the_reference_on_every_run(core, seed):
    model = _dropout(seed)
    feeds = _feeds()
    want_y, want_mask = ReferenceEvaluator(model).run(None, feeds)
    request = core.load_network(model, "NUMPY", {"NUM_STREAMS": "2"}).create_infer_request()
    for _ in range(3):
        got = request.infer(feeds)
        assert got["mask"].dtype == np.bool_
        np.testing.assert_array_equal(got["mask"], want_mask)
        np.testing.assert_allclose(got["y"], want_y, rtol=1e-6)
    assert 0 < want_mask.sum() < want_mask.size


def test_unseeded_training_dropout_draws_a_new_mask_each_run(core):
    request = core.load_network(_dropout(None), "NUMPY").create_infer_request()
    feeds = _feeds(ratio=0.5)
    first, second = request.infer(feeds), request.infer(feeds)
    assert not np.array_equal(first["mask"], second["mask"])
    for got in (first, second):
        kept = got["mask"]
        np.testing.assert_allclose(got["y"][kept], feeds["x"][kept] * 2, rtol=1e-6)
        assert not got["y"][~kept].any()


@pytest.mark.parametrize("ratio", [0.0, 0.75])
def test_inference_mode_and_zero_ratio_are_the_identity(core, ratio):
    request = core.load_network(_dropout(0), "NUMPY").create_infer_request()
    for training in (False, ratio == 0.0):
        feeds = _feeds(ratio=ratio, training=training)
        got = request.infer(feeds)
        np.testing.assert_array_equal(got["y"], feeds["x"])
        assert got["mask"].all()


def test_training_mode_known_at_load_is_supported_by_query(core):
    model = _dropout(0, constant_mode=True)
    assert set(core.query_network(model, "NUMPY").values()) == {"NUMPY"}
    x = _feeds()["x"]
    want_y, want_mask = ReferenceEvaluator(model).run(None, {"x": x})
    got = core.load_network(model, "NUMPY").create_infer_request().infer({"x": x})
    np.testing.assert_array_equal(got["mask"], want_mask)
    np.testing.assert_allclose(got["y"], want_y, rtol=1e-6)


def test_a_ratio_of_one_is_refused_at_run_time(core):
    request = core.load_network(_dropout(0), "NUMPY").create_infer_request()
    with pytest.raises(InvalidInput, match=r"'Dropout_0' \(Dropout\): ratio 1\.0 is outside"):
        request.infer(_feeds(ratio=1.0))
