"""Reductions, softmax family, cumulative ops, TopK and normalizations.

Reductions keep the input dtype (numpy would promote small ints to int64 and ints to float64
for means), so every reducer passes ``dtype=`` or casts back. Reductions over an empty set
yield the operation's identity: numpy already does this for sums and products; max and min
get an ``initial`` of the dtype's lowest or highest value.

The normalizations fold everything that depends only on constant inputs (scale, bias, running
statistics) into arrays already shaped for broadcasting, at load time.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_FLOATS = (np.float16, np.float32, np.float64)


def _as_array(value, dtype) -> np.ndarray:
    """numpy returns scalars for full reductions: the engine wants ndarrays of the ONNX dtype."""
    if isinstance(value, np.ndarray) and value.dtype == dtype:
        return value
    return np.asarray(value, dtype=dtype)


@functools.cache
def _lowest(dtype: np.dtype):
    if dtype == np.bool_:
        return False
    if np.issubdtype(dtype, np.floating):
        return -np.inf
    return np.iinfo(dtype).min


@functools.cache
def _highest(dtype: np.dtype):
    if dtype == np.bool_:
        return True
    if np.issubdtype(dtype, np.floating):
        return np.inf
    return np.iinfo(dtype).max


# --- reductions ---------------------------------------------------------------------------


def _r_sum(x, axes, keep):
    return np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _r_mean(x, axes, keep):
    if x.dtype.kind == "f":
        return np.mean(x, axis=axes, keepdims=keep, dtype=x.dtype)
    return np.mean(x, axis=axes, keepdims=keep).astype(x.dtype)


def _r_max(x, axes, keep):
    return np.max(x, axis=axes, keepdims=keep, initial=_lowest(x.dtype))


def _r_min(x, axes, keep):
    return np.min(x, axis=axes, keepdims=keep, initial=_highest(x.dtype))


def _r_prod(x, axes, keep):
    return np.prod(x, axis=axes, keepdims=keep, dtype=x.dtype)


def _r_l1(x, axes, keep):
    return np.sum(np.abs(x), axis=axes, keepdims=keep, dtype=x.dtype)


def _r_l2(x, axes, keep):
    return np.sqrt(np.sum(x * x, axis=axes, keepdims=keep, dtype=x.dtype))


def _r_sum_square(x, axes, keep):
    return np.sum(x * x, axis=axes, keepdims=keep, dtype=x.dtype)


def _r_log_sum(x, axes, keep):
    with np.errstate(divide="ignore"):
        return np.log(np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype))


def _r_log_sum_exp(x, axes, keep):
    """Shifted by the maximum so large inputs do not overflow exp."""
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    top = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    top[~np.isfinite(top)] = 0
    total = np.sum(np.exp(x - top), axis=axes, keepdims=True)
    with np.errstate(divide="ignore"):
        out = np.log(total)
    out += top
    if not keep:
        out = np.squeeze(out, axis=axes)
    return out


def _resolve_axes(axes, noop: bool):
    """ONNX axes (array, list or None) to a numpy ``axis``: None reduces all, () none."""
    if axes is None:
        return () if noop else None
    axes = tuple(int(a) for a in np.asarray(axes).reshape(-1))
    if not axes:
        return () if noop else None
    return axes


def _reduce_builder(reducer, axes_input_since: int):
    """A builder for a reduce op whose ``axes`` moved from attribute to input at a version."""

    def build(ctx: KernelContext):
        dtype = ctx.input_dtype(0)
        if dtype is not None and dtype.kind not in "fiub":
            raise ctx.unsupported(f"dtype {dtype}")
        keep = bool(ctx.attr("keepdims", 1))
        noop = bool(ctx.attr("noop_with_empty_axes", 0))
        if ctx.version < axes_input_since:
            axes = _resolve_axes(ctx.attr("axes", None), False)
        elif not ctx.has_input(1):
            axes = _resolve_axes(None, noop)
        elif ctx.constant(1) is not None:
            axes = _resolve_axes(ctx.constant(1), noop)
        else:

            def run_dynamic(x, axes_in):
                axis = _resolve_axes(axes_in, noop)
                if axis is None and x.ndim == 0:
                    axis = ()
                return _as_array(reducer(x, axis, keep), x.dtype)

            return run_dynamic

        rows = _trailing_rows_kernel(ctx, reducer, axes, keep)
        if rows is not None:
            return rows

        def run(x, *_):
            axis = () if axes is None and x.ndim == 0 else axes
            return _as_array(reducer(x, axis, keep), x.dtype)

        return run

    return build


def _trailing_rows_kernel(ctx: KernelContext, reducer, axes, keep: bool):
    """Sum and mean over the trailing axes of a float tensor of known rank: a 2-D view times a
    vector of ones goes through BLAS, several times faster than numpy's per-row reductions."""
    dtype, shape = ctx.input_dtype(0), ctx.input_shape(0)
    if reducer not in (_r_sum, _r_mean) or dtype not in _SAFE_SPREAD or not shape:
        return None
    rank = len(shape)
    reduced = sorted({a % rank for a in axes}) if axes is not None else list(range(rank))
    if not reduced or reduced != list(range(rank - len(reduced), rank)):
        return None
    split = rank - len(reduced)
    mean = reducer is _r_mean

    def run(x, *_):
        lead = x.shape[:split]
        n = math.prod(x.shape[split:])
        if n == 0 or x.ndim != rank:
            return _as_array(reducer(x, axes, keep), x.dtype)
        out = x.reshape(math.prod(lead), n) @ _ones(n, x.dtype)
        if mean:
            out *= 1.0 / n
        return out.reshape(lead + (1,) * (rank - split) if keep else lead)

    return run


