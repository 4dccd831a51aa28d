"""Tree ensembles: TreeEnsembleRegressor and TreeEnsembleClassifier (ai.onnx.ml 1, 3 and 5)
and TreeEnsemble (ai.onnx.ml 5).

Every (row, tree) pair walks its tree at once, one level per numpy step (:class:`_Trees`); the
leaves reached are gathered from a dense (leaf, target) weight table (:class:`_Leaves`). What a
request does not change (node layout, the one comparison most ensembles use, which leaves carry
which targets) is decided at load.

How leaf sums become outputs follows onnxruntime, which converters are tested against and whose
results users compare with: base values apply only when there is one per target (or one for a
single target); a single-target ensemble applies no post-transform but PROBIT; and a two-class
classifier has onnxruntime's conventions (see :func:`_two_classes`).
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.ml_scores import (
    LOGISTIC,
    PROBIT,
    as_rows,
    class_labels,
    post_transform_of,
    probit,
    transform,
)
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_ML = "ai.onnx.ml"
_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_LEAF = -1
_COMPARE = {
    _LEQ: np.less_equal,
    _LT: np.less,
    _GTE: np.greater_equal,
    _GT: np.greater,
    _EQ: np.equal,
    _NEQ: np.not_equal,
}
_MODE_NAMES = {
    "BRANCH_LEQ": _LEQ,
    "BRANCH_LT": _LT,
    "BRANCH_GTE": _GTE,
    "BRANCH_GT": _GT,
    "BRANCH_EQ": _EQ,
    "BRANCH_NEQ": _NEQ,
    "LEAF": _LEAF,
}
_AVERAGE, _SUM, _MIN, _MAX = range(4)  # TreeEnsemble's aggregate_function numbers
_AGGREGATE_NAMES = {"AVERAGE": _AVERAGE, "SUM": _SUM, "MIN": _MIN, "MAX": _MAX}
_CHUNK = 1 << 21


class _Trees:
    """Decision nodes as flat arrays; :meth:`walk` moves every (sample, tree) pair one level
    per iteration, over the pairs that have not reached a leaf yet (the set shrinks as trees
    end, so a deep tree costs only its own pairs).

    Converters write one comparison for every branch (LightGBM and scikit-learn
    ``BRANCH_LEQ``, XGBoost ``BRANCH_LT``), so a single ufunc usually serves; NaN tracking and
    set membership cost nothing when no node uses them.
    """

    def __init__(
        self,
        features: np.ndarray,
        splits: np.ndarray,
        modes: np.ndarray,
        true_next: np.ndarray,
        false_next: np.ndarray,
        true_leaf: np.ndarray,
        false_leaf: np.ndarray,
        missing_true: np.ndarray,
        members: dict[int, np.ndarray] | None = None,
    ) -> None:
        self.features = features
        self.splits = splits
        self.modes = modes
        # child[2 * node + condition]: the next node, or ~leaf when the branch ends in a leaf
        self.child = np.empty(2 * len(modes), dtype=np.int64)
        self.child[0::2] = np.where(false_leaf, ~false_next, false_next)
        self.child[1::2] = np.where(true_leaf, ~true_next, true_next)
        self.missing_true = missing_true if missing_true.any() else None
        # membership as (node, value) pairs encoded node + 1j*value: one isin for all nodes
        members = members or {}
        self.is_member = np.zeros(len(modes), dtype=bool)
        self.is_member[list(members)] = True
        self.member_keys = np.concatenate(
            [np.full(len(g), n) + 1j * np.asarray(g, np.float64) for n, g in members.items()]
            or [np.empty(0, complex)]
        )
        branch_modes = set(np.unique(modes[(modes >= 0) & (modes != _MEMBER)]).tolist())
        self.uniform = _COMPARE[branch_modes.pop()] if len(branch_modes) == 1 else None

    def _condition(self, v: np.ndarray, node: np.ndarray) -> np.ndarray:
        s = self.splits[node]
        if self.uniform is not None:
            cond = self.uniform(v, s)
        else:
            m = self.modes[node]
            cond = np.select(
                [m == mode for mode in _COMPARE],
                [compare(v, s) for compare in _COMPARE.values()],
                False,
            )
        if self.member_keys.size:
            hit = self.is_member[node]
            if hit.any():
                keys = node[hit] + 1j * v[hit].astype(np.float64)
                cond[hit] = np.isin(keys, self.member_keys)
        if self.missing_true is not None:
            cond |= self.missing_true[node] & np.isnan(v)
        return cond

    def walk(self, x2: np.ndarray, roots: np.ndarray, root_leaf: np.ndarray) -> np.ndarray:
        """Leaf index reached by each sample in each tree: (n_samples, n_trees). A tree whose
        ``root_leaf`` is >= 0 is that leaf alone."""
        n, width = x2.shape
        flat_x = np.ascontiguousarray(x2).ravel()
        leaf = np.empty((n, len(roots)), dtype=np.int64)
        leaf[:] = root_leaf
        pair = np.flatnonzero(leaf < 0)  # flat (row, tree)
        node = roots[pair % len(roots)]
        offset = (pair // len(roots)) * width  # where each pair's row starts in flat_x
        out = leaf.ravel()
        while pair.size:
            cond = self._condition(flat_x[offset + self.features[node]], node)
            node = self.child[2 * node + cond]
            ended = node < 0
            out[pair[ended]] = ~node[ended]
            going = ~ended
            pair, node, offset = pair[going], node[going], offset[going]
        return leaf


class _Leaves:
    """Each leaf's weight per target, and whether it has one at all (onnxruntime tells a
    target no leaf wrote from one whose weights summed to 0)."""

    def __init__(self, n_leaves: int, n_targets: int) -> None:
        self.table = np.zeros((n_leaves, n_targets))
        self.has = np.zeros((n_leaves, n_targets), dtype=bool)
        self.full = False

    def add(self, leaves: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> None:
        np.add.at(self.table, (leaves, targets), weights)
        self.has[leaves, targets] = True

    def seal(self, reachable: np.ndarray) -> None:
        """Decide once whether every reachable leaf has every target (then no mask per row)."""
        self.full = bool(self.has[reachable].all())

    def aggregate(self, leaf: np.ndarray, how: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, targets) scores over each row's leaves, and which targets any leaf wrote."""
        if self.full:
            has = np.ones((leaf.shape[0], self.table.shape[1]), dtype=bool)
        else:
            has = self.has[leaf].any(axis=1)
        if how in (_SUM, _AVERAGE):
            scores = self.table[leaf].sum(axis=1)
        else:
            reduce, empty = (np.min, np.inf) if how == _MIN else (np.max, -np.inf)
            values = self.table[leaf]
            if not self.full:
                values = np.where(self.has[leaf], values, empty)
            scores = np.where(has, reduce(values, axis=1), 0.0)
        return scores, has


