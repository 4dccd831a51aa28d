"""Tree ensembles on NUMPY against onnxruntime, on random ensembles written here: every node
mode, NaN tracking, leaves that feed only some targets, every aggregate and post-transform, base
values of every length, one and several targets, two and more classes, ints and strings, both
encodings (ai.onnx.ml 3 and TreeEnsemble in 5). Converter-made ensembles are in tests/zoo."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper

ML = "ai.onnx.ml"
FEATURES = 4
MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]
POSTS = ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"]


def random_trees(rng, n_trees: int, modes: list[str], depth: int = 3):
    """Legacy-encoded nodes (lists by attribute) and the (tree, node) ids of the leaves."""
    nodes = {k: [] for k in ("treeids", "nodeids", "featureids", "values", "modes", "t", "f")}
    nodes["missing"] = []
    leaves = []
    for tree in range(n_trees):
        counter = itertools.count()

        def grow(level: int, tree=tree, counter=counter) -> int:
            me = next(counter)
            leaf = level == depth or (level > 0 and rng.random() < 0.25)
            row = len(nodes["treeids"])
            for key in nodes:
                nodes[key].append(0)
            nodes["treeids"][row], nodes["nodeids"][row] = tree, me
            if leaf:
                nodes["modes"][row] = "LEAF"
                leaves.append((tree, me))
                return me
            nodes["modes"][row] = str(rng.choice(modes))
            nodes["featureids"][row] = int(rng.integers(FEATURES))
            # EQ/NEQ need values the inputs take: the inputs are rounded to halves
            nodes["values"][row] = float(rng.integers(-4, 5) / 2)
            nodes["missing"][row] = int(rng.random() < 0.3)
            nodes["f"][row] = grow(level + 1)
            nodes["t"][row] = grow(level + 1)
            return me

        grow(0)
    attrs = {
        "nodes_treeids": nodes["treeids"],
        "nodes_nodeids": nodes["nodeids"],
        "nodes_featureids": nodes["featureids"],
        "nodes_values": nodes["values"],
        "nodes_modes": nodes["modes"],
        "nodes_truenodeids": nodes["t"],
        "nodes_falsenodeids": nodes["f"],
        "nodes_missing_value_tracks_true": nodes["missing"],
    }
    return attrs, leaves


def leaf_weights(rng, leaves, targets: list[int], prefix: str, coverage: float, signed: bool):
    """Each leaf writes each of ``targets`` with probability ``coverage`` (at least one)."""
    ids, trees, nodes, weights = [], [], [], []
    for tree, node in leaves:
        chosen = [t for t in targets if rng.random() < coverage] or [int(rng.choice(targets))]
        for target in chosen:
            trees.append(tree)
            nodes.append(node)
            ids.append(target)
            w = rng.uniform(-1, 1) if signed else rng.uniform(0, 1)
            weights.append(float(np.float32(w)))
    return {
        f"{prefix}_treeids": trees,
        f"{prefix}_nodeids": nodes,
        f"{prefix}_ids": ids,
        f"{prefix}_weights": weights,
    }


def inputs(rng, n: int = 40) -> np.ndarray:
    x = (rng.integers(-5, 6, size=(n, FEATURES)) / 2).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    return x


def as_tensors(attrs: dict, names: list[str]) -> None:
    """Replace float-list attributes by their ``*_as_tensor`` double forms (ai.onnx.ml 3)."""
    for name in names:
        if name in attrs:
            values = attrs.pop(name)
            attrs[f"{name}_as_tensor"] = helper.make_tensor(
                name, TensorProto.DOUBLE, [len(values)], values
            )


def model(op, attrs, outputs, ml_opset=3, dtype=np.float32) -> bytes:
    node = helper.make_node(op, ["x"], [name for name, _ in outputs], domain=ML, **attrs)
    x_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [node],
        op,
        [helper.make_tensor_value_info("x", x_type, [None, FEATURES])],
        [
            helper.make_tensor_value_info(name, t, ["?"] * (1 if t != TensorProto.FLOAT else 2))
            for name, t in outputs
        ],
    )
    m = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ML, ml_opset)]
    )
    m.ir_version = 8
    return m.SerializeToString()


def differences(core, data: bytes, x: np.ndarray, reference: bytes | None = None) -> list[str]:
    """What NUMPY computes differently from onnxruntime running ``reference`` (default: the
    same model); nothing is an empty list."""
    import onnxruntime as ort

    session = ort.InferenceSession(reference or data, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    got = core.load_network(data, "NUMPY").create_infer_request().infer({"x": x})
    found = []
    for name, expected in want.items():
        value = np.asarray(got[name])
        if value.shape != expected.shape:
            found.append(f"{name}: shape {value.shape}, onnxruntime {expected.shape}")
        elif expected.dtype == object or expected.dtype.kind == "i":
            if value.tolist() != expected.tolist():
                found.append(f"{name}: {value.tolist()} vs {expected.tolist()}")
        elif not np.allclose(value, expected, rtol=1e-3, atol=1e-5, equal_nan=True):
            bad = ~np.isclose(value, expected, rtol=1e-3, atol=1e-5, equal_nan=True)
            found.append(f"{name}: {value[bad][:4]} vs {expected[bad][:4]}")
    return found


@pytest.mark.parametrize("post", POSTS)
def test_regressors(core, post) -> None:
    rng = np.random.default_rng(POSTS.index(post))
    failures = []
    for case in range(24):
        n_targets = int(rng.choice([1, 1, 3]))
        aggregate = ["SUM", "AVERAGE", "MIN", "MAX"][case % 4]
        modes = MODES if case % 3 else ["BRANCH_LEQ"]
        attrs, leaves = random_trees(rng, int(rng.integers(1, 5)), modes)
        coverage = 1.0 if case % 2 else 0.5
        attrs.update(leaf_weights(rng, leaves, list(range(n_targets)), "target", coverage, True))
        base = int(rng.choice([0, n_targets]))
        if base:
            attrs["base_values"] = rng.uniform(-1, 1, size=base).astype(np.float32).tolist()
        attrs.update(n_targets=n_targets, aggregate_function=aggregate, post_transform=post)
        x = inputs(rng)
        ml_opset = 1 if case % 5 == 0 else 3
        if case % 6 == 1:  # opset 3's double attributes, on double inputs
            as_tensors(attrs, ["nodes_values", "target_weights", "base_values"])
            x = x.astype(np.float64)
        data = model("TreeEnsembleRegressor", attrs, [("y", TensorProto.FLOAT)], ml_opset, x.dtype)
        if post == "PROBIT":  # defined on (0, 1): squash the features away from the splits
            x = np.nan_to_num(x)
        found = differences(core, data, x)
        if found:
            failures.append((case, aggregate, n_targets, base, found))
    assert failures == []


@pytest.mark.parametrize("post", POSTS)
@pytest.mark.parametrize("labels", [[0, 1], [4, 9], ["no", "yes"], [0, 1, 2], ["a", "b", "c", "d"]])
def test_classifiers(core, labels, post) -> None:
    rng = np.random.default_rng(len(labels) * 10 + POSTS.index(post))
    strings = isinstance(labels[0], str)
    failures = []
    for case in range(16):
        modes = MODES if case % 3 else ["BRANCH_LEQ"]
        attrs, leaves = random_trees(rng, int(rng.integers(1, 5)), modes)
        classes = list(range(len(labels)))
        # two classes: weights on one class (binary converters) or on both, all >= 0 or signed
        targets = [int(rng.integers(2))] if len(labels) == 2 and case % 2 else classes
        signed = case % 4 >= 2
        coverage = 1.0 if case % 8 < 4 else 0.6
        attrs.update(leaf_weights(rng, leaves, targets, "class", coverage, signed))
        base = int(rng.choice([0, len(labels), 1 if len(labels) == 2 else 0]))
        if base:
            attrs["base_values"] = rng.uniform(-0.5, 0.5, size=base).astype(np.float32).tolist()
        attrs["classlabels_strings" if strings else "classlabels_int64s"] = labels
        attrs["post_transform"] = post
        label_type = TensorProto.STRING if strings else TensorProto.INT64
        data = model(
            "TreeEnsembleClassifier",
            attrs,
            [("label", label_type), ("scores", TensorProto.FLOAT)],
            ml_opset=1 if case % 5 == 0 else 3,
        )
        if post == "PROBIT" and len(labels) == 2 and not set(targets) >= {1}:
            continue  # onnxruntime writes one probit per row and leaves the other slot unset
        found = differences(core, data, inputs(rng))
        if found:
            failures.append((case, targets, signed, base, found))
    assert failures == []


def as_v5(attrs: dict, leaves_attrs: dict, n_targets: int, aggregate: int, post: int) -> dict:
    """The same ensemble in TreeEnsemble's encoding: branch nodes and leaves apart."""
    modes = attrs["nodes_modes"]
    key = list(zip(attrs["nodes_treeids"], attrs["nodes_nodeids"]))
    branches = [i for i, m in enumerate(modes) if m != "LEAF"]
    leaves = [i for i, m in enumerate(modes) if m == "LEAF"]
    branch_at = {key[i]: j for j, i in enumerate(branches)}
    leaf_at = {key[i]: j for j, i in enumerate(leaves)}
    weight = {}
    for t, n, target, w in zip(
        leaves_attrs["target_treeids"],
        leaves_attrs["target_nodeids"],
        leaves_attrs["target_ids"],
        leaves_attrs["target_weights"],
    ):
        weight.setdefault((t, n), (target, w))
    code = {m: i for i, m in enumerate(MODES)}

    def pointer(i, side):
        target = (key[i][0], attrs[f"nodes_{side}nodeids"][i])
        return (leaf_at[target], 1) if target in leaf_at else (branch_at[target], 0)

    t_ids, t_leaf = zip(*[pointer(i, "true") for i in branches])
    f_ids, f_leaf = zip(*[pointer(i, "false") for i in branches])
    roots = []
    for tree in sorted(set(attrs["nodes_treeids"])):
        roots.append(branch_at[(tree, 0)])
    return {
        "tree_roots": roots,
        "nodes_featureids": [attrs["nodes_featureids"][i] for i in branches],
        "nodes_splits": helper.make_tensor(
            "s", TensorProto.FLOAT, [len(branches)], [attrs["nodes_values"][i] for i in branches]
        ),
        "nodes_modes": helper.make_tensor(
            "m", TensorProto.UINT8, [len(branches)], [code[modes[i]] for i in branches]
        ),
        "nodes_missing_value_tracks_true": [
            attrs["nodes_missing_value_tracks_true"][i] for i in branches
        ],
        "nodes_truenodeids": list(t_ids),
        "nodes_trueleafs": list(t_leaf),
        "nodes_falsenodeids": list(f_ids),
        "nodes_falseleafs": list(f_leaf),
        "leaf_targetids": [weight.get(key[i], (0, 0.0))[0] for i in leaves],
        "leaf_weights": helper.make_tensor(
            "w", TensorProto.FLOAT, [len(leaves)], [weight.get(key[i], (0, 0.0))[1] for i in leaves]
        ),
        "n_targets": n_targets,
        "aggregate_function": aggregate,
        "post_transform": post,
    }