register("ReduceSum", 1, 11, 13)(_reduce_builder(_r_sum, 13))
register("ReduceMean", 1, 11, 13, 18)(_reduce_builder(_r_mean, 18))
register("ReduceMax", 1, 11, 12, 13, 18, 20)(_reduce_builder(_r_max, 18))
register("ReduceMin", 1, 11, 12, 13, 18, 20)(_reduce_builder(_r_min, 18))
register("ReduceProd", 1, 11, 13, 18)(_reduce_builder(_r_prod, 18))
register("ReduceL1", 1, 11, 13, 18)(_reduce_builder(_r_l1, 18))
register("ReduceL2", 1, 11, 13, 18)(_reduce_builder(_r_l2, 18))
register("ReduceSumSquare", 1, 11, 13, 18)(_reduce_builder(_r_sum_square, 18))
register("ReduceLogSum", 1, 11, 13, 18, 28)(_reduce_builder(_r_log_sum, 18))
register("ReduceLogSumExp", 1, 11, 13, 18, 28)(_reduce_builder(_r_log_sum_exp, 18))


# --- ArgMax / ArgMin ----------------------------------------------------------------------


def _arg_builder(numpy_arg):
    def build(ctx: KernelContext):
        axis = ctx.attr("axis", 0)
        keep = bool(ctx.attr("keepdims", 1))
        last = bool(ctx.attr("select_last_index", 0))

        def run(x):
            if last:
                flipped = np.flip(x, axis)
                idx = numpy_arg(flipped, axis=axis, keepdims=keep)
                idx = (x.shape[axis] - 1) - idx
            else:
                idx = numpy_arg(x, axis=axis, keepdims=keep)
            return _as_array(idx, np.int64)

        return run

    return build


register("ArgMax", 1, 11, 12, 13)(_arg_builder(np.argmax))
register("ArgMin", 1, 11, 12, 13)(_arg_builder(np.argmin))


# --- softmax family -----------------------------------------------------------------------
#
# The kernels work on a 2-D view with the softmax axis last (rows x n), where numpy is at its
# slowest: per-row reductions over a short contiguous axis. Row sums go through BLAS (a
# matrix-vector product with ones). The shift that keeps exp from overflowing is the global
# maximum when the whole tensor spans a narrow enough range (no row's maximum can then
# underflow), else the exact row maxima.

_SAFE_SPREAD = {np.dtype(np.float32): 60.0, np.dtype(np.float64): 600.0}
_ONES: dict[tuple[int, np.dtype], np.ndarray] = {}


def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    ones = _ONES.get((n, dtype))
    if ones is None:
        ones = _ONES[(n, dtype)] = np.ones(n, dtype=dtype)
    return ones


