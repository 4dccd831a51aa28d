"""Classic ML as MLServer users bring it: scikit-learn through skl2onnx, LightGBM and XGBoost
through onnxmltools, trained here on seeded synthetic data (small: a few features, <= 20 trees).

The ``ai.onnx.ml`` opset is the one the converters emit by default for this onnx; the default
opset is pinned where a converter would otherwise pick one onnxruntime does not run.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx

from . import ZooModel, entry

SKL = ("scikit-learn", "skl2onnx", "pandas")
OPSETS = {"": 17, "ai.onnx.ml": 3}
FEATURES = 6


def _data(classes: int, labels=None):
    from sklearn.datasets import make_classification

    x, y = make_classification(120, FEATURES, n_informative=4, n_classes=classes, random_state=0)
    if labels is not None:
        y = np.asarray(labels, dtype=object)[y]
    return x.astype(np.float32), y


def _regression():
    from sklearn.datasets import make_regression

    x, y = make_regression(120, FEATURES, random_state=0)
    return x.astype(np.float32), y


def _rows(rng: np.random.Generator, n: int = 5) -> dict[str, np.ndarray]:
    return {"X": rng.normal(size=(n, FEATURES)).astype(np.float32)}


def _skl(
    name: str,
    make,
    data,
    zipmap: bool | None = None,
    unbatchable: str | None = None,
    openvino_wrong: str | None = None,
) -> None:
    """Register ``make()`` fitted on ``data()`` and converted by skl2onnx."""

    def build(folder: Path) -> None:
        from skl2onnx import to_onnx

        x, y = data()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = make().fit(x, y)
            options = None if zipmap is None else {id(model): {"zipmap": zipmap}}
            onx = to_onnx(model, x[:1], options=options, target_opset=OPSETS)
        assert [i.name for i in onx.graph.input] == ["X"], onx.graph.input
        onnx.save(onx, folder / "model.onnx")

    entry(
        ZooModel(
            name,
            "classic_ml",
            build,
            _rows,
            requires=SKL,
            unbatchable=unbatchable,
            openvino_wrong=openvino_wrong,
        )
    )


def _classifiers() -> None:
    from sklearn.decomposition import PCA
    from sklearn.ensemble import (
        GradientBoostingClassifier,
        RandomForestClassifier,
        RandomForestRegressor,
    )
    from sklearn.linear_model import LinearRegression, LogisticRegression, Ridge
    from sklearn.naive_bayes import GaussianNB
    from sklearn.neighbors import KNeighborsClassifier, KNeighborsRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC, SVR
    from sklearn.tree import DecisionTreeClassifier

    def binary():
        return _data(2)

    def multi():
        return _data(3)

    def strings():
        return _data(3, ["cat", "dog", "eel"])

    _skl(
        "sk_logreg_zipmap",
        lambda: LogisticRegression(max_iter=500),
        multi,
        zipmap=True,
        unbatchable="ZipMap's probabilities are a sequence of maps, not a tensor to split",
    )
    _skl("sk_logreg", lambda: LogisticRegression(max_iter=500), binary, zipmap=False)
    _skl("sk_logreg_strings", lambda: LogisticRegression(max_iter=500), strings, zipmap=False)
    _skl("sk_ridge", Ridge, _regression)
    _skl("sk_linear", LinearRegression, _regression)
    _skl("sk_tree", lambda: DecisionTreeClassifier(max_depth=5, random_state=0), multi, False)
    _skl(
        "sk_forest",
        lambda: RandomForestClassifier(10, max_depth=4, random_state=0),
        strings,
        zipmap=False,
    )
    _skl(
        "sk_forest_regressor",
        lambda: RandomForestRegressor(10, max_depth=4, random_state=0),
        _regression,
    )
    _skl(
        "sk_boosting",
        lambda: GradientBoostingClassifier(n_estimators=10, random_state=0),
        binary,
        zipmap=False,
    )
    _skl("sk_svc", lambda: SVC(probability=True, random_state=0), multi, zipmap=False)
    _skl("sk_svc_binary", lambda: SVC(random_state=0), binary, zipmap=False)
    _skl("sk_svr", SVR, _regression)
    _skl("sk_knn", lambda: KNeighborsClassifier(3), multi, zipmap=False)
    _skl("sk_knn_regressor", lambda: KNeighborsRegressor(3), _regression)
    _skl(
        "sk_gaussian_nb",
        lambda: make_pipeline(StandardScaler(), PCA(3), GaussianNB()),
        multi,
        zipmap=False,
        # openvino 2026.4 gives ReduceLogSumExp(axes=[1], keepdims=1) of [n, 3] as [1, 1]:
        # HETERO answered 1e-16 for 0.15/0.85 with status OK before it checked its devices
        openvino_wrong="ReduceLogSumExp",
    )


def _columns() -> None:
    """A ColumnTransformer: numbers scaled, a string column one-hot encoded, then a classifier."""

    def build(folder: Path) -> None:
        import pandas as pd
        from skl2onnx import convert_sklearn
        from skl2onnx.common.data_types import FloatTensorType, StringTensorType
        from sklearn.compose import ColumnTransformer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import Pipeline
        from sklearn.preprocessing import OneHotEncoder, StandardScaler

        rng = np.random.default_rng(0)
        frame = pd.DataFrame(
            {
                **{f"x{i}": rng.normal(size=80).astype(np.float32) for i in range(3)},
                "colour": rng.choice(["red", "green", "blue"], size=80),
            }
        )
        target = ((frame.x0 + (frame.colour == "red")) > 0.5).astype(int)
        prep = ColumnTransformer(
            [
                ("num", StandardScaler(), ["x0", "x1", "x2"]),
                ("cat", OneHotEncoder(handle_unknown="ignore"), ["colour"]),
            ]
        )
        pipeline = Pipeline([("prep", prep), ("clf", LogisticRegression())]).fit(frame, target)
        onx = convert_sklearn(
            pipeline,
            initial_types=[
                *[(f"x{i}", FloatTensorType([None, 1])) for i in range(3)],
                ("colour", StringTensorType([None, 1])),
            ],
            options={id(pipeline): {"zipmap": False}},
            target_opset=OPSETS,
        )
        onnx.save(onx, folder / "model.onnx")

    def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
        n = 4
        numbers = {f"x{i}": rng.normal(size=(n, 1)).astype(np.float32) for i in range(3)}
        colour = rng.choice(["red", "green", "blue", "mauve"], size=(n, 1)).astype(object)
        return {**numbers, "colour": colour}

    entry(ZooModel("sk_columns", "classic_ml", build, feeds, requires=SKL))


def _text() -> None:
    """Text pipelines on a string column: StringNormalizer, the com.microsoft Tokenizer and
    TfIdfVectorizer before the classifier. TF-IDF on words; counts of word pairs, case kept;
    counts of character pairs. Requests include a row with no known word (a zero row the
    TF-IDF normalizer must leave at 0)."""
    words = ["the", "a", "cat", "dog", "sat", "ran", "on", "far", "bird", "fly", "high", "and"]

    def texts(rng: np.random.Generator, n: int) -> np.ndarray:
        rows = [" ".join(rng.choice(words, size=rng.integers(2, 7))) for _ in range(n)]
        return np.array(rows, dtype=object)

    def register(name: str, make) -> None:
        def build(folder: Path) -> None:
            from skl2onnx import to_onnx
            from sklearn.linear_model import LogisticRegression
            from sklearn.pipeline import make_pipeline

            x = texts(np.random.default_rng(0), 60)
            target = np.array(["cat" in t for t in x], dtype=int)
            pipeline = make_pipeline(make(), LogisticRegression()).fit(x, target)
            onx = to_onnx(
                pipeline,
                x[:1].reshape(-1, 1),
                options={id(pipeline): {"zipmap": False}},
                target_opset=OPSETS,
            )
            assert [i.name for i in onx.graph.input] == ["X"], onx.graph.input
            onnx.save(onx, folder / "model.onnx")

        def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
            rows = [*(t.upper() for t in texts(rng, 3)), "zebra quokka"]
            return {"X": np.array(rows, dtype=object).reshape(-1, 1)}

        entry(ZooModel(name, "classic_ml", build, feeds, requires=SKL))

    from sklearn.feature_extraction.text import CountVectorizer, TfidfVectorizer

    register("sk_text", TfidfVectorizer)
    register("sk_text_pairs", lambda: CountVectorizer(ngram_range=(1, 2), lowercase=False))
    register("sk_text_chars", lambda: CountVectorizer(analyzer="char", ngram_range=(1, 2)))


def _boosters() -> None:
    """LightGBM and XGBoost through onnxmltools (its converters stop at opset 15)."""
    boost = ("lightgbm", "xgboost", "onnxmltools")

    def make(kind: str, task: str):
        def build(folder: Path) -> None:
            from onnxmltools import convert_lightgbm, convert_xgboost
            from onnxmltools.convert.common.data_types import FloatTensorType

            x, y = _data(3) if task == "multi" else _data(2) if task == "binary" else _regression()
            if kind == "lightgbm":
                import lightgbm

                cls = lightgbm.LGBMRegressor if task == "regression" else lightgbm.LGBMClassifier
                model = cls(n_estimators=10, num_leaves=8, verbose=-1).fit(x, y)
                onx = convert_lightgbm(
                    model,
                    initial_types=[("X", FloatTensorType([None, FEATURES]))],
                    target_opset=15,
                    zipmap=False,
                )
            else:
                import xgboost

                cls = xgboost.XGBRegressor if task == "regression" else xgboost.XGBClassifier
                model = cls(n_estimators=10, max_depth=3).fit(x, y)
                onx = convert_xgboost(
                    model,
                    initial_types=[("X", FloatTensorType([None, FEATURES]))],
                    target_opset=15,
                )
            onnx.save(onx, folder / "model.onnx")

        return build

    for kind in ("lightgbm", "xgboost"):
        for task in ("binary", "multi", "regression"):
            name = f"{'lgbm' if kind == 'lightgbm' else 'xgb'}_{task}"
            # onnxmltools declares LightGBM's label output as [1] (it is [N] at run time)
            declared = "label declared [1]" if kind == "lightgbm" and task != "regression" else None
            entry(
                ZooModel(
                    name,
                    "classic_ml",
                    make(kind, task),
                    _rows,
                    requires=boost,
                    unbatchable=declared,
                )
            )


_classifiers()
_columns()
_text()
_boosters()
