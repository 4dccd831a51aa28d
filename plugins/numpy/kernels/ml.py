"""The ai.onnx.ml domain: LabelEncoder, Binarizer, ArrayFeatureExtractor, TreeEnsemble."""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_ML = "ai.onnx.ml"


def _attr_list(ctx: KernelContext, name: str):
    value = ctx.attr(name, None)
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return value
    return list(value)


@register("LabelEncoder", 1, 2, 4, domain=_ML)
def label_encoder(ctx: KernelContext):
    """Map keys to values; unknown keys get the default.

    Numeric keys are looked up with a binary search over the sorted keys (NaN keys match NaN
    inputs); string keys with a dict.
    """
    if ctx.version == 1:
        classes = list(ctx.attr("classes_strings", []))
        if ctx.input_dtype(0) is not None and ctx.input_dtype(0).kind in "OUS":
            keys = np.array(classes, dtype=object)
            values = np.arange(len(classes), dtype=np.int64)
            default = np.int64(ctx.attr("default_int64", -1))
        else:
            keys = np.arange(len(classes), dtype=np.int64)
            values = np.array(classes, dtype=object)
            default = ctx.attr("default_string", "_Unused")
    else:
        keys = values = None
        for name, dtype in (
            ("keys_tensor", None),
            ("keys_floats", np.float32),
            ("keys_int64s", np.int64),
            ("keys_strings", object),
        ):
            raw = _attr_list(ctx, name)
            if raw is not None:
                keys = np.asarray(raw) if dtype is None else np.array(raw, dtype=dtype)
                break
        for name, dtype in (
            ("values_tensor", None),
            ("values_floats", np.float32),
            ("values_int64s", np.int64),
            ("values_strings", object),
        ):
            raw = _attr_list(ctx, name)
            if raw is not None:
                values = np.asarray(raw) if dtype is None else np.array(raw, dtype=dtype)
                break
        if keys is None or values is None or len(keys) != len(values):
            raise ctx.unsupported("keys and values must be given with equal lengths")
        if keys.dtype.kind in "US":
            keys = keys.astype(object)
        if values.dtype.kind in "US":
            values = values.astype(object)
        if ctx.has_attr("default_tensor"):
            default = np.asarray(ctx.attr("default_tensor")).ravel()[0]
        elif values.dtype.kind == "O":
            default = ctx.attr("default_string", "_Unused")
        elif values.dtype.kind == "f":
            default = ctx.attr("default_float", -0.0)
        else:
            default = ctx.attr("default_int64", -1)
    out_dtype = values.dtype

    if keys.dtype.kind == "O":
        table = dict(zip((str(k) for k in keys), values.tolist()))
        lookup = np.frompyfunc(lambda s: table.get(str(s), default), 1, 1)

        def run_str(x):
            out = lookup(x)
            return np.asarray(out, dtype=object) if out_dtype.kind == "O" else out.astype(out_dtype)

        return run_str

    nan_keys = np.isnan(keys) if keys.dtype.kind == "f" else np.zeros(len(keys), bool)
    nan_value = values[nan_keys][0] if nan_keys.any() else default
    order = np.argsort(keys[~nan_keys], kind="stable")
    sorted_keys = keys[~nan_keys][order]
    sorted_values = values[~nan_keys][order]
    fill = np.asarray(default, dtype=out_dtype) if out_dtype.kind != "O" else default

    def run(x):
        if sorted_keys.size == 0:
            out = np.full(x.shape, fill, dtype=out_dtype)
        else:
            pos = np.clip(np.searchsorted(sorted_keys, x), 0, sorted_keys.size - 1)
            found = sorted_keys[pos] == x
            out = np.where(found, sorted_values[pos], fill).astype(out_dtype)
        if x.dtype.kind == "f" and nan_keys.any():
            out[np.isnan(x)] = nan_value
        return out

    return run


@register("Binarizer", 1, domain=_ML)
def binarizer(ctx: KernelContext):
    threshold = float(ctx.attr("threshold", 0.0))

    def run(x):
        return (x > threshold).astype(x.dtype)

    return run


@register("ArrayFeatureExtractor", 1, domain=_ML)
def array_feature_extractor(ctx: KernelContext):
    """Select entries of the last axis; a 1-D input gives a [1, k] result (as onnxruntime)."""

    def run(data, indices):
        index = indices.ravel().astype(np.intp)
        if data.ndim == 1:
            return data[index].reshape(1, -1)
        return np.take(data, index, axis=-1)

    return run


_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)


