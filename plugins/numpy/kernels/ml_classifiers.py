"""The ai.onnx.ml linear and SVM classifiers, the SVM regressor and ZipMap (tree ensembles are
in :mod:`ml_trees`).

A classifier has two outputs: the label of each row and its per-class scores. The binary
conventions (one score column widened to two, label thresholds) follow onnxruntime, which every
converter (skl2onnx, onnxmltools) is tested against. Everything that depends only on the node's
attributes (label tables, kernel matrices' constant side, pairwise SVM index tables) is built at
load time; a request is a few array expressions over all rows at once.
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


def _rows(x: np.ndarray) -> np.ndarray:
    x = as_rows(x)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


@register("LinearClassifier", 1, domain=_ML, multi_output=True)
def linear_classifier(ctx: KernelContext):
    """Scores x @ coefficients.T + intercepts, one column per intercept. With one column the
    label is the positive one when the score is > 0 (the second of two labels, else 1 or
    "1"); with two labels the scores become [1 - s, s] (LOGISTIC: [sigmoid(-s), sigmoid(s)],
    other transforms are not applied), and otherwise the one column takes no post-transform
    but PROBIT: onnxruntime's conventions."""
    labels = class_labels(ctx, "classlabels_ints")
    post = post_transform_of(ctx)
    intercepts = ctx.attr("intercepts", None)
    columns = len(intercepts) if intercepts else 1
    coef = np.asarray(ctx.attr("coefficients"), dtype=np.float32).reshape(columns, -1).T
    bias = np.asarray(intercepts or [0.0], dtype=np.float32)
    if columns == 1:
        strings = labels.dtype == object or ctx.has_attr("classlabels_strings")
        pair = labels if labels.size == 2 else np.array(["0", "1"] if strings else [0, 1])
        pair = pair.astype(object) if strings else pair.astype(np.int64)
        second = labels.size == 2

        def one_column(x):
            score = (_rows(x).astype(np.float32, copy=False) @ coef + bias)[:, 0]
            label = pair[(score > 0).astype(np.int64)]
            if second and post == LOGISTIC:
                return label, transform(np.stack([-score, score], axis=1), LOGISTIC)
            if second:
                return label, np.stack([1 - score, score], axis=1)
            return label, transform(score[:, None], post if post == PROBIT else 0)

        return one_column

    def run(x):
        scores = _rows(x).astype(np.float32, copy=False) @ coef + bias
        winner = np.argmax(scores, axis=1)
        return (labels[winner] if labels.size else winner), transform(scores, post)

    return run


class _Kernel:
    """An SVM kernel function between rows and support vectors, parameters fixed at load."""

    def __init__(self, ctx: KernelContext, linear: bool = False) -> None:
        self.kind = "LINEAR" if linear else ctx.attr("kernel_type", "LINEAR")
        if self.kind not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
            raise ctx.unsupported(f"kernel_type {self.kind!r}")
        params = list(ctx.attr("kernel_params", []) or [])
        self.gamma, self.coef0, self.degree = [float(p) for p in [*params, 0.0, 0.0, 0.0][:3]]

    def __call__(self, x: np.ndarray, sv: np.ndarray) -> np.ndarray:
        if self.kind == "RBF":
            d2 = (x * x).sum(1)[:, None] + (sv * sv).sum(1)[None, :] - 2 * (x @ sv.T)
            return np.exp(-self.gamma * np.maximum(d2, 0))
        dot = x @ sv.T
        if self.kind == "POLY":
            return (dot * self.gamma + self.coef0) ** self.degree
        if self.kind == "SIGMOID":
            return np.tanh(dot * self.gamma + self.coef0)
        return dot