@pytest.mark.parametrize("post", range(5))
def test_tree_ensemble_v5(core, post) -> None:
    """Against onnxruntime running the same ensemble in the legacy encoding: its TreeEnsemble
    reads post_transform 1 as LOGISTIC and 2 as SOFTMAX, the spec's numbers swapped."""
    rng = np.random.default_rng(100 + post)
    failures = []
    for case in range(16):
        n_targets = int(rng.choice([1, 3]))
        modes = MODES if case % 2 else ["BRANCH_LEQ"]
        attrs, leaves = random_trees(rng, int(rng.integers(1, 5)), modes)
        weights = leaf_weights(rng, leaves, list(range(n_targets)), "target", 0.0, True)
        v5 = as_v5(attrs, weights, n_targets, case % 4, post)
        data = model("TreeEnsemble", v5, [("y", TensorProto.FLOAT)], ml_opset=5)
        legacy = {**attrs, **weights, "n_targets": n_targets, "post_transform": POSTS[post]}
        legacy["aggregate_function"] = ["AVERAGE", "SUM", "MIN", "MAX"][case % 4]
        reference = model("TreeEnsembleRegressor", legacy, [("y", TensorProto.FLOAT)])
        x = inputs(rng)
        found = differences(core, data, np.nan_to_num(x) if post == 4 else x, reference)
        if found:
            failures.append((case, n_targets, case % 4, found))
    assert failures == []