class _Trees:
    """Decision nodes as flat arrays; :meth:`walk` moves every (sample, tree) pair one level
    per iteration until all have reached a leaf."""

    def __init__(
        self, features, splits, modes, true_next, false_next, true_leaf, false_leaf, missing_true
    ):
        self.features = features
        self.splits = splits
        self.modes = modes
        self.true_next = true_next
        self.false_next = false_next
        self.true_leaf = true_leaf
        self.false_leaf = false_leaf
        self.missing_true = missing_true
        self.members: dict[int, np.ndarray] = {}

    def walk(self, x2, roots, root_is_leaf, root_leaf):
        """Leaf index reached by each sample in each tree: (n_samples, n_trees)."""
        n = x2.shape[0]
        node = np.broadcast_to(roots, (n, len(roots))).copy()
        leaf = np.full(node.shape, -1, dtype=np.int64)
        leaf[:, root_is_leaf] = root_leaf[root_is_leaf]
        active = np.broadcast_to(~root_is_leaf, node.shape).copy()
        rows = np.broadcast_to(np.arange(n)[:, None], node.shape)
        while active.any():
            r = rows[active]
            nd = node[active]
            v = x2[r, self.features[nd]]
            s = self.splits[nd]
            m = self.modes[nd]
            cond = np.select(
                [m == _LEQ, m == _LT, m == _GTE, m == _GT, m == _EQ, m == _NEQ],
                [v <= s, v < s, v >= s, v > s, v == s, v != s],
                False,
            )
            for member_node, group in self.members.items():
                hit = nd == member_node
                if hit.any():
                    cond[hit] = np.isin(v[hit], group)
            cond |= self.missing_true[nd] & np.isnan(v)
            nxt = np.where(cond, self.true_next[nd], self.false_next[nd])
            is_leaf = np.where(cond, self.true_leaf[nd], self.false_leaf[nd])
            idx = np.flatnonzero(active.ravel())
            leaf.ravel()[idx[is_leaf]] = nxt[is_leaf]
            node.ravel()[idx] = nxt
            active.ravel()[idx[is_leaf]] = False
        return leaf


@register("TreeEnsemble", 5, domain=_ML)
def tree_ensemble(ctx: KernelContext):
    """All (sample, tree) pairs walk their trees together, one level per loop iteration."""
    modes = np.asarray(ctx.attr("nodes_modes")).astype(np.int64).ravel()
    splits = np.asarray(ctx.attr("nodes_splits")).ravel()
    features = np.asarray(ctx.attr("nodes_featureids"), dtype=np.int64)
    true_ids = np.asarray(ctx.attr("nodes_truenodeids"), dtype=np.int64)
    false_ids = np.asarray(ctx.attr("nodes_falsenodeids"), dtype=np.int64)
    true_leaf = np.asarray(ctx.attr("nodes_trueleafs"), dtype=bool)
    false_leaf = np.asarray(ctx.attr("nodes_falseleafs"), dtype=bool)
    leaf_targets = np.asarray(ctx.attr("leaf_targetids"), dtype=np.int64)
    leaf_weights = np.asarray(ctx.attr("leaf_weights")).ravel()
    roots = np.asarray(ctx.attr("tree_roots"), dtype=np.int64)
    n_targets = int(ctx.attr("n_targets"))
    aggregate = int(ctx.attr("aggregate_function", 1))
    post = int(ctx.attr("post_transform", 0))
    missing = _attr_list(ctx, "nodes_missing_value_tracks_true")
    missing_true = (
        np.asarray(missing, dtype=bool) if missing is not None else np.zeros(len(modes), bool)
    )
    if aggregate not in (0, 1, 2, 3):
        raise ctx.unsupported(f"aggregate_function {aggregate}")
    if post not in (0, 1, 2, 3):
        raise ctx.unsupported(f"post_transform {post}")
    if np.any((modes < 0) | (modes > _MEMBER)):
        raise ctx.unsupported("unknown node mode")
    members: dict[int, np.ndarray] = {}
    if np.any(modes == _MEMBER):
        values = np.asarray(ctx.attr("membership_values")).ravel()
        groups = np.split(values, np.flatnonzero(np.isnan(values)) + 1)
        for node, group in zip(np.flatnonzero(modes == _MEMBER), groups):
            members[int(node)] = group[~np.isnan(group)]
    root_is_leaf = true_leaf[roots] & false_leaf[roots] & (true_ids[roots] == false_ids[roots])
    trees = _Trees(
        features, splits, modes, true_ids, false_ids, true_leaf, false_leaf, missing_true
    )
    trees.members = members

    def run(x):
        n = x.shape[0]
        leaf = trees.walk(x.reshape(n, -1), roots, root_is_leaf, true_ids[roots])
        weights = leaf_weights[leaf].astype(x.dtype)
        targets = leaf_targets[leaf]
        r = np.broadcast_to(np.arange(n)[:, None], leaf.shape)
        if aggregate in (0, 1):
            out = np.zeros((n, n_targets), dtype=x.dtype)
            np.add.at(out, (r, targets), weights)
            if aggregate == 0:
                out /= len(roots)
        elif aggregate == 2:
            out = np.full((n, n_targets), np.finfo(x.dtype).max, dtype=x.dtype)
            np.minimum.at(out, (r, targets), weights)
        else:
            out = np.full((n, n_targets), np.finfo(x.dtype).min, dtype=x.dtype)
            np.maximum.at(out, (r, targets), weights)
        return _post_transform(out, post)

    return run