@register("SVMRegressor", 1, domain=_ML)
def svm_regressor(ctx: KernelContext):
    """Support vectors (``n_supports`` > 0) or, without them, a linear model whose coefficients
    are the weights. onnxruntime applies no post_transform here; neither do we."""
    n_supports = int(ctx.attr("n_supports", 0))
    kernel = _Kernel(ctx, linear=n_supports == 0)
    coef = np.asarray(ctx.attr("coefficients"), dtype=np.float64)
    rho = float(np.asarray(ctx.attr("rho", [0.0])).ravel()[0])
    one_class = bool(ctx.attr("one_class", 0))
    if n_supports > 0:
        sv = np.asarray(ctx.attr("support_vectors"), dtype=np.float64).reshape(n_supports, -1)
    else:
        sv, coef = coef.reshape(1, -1), np.ones(1)

    def run(x):
        s = kernel(_rows(x).astype(np.float64), sv) @ coef + rho
        if one_class:
            s = np.where(s > 0, 1.0, -1.0)
        return s.reshape(-1, 1).astype(np.float32)

    return run


@register("SVMClassifier", 1, domain=_ML, multi_output=True)
def svm_classifier(ctx: KernelContext):
    """One-vs-one voting over ``vectors_per_class`` (libsvm's layout); with ``prob_a``/``prob_b``
    the pairwise decisions become probabilities by Platt scaling and libsvm's pairwise coupling,
    solved for all rows at once. Without probabilities the scores are the pairwise decisions
    (two classes: [-d, d], or [1 - d, d] under a post_transform, as onnxruntime writes them)."""
    labels = class_labels(ctx, "classlabels_ints")
    if labels.size < 2:
        raise ctx.unsupported("an SVM classifier needs at least two class labels")
    post = post_transform_of(ctx)
    coefs = np.asarray(ctx.attr("coefficients"), dtype=np.float64)
    rho = np.asarray(ctx.attr("rho", [0.0]), dtype=np.float64).ravel()
    prob_a = np.asarray(ctx.attr("prob_a", []) or [], dtype=np.float64)
    prob_b = np.asarray(ctx.attr("prob_b", []) or [], dtype=np.float64)
    per_class = np.asarray(ctx.attr("vectors_per_class", []) or [], dtype=np.int64)
    k = len(labels)
    total = int(per_class.sum())
    if total == 0:
        return _linear_svm(labels, coefs, rho, post, probabilities=prob_a.size > 0)
    kernel = _Kernel(ctx)
    if len(per_class) != k:
        raise ctx.unsupported(f"vectors_per_class has {len(per_class)} entries for {k} labels")
    sv = np.asarray(ctx.attr("support_vectors"), dtype=np.float64).reshape(total, -1)
    coefs = coefs.reshape(-1, total)
    start = np.concatenate([[0], np.cumsum(per_class)[:-1]])
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    if len(rho) < len(pairs) or coefs.shape[0] < k - 1:
        raise ctx.unsupported(f"rho or coefficients too short for {len(pairs)} class pairs")
    # each pair's decision is one dot product of the kernel row with a fixed weight vector
    weights = np.zeros((total, len(pairs)))
    for p, (i, j) in enumerate(pairs):
        si, ni, sj, nj = start[i], per_class[i], start[j], per_class[j]
        weights[si : si + ni, p] = coefs[j - 1, si : si + ni]
        weights[sj : sj + nj, p] = coefs[i, sj : sj + nj]
    first = np.array([i for i, _ in pairs])
    second = np.array([j for _, j in pairs])
    probabilities = prob_a.size > 0
    if probabilities and min(prob_a.size, prob_b.size) < len(pairs):
        raise ctx.unsupported(f"prob_a and prob_b need {len(pairs)} values")
    rho = rho[: len(pairs)]

    def run(x):
        decision = kernel(_rows(x).astype(np.float64), sv) @ weights + rho  # (n, pairs)
        n = decision.shape[0]
        votes = np.zeros((n, k))
        np.add.at(votes, (slice(None), first), decision > 0)
        np.add.at(votes, (slice(None), second), decision <= 0)
        label = labels[np.argmax(votes, axis=1)]  # the vote's winner, first on a tie
        if probabilities:
            scores = transform(_couple(decision, prob_a, prob_b, first, second, k), post)
        elif k > 2:
            scores = transform(decision, post)
        else:
            scores = _one_decision(decision[:, 0].astype(np.float32), post)
        return label, scores

    return run


