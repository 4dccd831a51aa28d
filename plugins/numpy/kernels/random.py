"""Random generators: RandomUniform(Like), RandomNormal(Like), Bernoulli, Multinomial.

Each node owns one numpy Generator made in the builder: seeded from the ``seed`` attribute
when present (so a fresh load reproduces the same sequence), from OS entropy otherwise. The
generator advances across requests, as onnxruntime's does, so repeated calls differ. The
values are not bit-compatible with any other runtime's generator: ONNX leaves that open.
"""

from __future__ import annotations

import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype

from plugserve.plugins.numpy.kernels.registry import KernelContext, register


def _rng(ctx: KernelContext) -> np.random.Generator:
    if ctx.has_attr("seed"):
        seed = float(ctx.attr("seed"))
        return np.random.default_rng(np.frombuffer(np.float64(seed).tobytes(), np.uint32))
    return np.random.default_rng()


def _dtype(ctx: KernelContext, default: np.dtype | None, allowed: str = "f") -> np.dtype | None:
    """The ``dtype`` attribute as numpy dtype (``default`` when absent)."""
    if not ctx.has_attr("dtype"):
        return default
    dtype = np.dtype(tensor_dtype_to_np_dtype(int(ctx.attr("dtype"))))
    if dtype.kind not in allowed:
        raise ctx.unsupported(f"dtype {dtype}")
    return dtype


@register("RandomUniform", 1, 22)
def random_uniform(ctx: KernelContext):
    rng = _rng(ctx)
    dtype = _dtype(ctx, np.dtype(np.float32))
    low, high = float(ctx.attr("low", 0.0)), float(ctx.attr("high", 1.0))
    shape = tuple(int(s) for s in ctx.attr("shape"))

    def run():
        return rng.uniform(low, high, shape).astype(dtype)

    return run


@register("RandomNormal", 1, 22)
def random_normal(ctx: KernelContext):
    rng = _rng(ctx)
    dtype = _dtype(ctx, np.dtype(np.float32))
    mean, scale = float(ctx.attr("mean", 0.0)), float(ctx.attr("scale", 1.0))
    shape = tuple(int(s) for s in ctx.attr("shape"))

    def run():
        return rng.normal(mean, scale, shape).astype(dtype)

    return run


@register("RandomUniformLike", 1, 22)
def random_uniform_like(ctx: KernelContext):
    rng = _rng(ctx)
    dtype = _dtype(ctx, None)
    low, high = float(ctx.attr("low", 0.0)), float(ctx.attr("high", 1.0))

    def run(x):
        return rng.uniform(low, high, x.shape).astype(dtype or x.dtype)

    return run


@register("RandomNormalLike", 1, 22)
def random_normal_like(ctx: KernelContext):
    rng = _rng(ctx)
    dtype = _dtype(ctx, None)
    mean, scale = float(ctx.attr("mean", 0.0)), float(ctx.attr("scale", 1.0))

    def run(x):
        return rng.normal(mean, scale, x.shape).astype(dtype or x.dtype)

    return run


@register("Bernoulli", 15, 22)
def bernoulli(ctx: KernelContext):
    """1 with probability x, else 0, in the ``dtype`` attribute's type (input's by default)."""
    rng = _rng(ctx)
    dtype = _dtype(ctx, None, allowed="fiub")

    def run(x):
        return (rng.random(x.shape) < x).astype(dtype or x.dtype)

    return run


@register("Multinomial", 7, 22)
def multinomial(ctx: KernelContext):
    """``sample_size`` class indices per row, drawn from softmax(input row)."""
    rng = _rng(ctx)
    dtype = _dtype(ctx, np.dtype(np.int32), allowed="i")
    samples = int(ctx.attr("sample_size", 1))

    def run(logits):
        shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        probs = np.exp(shifted)
        cdf = np.cumsum(probs, axis=1)
        cdf /= cdf[:, -1:]
        u = rng.random((logits.shape[0], samples))
        idx = np.empty((logits.shape[0], samples), dtype=np.int64)
        for b in range(logits.shape[0]):
            idx[b] = np.searchsorted(cdf[b], u[b], side="right")
        return np.minimum(idx, logits.shape[1] - 1).astype(dtype)

    return run