def test_an_empty_batch(core) -> None:
    rng = np.random.default_rng(7)
    attrs, leaves = random_trees(rng, 3, MODES)
    classifier = {**attrs, **leaf_weights(rng, leaves, [0, 1, 2], "class", 0.5, True)}
    classifier["classlabels_int64s"] = [4, 5, 6]
    regressor = {**attrs, **leaf_weights(rng, leaves, [0, 1], "target", 0.5, True)}
    regressor["n_targets"] = 2
    empty = np.zeros((0, FEATURES), np.float32)
    outputs = [("label", TensorProto.INT64), ("scores", TensorProto.FLOAT)]
    assert differences(core, model("TreeEnsembleClassifier", classifier, outputs), empty) == []
    y = [("y", TensorProto.FLOAT)]
    assert differences(core, model("TreeEnsembleRegressor", regressor, y), empty) == []


def test_a_batch_scored_in_parts(core, monkeypatch) -> None:
    """Rows are scored in parts that bound memory; the parts join to onnxruntime's result."""
    from plugserve.plugins.numpy.kernels import ml_trees

    monkeypatch.setattr(ml_trees, "_CHUNK", 20)  # 20 // (3 trees * 3 targets): 2 rows a part
    rng = np.random.default_rng(8)
    attrs, leaves = random_trees(rng, 3, MODES)
    attrs.update(leaf_weights(rng, leaves, [0, 1, 2], "target", 0.5, True))
    attrs.update(n_targets=3, aggregate_function="MAX")
    data = model("TreeEnsembleRegressor", attrs, [("y", TensorProto.FLOAT)])
    assert differences(core, data, inputs(rng, 25)) == []