def _row_sums(a: np.ndarray) -> np.ndarray:
    """Sums of the rows of a 2-D array, as a column."""
    if a.dtype in _SAFE_SPREAD:
        return (a @ _ones(a.shape[1], a.dtype))[:, None]
    return np.sum(a, axis=1, keepdims=True)


def _shifted_rows(x2: np.ndarray) -> np.ndarray:
    """A new array ``x2 - shift`` with, per row, a shift that makes exp safe."""
    spread = _SAFE_SPREAD.get(x2.dtype)
    if spread is not None:
        hi, lo = x2.max(), x2.min()
        if hi - lo <= spread:
            return np.subtract(x2, hi)
    return np.subtract(x2, np.maximum.reduce(x2.T, axis=0)[:, None])


def _softmax_rows(x2):
    e = _shifted_rows(x2)
    np.exp(e, out=e)
    e /= _row_sums(e)
    return e


def softmax_last_axis_inplace(e: np.ndarray) -> np.ndarray:
    """Softmax along the last axis of ``e`` (float32/float64, C-contiguous, a fresh buffer the
    caller owns), computed in place and returned.

    When every value lies within +-spread/2 (+-30 for float32) exp cannot overflow nor a whole
    row underflow, so no shift is subtracted at all: exp(x_i) / sum exp(x) equals the shifted
    form to rounding. Otherwise the usual shift (global or per-row maximum) applies.
    """
    rows = e.reshape(-1, e.shape[-1])
    spread = _SAFE_SPREAD[e.dtype]
    hi, lo = rows.max(), rows.min()
    if not (-spread / 2 <= lo and hi <= spread / 2):
        if hi - lo <= spread:
            np.subtract(rows, hi, out=rows)
        else:
            np.subtract(rows, np.maximum.reduce(rows.T, axis=0)[:, None], out=rows)
    np.exp(rows, out=rows)
    sums = rows @ _ones(rows.shape[1], rows.dtype)
    np.reciprocal(sums, out=sums)
    rows *= sums[:, None]
    return e


def layer_norm_rows_inplace(
    y: np.ndarray, scale: np.ndarray | None, bias: np.ndarray | None, eps: float
) -> np.ndarray:
    """LayerNormalization over the rows of a 2-D float32/float64 C-contiguous array that the
    caller owns, in place: mean through BLAS, variance of the centred rows through einsum."""
    n = y.shape[1]
    mean = y @ _ones(n, y.dtype)
    mean *= y.dtype.type(1 / n)
    y -= mean[:, None]
    inv = np.einsum("ij,ij->i", y, y)
    inv *= y.dtype.type(1 / n)
    inv += y.dtype.type(eps)
    np.sqrt(inv, out=inv)
    np.reciprocal(inv, out=inv)
    y *= inv[:, None]
    if scale is not None:
        y *= scale
    if bias is not None:
        y += bias
    return y


def _log_softmax_rows(x2):
    e = _shifted_rows(x2)
    with np.errstate(divide="ignore"):
        e -= np.log(_row_sums(np.exp(e)))
    return e


def _hardmax_rows(x2):
    out = np.zeros(x2.shape, dtype=x2.dtype)
    out[np.arange(x2.shape[0]), np.argmax(x2, axis=1)] = 1
    return out


def _softmax_axis(x, axis):
    e = x - np.max(x, axis=axis, keepdims=True)
    np.exp(e, out=e)
    e /= np.sum(e, axis=axis, keepdims=True)
    return e


