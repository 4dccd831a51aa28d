"""Gemm and MatMul."""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register
from plugserve.plugins.numpy.kernels.window import (
    compute_dtype,
)
from plugserve.plugins.numpy.parallel import matmul as _gemm

__all__ = ["gemm", "matmul"]


# --------------------------------------------------------------------------- Gemm, MatMul


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype == np.float16:
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.matmul(a, b)


@register("MatMul", 1, 9, 13)
def matmul(ctx: KernelContext):
    dtype = ctx.input_dtype(0)
    b_const = ctx.constant(1)
    if dtype == np.float16:
        if b_const is not None:
            b32 = np.ascontiguousarray(b_const, dtype=np.float32)
            return lambda a, b: np.matmul(a.astype(np.float32), b32).astype(np.float16)
        return _matmul
    if b_const is not None and b_const.ndim == 2:
        b_c = np.ascontiguousarray(b_const)  # no copy when it already is
        return lambda a, b: _gemm(a, b_c)
    if dtype == np.float32:
        return _gemm  # two activations (attention scores left unfused) split as weights are
    return np.matmul if dtype is not None else _matmul


@register("Gemm", 1, 6, 7, 9, 11, 13)
def gemm(ctx: KernelContext):
    """Y = alpha * A' B' + beta * C. A constant B is transposed and pre-scaled by alpha once and
    a constant C pre-scaled by beta, so a request is one matmul and one in-place add."""
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    trans_a = bool(ctx.attr("transA", 0))
    trans_b = bool(ctx.attr("transB", 0))
    dtype = ctx.input_dtype(0)
    is_float = dtype is None or dtype.kind == "f"
    if dtype is not None and dtype.kind not in "fiu":
        raise ctx.unsupported(f"input dtype {dtype}")
    b_const = ctx.constant(1)
    c_const = ctx.constant(2)
    cdt = compute_dtype(dtype) if dtype is not None else None

    b_ready = None
    if b_const is not None and is_float and cdt is not None:
        bm = b_const.T if trans_b else b_const
        b_ready = np.ascontiguousarray(bm if alpha == 1 else bm * alpha, dtype=cdt)
    c_ready = None
    if c_const is not None and is_float and cdt is not None:
        c_ready = np.asarray(c_const if beta == 1 else c_const * beta, dtype=cdt)

    def run(a, b, c=None):
        out_dtype = a.dtype
        work = compute_dtype(a.dtype)
        am = (a.T if trans_a else a).astype(work, copy=False)
        if b_ready is not None:
            y = _gemm(am, b_ready)
        else:
            bm = (b.T if trans_b else b).astype(work, copy=False)
            y = _gemm(am, bm)
            if alpha != 1:
                y = y * alpha if y.dtype.kind == "f" else (y * alpha).astype(work)
        if c is not None and beta != 0:
            if c_ready is not None:
                cc = c_ready
            else:
                cc = c.astype(work, copy=False)
                if beta != 1:
                    cc = cc * beta if cc.dtype.kind == "f" else (cc * beta).astype(work)
            if cc.shape == y.shape or np.broadcast_shapes(cc.shape, y.shape) == y.shape:
                y += cc
            else:
                y = y + cc
        return y if y.dtype == out_dtype else y.astype(out_dtype)

    return run
