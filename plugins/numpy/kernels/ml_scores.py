"""What the ai.onnx.ml classifiers and regressors share: their view of X as rows, class
labels and score post-transforms.

The spec names the transforms; their numerics follow onnxruntime, the runtime every converter
(skl2onnx, onnxmltools) is tested against: PROBIT is Winitzki's closed-form inverse error
function (a = 0.147) as onnxruntime computes it, not the exact one (they differ by up to 2e-3,
more than the tolerance users compare with), and SOFTMAX_ZERO leaves entries within 1e-7 of
zero out of the sum, which is 0/0 (NaN) for a row of zeros, as there.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext

NONE, SOFTMAX, LOGISTIC, SOFTMAX_ZERO, PROBIT = range(5)
POST_TRANSFORMS = {
    "NONE": NONE,
    "SOFTMAX": SOFTMAX,
    "LOGISTIC": LOGISTIC,
    "SOFTMAX_ZERO": SOFTMAX_ZERO,
    "PROBIT": PROBIT,
}


def as_rows(x: np.ndarray) -> np.ndarray:
    """X as [rows, features]: a 1-D X is one row, more dimensions are flattened per row (an
    empty batch stays [0, features])."""
    if x.ndim < 2:
        return x.reshape(1, -1)
    return x.reshape(x.shape[0], int(np.prod(x.shape[1:])))


def class_labels(ctx: KernelContext, ints: str) -> np.ndarray:
    """The node's class labels: ``classlabels_strings`` as an object array, else ``ints``."""
    strings = list(ctx.attr("classlabels_strings", []) or [])
    if strings:
        return np.array([s.decode() if isinstance(s, bytes) else s for s in strings], object)
    return np.asarray(list(ctx.attr(ints, []) or []), dtype=np.int64)


def post_transform_of(ctx: KernelContext) -> int:
    """The node's ``post_transform`` (a name before TreeEnsemble, an int in it)."""
    value = ctx.attr("post_transform", NONE if ctx.op_type == "TreeEnsemble" else "NONE")
    post = POST_TRANSFORMS.get(value) if isinstance(value, str) else int(value)
    if post not in range(5):
        raise ctx.unsupported(f"post_transform {value!r}")
    return post


def probit(p: np.ndarray) -> np.ndarray:
    """sqrt(2) * erfinv(2p - 1) with Winitzki's approximation of erfinv, step by step in
    float32 as onnxruntime rounds it (the sign of 2p - 1 = 0 is +)."""
    f = np.float32
    y = f(2) * p.astype(f) - f(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.log((f(1) - y) * (f(1) + y))
        v = f(2) / (f(np.pi) * f(0.147)) + f(0.5) * log
        root = np.sqrt(-v + np.sqrt(v * v - f(1) / f(0.147) * log))
    return (f(np.sqrt(2)) * np.where(y < 0, f(-1), f(1)) * root).astype(f)


def transform(scores: np.ndarray, post: int) -> np.ndarray:
    """``post`` applied to every row of (n, k) float32 scores."""
    scores = scores.astype(np.float32, copy=False)
    if post == SOFTMAX:
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if post == LOGISTIC:
        return (1 / (1 + np.exp(-scores.astype(np.float64)))).astype(np.float32)
    if post == SOFTMAX_ZERO:
        top = scores.max(axis=1, keepdims=True)
        kept = np.abs(scores) > 1e-7
        e = np.where(kept, np.exp(scores - top), scores * np.exp(-top))
        total = np.where(kept, e, 0).sum(axis=1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            return (e / total).astype(np.float32)
    if post == PROBIT:
        return probit(scores)
    return scores
