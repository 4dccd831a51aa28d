"""The ai.onnx.ml classifiers (linear, tree ensemble, SVM), the SVM regressor and ZipMap.

A classifier has two outputs: the label of each row and its per-class scores. The binary
conventions (one score column widened to two, label thresholds) follow onnxruntime, which every
converter (skl2onnx, onnxmltools) is tested against. Everything that depends only on the node's
attributes (label tables, kernel matrices' constant side, pairwise SVM index tables) is built at
load time; a request is a few array expressions over all rows at once.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.ml import _POST, _LegacyEnsemble, _post_transform
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_ML = "ai.onnx.ml"
_PROBIT = 4
_POST_ALL = {**_POST, "PROBIT": _PROBIT}


def _post(ctx: KernelContext) -> int:
    name = ctx.attr("post_transform", "NONE")
    if name not in _POST_ALL:
        raise ctx.unsupported(f"post_transform {name!r}")
    return _POST_ALL[name]


def _transform(scores: np.ndarray, post: int) -> np.ndarray:
    if post == _PROBIT:
        return (np.sqrt(2) * _erfinv(2 * scores.astype(np.float64) - 1)).astype(np.float32)
    return _post_transform(scores.astype(np.float32), post)


def _erfinv(y: np.ndarray) -> np.ndarray:
    """Inverse error function: Giles' single-precision approximation, then two Newton steps
    on erf (numpy has neither function; erf comes from math, element by element)."""
    import math

    w = -np.log((1 - y) * (1 + y))
    small = w < 5
    ws, wl = w - 2.5, np.sqrt(np.maximum(w, 5)) - 3
    ps = 2.81022636e-08
    for c in (
        3.43273939e-07,
        -3.5233877e-06,
        -4.39150654e-06,
        0.00021858087,
        -0.00125372503,
        -0.00417768164,
        0.246640727,
        1.50140941,
    ):
        ps = c + ps * ws
    pl = -0.000200214257
    for c in (
        0.000100950558,
        0.00134934322,
        -0.00367342844,
        0.00573950773,
        -0.0076224613,
        0.00943887047,
        1.00167406,
        2.83297682,
    ):
        pl = c + pl * wl
    x = np.where(small, ps, pl) * y
    erf = np.vectorize(math.erf, otypes=[np.float64])
    for _ in range(2):
        x = x - (erf(x) - y) / (2 / np.sqrt(np.pi) * np.exp(-x * x))
    return x


def _labels(ctx: KernelContext, ints: str, strings: str) -> np.ndarray:
    """The class labels as an array (int64, or object for strings)."""
    if ctx.has_attr(strings) and len(ctx.attr(strings)):
        return np.array(list(ctx.attr(strings)), dtype=object)
    return np.asarray(list(ctx.attr(ints, [])), dtype=np.int64)


def _rows(x: np.ndarray) -> np.ndarray:
    x = x.reshape(x.shape[0] if x.ndim > 1 else 1, -1)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


@register("LinearClassifier", 1, domain=_ML, multi_output=True)
def linear_classifier(ctx: KernelContext):
    labels = _labels(ctx, "classlabels_ints", "classlabels_strings")
    post = _post(ctx)
    coef = np.asarray(ctx.attr("coefficients"), dtype=np.float32)
    intercepts = ctx.attr("intercepts", None)
    rows = max(1, len(intercepts) if intercepts is not None else 1)
    coef = coef.reshape(rows, -1).T
    bias = np.asarray(intercepts if intercepts is not None else [0.0] * rows, dtype=np.float32)
    binary = coef.shape[1] == 1 and len(labels) == 2

    def run(x):
        scores = _rows(x).astype(np.float32) @ coef + bias
        if binary:  # one score column: the positive class; the negative one is its opposite
            scores = np.concatenate([-scores, scores], axis=1)
        scores = _transform(scores, post)
        if scores.shape[1] > 1:
            return labels[np.argmax(scores, axis=1)], scores
        positive = scores[:, 0] >= (0 if post == 0 else 0.5)
        if labels.size:
            return np.where(positive, labels[0], labels.dtype.type(0)), scores
        return positive.astype(np.int64), scores

    return run


@register("TreeEnsembleClassifier", 1, 3, 5, domain=_ML, multi_output=True)
def tree_ensemble_classifier(ctx: KernelContext):
    labels = _labels(ctx, "classlabels_int64s", "classlabels_strings")
    if labels.size == 0:
        raise ctx.unsupported("no class labels")
    post = _post(ctx)
    ensemble = _LegacyEnsemble(ctx, "class", len(labels))
    # All weights on one class of two: the scores are one column, the other is derived.
    binary = len(set(ensemble.target_ids)) == 1 and len(labels) == 2
    only = ensemble.target_ids[0] if ensemble.target_ids else 0

    def run(x):
        scores = (ensemble.sums(_rows(x)) + ensemble.base).astype(np.float32)
        if binary:
            positive = scores[:, only]
            negative = 1 - positive if post in (0, _PROBIT) else -positive
            scores = np.stack([negative, positive], axis=1)
        scores = _transform(scores, post)
        return labels[np.argmax(scores, axis=1)], scores

    return run


class _Kernel:
    """An SVM kernel function between rows and support vectors, parameters fixed at load."""

    def __init__(self, ctx: KernelContext) -> None:
        self.kind = ctx.attr("kernel_type", "LINEAR")
        if self.kind not in ("LINEAR", "POLY", "RBF", "SIGMOID"):
            raise ctx.unsupported(f"kernel_type {self.kind!r}")
        params = list(ctx.attr("kernel_params", []) or [])
        self.gamma, self.coef0, self.degree = [*params, 0.0, 0.0, 0.0][:3]
        self.degree = int(self.degree)

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
    kernel = _Kernel(ctx)
    post = _post(ctx)
    coef = np.asarray(ctx.attr("coefficients"), dtype=np.float64)
    rho = float(np.asarray(ctx.attr("rho", [0.0])).ravel()[0])
    n_supports = int(ctx.attr("n_supports", 0))
    one_class = bool(ctx.attr("one_class", 0))
    sv = None
    if n_supports > 0:
        sv = np.asarray(ctx.attr("support_vectors"), dtype=np.float64).reshape(n_supports, -1)

    def run(x):
        x2 = _rows(x).astype(np.float64)
        if sv is not None:
            s = kernel(x2, sv) @ coef + rho
        else:
            s = x2 @ coef + rho  # a linear SVM: the coefficients are the weights
        if one_class:
            s = np.where(s > 0, 1.0, -1.0)
        return _transform(s.reshape(-1, 1), post)

    return run


@register("SVMClassifier", 1, domain=_ML, multi_output=True)
def svm_classifier(ctx: KernelContext):
    """One-vs-one voting over ``vectors_per_class`` (libsvm's layout); with ``prob_a``/``prob_b``
    the pairwise decisions become probabilities by Platt scaling and libsvm's pairwise coupling,
    solved for all rows at once."""
    labels = _labels(ctx, "classlabels_ints", "classlabels_strings")
    kernel = _Kernel(ctx)
    post = _post(ctx)
    coefs = np.asarray(ctx.attr("coefficients"), dtype=np.float64)
    rho = np.asarray(ctx.attr("rho", [0.0]), dtype=np.float64).ravel()
    prob_a = np.asarray(ctx.attr("prob_a", []) or [], dtype=np.float64)
    prob_b = np.asarray(ctx.attr("prob_b", []) or [], dtype=np.float64)
    per_class = np.asarray(ctx.attr("vectors_per_class", []) or [], dtype=np.int64)
    k = max(len(labels), 1)
    total = int(per_class.sum())
    if total == 0:
        return _linear_svm(ctx, labels, coefs, rho, kernel, post)
    sv = np.asarray(ctx.attr("support_vectors"), dtype=np.float64).reshape(total, -1)
    coefs = coefs.reshape(-1, total)
    start = np.concatenate([[0], np.cumsum(per_class)[:-1]])
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    if len(rho) != len(pairs):
        raise ctx.unsupported(f"{len(rho)} rho values for {len(pairs)} class pairs")
    # each pair's decision is one dot product of the kernel row with a fixed weight vector
    weights = np.zeros((total, len(pairs)))
    for p, (i, j) in enumerate(pairs):
        si, ni, sj, nj = start[i], per_class[i], start[j], per_class[j]
        weights[si : si + ni, p] = coefs[j - 1, si : si + ni]
        weights[sj : sj + nj, p] = coefs[i, sj : sj + nj]
    first = np.array([i for i, _ in pairs])
    second = np.array([j for _, j in pairs])
    probabilities = len(prob_a) == len(pairs) and len(pairs) > 0

    def run(x):
        decision = kernel(_rows(x).astype(np.float64), sv) @ weights + rho  # (n, pairs)
        n = decision.shape[0]
        votes = np.zeros((n, k))
        np.add.at(votes, (slice(None), first), decision > 0)
        np.add.at(votes, (slice(None), second), decision <= 0)
        # the label is the vote's winner (first on a tie), with or without probabilities
        winner = np.argmax(votes, axis=1)
        if probabilities:
            scores = _couple(decision, prob_a, prob_b, first, second, k)
        elif k == 2:  # one decision value, reported for both classes as onnxruntime does
            scores = np.concatenate([-decision, decision], axis=1)
        else:
            scores = decision
        scores = _transform(scores, post) if post else scores.astype(np.float32)
        label = labels[winner] if labels.size else winner.astype(np.int64)
        return label, scores

    return run


def _linear_svm(ctx, labels, coefs, rho, kernel, post):
    k = max(len(labels), 1)
    coefs = coefs.reshape(k if len(rho) == k else len(rho), -1)

    def run(x):
        x2 = _rows(x).astype(np.float64)
        scores = kernel(x2, coefs) + rho[None, : coefs.shape[0]]
        if scores.shape[1] == 1 and len(labels) == 2:
            winner = (scores[:, 0] > 0).astype(np.int64)
            scores = np.concatenate([-scores, scores], axis=1)
        else:
            winner = np.argmax(scores, axis=1)
        scores = _transform(scores, post) if post else scores.astype(np.float32)
        return (labels[winner] if labels.size else winner), scores

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
    for _ in range(max(100, k)):
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
    labels = _labels(ctx, "classlabels_int64s", "classlabels_strings").tolist()

    def run(x):
        x2 = np.asarray(x, dtype=np.float32).reshape(-1, len(labels))
        return [dict(zip(labels, row)) for row in x2.tolist()]

    return run
