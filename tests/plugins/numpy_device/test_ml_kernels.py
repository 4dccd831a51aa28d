"""Every ai.onnx.ml op but the tree ensembles (tests/test_ml_trees.py), and the com.microsoft
Tokenizer, on NUMPY against onnxruntime: node models over grids of attributes, input types and
ranks. Where onnxruntime's result is not defined (it leaves part of an output unset), the case
is left out and the reason written beside it."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from plugserve.plugins.numpy.kernels.registry import default_registry

ML = "ai.onnx.ml"
F, D, I, I32, S = (
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.INT64,
    TensorProto.INT32,
    TensorProto.STRING,
)
POSTS = ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"]


def test_every_ai_onnx_ml_op_version_has_a_kernel() -> None:
    missing = [
        (s.name, s.since_version)
        for s in onnx.defs.get_all_schemas_with_history()
        if s.domain == ML and default_registry.lookup(ML, s.name, s.since_version) is None
    ]
    assert missing == []


def node_model(op, inputs, outputs, ml_opset=1, domain=ML, **attrs) -> bytes:
    """``inputs``/``outputs``: (name, element type or a TypeProto, shape or None)."""

    def value(name, kind, shape):
        if isinstance(kind, int):
            return helper.make_tensor_value_info(name, kind, shape)
        return helper.make_value_info(name, kind)

    node = helper.make_node(
        op, [n for n, *_ in inputs], [n for n, *_ in outputs], domain=domain, **attrs
    )
    graph = helper.make_graph([node], op, [value(*i) for i in inputs], [value(*o) for o in outputs])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)]
    if domain != ML:
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


def same(got, want) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(want)
            and all(same(got[k], want[k]) for k in want)
        )
    want, got = np.asarray(want), np.asarray(got)
    if got.shape != want.shape:
        return False
    if want.dtype == object or want.dtype.kind in "iub":
        return got.tolist() == want.tolist() and (want.dtype == object or got.dtype == want.dtype)
    return got.dtype == want.dtype and np.allclose(got, want, rtol=1e-3, atol=1e-5, equal_nan=True)


def difference(core, data: bytes, feeds: dict) -> str | None:
    """How NUMPY's outputs differ from onnxruntime's (None: they do not)."""
    import onnxruntime as ort

    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    want = dict(zip(names, session.run(None, feeds)))
    got = core.load_network(data, "NUMPY").create_infer_request().infer(feeds)
    for name in names:
        if not same(got[name], want[name]):
            return f"{name}: got {got[name]!r}, onnxruntime {want[name]!r}"
    return None


def check_all(core, cases) -> None:
    """Run every (description, model, feeds) and report every mismatch at once."""
    failures = []
    for what, data, feeds in cases:
        try:
            found = difference(core, data, feeds)
        except Exception as error:  # reported with its case
            found = f"{type(error).__name__}: {error}"[:300]
        if found:
            failures.append((what, found))
    assert failures == []


def labelled(labels) -> tuple[dict, int]:
    if isinstance(labels[0], str):
        return {"classlabels_strings": labels}, S
    return {"classlabels_ints": labels}, I


def test_linear_classifier(core) -> None:
    rng = np.random.default_rng(0)
    cases = []
    grid = itertools.product(
        [[0, 1], [3, 7], ["a", "b"], [0, 1, 2], ["q", "r", "s"]], [1, 2, 3], POSTS
    )
    for labels, columns, post in grid:
        if columns == 1 and post == "PROBIT" and len(labels) == 2:
            continue  # onnxruntime writes one probit per row and leaves the other column unset
        if columns != len(labels) and (columns, len(labels)) != (1, 2):
            continue
        attrs, label_type = labelled(labels)
        data = node_model(
            "LinearClassifier",
            [("x", F, [None, 3])],
            [("label", label_type, [None]), ("scores", F, [None, None])],
            coefficients=rng.normal(size=3 * columns).tolist(),
            intercepts=rng.normal(size=columns).tolist(),
            post_transform=post,
            **attrs,
        )
        x = rng.normal(size=(5, 3)).astype(np.float32)
        if post == "PROBIT":
            x = np.abs(x) / 20
        cases.append(((labels, columns, post), data, {"x": x}))
    for kind, array in ((D, np.float64), (I, np.int64), (I32, np.int32)):
        data = node_model(
            "LinearClassifier",
            [("x", kind, [None, 2])],
            [("label", I, [None]), ("scores", F, [None, None])],
            coefficients=[0.5, -1.0, 0.25, 2.0],
            intercepts=[0.1, -0.2],
            classlabels_ints=[4, 5],
        )
        cases.append((kind, data, {"x": np.array([[1, 2], [3, -4]], dtype=array)}))
    check_all(core, cases)


def test_linear_regressor(core) -> None:
    rng = np.random.default_rng(1)
    cases = []
    for targets, post in itertools.product([1, 2, 3], POSTS):
        data = node_model(
            "LinearRegressor",
            [("x", F, [None, 4])],
            [("y", F, [None, None])],
            coefficients=rng.normal(size=4 * targets).tolist(),
            intercepts=rng.normal(size=targets).tolist(),
            targets=targets,
            post_transform=post,
        )
        x = rng.normal(size=(6, 4)).astype(np.float32) / (20 if post == "PROBIT" else 1)
        cases.append(((targets, post), data, {"x": x}))
    check_all(core, cases)


def svm_attrs(rng, k: int, kernel: str, proba: bool, linear: bool, features: int) -> dict:
    attrs = {"kernel_type": kernel, "kernel_params": [0.3, 0.1, 2.0]}
    pairs = k * (k - 1) // 2
    if linear:
        attrs.update(coefficients=rng.normal(size=k * features).tolist(), rho=[0.3])
    else:
        per_class = rng.integers(1, 4, size=k).tolist()
        total = sum(per_class)
        attrs.update(
            vectors_per_class=per_class,
            support_vectors=rng.normal(size=total * features).tolist(),
            coefficients=rng.normal(size=(k - 1) * total).tolist(),
            rho=rng.normal(size=pairs).tolist(),
        )
    if proba:
        attrs.update(prob_a=rng.normal(size=pairs).tolist(), prob_b=rng.normal(size=pairs).tolist())
    return attrs


def test_svm_classifier(core) -> None:
    rng = np.random.default_rng(2)
    cases = []
    grid = itertools.product(
        [[0, 1], [3, 7], ["a", "b"], [0, 1, 2], ["a", "b", "c", "d"]],
        ["LINEAR", "POLY", "RBF", "SIGMOID"],
        [False, True],
        POSTS,
        [False, True],
    )
    for labels, kernel, proba, post, linear in grid:
        k = len(labels)
        if post == "PROBIT" and ((k == 2 and not proba and not linear) or proba):
            # two classes: one probit per row, the other column unset; probabilities near 1
            # lose their digits in onnxruntime's float32 coupling before the probit
            continue
        attrs, label_type = labelled(labels)
        data = node_model(
            "SVMClassifier",
            [("x", F, [None, 3])],
            [("label", label_type, [None]), ("scores", F, [None, None])],
            post_transform=post,
            **attrs,
            **svm_attrs(rng, k, kernel, proba, linear, 3),
        )
        x = rng.normal(size=(6, 3)).astype(np.float32)
        cases.append(((labels, kernel, proba, post, linear), data, {"x": x}))
    check_all(core, cases)


def test_svm_regressor(core) -> None:
    rng = np.random.default_rng(3)
    cases = []
    for kernel, post, linear, one_class in itertools.product(
        ["LINEAR", "POLY", "RBF", "SIGMOID"], POSTS, [False, True], [0, 1]
    ):
        attrs = {"kernel_type": kernel, "kernel_params": [0.3, 0.1, 2.0], "one_class": one_class}
        if linear:
            attrs.update(coefficients=rng.normal(size=3).tolist(), rho=[0.2], n_supports=0)
        else:
            attrs.update(
                n_supports=4,
                support_vectors=rng.normal(size=12).tolist(),
                coefficients=rng.normal(size=4).tolist(),
                rho=[0.3],
            )
        data = node_model(
            "SVMRegressor",
            [("x", F, [None, 3])],
            [("y", F, [None, 1])],
            post_transform=post,
            **attrs,
        )
        cases.append(
            (
                (kernel, post, linear, one_class),
                data,
                {"x": rng.normal(size=(6, 3)).astype(np.float32)},
            )
        )
    check_all(core, cases)


def test_label_encoder_every_version(core) -> None:
    words = np.array([["cat", "eel"], ["dog", "owl"]], dtype=object)
    cases = [
        (
            "v1 strings to ints",
            node_model(
                "LabelEncoder",
                [("x", S, [None, 2])],
                [("y", I, [None, 2])],
                classes_strings=["cat", "dog", "eel"],
                default_int64=-3,
            ),
            {"x": words},
        ),
        (
            "v1 ints to strings",
            node_model(
                "LabelEncoder",
                [("x", I, [None])],
                [("y", S, [None])],
                classes_strings=["cat", "dog", "eel"],
                default_string="none",
            ),
            {"x": np.array([2, 0, 7, -1], np.int64)},
        ),
    ]
    pairs = {
        "strings": (S, {"keys_strings": ["cat", "dog"]}, words),
        "int64s": (I, {"keys_int64s": [3, -1, 8]}, np.array([8, 3, 5, -1], np.int64)),
        "floats": (F, {"keys_floats": [0.5, -2.0]}, np.array([[-2.0, 0.5, 1.0]], np.float32)),
    }
    values = {
        "strings": (S, {"values_strings": ["A", "B", "C"]}, {"default_string": "?"}),
        "int64s": (I, {"values_int64s": [10, 20, 30]}, {"default_int64": 99}),
        "floats": (F, {"values_floats": [1.5, 2.5, 3.5]}, {"default_float": -1.0}),
    }
    for opset in (2, 4):
        for (kname, (ktype, keys, x)), (vname, (vtype, vals, default)) in itertools.product(
            pairs.items(), values.items()
        ):
            n = len(next(iter(keys.values())))
            vals = {name: v[:n] for name, v in vals.items()}
            data = node_model(
                "LabelEncoder",
                [("x", ktype, list(x.shape))],
                [("y", vtype, list(x.shape))],
                ml_opset=opset,
                **keys,
                **vals,
                **default,
            )
            cases.append(((opset, kname, vname), data, {"x": x}))
    tensor_keys = helper.make_tensor("k", TensorProto.INT64, [3], [1, 2, 3])
    tensor_values = helper.make_tensor("v", TensorProto.DOUBLE, [3], [0.1, 0.2, 0.3])
    data = node_model(
        "LabelEncoder",
        [("x", I, [3])],
        [("y", D, [3])],
        ml_opset=4,
        keys_tensor=tensor_keys,
        values_tensor=tensor_values,
        default_tensor=helper.make_tensor("d", TensorProto.DOUBLE, [1], [-5.0]),
    )
    cases.append(("v4 tensors", data, {"x": np.array([3, 4, 1], np.int64)}))
    check_all(core, cases)


def test_array_feature_extractor(core) -> None:
    cases = []
    for kind, x in (
        (F, np.arange(24, dtype=np.float32).reshape(2, 3, 4)),
        (I, np.arange(12, dtype=np.int64).reshape(3, 4)),
        (S, np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)),
        (D, np.arange(5, dtype=np.float64)),
    ):
        for index in ([0], [2, 0], [[1], [1]]):
            rank = max(x.ndim, 2)
            data = node_model(
                "ArrayFeatureExtractor",
                [("x", kind, list(x.shape)), ("i", I, list(np.shape(index)))],
                [("y", kind, ["?"] * rank)],
            )
            cases.append(((kind, index), data, {"x": x, "i": np.array(index, np.int64)}))
    check_all(core, cases)


def test_element_wise_transforms(core) -> None:
    x = np.array([[1.0, -2.0, 0.0], [0.5, 3.0, 4.0]], np.float32)
    binarizer = node_model("Binarizer", [("x", F, [2, 3])], [("y", F, [2, 3])], threshold=0.7)
    cases = [("Binarizer", binarizer, {"x": x})]  # onnxruntime has it for float only
    for kind, array in ((F, np.float32), (D, np.float64), (I, np.int64), (I32, np.int32)):
        for scale in ([2.0], [2.0, 0.5, 1.0]):
            cases.append(
                (
                    ("Scaler", kind, len(scale)),
                    node_model(
                        "Scaler",
                        [("x", kind, [None, 3])],
                        [("y", F, [None, 3])],
                        offset=[1.0, 0.0, -1.0][: len(scale)],
                        scale=scale,
                    ),
                    {"x": x.astype(array)},
                )
            )
        for norm in ("MAX", "L1", "L2"):
            cases.append(
                (
                    ("Normalizer", kind, norm),
                    node_model(
                        "Normalizer", [("x", kind, [None, 3])], [("y", F, [None, 3])], norm=norm
                    ),
                    {"x": np.vstack([x, -x - 1, np.zeros(3)]).astype(array)},
                )
            )
    nan = np.array([[1.0, np.nan, 3.0], [np.nan, 2.0, -1.0]], np.float32)
    for values in ([9.0], [9.0, 8.0, 7.0]):
        cases.append(
            (
                ("Imputer floats", len(values)),
                node_model(
                    "Imputer",
                    [("x", F, [None, 3])],
                    [("y", F, [None, 3])],
                    imputed_value_floats=values,
                    replaced_value_float=float("nan"),
                ),
                {"x": nan},
            )
        )
    cases.append(
        (
            "Imputer ints",
            node_model(
                "Imputer",
                [("x", I, [None, 3])],
                [("y", I, [None, 3])],
                imputed_value_int64s=[7, 8, 9],
                replaced_value_int64=-1,
            ),
            {"x": np.array([[1, -1, 3], [-1, -1, 0]], np.int64)},
        )
    )
    check_all(core, cases)


def test_encoders(core) -> None:
    cases = []
    for kind, cats, x in (
        (S, {"cats_strings": ["a", "b", "c"]}, np.array([["a", "c"], ["z", "b"]], dtype=object)),
        (I, {"cats_int64s": [7, 3, 5]}, np.array([[3, 9, 7, 5]], np.int64)),
        (F, {"cats_int64s": [1, 2]}, np.array([[1.0, 2.0], [2.0, 1.0]], np.float32)),
        (D, {"cats_int64s": [1, 2]}, np.array([[[1.0], [2.0]]], np.float64)),
    ):
        for zeros in (1, 0):
            if zeros == 0 and kind in (S, I):
                continue  # an unknown category then fails the request (tested below)
            shape = list(x.shape)
            data = node_model(
                "OneHotEncoder",
                [("x", kind, shape)],
                [("y", F, [*shape, "?"])],
                zeros=zeros,
                **cats,
            )
            cases.append((("OneHotEncoder", kind, zeros), data, {"x": x}))
    cats = {"cats_strings": ["red", "green", "blue"], "cats_int64s": [1, 2, 3]}
    cases.append(
        (
            "CategoryMapper to ints",
            node_model(
                "CategoryMapper",
                [("x", S, [2, 2])],
                [("y", I, [2, 2])],
                default_int64=-7,
                **cats,
            ),
            {"x": np.array([["blue", "pink"], ["red", "red"]], dtype=object)},
        )
    )
    cases.append(
        (
            "CategoryMapper to strings",
            node_model(
                "CategoryMapper",
                [("x", I, [3])],
                [("y", S, [3])],
                default_string="?",
                **cats,
            ),
            {"x": np.array([2, 9, 1], np.int64)},
        )
    )
    cases.append(
        (
            "FeatureVectorizer",
            node_model(
                "FeatureVectorizer",
                [("a", F, [None, 3]), ("b", F, [None, 1]), ("c", F, [None, 2])],
                [("y", F, [None, None])],
                inputdimensions=[2, 3, 2],
            ),
            {
                "a": np.arange(6, dtype=np.float32).reshape(2, 3),
                "b": np.array([[4], [5]], np.float32),
                "c": np.ones((2, 2), np.float32),
            },
        )
    )
    check_all(core, cases)


def test_one_hot_encoder_without_zeros_refuses_an_unknown_category(core) -> None:
    data = node_model(
        "OneHotEncoder",
        [("x", S, [2])],
        [("y", F, [2, 2])],
        zeros=0,
        cats_strings=["a", "b"],
    )
    request = core.load_network(data, "NUMPY").create_infer_request()
    with pytest.raises(Exception, match="not among the categories"):
        request.infer({"x": np.array(["a", "z"], dtype=object)})


def map_type(key: int, value: int):
    return helper.make_map_type_proto(key, helper.make_tensor_type_proto(value, None))


def test_maps(core) -> None:
    """DictVectorizer and CastMap take maps; ZipMap makes a sequence of maps. (onnxruntime's
    Python binding cannot feed a map of strings, so those are tested on NUMPY alone.)"""
    cases = []
    for key, value, feed in (
        (S, F, {"b": 2.0, "z": 9.0, "a": 1.0}),
        (I, F, {4: 0.5, 1: 1.5}),
    ):
        vocab = (
            {"string_vocabulary": ["a", "b", "c"]} if key == S else {"int64_vocabulary": [1, 2, 4]}
        )
        data = node_model(
            "DictVectorizer",
            [("m", map_type(key, value), None)],
            [("y", value, ["?", 3])],
            **vocab,
        )
        cases.append((("DictVectorizer", key, value), data, {"m": feed}))
    for form, cast in itertools.product(["DENSE", "SPARSE"], ["TO_FLOAT", "TO_STRING", "TO_INT64"]):
        out = {"TO_FLOAT": F, "TO_STRING": S, "TO_INT64": I}[cast]
        data = node_model(
            "CastMap",
            [("m", map_type(I, F), None)],
            [("y", out, [1, "?"])],
            map_form=form,
            cast_to=cast,
            max_map=5,
        )
        cases.append((("CastMap", form, cast), data, {"m": {3: 1.5, 0: 2.25}}))
    for labels in ({"classlabels_strings": ["x", "y", "z"]}, {"classlabels_int64s": [5, 6, 7]}):
        key = S if "classlabels_strings" in labels else I
        seq = helper.make_sequence_type_proto(map_type(key, F))
        data = node_model("ZipMap", [("x", F, [None, 3])], [("z", seq, None)], **labels)
        scores = np.arange(6, dtype=np.float32).reshape(2, 3) / 10
        cases.append((("ZipMap", key), data, {"x": scores}))
    check_all(core, cases)


def test_maps_of_strings(core) -> None:
    vectorizer = node_model(
        "DictVectorizer",
        [("m", map_type(I, S), None)],
        [("y", S, ["?", 3])],
        int64_vocabulary=[1, 2, 4],
    )
    got = core.load_network(vectorizer, "NUMPY").create_infer_request().infer({"m": {4: "x"}})
    assert got["y"].tolist() == [["", "", "x"]]
    cast = node_model(
        "CastMap",
        [("m", map_type(I, S), None)],
        [("y", F, [1, "?"])],
        map_form="SPARSE",
        cast_to="TO_FLOAT",
        max_map=3,
    )
    got = core.load_network(cast, "NUMPY").create_infer_request().infer({"m": {2: "7.5"}})
    assert got["y"].tolist() == [[0.0, 0.0, 7.5]]


@pytest.mark.parametrize(
    ("attrs", "texts"),
    [
        ({"separators": [" "], "mincharnum": 1}, [["a bb  ccc", "dd"], ["", "e f"]]),
        ({"separators": [" ", ";"], "mincharnum": 2}, [["a;bb ccc", "dd;;e"]]),
        ({"tokenexp": "[a-z]+", "mincharnum": 1}, [["ab12cd e", "x"]]),
        ({"tokenexp": "\\w+", "mincharnum": 3, "mark": 1}, [["the big dog", "a cat"]]),
        ({"separators": [""], "mincharnum": 1}, [["abc", "de"]]),
        ({"separators": [" "], "mincharnum": 5}, [["no long words", "here"]]),
    ],
)
def test_tokenizer(core, attrs, texts) -> None:
    """onnxruntime's contrib Tokenizer, which skl2onnx emits for text pipelines."""
    attrs = {"mark": 0, "pad_value": "#", **attrs}
    data = node_model(
        "Tokenizer",
        [("x", S, ["?"] * len(np.shape(texts)))],
        [("y", S, ["?"] * (len(np.shape(texts)) + 1))],
        domain="com.microsoft",
        **attrs,
    )
    feeds = {"x": np.array(texts, dtype=object)}
    assert difference(core, data, feeds) is None
    flat = node_model(
        "Tokenizer",
        [("x", S, ["?"])],
        [("y", S, ["?", "?"])],
        domain="com.microsoft",
        **attrs,
    )
    assert difference(core, flat, {"x": np.array(texts[0], dtype=object)}) is None


def test_an_empty_batch(core) -> None:
    """Zero rows give zero-row outputs, as in onnxruntime."""
    rng = np.random.default_rng(6)
    x = [("x", F, [None, 4])]
    labels_scores = [("label", I, [None]), ("scores", F, [None, None])]
    models = [
        node_model(
            "SVMClassifier",
            x,
            labels_scores,
            classlabels_ints=[0, 1, 2],
            **svm_attrs(rng, 3, "RBF", True, False, 4),
        ),
        node_model(
            "LinearClassifier",
            x,
            labels_scores,
            coefficients=[0.5] * 8,
            intercepts=[0.0, 1.0],
            classlabels_ints=[3, 4],
        ),
        node_model("LinearRegressor", x, [("y", F, [None, 1])], coefficients=[1.0] * 4),
    ]
    empty = {"x": np.zeros((0, 4), np.float32)}
    check_all(core, [(i, data, empty) for i, data in enumerate(models)])