def _one_decision(d: np.ndarray, post: int) -> np.ndarray:
    """onnxruntime's two columns for a single binary decision value."""
    if post == PROBIT:  # one probit, the other slot left unset there
        return np.stack([probit(d), np.zeros_like(d)], axis=1)
    if post == LOGISTIC:
        return transform(np.stack([-d, d], axis=1), LOGISTIC)
    if post:
        return np.stack([1 - d, d], axis=1)
    return np.stack([-d, d], axis=1)


def _linear_svm(labels, coefs, rho, post, probabilities: bool):
    """No support vectors: one linear score per class, x @ coefficients[c] + rho[0] (a single
    rho for every class, as onnxruntime reads it). The label is the larger score's; of two
    classes without prob_a, the second when the larger score passes 0.5 (all coefficients
    >= 0) or 0 (onnxruntime's rule)."""
    k = len(labels)
    coefs = coefs.reshape(k, -1)
    bias = float(rho[0]) if rho.size else 0.0
    all_positive = bool((coefs >= 0).all())

    def run(x):
        scores = _rows(x).astype(np.float32) @ coefs.T.astype(np.float32) + np.float32(bias)
        winner = np.argmax(scores, axis=1)
        if k == 2 and not probabilities:
            top = scores[np.arange(len(winner)), winner]
            second = (top >= 0.5) if all_positive else (top > 0)
            winner = np.where(second, 1, winner)
        return labels[winner], transform(scores, post)

    return run


def _couple(decision, prob_a, prob_b, first, second, k):
    """libsvm's multiclass_probability (Wu, Lin and Weng's method 2) for every row."""
    n = decision.shape[0]
    r = 1 / (1 + np.exp(decision * prob_a + prob_b))  # P(first wins the pair)
    r = np.clip(r, 1e-7, 1 - 1e-7)
    big_r = np.zeros((n, k, k))
    big_r[:, first, second] = r
    big_r[:, second, first] = 1 - r
    q = np.zeros((n, k, k))
    idx = np.arange(k)
    sq = big_r**2
    q[:, idx, idx] = sq.sum(axis=1) - sq[:, idx, idx]
    q -= np.where(np.eye(k, dtype=bool), 0, big_r.transpose(0, 2, 1) * big_r)
    p = np.full((n, k), 1.0 / k)
    eps = 0.005 / k
    active = np.arange(n)  # each row stops iterating when it converges, as libsvm's loop does
    for _ in range(100):
        qa, pa = q[active], p[active]
        qpa = np.einsum("nij,nj->ni", qa, pa)
        pqp = (pa * qpa).sum(axis=1)
        going = np.abs(qpa - pqp[:, None]).max(axis=1) >= eps
        active, qa, pa, qpa, pqp = active[going], qa[going], pa[going], qpa[going], pqp[going]
        if not active.size:
            break
        for t in range(k):
            diff = (-qpa[:, t] + pqp) / qa[:, t, t]
            pa[:, t] += diff
            pqp = (pqp + diff * (diff * qa[:, t, t] + 2 * qpa[:, t])) / (1 + diff) ** 2
            pa /= (1 + diff)[:, None]
            qpa = (qpa + diff[:, None] * qa[:, t, :]) / (1 + diff)[:, None]
        p[active] = pa
    return p


@register("ZipMap", 1, domain=_ML)
def zipmap(ctx: KernelContext):
    """Scores as a list of ``{label: score}`` per row (a sequence of maps)."""
    labels = class_labels(ctx, "classlabels_int64s").tolist()

    def run(x):
        x2 = np.asarray(x, dtype=np.float32).reshape(-1, len(labels))
        return [dict(zip(labels, row)) for row in x2.tolist()]

    return run