def _log_softmax_axis(x, axis):
    e = x - np.max(x, axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        e -= np.log(np.sum(np.exp(e), axis=axis, keepdims=True))
    return e


def _hardmax_axis(x, axis):
    out = np.zeros(x.shape, dtype=x.dtype)
    np.put_along_axis(out, np.argmax(x, axis=axis, keepdims=True), 1, axis=axis)
    return out


def _softmax_family(rows_fn, axis_fn):
    """Since version 13 the op works along one axis (default -1); before, it flattens the
    input into a 2-D matrix at ``axis`` (default 1) and works along the second dimension."""

    def build(ctx: KernelContext):
        dtype = ctx.input_dtype(0)
        if dtype is not None and dtype.type not in _FLOATS:
            raise ctx.unsupported(f"dtype {dtype}")
        coerce = ctx.version < 13
        axis = ctx.attr("axis", 1 if coerce else -1)

        def run(x):
            a = axis + x.ndim if axis < 0 else axis
            if x.size == 0:
                return x.copy()
            if coerce or a == x.ndim - 1:
                return rows_fn(x.reshape(math.prod(x.shape[:a]), -1)).reshape(x.shape)
            return axis_fn(x, a)

        return run

    return build


register("Softmax", 1, 11, 13)(_softmax_family(_softmax_rows, _softmax_axis))
register("LogSoftmax", 1, 11, 13)(_softmax_family(_log_softmax_rows, _log_softmax_axis))
register("Hardmax", 1, 11, 13)(_softmax_family(_hardmax_rows, _hardmax_axis))


# --- cumulative ops -----------------------------------------------------------------------


def _cumulative_builder(numpy_cum, ufunc):
    def build(ctx: KernelContext):
        exclusive = bool(ctx.attr("exclusive", 0))
        reverse = bool(ctx.attr("reverse", 0))
        identity = ufunc.identity

        def run(x, axis):
            ax = int(np.asarray(axis).reshape(-1)[0])
            ax = ax + x.ndim if ax < 0 else ax
            src = np.flip(x, ax) if reverse else x
            out = numpy_cum(src, axis=ax, dtype=x.dtype)
            if exclusive:
                lead = (slice(None),) * ax
                shifted = np.empty_like(out)
                shifted[(*lead, slice(0, 1))] = identity
                shifted[(*lead, slice(1, None))] = out[(*lead, slice(0, -1))]
                out = shifted
            return np.flip(out, ax) if reverse else out

        return run

    return build


register("CumSum", 11, 14)(_cumulative_builder(np.cumsum, np.add))
register("CumProd", 26)(_cumulative_builder(np.cumprod, np.multiply))


# --- TopK ---------------------------------------------------------------------------------


@register("TopK", 1, 10, 11, 24, multi_output=True)
def topk(ctx: KernelContext):
    """Ties keep the lower index first. For the largest elements a stable ascending sort of the
    reversed axis, read backwards, gives descending values with ascending indices on ties."""
    axis = ctx.attr("axis", -1)
    largest = bool(ctx.attr("largest", 1))
    fixed_k = ctx.attr("k") if ctx.version < 10 else None

    def run(x, k=None):
        kk = fixed_k if fixed_k is not None else int(np.asarray(k).reshape(-1)[0])
        ax = axis + x.ndim if axis < 0 else axis
        n = x.shape[ax]
        if largest:
            order = np.argsort(np.flip(x, ax), axis=ax, kind="stable")
            order = np.flip(order, ax)
            sel = [slice(None)] * x.ndim
            sel[ax] = slice(0, kk)
            idx = (n - 1) - order[tuple(sel)]
        else:
            order = np.argsort(x, axis=ax, kind="stable")
            sel = [slice(None)] * x.ndim
            sel[ax] = slice(0, kk)
            idx = order[tuple(sel)]
        idx = idx.astype(np.int64, copy=False)
        return np.take_along_axis(x, idx, axis=ax), idx

    return run


# --- normalizations -----------------------------------------------------------------------


def _channel_shape(c: int, ndim: int) -> tuple[int, ...]:
    return (c,) + (1,) * (ndim - 2)


_FULL_FOLD_LIMIT = 1 << 18


def _fold_channels(a: np.ndarray, b: np.ndarray, item_shape: tuple, dtype) -> tuple:
    """Per-channel ``a`` and ``b`` shaped to broadcast against one item ``x[n]`` of shape
    (C, *spatial). numpy is slow at broadcasting a per-channel scalar over many short rows, so
    when an item is small (at most 1 MiB of float32) they are materialized at its full shape."""
    cs = _channel_shape(a.shape[0], len(item_shape) + 1)
    fa, fb = a.astype(dtype).reshape(cs), b.astype(dtype).reshape(cs)
    if math.prod(item_shape[1:]) > 1 and math.prod(item_shape) <= _FULL_FOLD_LIMIT:
        fa = np.ascontiguousarray(np.broadcast_to(fa, item_shape))
        fb = np.ascontiguousarray(np.broadcast_to(fb, item_shape))
    return fa, fb


@register("BatchNormalization", 1, 6, 7, 9, 14, 15, multi_output=True)
def batch_normalization(ctx: KernelContext):
    """Inference: ``y = x * a + b`` with ``a = scale / sqrt(var + eps)``, ``b = B - mean * a``
    folded once at load when the parameters are constants. ``training_mode`` (14+) also
    returns the updated running statistics; the older training outputs are not implemented."""
    eps = ctx.attr("epsilon", 1e-5)
    momentum = ctx.attr("momentum", 0.9)
    training = ctx.version >= 14 and bool(ctx.attr("training_mode", 0))
    if ctx.version < 14 and ctx.num_outputs > 1:
        raise ctx.unsupported("training outputs of BatchNormalization before version 14")
    if ctx.version < 9 and not ctx.attr("spatial", 1):
        raise ctx.unsupported("spatial=0")
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")

    if training:

        def run_training(x, scale, bias, mean, var):
            axes = (0, *tuple(range(2, x.ndim)))
            cs = _channel_shape(x.shape[1], x.ndim)
            cur_mean = x.mean(axis=axes, dtype=np.float64 if x.dtype == np.float16 else None)
            cur_var = x.var(axis=axes, dtype=np.float64 if x.dtype == np.float16 else None)
            a = scale / np.sqrt(cur_var + eps)
            y = (x - cur_mean.reshape(cs).astype(x.dtype)) * a.reshape(cs).astype(x.dtype)
            y += bias.reshape(cs).astype(x.dtype)
            run_mean = (mean * momentum + cur_mean * (1 - momentum)).astype(mean.dtype)
            run_var = (var * momentum + cur_var * (1 - momentum)).astype(var.dtype)
            return y.astype(x.dtype, copy=False), run_mean, run_var

        return run_training

    consts = [ctx.constant(i) for i in range(1, 5)]
    if all(c is not None for c in consts):
        scale, bias, mean, var = (c.astype(np.float64) for c in consts)
        a = scale / np.sqrt(var + eps)
        b = bias - mean * a
        folded: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        shape = ctx.input_shape(0)
        if dtype is not None and shape and all(isinstance(d, int) for d in shape):
            folded[(tuple(shape[1:]), dtype)] = _fold_channels(a, b, tuple(shape[1:]), dtype)

        def run(x, *_):
            key = (x.shape[1:], x.dtype)
            ab = folded.get(key)
            if ab is None:
                if len(folded) >= 8:
                    folded.clear()
                ab = folded[key] = _fold_channels(a, b, x.shape[1:], x.dtype)
            y = np.multiply(x, ab[0])
            y += ab[1]
            return (y,)

        return run

    def run_dynamic(x, scale, bias, mean, var):
        cs = _channel_shape(x.shape[1], x.ndim)
        a = scale / np.sqrt(var + eps)
        y = (x - mean.reshape(cs)) * a.reshape(cs) + bias.reshape(cs)
        return (y.astype(x.dtype, copy=False),)

    return run_dynamic


def _standardize(x, axes, eps):
    """(x - mean) / sqrt(var + eps) over ``axes``; also returns mean and 1/std (kept dims)."""
    mean = np.mean(x, axis=axes, keepdims=True)
    d = x - mean
    var = np.mean(np.square(d), axis=axes, keepdims=True)
    var += eps
    inv = np.sqrt(var, out=var)
    np.reciprocal(inv, out=inv)
    d *= inv
    return d, mean, inv


@register("InstanceNormalization", 1, 6, 22)
def instance_normalization(ctx: KernelContext):
    eps = ctx.attr("epsilon", 1e-5)
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")
    s_const, b_const = ctx.constant(1), ctx.constant(2)

    def run(x, scale, bias):
        cs = _channel_shape(x.shape[1], x.ndim)
        work = x.astype(np.float32) if x.dtype == np.float16 else x
        y, _, _ = _standardize(work, tuple(range(2, x.ndim)), eps)
        y *= (s_const if s_const is not None else scale).reshape(cs)
        y += (b_const if b_const is not None else bias).reshape(cs)
        return y.astype(x.dtype, copy=False)

    return run


def _stash_dtype(ctx: KernelContext):
    """The dtype in which the statistics are computed: float32 for stash_type 1 (at least)."""
    stash = ctx.attr("stash_type", 1)
    if stash != 1:
        raise ctx.unsupported(f"stash_type={stash}")
    return np.float32


@register("LayerNormalization", 17, multi_output=True)
def layer_normalization(ctx: KernelContext):
    """Statistics over axes ``[axis, rank)`` on a 2-D view (rows x normalized size), in float32
    (float64 for double inputs). The mean's row sums go through BLAS like the softmax's, the
    variance's through einsum (no squared temporary); one output-sized allocation in all."""
    axis = ctx.attr("axis", -1)
    eps = ctx.attr("epsilon", 1e-5)
    _stash_dtype(ctx)
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")
    scale_c, bias_c = ctx.constant(1), ctx.constant(2)
    has_bias = ctx.has_input(2)
    stats = ctx.num_outputs > 1
    stat_dtypes = [ctx.output_dtype(i) or np.dtype(np.float32) for i in (1, 2)]
    if dtype is not None:
        work = np.float64 if dtype == np.float64 else np.float32
        if scale_c is not None:
            scale_c = scale_c.astype(work)
        if bias_c is not None:
            bias_c = bias_c.astype(work)

    def run(x, scale, bias=None):
        a = axis + x.ndim if axis < 0 else axis
        x2 = x.reshape(math.prod(x.shape[:a]), -1)
        if x2.dtype == np.float16:
            x2 = x2.astype(np.float32)
        norm = 1.0 / x2.shape[1] if x2.shape[1] else np.nan
        mean = _row_sums(x2)
        mean *= norm
        d = x2 - mean
        inv = np.einsum("ij,ij->i", d, d)[:, None]
        inv *= norm
        inv += eps
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        d *= inv
        y = d.reshape(x.shape)
        y *= scale_c if scale_c is not None else scale
        if has_bias:
            y += bias_c if bias_c is not None else bias
        y = y.astype(x.dtype, copy=False)
        if not stats:
            return (y,)
        kept = x.shape[:a] + (1,) * (x.ndim - a)
        return (
            y,
            mean.reshape(kept).astype(stat_dtypes[0], copy=False),
            inv.reshape(kept).astype(stat_dtypes[1], copy=False),
        )

    return run


@register("GroupNormalization", 18, 21)
def group_normalization(ctx: KernelContext):
    """Statistics per (instance, group); scale and bias are per channel since version 21 and
    per group in version 18 (expanded to channels at load when constant)."""
    groups = ctx.attr("num_groups")
    eps = ctx.attr("epsilon", 1e-5)
    if ctx.version >= 21:
        _stash_dtype(ctx)
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")
    per_group = ctx.version < 21

    def run(x, scale, bias):
        n, c = x.shape[0], x.shape[1]
        work = x.astype(np.float32) if x.dtype == np.float16 else x
        g = work.reshape(n, groups, -1)
        y, _, _ = _standardize(g, (2,), eps)
        y = y.reshape(x.shape)
        if per_group:
            scale = np.repeat(scale, c // groups)
            bias = np.repeat(bias, c // groups)
        cs = _channel_shape(c, x.ndim)
        y *= scale.reshape(cs)
        y += bias.reshape(cs)
        return y.astype(x.dtype, copy=False)

    return run


@register("LpNormalization", 1, 22)
def lp_normalization(ctx: KernelContext):
    """Where the norm is zero the output is zero (defined since version 22)."""
    axis = ctx.attr("axis", -1)
    p = ctx.attr("p", 2)
    if p not in (1, 2):
        raise ctx.unsupported(f"p={p}")
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")

    def run(x):
        if p == 1:
            norm = np.sum(np.abs(x), axis=axis, keepdims=True)
        else:
            norm = np.sqrt(np.sum(x * x, axis=axis, keepdims=True))
        zero = norm == 0
        norm[zero] = 1
        y = x / norm
        if zero.any():
            y = np.where(zero, np.zeros((), x.dtype), y)
        return y.astype(x.dtype, copy=False)

    return run


@register("MeanVarianceNormalization", 9, 13)
def mean_variance_normalization(ctx: KernelContext):
    """``(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9)``, as the ONNX function body computes it."""
    axes = tuple(ctx.attr("axes", [0, 2, 3]))
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")

    def run(x):
        mean = np.mean(x, axis=axes, keepdims=True)
        var = np.mean(x * x, axis=axes, keepdims=True) - mean * mean
        std = np.sqrt(var)
        std += x.dtype.type(1e-9)
        return ((x - mean) / std).astype(x.dtype, copy=False)

    return run


@register("LRN", 1, 13)
def lrn(ctx: KernelContext):
    """The window sum of squares over channels comes from a cumulative sum along the channel
    axis of the zero-padded squares."""
    size = ctx.attr("size")
    alpha = ctx.attr("alpha", 1e-4)
    beta = ctx.attr("beta", 0.75)
    bias = ctx.attr("bias", 1.0)
    before = (size - 1) // 2
    after = size - 1 - before
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")

    def run(x):
        c = x.shape[1]
        sq = np.square(x.astype(np.float64) if x.dtype == np.float16 else x)
        pad = [(0, 0)] * x.ndim
        pad[1] = (before + 1, after)
        cum = np.cumsum(np.pad(sq, pad), axis=1)
        window = cum[:, size : size + c] - cum[:, 0:c]
        denom = (bias + (alpha / size) * window) ** beta
        return (x / denom).astype(x.dtype, copy=False)

    return run


@register("RMSNormalization", 23)
def rms_normalization(ctx: KernelContext):
    """``x / sqrt(mean(x^2) + eps) * scale`` over axes ``[axis, rank)``; Y has scale's dtype."""
    axis = ctx.attr("axis", -1)
    eps = ctx.attr("epsilon", 1e-5)
    _stash_dtype(ctx)
    for i in (0, 1):
        dtype = ctx.input_dtype(i)
        if dtype is not None and dtype.type not in _FLOATS:
            raise ctx.unsupported(f"dtype {dtype}")
    scale_c = ctx.constant(1)

    def run(x, scale):
        a = axis + x.ndim if axis < 0 else axis
        x2 = x.reshape(math.prod(x.shape[:a]), -1)
        if x2.dtype == np.float16:
            x2 = x2.astype(np.float32)
        inv = np.einsum("ij,ij->i", x2, x2)[:, None]
        inv *= 1.0 / x2.shape[1] if x2.shape[1] else np.nan
        inv += eps
        np.sqrt(inv, out=inv)
        np.reciprocal(inv, out=inv)
        y = np.multiply(x2, inv).reshape(x.shape).astype(x.dtype, copy=False)
        s = scale_c if scale_c is not None else scale
        return np.multiply(y, s, dtype=np.result_type(y.dtype, s.dtype)).astype(s.dtype, copy=False)

    return run


# --- Einsum and Det -----------------------------------------------------------------------


@register("Einsum", 12, 28)
def einsum(ctx: KernelContext):
    """With two or more operands numpy can contract pairwise through BLAS (tensordot); with
    static shapes that contraction path is found once here, otherwise numpy plans per call."""
    equation = ctx.attr("equation")
    if isinstance(equation, bytes):
        equation = equation.decode()
    equation = equation.replace(" ", "")
    n = ctx.num_inputs
    for i in range(n):
        dtype = ctx.input_dtype(i)
        if dtype is not None and dtype.kind not in "fiu":
            raise ctx.unsupported(f"dtype {dtype}")
    optimize: bool | list = n >= 2
    shapes = [ctx.input_shape(i) for i in range(n)]
    if n >= 2 and all(
        s is not None and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        dummies = [np.empty(s, dtype=np.float32) for s in shapes]
        optimize = np.einsum_path(equation, *dummies, optimize="optimal")[0]

    def run(*xs):
        out = np.einsum(equation, *xs, optimize=optimize)
        return _as_array(out, xs[0].dtype)

    return run


@register("Det", 11, 22)
def det(ctx: KernelContext):
    """LAPACK has no float16: those are computed in float32."""
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype.type not in _FLOATS:
        raise ctx.unsupported(f"dtype {dtype}")

    def run(x):
        work = x.astype(np.float32) if x.dtype == np.float16 else x
        return _as_array(np.linalg.det(work), x.dtype)

    return run