class _Ensemble:
    """Trees, their roots and leaves, and the node's base values: what both encodings share."""

    def __init__(self, trees: _Trees, roots, root_leaf, leaves: _Leaves, base) -> None:
        self.trees = trees
        self.roots = roots
        self.root_leaf = root_leaf
        self.leaves = leaves
        self.base = base

    def scores(self, x: np.ndarray, how: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, targets) aggregated leaf weights and which targets a leaf wrote, computed for
        as many rows at a time as keep (row, tree, target) arrays near _CHUNK entries, so a
        large request costs time, not memory."""
        x2 = as_rows(x)
        if x2.dtype.kind not in "f":
            x2 = x2.astype(np.float32)
        step = max(1, _CHUNK // (len(self.roots) * self.leaves.table.shape[1] or 1))
        parts = []
        for start in range(0, max(x2.shape[0], 1), step):  # once for an empty batch
            leaf = self.trees.walk(x2[start : start + step], self.roots, self.root_leaf)
            parts.append(self.leaves.aggregate(leaf, how))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _legacy(ctx: KernelContext, prefix: str, n_targets: int) -> _Ensemble:
    """The encoding before TreeEnsemble: nodes addressed by (tree id, node id), leaves are
    nodes with mode LEAF, weights listed by (tree id, node id, target). A tree's root is its
    first node (onnxruntime's rule); weights on branch nodes are never read."""
    names = list(ctx.attr("nodes_modes"))
    unknown = sorted({m for m in names if m not in _MODE_NAMES})
    if unknown:
        raise ctx.unsupported(f"unknown node modes {unknown}")
    modes = np.array([_MODE_NAMES[m] for m in names], dtype=np.int64)
    tree_ids = list(ctx.attr("nodes_treeids"))
    node_ids = list(ctx.attr("nodes_nodeids"))
    index = {(t, n): i for i, (t, n) in enumerate(zip(tree_ids, node_ids))}
    if len(index) != len(modes):
        raise ctx.unsupported("a (tree, node) id appears twice")
    if ctx.has_attr("nodes_values_as_tensor"):
        splits = np.asarray(ctx.attr("nodes_values_as_tensor")).ravel()
    else:
        splits = np.asarray(ctx.attr("nodes_values", [0.0] * len(modes)), dtype=np.float32)
    is_leaf = modes == _LEAF

    def child(attr: str) -> np.ndarray:
        ids = list(ctx.attr(attr, [0] * len(modes)))
        try:
            rows = enumerate(zip(tree_ids, ids, is_leaf))
            return np.array([i if leaf else index[(t, c)] for i, (t, c, leaf) in rows], np.int64)
        except KeyError as missing:
            raise ctx.unsupported(f"{attr} names node {missing} that does not exist") from None

    true_next, false_next = child("nodes_truenodeids"), child("nodes_falsenodeids")
    missing = ctx.attr("nodes_missing_value_tracks_true", None)
    missing_true = np.zeros(len(modes), dtype=bool)
    if missing:
        missing_true[: len(missing)] = np.asarray(missing) == 1
    trees = _Trees(
        np.asarray(ctx.attr("nodes_featureids"), dtype=np.int64),
        splits,
        modes,
        true_next,
        false_next,
        is_leaf[true_next],
        is_leaf[false_next],
        missing_true,
    )
    if ctx.has_attr(f"{prefix}_weights_as_tensor"):
        weights = np.asarray(ctx.attr(f"{prefix}_weights_as_tensor"), np.float64).ravel()
    else:
        weights = np.asarray(ctx.attr(f"{prefix}_weights", []) or [], dtype=np.float64)
    targets = np.asarray(ctx.attr(f"{prefix}_ids", []) or [], dtype=np.int64)
    keys = zip(ctx.attr(f"{prefix}_treeids", []) or [], ctx.attr(f"{prefix}_nodeids", []) or [])
    try:
        at = np.array([index[k] for k in keys], dtype=np.int64)
    except KeyError as missing_node:
        why = f"{prefix} weight for a node that does not exist: {missing_node}"
        raise ctx.unsupported(why) from None
    if not (len(at) == len(targets) == len(weights)):
        raise ctx.unsupported(f"{prefix}_* attributes differ in length")
    if targets.size and (targets.min() < 0 or targets.max() >= n_targets):
        raise ctx.unsupported(f"{prefix}_ids must be in [0, {n_targets})")
    on_leaf = is_leaf[at]
    leaves = _Leaves(len(modes), n_targets)
    leaves.add(at[on_leaf], targets[on_leaf], weights[on_leaf])
    first: dict[int, int] = {}
    for i, t in enumerate(tree_ids):
        first.setdefault(t, i)
    roots = np.array(list(first.values()), dtype=np.int64)
    leaves.seal(is_leaf)
    return _Ensemble(
        trees, roots, np.where(is_leaf[roots], roots, -1), leaves, _base(ctx, n_targets)
    )


def _base(ctx: KernelContext, n_targets: int) -> np.ndarray:
    """One base value per target, or none; two classes may also take one (onnxruntime
    refuses other lengths, and so do we)."""
    if ctx.has_attr("base_values_as_tensor"):
        base = np.asarray(ctx.attr("base_values_as_tensor"), dtype=np.float64).ravel()
    else:
        base = np.asarray(ctx.attr("base_values", []) or [], dtype=np.float64)
    two_classes = ctx.op_type == "TreeEnsembleClassifier" and n_targets == 2
    if len(base) not in (0, n_targets) and not (two_classes and len(base) == 1):
        raise ctx.unsupported(f"{len(base)} base_values for {n_targets} targets or classes")
    return base


def _regress(scores, has, ensemble: _Ensemble, how: int, post: int) -> np.ndarray:
    """onnxruntime's regressor finish: the average over trees, base values when they fit, and
    the post-transform; a single target takes no post-transform but PROBIT, and of several
    targets one that no leaf wrote is 0 whatever its base value."""
    targets = scores.shape[1]
    if how == _AVERAGE:
        scores = scores / len(ensemble.roots)
    if len(ensemble.base) == targets:
        scores = scores + ensemble.base
    if targets == 1:
        return probit(scores) if post == PROBIT else scores
    return transform(np.where(has, scores, 0.0), post)


@register("TreeEnsembleRegressor", 1, 3, 5, domain=_ML)
def tree_ensemble_regressor(ctx: KernelContext):
    name = ctx.attr("aggregate_function", "SUM")
    how = _AGGREGATE_NAMES.get(name)
    if how is None:
        raise ctx.unsupported(f"aggregate_function {name!r}")
    post = post_transform_of(ctx)
    ensemble = _legacy(ctx, "target", int(ctx.attr("n_targets", 1)))

    def run(x):
        scores, has = ensemble.scores(x, how)
        return _regress(scores, has, ensemble, how, post).astype(np.float32)

    return run


@register("TreeEnsemble", 5, domain=_ML)
def tree_ensemble(ctx: KernelContext):
    """The opset-5 encoding: nodes and leaves are separate lists, a branch says whether it
    leads to a node or a leaf, and one leaf feeds one target. Output type is X's."""
    modes = np.asarray(ctx.attr("nodes_modes")).astype(np.int64).ravel()
    if np.any((modes < 0) | (modes > _MEMBER)):
        raise ctx.unsupported("unknown node mode")
    how = int(ctx.attr("aggregate_function", _SUM))
    if how not in range(4):
        raise ctx.unsupported(f"aggregate_function {how}")
    post = post_transform_of(ctx)
    members: dict[int, np.ndarray] = {}
    if np.any(modes == _MEMBER):
        values = np.asarray(ctx.attr("membership_values")).ravel()
        groups = np.split(values, np.flatnonzero(np.isnan(values)) + 1)
        for node, group in zip(np.flatnonzero(modes == _MEMBER), groups):
            members[int(node)] = group[~np.isnan(group)]
    missing = ctx.attr("nodes_missing_value_tracks_true", None)
    missing_true = np.zeros(len(modes), dtype=bool)
    if missing is not None:
        missing_true[: len(missing)] = np.asarray(missing).ravel() == 1
    trees = _Trees(
        np.asarray(ctx.attr("nodes_featureids"), dtype=np.int64),
        np.asarray(ctx.attr("nodes_splits")).ravel(),
        modes,
        np.asarray(ctx.attr("nodes_truenodeids"), dtype=np.int64),
        np.asarray(ctx.attr("nodes_falsenodeids"), dtype=np.int64),
        np.asarray(ctx.attr("nodes_trueleafs"), dtype=bool),
        np.asarray(ctx.attr("nodes_falseleafs"), dtype=bool),
        missing_true,
        members,
    )
    weights = np.asarray(ctx.attr("leaf_weights"), dtype=np.float64).ravel()
    targets = np.asarray(ctx.attr("leaf_targetids"), dtype=np.int64)
    n_targets = int(ctx.attr("n_targets"))
    if len(targets) != len(weights) or (targets.size and targets.max() >= n_targets):
        raise ctx.unsupported("leaf_targetids and leaf_weights disagree, or name no target")
    leaves = _Leaves(len(weights), n_targets)
    leaves.add(np.arange(len(weights)), targets, weights)
    leaves.seal(np.arange(len(weights)))
    roots = np.asarray(ctx.attr("tree_roots"), dtype=np.int64)
    ensemble = _Ensemble(trees, roots, np.full(len(roots), -1), leaves, _base(ctx, n_targets))

    def run(x):
        scores, has = ensemble.scores(x, how)
        return _regress(scores, has, ensemble, how, post).astype(x.dtype)

    return run


@register("TreeEnsembleClassifier", 1, 3, 5, domain=_ML, multi_output=True)
def tree_ensemble_classifier(ctx: KernelContext):
    labels = class_labels(ctx, "classlabels_int64s")
    if labels.size < 2:
        raise ctx.unsupported("a tree classifier needs at least two class labels")
    post = post_transform_of(ctx)
    ensemble = _legacy(ctx, "class", len(labels))
    ids = list(ctx.attr("class_ids", []) or [])
    if ctx.has_attr("class_weights_as_tensor"):
        weights = np.asarray(ctx.attr("class_weights_as_tensor")).ravel()
    else:
        weights = np.asarray(ctx.attr("class_weights", []) or [])
    one_class = len(labels) == 2 and len(set(ids)) == 1
    all_positive = not (weights < 0).any()

    def run(x):
        scores, has = ensemble.scores(x, _SUM)
        if len(labels) > 2:
            base = ensemble.base[: len(labels)]
            scores[:, : len(base)] += base
            has[:, : len(base)] = True
            winner = np.argmax(np.where(has, scores, -np.inf), axis=1)
            return labels[winner], transform(scores, post)
        return _two_classes(scores, has, ensemble.base, labels, one_class, all_positive, post)

    return run


def _two_classes(scores, has, base, labels, one_class, all_positive, post):
    """onnxruntime's two-class finish. A row whose second class got no weight keeps one score
    (unless two base values are given); that score is the positive class's when all weights
    went to one class (``one_class``): a probability (label at > 0.5, scores [1 - s, s]) when
    no weight is negative, else a margin (label at > 0, scores [-s, s], or their logistic).
    Two base values make the second score base[1] plus the *first* class's sum and the first
    its opposite, as there. A label not from ``one_class`` is the positive one when the score
    is > 0, and then ints are 1/0 whatever the labels (onnxruntime's default labels)."""
    s0, s1 = scores[:, 0], scores[:, 1]
    h0, h1 = has[:, 0], has[:, 1]
    two = h1.copy()
    if len(base) == 2:
        shifted = base[1] + s0
        s0, s1 = np.where(h1, -shifted, s0 + base[0]), np.where(h1, shifted, s1 + base[1])
        two[:] = True
    elif len(base) == 1:
        s0 = s0 + base[0]
    elif len(base) > 2:
        two[:] = True
    positive = np.where(two & h1, s1, np.where(h0, s0, 0.0))
    s0, s1 = np.where(h0, s0, 0.0), np.where(h1, s1, 0.0)  # a class no leaf wrote reads 0
    win = positive > (0.5 if one_class and all_positive else 0.0)
    if one_class or labels.dtype == object:
        label = labels[win.astype(np.int64)]
    else:
        label = win.astype(np.int64)
    both = transform(np.stack([s0, s1], axis=1), post)
    if post == PROBIT:  # onnxruntime writes one probit and leaves the other slot unset
        one = np.stack([probit(s0), np.zeros_like(s0, dtype=np.float32)], axis=1)
    elif not one_class and len(base) == 1:  # nothing to derive the other from: left unset
        one = np.stack([s0, np.zeros_like(s0)], axis=1)
    elif post == LOGISTIC:
        one = transform(np.stack([-s0, s0], axis=1), LOGISTIC)
    elif one_class and all_positive:
        one = np.stack([1 - s0, s0], axis=1)
    else:
        one = np.stack([-s0, s0], axis=1)
    scores = np.where(two[:, None], both, one.astype(np.float32))
    return label, scores.astype(np.float32)
