"""Pooling: Max, Average, Lp, their global forms and MaxUnpool."""

from __future__ import annotations

import itertools
import math

import numpy as np

from plugserve.plugins.numpy.kernels import window
from plugserve.plugins.numpy.kernels.registry import KernelContext, register
from plugserve.plugins.numpy.kernels.window import (
    ConvSpec,
    check_float,
    compute_dtype,
    pad_constant,
    tap_views,
)

__all__ = ["pool_reduce", "separable_max", "separable_max_plan"]


# --------------------------------------------------------------------------- pooling


def _pool_kernel(ctx: KernelContext) -> tuple:
    kernel = ctx.attr("kernel_shape", None)
    if not kernel:
        raise ctx.unsupported("kernel_shape is required")
    return tuple(int(k) for k in kernel)


def _pool_setup(spec: ConvSpec, x: np.ndarray, kernel: tuple, pad_value):
    """Pad ``x`` so every window of the resolved geometry fits; returns the pieces."""
    out, begin, end, strides, dil = spec.resolve(x.shape[2:], kernel)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    reach_end = tuple(
        max(window.window_reach(o, s, sp) - size - b, 0)
        for o, s, sp, size, b in zip(out, strides, spans, x.shape[2:], begin)
    )
    xp = pad_constant(x, begin, reach_end, pad_value)
    return xp, out, begin, end, strides, dil


def _window_counts(spatial, out, begin, end, kernel, strides, dil, include_pad) -> np.ndarray:
    """How many window elements count for the average, per output position (separable)."""
    result = np.ones((), np.float64)
    for size, o, b, e, k, s, d in zip(spatial, out, begin, end, kernel, strides, dil):
        pos = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
        lo, hi = (-b, size + e) if include_pad else (0, size)
        counts = ((pos >= lo) & (pos < hi)).sum(axis=1)
        result = np.multiply.outer(result, counts)
    return result


def _pool_taps(spec: ConvSpec, shape: tuple, kernel: tuple):
    """How a pool reads its windows without materialising a padded copy. Cached per shape.

    Per kernel offset: the output slices it contributes to and the input slices it reads,
    clipped to the data. A strided pool first splits the input into stride phases
    (``x[..., a::s]`` copied contiguously), so every tap reads a unit-stride slice of one
    phase: numpy's strided loops are several times slower than contiguous ones.
    """
    key = ("pool", shape, kernel)
    hit = spec.plans.get(key)
    if hit is not None:
        return hit
    out, begin, _, strides, dil = spec.resolve(shape[2:], kernel)
    spatial = shape[2:]
    phased = any(s > 1 for s in strides)
    counts = [[len(range(a, size, s)) for a in range(s)] for size, s in zip(spatial, strides)]
    fills = []
    for phase in itertools.product(*(range(s) for s in strides)):
        dst = tuple(slice(0, counts[d][a]) for d, a in enumerate(phase))
        src = tuple(slice(a, None, s) for a, s in zip(phase, strides))
        if all(sl.stop > 0 for sl in dst):
            fills.append(((*phase, Ellipsis, *dst), (Ellipsis, *src)))
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        dst, src, phase = [Ellipsis], [Ellipsis], []
        for d, (o, b, k, s, dl) in enumerate(zip(out, begin, offset, strides, dil)):
            first = k * dl - b  # input position read for output 0
            a, q0 = first % s, first // s
            lo, hi = max(0, -q0), min(o, counts[d][a] - q0)
            if hi <= lo:
                break
            dst.append(slice(lo, hi))
            src.append(slice(q0 + lo, q0 + hi))
            phase.append(a)
        else:
            taps.append((tuple(dst), (*phase, *src) if phased else tuple(src)))
    shape_ph = (*strides, *shape[:2], *(max(c) for c in counts)) if phased else None
    whole = (Ellipsis, *(slice(0, o) for o in out))
    cover = next((i for i, (dst, _) in enumerate(taps) if dst == whole), None)
    hit = spec.plans[key] = (out, shape_ph, fills, taps, cover)
    return hit


def pool_reduce(spec: ConvSpec, x: np.ndarray, kernel: tuple, init, combine) -> np.ndarray:
    """``combine`` (np.maximum or np.add) of every window, starting from ``init``."""
    out, shape_ph, fills, taps, cover = _pool_taps(spec, x.shape, kernel)
    src = x
    if shape_ph is not None:
        src = np.empty(shape_ph, x.dtype)
        for dst, part in fills:
            src[dst] = x[part]
    if cover is None:
        y = np.full((*x.shape[:2], *out), init, x.dtype)
    else:  # a tap that covers every output (the centre one, usually) initialises y
        y = src[taps[cover][1]].copy()
    for i, (dst, part) in enumerate(taps):
        if i != cover:
            combine(y[dst], src[part], out=y[dst])
    return y


