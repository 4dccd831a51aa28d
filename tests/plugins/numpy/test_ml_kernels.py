"""The ai.onnx.ml domain on NUMPY: every op and version onnx defines has a kernel, and the ones
converters rarely emit on their own (encoders, maps, TreeEnsemble v5, SVM kernels) match
onnxruntime on node models written here. The converter-made models are in tests/zoo."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from plugserve.plugins.numpy.kernels.registry import default_registry

ML = "ai.onnx.ml"


def test_every_ai_onnx_ml_op_version_has_a_kernel() -> None:
    missing = [
        (s.name, s.since_version)
        for s in onnx.defs.get_all_schemas_with_history()
        if s.domain == ML and default_registry.lookup(ML, s.name, s.since_version) is None
    ]
    assert missing == []


def node_model(op, inputs, outputs, ml_opset=3, **attrs) -> onnx.ModelProto:
    node = helper.make_node(
        op, [n for n, *_ in inputs], [o[0] for o in outputs], domain=ML, **attrs
    )
    graph = helper.make_graph(
        [node],
        op,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        # the checker wants a rank on graph outputs; symbolic dims leave the values free
        [helper.make_tensor_value_info(n, t, s or ["?"] * rank) for n, t, s, rank in outputs],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)]
    )
    model.ir_version = 8
    return model


def same_as_onnxruntime(core, model: onnx.ModelProto, feeds: dict) -> None:
    import onnxruntime as ort

    data = model.SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = core.load_network(data, "NUMPY").create_infer_request().infer(feeds)
    for name, expected in want.items():
        value = np.asarray(got[name])
        assert value.shape == np.shape(expected), (name, value.shape, np.shape(expected))
        if np.asarray(expected).dtype.kind in "OUS":
            assert value.tolist() == np.asarray(expected).tolist(), name
        else:
            assert value.dtype == expected.dtype, (name, value.dtype, expected.dtype)
            np.testing.assert_allclose(value, expected, rtol=1e-3, atol=1e-4, err_msg=name)


F, I, S = TensorProto.FLOAT, TensorProto.INT64, TensorProto.STRING


@pytest.mark.parametrize("zeros", [1, 0])
def test_one_hot_encoder(core, zeros) -> None:
    model = node_model(
        "OneHotEncoder",
        [("x", S, [None, 2])],
        [("y", F, None, 3)],
        cats_strings=["a", "b", "c"],
        zeros=zeros,
    )
    x = np.array([["a", "c"], ["b", "a"]], dtype=object)
    same_as_onnxruntime(core, model, {"x": x})
    ints = node_model(
        "OneHotEncoder", [("x", I, [None])], [("y", F, None, 2)], cats_int64s=[7, 3, 5]
    )
    same_as_onnxruntime(core, ints, {"x": np.array([3, 9, 7, 5], np.int64)})


def test_category_mapper_both_ways(core) -> None:
    cats = {"cats_strings": ["red", "green", "blue"], "cats_int64s": [1, 2, 3]}
    to_int = node_model(
        "CategoryMapper", [("x", S, [None])], [("y", I, None, 1)], default_int64=-7, **cats
    )
    same_as_onnxruntime(core, to_int, {"x": np.array(["blue", "pink", "red"], dtype=object)})
    to_str = node_model(
        "CategoryMapper", [("x", I, [None])], [("y", S, None, 1)], default_string="?", **cats
    )
    same_as_onnxruntime(core, to_str, {"x": np.array([2, 9, 1], np.int64)})


def test_feature_vectorizer_cuts_and_pads(core) -> None:
    model = node_model(
        "FeatureVectorizer",
        [("a", F, [None, 3]), ("b", F, [None, 1])],
        [("y", F, None, 2)],
        inputdimensions=[2, 3],
    )
    feeds = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([[4], [5]], np.float32),
    }
    same_as_onnxruntime(core, model, feeds)


def test_binarizer_scaler_normalizer_imputer(core) -> None:
    x = np.array([[1.0, -2.0, np.nan], [0.5, 3.0, 4.0]], np.float32)
    same_as_onnxruntime(
        core,
        node_model("Binarizer", [("x", F, [None, 3])], [("y", F, None, 2)], threshold=0.7),
        {"x": np.nan_to_num(x)},
    )
    same_as_onnxruntime(
        core,
        node_model(
            "Scaler",
            [("x", F, [None, 3])],
            [("y", F, None, 2)],
            offset=[1.0, 0.0, -1.0],
            scale=[2.0, 0.5, 1.0],
        ),
        {"x": np.nan_to_num(x)},
    )
    for norm in ("MAX", "L1", "L2"):
        same_as_onnxruntime(
            core,
            node_model("Normalizer", [("x", F, [None, 3])], [("y", F, None, 2)], norm=norm),
            {"x": np.nan_to_num(x) + 5},
        )
    same_as_onnxruntime(
        core,
        node_model(
            "Imputer",
            [("x", F, [None, 3])],
            [("y", F, None, 2)],
            imputed_value_floats=[9.0, 8.0, 7.0],
            replaced_value_float=float("nan"),
        ),
        {"x": x},
    )


def test_tree_ensemble_v5_matches_the_legacy_regressor(core) -> None:
    """Two stumps on feature 0 and 1 in the opset-5 encoding, against onnxruntime."""
    model = node_model(
        "TreeEnsemble",
        [("x", F, [None, 2])],
        [("y", F, None, 2)],
        ml_opset=5,
        tree_roots=[0, 1],
        nodes_featureids=[0, 1],
        nodes_splits=helper.make_tensor("s", F, [2], [0.5, -0.5]),
        nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [2], [0, 2]),
        nodes_truenodeids=[0, 2],
        nodes_trueleafs=[1, 1],
        nodes_falsenodeids=[1, 3],
        nodes_falseleafs=[1, 1],
        leaf_targetids=[0, 0, 0, 0],
        leaf_weights=helper.make_tensor("w", F, [4], [1.0, 2.0, 10.0, 20.0]),
        n_targets=1,
        aggregate_function=1,
        post_transform=0,
    )
    x = np.array([[0.0, 0.0], [1.0, -1.0], [0.2, 3.0]], np.float32)
    same_as_onnxruntime(core, model, {"x": x})


@pytest.mark.parametrize("kernel", ["LINEAR", "POLY", "RBF", "SIGMOID"])
def test_svm_regressor_kernels(core, kernel) -> None:
    rng = np.random.default_rng(0)
    model = node_model(
        "SVMRegressor",
        [("x", F, [None, 3])],
        [("y", F, None, 2)],
        kernel_type=kernel,
        kernel_params=[0.3, 0.1, 2.0],
        n_supports=4,
        support_vectors=rng.normal(size=12).astype(np.float32).tolist(),
        coefficients=rng.normal(size=4).astype(np.float32).tolist(),
        rho=[0.25],
    )
    same_as_onnxruntime(core, model, {"x": rng.normal(size=(5, 3)).astype(np.float32)})


def test_linear_classifier_post_transforms(core) -> None:
    rng = np.random.default_rng(1)
    for post in ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"):
        model = node_model(
            "LinearClassifier",
            [("x", F, [None, 4])],
            [("label", I, None, 1), ("scores", F, None, 2)],
            coefficients=rng.uniform(-0.3, 0.3, size=12).astype(np.float32).tolist(),
            # PROBIT is defined on (0, 1): scores that land there
            intercepts=[0.5, 0.4, 0.6] if post == "PROBIT" else [0.1, -0.1, 0.0],
            classlabels_ints=[4, 5, 6],
            post_transform=post,
        )
        x = rng.uniform(-1, 1, size=(6, 4)).astype(np.float32)
        if post == "PROBIT":
            x = x / 8
        same_as_onnxruntime(core, model, {"x": x})


def test_cast_map_and_dict_vectorizer_take_maps(core) -> None:
    """Maps are not tensors: NUMPY takes them in-process as Python dicts."""
    import onnxruntime as ort

    node = helper.make_node("CastMap", ["m"], ["y"], domain=ML, map_form="SPARSE", max_map=5)
    graph = helper.make_graph(
        [node],
        "castmap",
        [
            helper.make_value_info(
                "m", helper.make_map_type_proto(I, helper.make_tensor_type_proto(F, None))
            )
        ],
        [helper.make_tensor_value_info("y", F, ["?", "?"])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, 1)]
    )
    model.ir_version = 8
    feeds = {"m": {3: 1.5, 0: 2.5}}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    got = core.load_network(model.SerializeToString(), "NUMPY").create_infer_request().infer(feeds)
    np.testing.assert_array_equal(got["y"], want)