def test_set_membership_v5(core) -> None:
    """BRANCH_MEMBER (mode 6): a feature value among a NaN-separated list goes true."""
    v5 = {
        "tree_roots": [0],
        "nodes_featureids": [0, 1],
        "nodes_splits": helper.make_tensor("s", TensorProto.FLOAT, [2], [0.0, 0.5]),
        "nodes_modes": helper.make_tensor("m", TensorProto.UINT8, [2], [6, 6]),
        "membership_values": helper.make_tensor(
            "v", TensorProto.FLOAT, [6], [1.0, 3.0, np.nan, 2.0, 4.0, 5.0]
        ),
        "nodes_truenodeids": [0, 2],
        "nodes_trueleafs": [1, 1],
        "nodes_falsenodeids": [1, 1],
        "nodes_falseleafs": [0, 1],
        "leaf_targetids": [0, 0, 0],
        "leaf_weights": helper.make_tensor("w", TensorProto.FLOAT, [3], [10.0, 20.0, 30.0]),
        "n_targets": 1,
        "aggregate_function": 1,
        "post_transform": 0,
    }
    data = model("TreeEnsemble", v5, [("y", TensorProto.FLOAT)], ml_opset=5)
    x = np.zeros((6, FEATURES), np.float32)
    x[:, :2] = [[1, 0], [3, 4], [2, 2], [2, 5], [np.nan, 4], [0, 1]]
    assert differences(core, data, x) == []
    got = core.load_network(data, "NUMPY").create_infer_request().infer({"x": x})["y"]
    assert got.ravel().tolist() == [10.0, 10.0, 30.0, 30.0, 30.0, 20.0]