def _axis_taps(size: int, out: int, begin: int, k: int, stride: int, dil: int):
    """For one axis of a pool: per kernel offset, the outputs ``[lo, hi)`` it reaches inside
    the data and the input slice they read; plus the index of an offset covering all outputs
    (None if none does)."""
    taps = []
    for t in range(k):
        first = t * dil - begin  # the input index output 0 reads at this offset
        lo = max(0, -(first // stride))
        hi = min(out, (size - 1 - first) // stride + 1)
        if hi > lo:
            taps.append((lo, hi, slice(first + lo * stride, first + (hi - 1) * stride + 1, stride)))
    cover = next((i for i, (lo, hi, _) in enumerate(taps) if (lo, hi) == (0, out)), None)
    return taps, cover


def separable_max_plan(spec: ConvSpec, shape: tuple, kernel: tuple):
    """Per spatial axis, the taps of :func:`_axis_taps`, or None when an axis has no covering
    offset. Cached per shape. Outer axes go first: their passes read whole contiguous rows,
    and the strided innermost axis is then reduced on the already smaller array."""
    key = ("separable", shape, kernel)
    if key not in spec.plans:
        out, begin, _, strides, dil = spec.resolve(shape[2:], kernel)
        axes = []
        for axis in range(len(kernel)):
            args = (shape[2 + axis], out[axis], begin[axis], kernel[axis])
            taps, cover = _axis_taps(*args, strides[axis], dil[axis])
            if cover is None:
                axes = None
                break
            axes.append((2 + axis, taps, cover))
        spec.plans[key] = axes
    return spec.plans[key]


def separable_max(x: np.ndarray, axes) -> np.ndarray:
    """Max pooling one axis at a time: a k x k window costs 2(k - 1) passes, not k^2 - 1 (the
    3x3 stride-2 pool after ResNet's stem: 0.39 ms instead of 0.56). Windows are clipped to
    the data, which is what padding with -inf means for a max."""
    for axis, taps, cover in axes:
        pre = (slice(None),) * axis
        y = x[(*pre, taps[cover][2])].copy()
        for i, (lo, hi, src) in enumerate(taps):
            if i != cover:
                dst = y[(*pre, slice(lo, hi))]
                np.maximum(dst, x[(*pre, src)], out=dst)
        x = y
    return x


@register("MaxPool", 1, 8, 10, 11, 12, 22, multi_output=True)
def max_pool(ctx: KernelContext):
    """MaxPool; the Indices output (flat index into the input, row- or column-major spatial
    order per storage_order) is only computed when the node asks for it."""
    check_float(ctx, allow_int8=True)
    kernel = _pool_kernel(ctx)
    spec = ConvSpec(ctx, kernel, ceil_mode=bool(ctx.attr("ceil_mode", 0)), pooling=True)
    storage_order = int(ctx.attr("storage_order", 0))
    want_indices = ctx.has_output(1)

    def fill_value(dtype):
        return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min

    def run(x):
        if not want_indices:
            axes = separable_max_plan(spec, x.shape, kernel) if x.ndim > 2 else None
            if axes:
                return (separable_max(x, axes),)
            return (pool_reduce(spec, x, kernel, fill_value(x.dtype), np.maximum),)
        xp, out, begin, _, strides, dil = _pool_setup(spec, x, kernel, fill_value(x.dtype))
        taps = tap_views(xp, kernel, out, strides, dil)
        _, first = next(taps)
        y = first.copy()
        best = np.zeros(y.shape, np.int64)
        for index, (_, tap) in enumerate(taps, start=1):
            mask = tap > y
            np.copyto(y, tap, where=mask)
            best[mask] = index
        return y, _max_indices(best, x.shape, kernel, out, begin, strides, dil, storage_order)

    return run


def _max_indices(best, shape, kernel, out, begin, strides, dil, storage_order) -> np.ndarray:
    """Flat input indices of the chosen window element (per ONNX MaxPool Indices)."""
    n, c = shape[:2]
    spatial = shape[2:]
    offsets = np.unravel_index(best, kernel)
    grids = np.meshgrid(*(np.arange(o) for o in out), indexing="ij")
    pos = [grids[i] * strides[i] - begin[i] + offsets[i] * dil[i] for i in range(len(kernel))]
    if storage_order == 0:
        flat = np.zeros(best.shape, np.int64)
        for i, p in enumerate(pos):
            flat = flat * spatial[i] + p
    else:
        flat = np.zeros(best.shape, np.int64)
        for i in reversed(range(len(pos))):
            flat = flat * spatial[i] + pos[i]
    plane = math.prod(spatial)
    base = (np.arange(n * c, dtype=np.int64) * plane).reshape((n, c) + (1,) * len(spatial))
    return flat + base


@register("AveragePool", 1, 7, 10, 11, 19, 22)
def average_pool(ctx: KernelContext):
    """AveragePool: window sums divided by a per-position count (count_include_pad counts the
    explicit pads but never the extra reach ceil_mode adds)."""
    check_float(ctx)
    kernel = _pool_kernel(ctx)
    spec = ConvSpec(ctx, kernel, ceil_mode=bool(ctx.attr("ceil_mode", 0)), pooling=True)
    include_pad = bool(ctx.attr("count_include_pad", 0))
    divisors: dict[tuple, np.ndarray] = {}

    def run(x):
        c = compute_dtype(x.dtype)
        xc = x.astype(c, copy=False)
        y = pool_reduce(spec, xc, kernel, 0, np.add)
        out = y.shape[2:]
        key = x.shape[2:]
        div = divisors.get(key)
        if div is None:
            _, begin, end, strides, dil = spec.resolve(x.shape[2:], kernel)
            counts = _window_counts(x.shape[2:], out, begin, end, kernel, strides, dil, include_pad)
            div = divisors[key] = (1.0 / np.maximum(counts, 1)).astype(c)
        y *= div
        return y.astype(x.dtype, copy=False)

    return run


@register("LpPool", 1, 2, 11, 18, 22)
def lp_pool(ctx: KernelContext):
    """LpPool: (sum over the window of |x|^p)^(1/p); pads contribute zero."""
    check_float(ctx)
    kernel = _pool_kernel(ctx)
    p = float(ctx.attr("p", 2.0 if ctx.version == 1 else 2))
    spec = ConvSpec(ctx, kernel, ceil_mode=bool(ctx.attr("ceil_mode", 0)), pooling=True)

    def run(x):
        c = compute_dtype(x.dtype)
        xa = np.abs(x.astype(c, copy=False))
        powered = xa * xa if p == 2 else xa**p
        y = pool_reduce(spec, powered, kernel, 0, np.add)
        y = np.sqrt(y) if p == 2 else y ** (1.0 / p)
        return y.astype(x.dtype, copy=False)

    return run


def _spatial_axes(x: np.ndarray) -> tuple:
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", 1, 22)
def global_average_pool(ctx: KernelContext):
    check_float(ctx)

    def run(x):
        y = x.mean(axis=_spatial_axes(x), keepdims=True, dtype=compute_dtype(x.dtype))
        return y.astype(x.dtype, copy=False)

    return run


@register("GlobalMaxPool", 1, 22)
def global_max_pool(ctx: KernelContext):
    check_float(ctx)
    return lambda x: x.max(axis=_spatial_axes(x), keepdims=True)


@register("GlobalLpPool", 1, 2, 22)
def global_lp_pool(ctx: KernelContext):
    check_float(ctx)
    p = float(ctx.attr("p", 2.0 if ctx.version == 1 else 2))

    def run(x):
        xa = np.abs(x.astype(compute_dtype(x.dtype), copy=False))
        y = (xa**p).sum(axis=_spatial_axes(x), keepdims=True) ** (1.0 / p)
        return y.astype(x.dtype, copy=False)

    return run


@register("MaxUnpool", 9, 11, 22)
def max_unpool(ctx: KernelContext):
    """MaxUnpool: scatter X into zeros at the flat Indices MaxPool produced, in the shape that
    inverts the pool's size formula."""
    kernel = _pool_kernel(ctx)
    strides = tuple(ctx.attr("strides", None) or (1,) * len(kernel))
    pads = tuple(ctx.attr("pads", None) or (0,) * (2 * len(kernel)))
    n = len(kernel)

    def run(x, indices, output_shape=None):
        inferred = x.shape[:2] + tuple(
            (x.shape[2 + i] - 1) * strides[i] - pads[i] - pads[n + i] + kernel[i] for i in range(n)
        )
        y = np.zeros(math.prod(inferred), x.dtype)
        y[indices.reshape(-1)] = x.reshape(-1)
        y = y.reshape(inferred)
        if output_shape is None:
            return y
        shape = tuple(int(s) for s in output_shape)
        if shape == inferred:
            return y
        # As the reference and the conformance data do: the unpooled block is placed at the
        # origin of the requested shape (indices stay relative to the inferred shape).
        out = np.zeros(shape, x.dtype)
        common = tuple(slice(0, min(a, b)) for a, b in zip(shape, inferred))
        out[common] = y[common]
        return out

    return run