def _post_transform(out, post):
    if post == 1:  # SOFTMAX
        e = np.exp(out - out.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(out.dtype)
    if post == 2:  # LOGISTIC
        return (1 / (1 + np.exp(-out))).astype(out.dtype)
    if post == 3:  # SOFTMAX_ZERO: softmax over the non-zero entries, zeros stay zero
        nz = out != 0
        shifted = np.where(nz, out, -np.inf)
        top = np.max(shifted, axis=1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0)
        e = np.where(nz, np.exp(out - top), 0)
        total = e.sum(axis=1, keepdims=True)
        return (e / np.where(total == 0, 1, total)).astype(out.dtype)
    return out


_BRANCH_MODES = {
    "BRANCH_LEQ": _LEQ,
    "BRANCH_LT": _LT,
    "BRANCH_GTE": _GTE,
    "BRANCH_GT": _GT,
    "BRANCH_EQ": _EQ,
    "BRANCH_NEQ": _NEQ,
    "LEAF": -1,
}
_POST = {"NONE": 0, "SOFTMAX": 1, "LOGISTIC": 2, "SOFTMAX_ZERO": 3}


class _LegacyEnsemble:
    """The pre-``TreeEnsemble`` encoding of TreeEnsembleRegressor/Classifier: nodes addressed by
    (tree id, node id), leaves are nodes with mode LEAF, and a leaf may feed several targets
    (``target_*`` or ``class_*`` attributes). Leaves are folded into one dense (leaf, target)
    weight table at load, so a request is a walk, a gather and a sum."""

    def __init__(self, ctx: KernelContext, prefix: str, n_targets: int) -> None:
        modes = [_BRANCH_MODES.get(m) for m in ctx.attr("nodes_modes")]
        if None in modes:
            raise ctx.unsupported("unknown node mode")
        tree_ids = list(ctx.attr("nodes_treeids"))
        node_ids = list(ctx.attr("nodes_nodeids"))
        index = {(t, n): i for i, (t, n) in enumerate(zip(tree_ids, node_ids))}
        if ctx.has_attr("nodes_values_as_tensor"):
            splits = np.asarray(ctx.attr("nodes_values_as_tensor")).ravel()
        else:
            splits = np.asarray(ctx.attr("nodes_values", [0.0] * len(modes)), dtype=np.float32)
        modes_arr = np.asarray(modes, dtype=np.int64)
        is_leaf = modes_arr < 0

        def child(attr):
            ids = list(ctx.attr(attr, [0] * len(modes)))
            return np.array(
                [
                    index.get((t, c), i) if not leaf else i
                    for i, (t, c, leaf) in enumerate(zip(tree_ids, ids, is_leaf))
                ],
                dtype=np.int64,
            )

        true_next, false_next = child("nodes_truenodeids"), child("nodes_falsenodeids")
        missing = ctx.attr("nodes_missing_value_tracks_true", None)
        missing_true = (
            np.asarray(missing, dtype=bool) if missing else np.zeros(len(modes), dtype=bool)
        )
        self.trees = _Trees(
            np.asarray(ctx.attr("nodes_featureids"), dtype=np.int64),
            splits,
            modes_arr,
            true_next,
            false_next,
            is_leaf[true_next],
            is_leaf[false_next],
            missing_true,
        )
        self.table = np.zeros((len(modes), n_targets))
        if ctx.has_attr(f"{prefix}_weights_as_tensor"):
            weights = np.asarray(ctx.attr(f"{prefix}_weights_as_tensor")).ravel().tolist()
        else:
            weights = list(ctx.attr(f"{prefix}_weights", []) or [])
        self.target_ids = list(ctx.attr(f"{prefix}_ids", []))
        for t, nd, target, w in zip(
            ctx.attr(f"{prefix}_treeids", []),
            ctx.attr(f"{prefix}_nodeids", []),
            self.target_ids,
            weights,
        ):
            if (t, nd) not in index or not 0 <= target < n_targets:
                raise ctx.unsupported(f"{prefix} weight for an unknown node or target")
            self.table[index[(t, nd)], target] += w
        first: dict[int, int] = {}  # a tree's root is its first node in the lists
        for i, t in enumerate(tree_ids):
            first.setdefault(t, i)
        self.roots = np.array(list(first.values()), dtype=np.int64)
        self.root_leaf = is_leaf[self.roots]
        if ctx.has_attr("base_values_as_tensor"):
            base = np.asarray(ctx.attr("base_values_as_tensor"), dtype=np.float64).ravel()
        else:
            base = np.asarray(ctx.attr("base_values", []) or [0.0] * n_targets, dtype=np.float64)
        self.base = base

    def sums(self, x: np.ndarray) -> np.ndarray:
        """Per row, the sum over trees of each target's leaf weights: (n, n_targets)."""
        n = x.shape[0]
        leaf = self.trees.walk(x.reshape(n, -1), self.roots, self.root_leaf, self.roots)
        return self.table[leaf].sum(axis=1)


@register("TreeEnsembleRegressor", 1, 3, 5, domain=_ML)
def tree_ensemble_regressor(ctx: KernelContext):
    aggregate = ctx.attr("aggregate_function", "SUM")
    if aggregate not in ("SUM", "AVERAGE"):
        raise ctx.unsupported(f"aggregate_function {aggregate!r}")
    post = _POST.get(ctx.attr("post_transform", "NONE"))
    if post is None:
        raise ctx.unsupported(f"post_transform {ctx.attr('post_transform')!r}")
    ensemble = _LegacyEnsemble(ctx, "target", int(ctx.attr("n_targets", 1)))
    scale = 1.0 / len(ensemble.roots) if aggregate == "AVERAGE" else 1.0

    def run(x):
        out = ensemble.sums(x) * scale + ensemble.base
        return _post_transform(out.astype(np.float32), post)

    return run


@register("Scaler", 1, domain=_ML)
def scaler(ctx: KernelContext):
    offset = np.asarray(ctx.attr("offset", [0.0]), dtype=np.float32)
    scale = np.asarray(ctx.attr("scale", [1.0]), dtype=np.float32)

    def run(x):
        return ((x.astype(np.float32, copy=False) - offset) * scale).astype(np.float32)

    return run


@register("Normalizer", 1, domain=_ML)
def normalizer(ctx: KernelContext):
    norm = ctx.attr("norm", "MAX")
    if norm not in ("MAX", "L1", "L2"):
        raise ctx.unsupported(f"norm {norm!r}")

    def run(x):
        x = x.astype(np.float32, copy=False)
        if norm == "MAX":
            d = np.max(x, axis=-1, keepdims=True)
        elif norm == "L1":
            d = np.sum(np.abs(x), axis=-1, keepdims=True)
        else:
            d = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
        with np.errstate(divide="ignore", invalid="ignore"):
            return (x / d).astype(np.float32)

    return run


@register("LinearRegressor", 1, domain=_ML)
def linear_regressor(ctx: KernelContext):
    targets = int(ctx.attr("targets", 1))
    coef = np.asarray(ctx.attr("coefficients"), dtype=np.float32).reshape(targets, -1)
    intercepts = np.asarray(ctx.attr("intercepts", [0.0] * targets), dtype=np.float32)
    post = _POST.get(ctx.attr("post_transform", "NONE"))
    if post is None:
        raise ctx.unsupported(f"post_transform {ctx.attr('post_transform')!r}")

    def run(x):
        x2 = x.reshape(x.shape[0] if x.ndim > 1 else 1, -1).astype(np.float32, copy=False)
        return _post_transform(x2 @ coef.T + intercepts, post)

    return run


@register("Imputer", 1, domain=_ML)
def imputer(ctx: KernelContext):
    """Replace ``replaced_value_*`` (NaN by default for floats) with per-feature values."""
    if ctx.has_attr("imputed_value_int64s"):
        values = np.asarray(ctx.attr("imputed_value_int64s"), dtype=np.int64)
        missing = int(ctx.attr("replaced_value_int64", 0))
    else:
        values = np.asarray(ctx.attr("imputed_value_floats"), dtype=np.float32)
        missing = float(ctx.attr("replaced_value_float", 0.0))

    def run(x):
        hit = np.isnan(x) if isinstance(missing, float) and np.isnan(missing) else x == missing
        fill = np.broadcast_to(values if values.size > 1 else values[0], x.shape)
        return np.where(hit, fill, x).astype(x.dtype)

    return run
