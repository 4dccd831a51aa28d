"""Shape and data-movement ops: reshape, slice, gather, scatter, pad, and friends.

Ops whose result ONNX defines as a relabelling of the input's elements (Reshape, Squeeze,
Unsqueeze, Flatten, Transpose, Slice, Split, Expand, Identity) return numpy views instead of
copies. That is safe because no kernel writes into its inputs: scatter-type ops copy ``data``
before writing, and the engine copies read-only views of initializers before handing outputs out.

Every axis list, shape or pad vector that is an initializer is resolved in the builder; when it
arrives at run time it is resolved per call by the same helper.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper

from plugserve.plugins.api import InvalidInput
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

# --------------------------------------------------------------------------- helpers


def _ints(value) -> list[int]:
    """A shape/axes/pads value (array, list or scalar) as a list of Python ints."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _rank(ctx: KernelContext, i: int = 0) -> int | None:
    shape = ctx.input_shape(i)
    return None if shape is None else len(shape)


def _norm_axes(axes: list[int], rank: int) -> list[int]:
    out = [a + rank if a < 0 else a for a in axes]
    if any(a < 0 or a >= rank for a in out):
        raise ValueError(f"axes {axes} out of range for rank {rank}")
    return out


def _axes_input(ctx: KernelContext, i: int, attr: str, since: int) -> tuple[bool, list | None]:
    """Axes given as an attribute (before ``since``) or as input ``i``.

    Returns ``(known, axes)``: ``known`` is False when the axes are a run-time input.
    """
    if ctx.version < since:
        axes = ctx.attr(attr, None)
        return True, None if axes is None else list(axes)
    if not ctx.has_input(i):
        return True, None
    value = ctx.constant(i)
    if value is None:
        return False, None
    return True, _ints(value)


def _np_dtype(onnx_type: int) -> np.dtype:
    if onnx_type == 8:  # STRING
        return np.dtype(object)
    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))


def _frozen(array: np.ndarray) -> np.ndarray:
    """A read-only array, safe to return from every call of a kernel."""
    array = np.asarray(array)
    array.setflags(write=False)
    return array


# --------------------------------------------------------------------------- Identity, Constant


@register("Identity", 1, 13, 14, 16, 19, 21, 23, 24, 25)
def identity(ctx: KernelContext):
    """Pass-through for tensors, sequences (lists) and optionals (None) alike."""
    return lambda x: x


@register("Constant", 1, 9, 11, 12, 13, 19, 21, 23, 24, 25)
def constant(ctx: KernelContext):
    value = _frozen(constant_value(ctx))
    return lambda: value


def constant_value(ctx: KernelContext) -> np.ndarray:
    """The value a Constant node holds, from whichever ``value*`` attribute it has."""
    for name, dtype in (
        ("value", None),
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
        ("value_string", object),
        ("value_strings", object),
    ):
        if ctx.has_attr(name):
            value = ctx.attr(name)
            return np.asarray(value) if dtype is None else np.array(value, dtype=dtype)
    if ctx.has_attr("sparse_value"):
        from onnx import numpy_helper

        sparse = ctx.node.attrs["sparse_value"].sparse_tensor
        values = numpy_helper.to_array(sparse.values)
        dense = np.zeros(tuple(sparse.dims), dtype=values.dtype)
        indices = numpy_helper.to_array(sparse.indices)
        if indices.ndim == 1:
            dense.reshape(-1)[indices] = values
        else:
            dense[tuple(indices.T)] = values
        return dense
    raise ctx.unsupported("Constant without a value attribute")


# --------------------------------------------------------------------------- reshaping (views)


@register("Reshape", 1, 5, 13, 14, 19, 21, 23, 24, 25)
def reshape(ctx: KernelContext):
    """A 0 in the target copies the input dim unless ``allowzero``; -1 is left to numpy."""
    allowzero = bool(ctx.attr("allowzero", 0))

    def target(shape: list[int], in_shape: tuple) -> list[int]:
        if allowzero or 0 not in shape:
            return shape
        return [in_shape[i] if d == 0 else d for i, d in enumerate(shape)]

    if ctx.version < 5:
        shape = _ints(ctx.attr("shape"))
    elif ctx.constant(1) is not None:
        shape = _ints(ctx.constant(1))
    else:
        return lambda x, s: x.reshape(target(_ints(s), x.shape))
    if allowzero or 0 not in shape:
        fixed = tuple(shape)
        return lambda x, *_: x.reshape(fixed)
    return lambda x, *_: x.reshape(target(shape, x.shape))


@register("Transpose", 1, 13, 21, 23, 24, 25)
def transpose(ctx: KernelContext):
    perm = ctx.attr("perm", None)
    if perm is None:
        return lambda x: x.transpose()
    perm = tuple(perm)
    return lambda x: x.transpose(perm)


@register("Squeeze", 1, 11, 13, 21, 23, 24, 25)
def squeeze(ctx: KernelContext):
    known, axes = _axes_input(ctx, 1, "axes", 13)
    if not known:
        return lambda x, a=None: x.squeeze(None if a is None else tuple(_ints(a)))
    if axes is None:
        return lambda x, *_: x.squeeze()
    axes = tuple(axes)
    return lambda x, *_: x.squeeze(axes)


@register("Unsqueeze", 1, 11, 13, 21, 23, 24, 25)
def unsqueeze(ctx: KernelContext):
    """Axes index the output, negative ones counted from its end (numpy's expand_dims rule)."""
    known, axes = _axes_input(ctx, 1, "axes", 13)
    if not known:
        return lambda x, a: np.expand_dims(x, tuple(_ints(a)))
    if axes is None:
        raise ctx.unsupported("Unsqueeze needs axes")
    axes = tuple(axes)
    rank = _rank(ctx)
    if rank is not None:
        out_rank = rank + len(axes)
        norm = sorted(a + out_rank if a < 0 else a for a in axes)
        shape = ctx.input_shape(0)
        if all(isinstance(d, int) for d in shape):
            dims = iter(shape)
            fixed = tuple(1 if i in norm else next(dims) for i in range(out_rank))
            return lambda x, *_: x.reshape(fixed)
    return lambda x, *_: np.expand_dims(x, axes)


@register("Flatten", 1, 9, 11, 13, 21, 23, 24, 25)
def flatten(ctx: KernelContext):
    axis = ctx.attr("axis", 1)

    def run(x):
        # shape[:axis] counts a negative axis from the end, which is ONNX's rule too.
        outer = math.prod(x.shape[:axis])
        return x.reshape(outer, math.prod(x.shape[axis:]))

    return run


@register("Expand", 8, 13)
def expand(ctx: KernelContext):
    """Bidirectional broadcast, as a read-only broadcast view."""
    shape = ctx.constant(1)
    if shape is not None:
        target = tuple(_ints(shape))
        return lambda x, _: np.broadcast_to(x, np.broadcast_shapes(x.shape, target))
    return lambda x, s: np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(_ints(s))))


# --------------------------------------------------------------------------- concat, split, slice


@register("Concat", 1, 4, 11, 13)
def concat(ctx: KernelContext):
    axis = ctx.attr("axis", 1 if ctx.version < 4 else None)
    if axis is None:
        raise ctx.unsupported("Concat needs an axis")
    return lambda *xs: np.concatenate(xs, axis=axis)


@register("Split", 1, 2, 11, 13, 18, multi_output=True)
def split(ctx: KernelContext):
    """Split sizes from the attribute (v1-11), the input (v1, v13+), num_outputs (v18) or an even
    split into as many parts as there are outputs. Outputs are views."""
    axis = ctx.attr("axis", 0)
    parts = ctx.num_outputs
    sizes = None
    if ctx.version < 13 and ctx.has_attr("split"):
        sizes = _ints(ctx.attr("split"))
    elif ctx.version in (1, 13, 18) and ctx.has_input(1):
        value = ctx.constant(1)
        if value is None:

            def run_dynamic(x, s):
                return np.split(x, np.cumsum(_ints(s))[:-1], axis=axis)

            return run_dynamic
        sizes = _ints(value)
    elif ctx.version >= 18 and ctx.has_attr("num_outputs"):
        count = ctx.attr("num_outputs")
        if count != parts:
            raise ctx.unsupported(f"num_outputs={count} but the node has {parts} outputs")

        def run_chunks(x, *_):
            chunk = -(-x.shape[axis] // count)
            return np.split(x, [chunk * (i + 1) for i in range(count - 1)], axis=axis)

        return run_chunks
    if sizes is None:
        return lambda x, *_: np.split(x, parts, axis=axis)
    if len(sizes) != parts:
        raise ctx.unsupported(f"{len(sizes)} split sizes for {parts} outputs")
    cuts = [int(c) for c in np.cumsum(sizes)[:-1]]
    total = sum(sizes)

    def run(x, *_):
        if x.shape[axis] != total:
            raise ValueError(f"split sizes {sizes} do not add up to dim {x.shape[axis]}")
        return np.split(x, cuts, axis=axis)

    return run


def _slice_key(starts, ends, axes, steps, rank: int | None) -> tuple:
    """The basic-indexing key for Slice. Python's slice clamping is ONNX's: out-of-range
    starts/ends clamp to the dim (or to "before the first element" for negative steps)."""
    starts, ends = _ints(starts), _ints(ends)
    axes = list(range(len(starts))) if axes is None else _ints(axes)
    steps = [1] * len(starts) if steps is None else _ints(steps)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError("starts, ends, axes and steps differ in length")
    if any(a < 0 for a in axes):
        if rank is None:
            raise ValueError("negative axes need the input rank")
        axes = _norm_axes(axes, rank)
    if len(set(axes)) != len(axes):
        raise ValueError(f"repeated axes {axes}")
    if 0 in steps:
        raise ValueError("slice step 0")
    key = [slice(None)] * (max(axes) + 1 if axes else 0)
    for a, s, e, st in zip(axes, starts, ends, steps):
        key[a] = slice(s, e, st)
    return tuple(key)


@register("Slice", 1, 10, 11, 13)
def slice_(ctx: KernelContext):
    rank = _rank(ctx)
    if ctx.version < 10:
        key = _slice_key(ctx.attr("starts"), ctx.attr("ends"), ctx.attr("axes", None), None, rank)
        return lambda x: x[key]
    known = [ctx.constant(i) for i in range(1, 5)]
    present = [ctx.has_input(i) for i in range(1, 5)]
    if all(v is not None or not p for v, p in zip(known, present)) and (
        rank is not None or known[2] is None or min(_ints(known[2]), default=0) >= 0
    ):
        try:
            key = _slice_key(*known, rank)
        except ValueError as exc:
            raise ctx.unsupported(str(exc)) from None
        return lambda x, *_: x[key]

    def run(x, starts, ends, axes=None, steps=None):
        return x[_slice_key(starts, ends, axes, steps, x.ndim)]

    return run


# --------------------------------------------------------------------------- gather


@register("Gather", 1, 11, 13)
def gather(ctx: KernelContext):
    axis = ctx.attr("axis", 0)
    return lambda x, idx: np.asarray(np.take(x, idx, axis=axis))


@register("GatherElements", 11, 13)
def gather_elements(ctx: KernelContext):
    axis = ctx.attr("axis", 0)
    return lambda x, idx: np.take_along_axis(x, idx, axis=axis)


@register("GatherND", 11, 12, 13)
def gather_nd(ctx: KernelContext):
    """The leading ``batch_dims`` dims are flattened into one and indexed by an arange."""
    batch_dims = ctx.attr("batch_dims", 0)
    if batch_dims == 0:
        return lambda x, idx: np.asarray(x[tuple(np.moveaxis(idx, -1, 0))])

    def run(x, idx):
        batch = math.prod(x.shape[:batch_dims])
        depth = idx.shape[-1]
        rows = math.prod(idx.shape[batch_dims:-1])
        data = x.reshape((batch, *x.shape[batch_dims:]))
        flat = idx.reshape(batch, rows, depth)
        key = (np.arange(batch)[:, None], *(flat[..., j] for j in range(depth)))
        return data[key].reshape(idx.shape[:-1] + x.shape[batch_dims + depth :])

    return run


# --------------------------------------------------------------------------- scatter

_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_reduction(ctx: KernelContext):
    """None for plain assignment, else the ufunc whose ``.at`` accumulates duplicates."""
    reduction = ctx.attr("reduction", "none")
    if reduction == "none":
        return None
    allowed = ("add", "mul") if ctx.version < 18 else ("add", "mul", "max", "min")
    if reduction not in allowed:
        raise ctx.unsupported(f"reduction {reduction!r}")
    return _SCATTER_UFUNCS[reduction]


def _along_axis_key(idx: np.ndarray, axis: int) -> tuple:
    """Fancy-index key addressing ``out[..., idx[i,j,k], ...]`` at every position of ``idx``."""
    key = []
    for d, n in enumerate(idx.shape):
        if d == axis:
            key.append(idx)
        else:
            shape = [1] * idx.ndim
            shape[d] = n
            key.append(np.arange(n).reshape(shape))
    return tuple(key)


@register("ScatterElements", 11, 13, 16, 18)
@register("Scatter", 9, 11)
def scatter_elements(ctx: KernelContext):
    axis = ctx.attr("axis", 0)
    ufunc = _scatter_reduction(ctx) if ctx.op_type == "ScatterElements" else None

    def run(x, idx, updates):
        out = x.copy()
        key = _along_axis_key(idx, axis + x.ndim if axis < 0 else axis)
        if ufunc is None:
            out[key] = updates
        else:
            ufunc.at(out, key, updates)
        return out

    return run


@register("ScatterND", 11, 13, 16, 18)
def scatter_nd(ctx: KernelContext):
    ufunc = _scatter_reduction(ctx)

    def run(x, idx, updates):
        out = x.copy()
        key = tuple(np.moveaxis(idx, -1, 0))
        if ufunc is None:
            out[key] = updates
        else:
            ufunc.at(out, key, updates)
        return out

    return run


@register("TensorScatter", 24)
def tensor_scatter(ctx: KernelContext):
    """KV-cache update: ``update``'s rows along ``axis`` are written into a copy of the cache at
    ``write_indices[b] + s`` (modulo the cache length in circular mode)."""
    mode = ctx.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise ctx.unsupported(f"mode {mode!r}")
    axis = ctx.attr("axis", -2)

    def run(cache, update, write_indices=None):
        ax = axis + cache.ndim if axis < 0 else axis
        out = cache.copy()
        batch, length, count = cache.shape[0], cache.shape[ax], update.shape[ax]
        start = np.zeros(batch, np.int64) if write_indices is None else write_indices
        pos = start.reshape(batch, 1).astype(np.int64) + np.arange(count)
        if mode == "circular":
            pos %= length
        elif count and (pos.min() < 0 or pos.max() >= length):
            raise IndexError("write_indices + sequence_length exceed max_sequence_length")
        target = np.moveaxis(out, ax, 1)
        target[np.arange(batch)[:, None], pos] = np.moveaxis(update, ax, 1)
        return out

    return run


# --------------------------------------------------------------------------- tile, pad, crop


@register("Tile", 1, 6, 13)
def tile(ctx: KernelContext):
    if ctx.version < 6:
        raise ctx.unsupported("Tile-1 (tiles/axis inputs) is not implemented")
    repeats = ctx.constant(1)
    if repeats is not None:
        reps = tuple(_ints(repeats))
        return lambda x, _: _tile(x, reps)
    return lambda x, r: _tile(x, tuple(_ints(r)))


def _tile(x: np.ndarray, reps: tuple[int, ...]) -> np.ndarray:
    """np.tile as one broadcast copy into the new array: numpy's repeat, which np.tile uses,
    keeps the GIL for the whole copy (a 60 MB tile folded at a load held it 380 ms, every
    other thread of the server waiting); an assignment lets go of it."""
    x = np.asarray(x)
    rank = max(x.ndim, len(reps))
    reps = (1,) * (rank - len(reps)) + tuple(reps)
    shape = (1,) * (rank - x.ndim) + x.shape
    out = np.empty(tuple(r * n for r, n in zip(reps, shape)), dtype=x.dtype)
    # out[i * n + j] is x[j]: out seen as (r0, n0, r1, n1, ...) takes x as (1, n0, 1, n1, ...)
    view = out.reshape(tuple(d for r, n in zip(reps, shape) for d in (r, n)))
    view[...] = x.reshape(tuple(d for n in shape for d in (1, n)))
    return out


def _pad_widths(pads, axes, rank: int) -> list[tuple[int, int]]:
    pads = _ints(pads)
    axes = list(range(rank)) if axes is None else _norm_axes(_ints(axes), rank)
    if len(pads) != 2 * len(axes):
        raise ValueError(f"{len(pads)} pads for {len(axes)} axes")
    widths = [(0, 0)] * rank
    for i, a in enumerate(axes):
        widths[a] = (pads[i], pads[i + len(axes)])
    return widths


def _pad(x: np.ndarray, widths, mode: str, value) -> np.ndarray:
    """Negative pads crop first; then constant pads fill a new array, other modes use np.pad."""
    if any(b < 0 or e < 0 for b, e in widths):
        x = x[tuple(slice(max(-b, 0), n - max(-e, 0)) for n, (b, e) in zip(x.shape, widths))]
        widths = [(max(b, 0), max(e, 0)) for b, e in widths]
    if mode != "constant":
        return np.pad(x, widths, mode=mode)
    shape = tuple(n + b + e for n, (b, e) in zip(x.shape, widths))
    out = np.full(shape, value, dtype=x.dtype)
    out[tuple(slice(b, b + n) for n, (b, _) in zip(x.shape, widths))] = x
    return out


@register("Pad", 1, 2, 11, 13, 18, 19, 21, 23, 24, 25)
def pad(ctx: KernelContext):
    mode = ctx.attr("mode", "constant")
    modes = ("constant", "reflect", "edge") + (("wrap",) if ctx.version >= 19 else ())
    if mode not in modes:
        raise ctx.unsupported(f"mode {mode!r}")
    np_mode = mode  # ONNX's reflect/edge/wrap are numpy's modes of the same names
    rank = _rank(ctx)
    in_dtype = ctx.input_dtype(0)
    default_fill = "" if in_dtype is not None and in_dtype.kind == "O" else 0

    if ctx.version < 11:
        pads = ctx.attr("paddings" if ctx.version == 1 else "pads")
        fill = ctx.attr("value", 0.0)
        if rank is not None:
            widths = _pad_widths(pads, None, rank)
            return lambda x: _pad(x, widths, np_mode, fill)
        return lambda x: _pad(x, _pad_widths(pads, None, x.ndim), np_mode, fill)

    def fill_of(value, x):
        if value is None or value.size == 0:
            return "" if x.dtype.kind == "O" else 0
        return value.reshape(-1)[0]

    pads_c, axes_c = ctx.constant(1), ctx.constant(3)
    axes_known = not ctx.has_input(3) or axes_c is not None
    value_known = not ctx.has_input(2) or ctx.constant(2) is not None
    if pads_c is not None and axes_known and value_known and rank is not None:
        widths = _pad_widths(pads_c, axes_c, rank)
        value = ctx.constant(2)
        fill = default_fill if value is None or value.size == 0 else value.reshape(-1)[0]
        return lambda x, *_: _pad(x, widths, np_mode, fill)

    def run(x, pads, value=None, axes=None):
        return _pad(x, _pad_widths(pads, axes, x.ndim), np_mode, fill_of(value, x))

    return run


@register("CenterCropPad", 18)
def center_crop_pad(ctx: KernelContext):
    """Per axis: crop centred (extra element dropped at the end) or zero-pad centred."""
    axes_attr = ctx.attr("axes", None)

    def run(x, shape):
        axes = list(range(x.ndim)) if axes_attr is None else _norm_axes(axes_attr, x.ndim)
        target = _ints(shape)
        if len(target) != len(axes):
            raise ValueError(f"shape has {len(target)} dims for {len(axes)} axes")
        crop = [slice(None)] * x.ndim
        place = [slice(None)] * x.ndim
        out_shape = list(x.shape)
        for a, size in zip(axes, target):
            dim = x.shape[a]
            out_shape[a] = size
            if size < dim:
                start = (dim - size) // 2
                crop[a] = slice(start, start + size)
            elif size > dim:
                start = (size - dim) // 2
                place[a] = slice(start, start + dim)
        cropped = x[tuple(crop)]
        if tuple(out_shape) == cropped.shape:
            return cropped
        out = np.zeros(out_shape, dtype=x.dtype)
        out[tuple(place)] = cropped
        return out

    return run


# --------------------------------------------------------------------------- shape queries, makers


@register("Shape", 1, 13, 15, 19, 21, 23, 24, 25)
def shape(ctx: KernelContext):
    """start/end (v15+) slice the shape with Python's clamping, which matches ONNX's."""
    start, end = ctx.attr("start", 0), ctx.attr("end", None)
    if start == 0 and end is None:
        return lambda x: np.array(x.shape, dtype=np.int64)
    return lambda x: np.array(x.shape[start:end], dtype=np.int64)


@register("Size", 1, 13, 19, 21, 23, 24, 25)
def size(ctx: KernelContext):
    return lambda x: np.array(x.size, dtype=np.int64)


@register("ConstantOfShape", 9, 20, 21, 23, 24, 25)
def constant_of_shape(ctx: KernelContext):
    value = ctx.attr("value", None)
    value = np.zeros(1, np.float32) if value is None else np.asarray(value)
    if value.size != 1:
        raise ctx.unsupported("value must hold one element")
    fill, dtype = value.reshape(-1)[0], value.dtype
    shape = ctx.constant(0)
    if shape is not None:
        # One fill value seen through a broadcast view: a constant shape known at load time
        # costs no memory here, however large it is (a 180-byte model can ask for 2 GB).
        result = np.broadcast_to(np.asarray(fill, dtype=dtype), tuple(_ints(shape)))
        return lambda _: result
    return lambda s: np.full(tuple(_ints(s)), fill, dtype=dtype)


@register("Range", 11, 27)
def range_(ctx: KernelContext):
    """``start + i * delta`` for i < max(ceil((limit - start) / delta), 0), in T's arithmetic
    (float16 is computed in float32, as stash_type 1 asks, and rounded once)."""
    dtype = ctx.input_dtype(0)
    if ctx.version >= 27 and ctx.attr("stash_type", 1) != 1 and dtype == np.float16:
        raise ctx.unsupported("stash_type other than float")

    def run(start, limit, delta):
        # Scalars by the spec; 1-element tensors are accepted too (ONNX's own AffineGrid
        # function body feeds those).
        start, limit, delta = (_scalar(v, "Range") for v in (start, limit, delta))
        out_dtype = start.dtype
        if out_dtype.kind in "iu":
            s, lim, d = int(start), int(limit), int(delta)
            if d == 0:
                raise ValueError("delta is 0")
            n = max(-((s - lim) // d), 0)
            return (_counting(n, np.int64) * d + s).astype(out_dtype)
        work = np.float32 if out_dtype == np.float16 else out_dtype
        s, lim, d = (np.asarray(v, dtype=work) for v in (start, limit, delta))
        n = max(int(np.ceil((lim - s) / d)), 0)
        out = _counting(n, work)
        out *= d
        out += s
        return out.astype(out_dtype, copy=False)

    return run


#: elements numpy's arange fills at a time in :func:`_counting` (its fill keeps the GIL)
_COUNT_CHUNK = 1 << 20


def _counting(n: int, dtype: np.dtype | type) -> np.ndarray:
    """0, 1, ..., n - 1 as ``dtype``, as np.arange(n, dtype) makes them (each integer rounded
    to the type once), a million at a time: numpy's arange keeps the GIL while it fills, 0.3 s
    for 15 million floats folded at a load, every other thread of the server waiting; between
    pieces the interpreter lets the others run, and the casting copy lets go of it."""
    if n <= _COUNT_CHUNK:
        return np.arange(n, dtype=dtype)
    out = np.empty(n, dtype=dtype)
    for first in range(0, n, _COUNT_CHUNK):
        last = min(n, first + _COUNT_CHUNK)
        out[first:last] = np.arange(first, last, dtype=np.int64)
    return out


def _scalar(value: np.ndarray, op: str) -> np.ndarray:
    value = np.asarray(value)
    if value.size != 1:
        raise ValueError(f"{op} expects scalar inputs, got shape {list(value.shape)}")
    return value.reshape(())


@register("EyeLike", 9, 22)
def eye_like(ctx: KernelContext):
    k = ctx.attr("k", 0)
    dtype = _np_dtype(ctx.attr("dtype")) if ctx.has_attr("dtype") else None

    def run(x):
        if x.ndim != 2:
            raise ValueError("EyeLike input must be 2-D")
        return np.eye(x.shape[0], x.shape[1], k, dtype=x.dtype if dtype is None else dtype)

    return run


@register("OneHot", 9, 11, 28)
def one_hot(ctx: KernelContext):
    """Indices in [-depth, depth) select ``on``; anything else leaves the row all ``off``."""
    axis = ctx.attr("axis", -1)

    def run(indices, depth, values):
        d = int(np.asarray(depth).reshape(-1)[0])
        idx = indices.astype(np.int64) if indices.dtype != np.int64 else indices
        idx = np.where(idx < 0, idx + d, idx)
        hot = idx[..., None] == np.arange(d)
        ax = axis + hot.ndim if axis < 0 else axis
        if ax != hot.ndim - 1:
            hot = np.moveaxis(hot, -1, ax)
        return values.reshape(-1)[hot.astype(np.intp)]

    return run


@register("NonZero", 9, 13)
def non_zero(ctx: KernelContext):
    def run(x):
        if x.ndim == 0:
            return np.zeros((0, int(bool(x))), dtype=np.int64)
        return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)

    return run


@register("Compress", 9, 11, 28)
def compress(ctx: KernelContext):
    axis = ctx.attr("axis", None)
    return lambda x, cond: np.compress(cond.reshape(-1), x, axis=axis)


@register("Trilu", 14)
def trilu(ctx: KernelContext):
    keep = np.triu if ctx.attr("upper", 1) else np.tril
    k_const = ctx.constant(1)
    if not ctx.has_input(1) or k_const is not None:
        k = 0 if k_const is None else int(k_const.reshape(-1)[0])
        return lambda x, *_: keep(x, k)
    return lambda x, k=None: keep(x, 0 if k is None else int(k.reshape(-1)[0]))


# --------------------------------------------------------------------------- space <-> depth


@register("DepthToSpace", 1, 11, 13, 28)
def depth_to_space(ctx: KernelContext):
    """DCR splits channels as (block_h, block_w, C'), CRD as (C', block_h, block_w)."""
    bs = ctx.attr("blocksize")
    mode = ctx.attr("mode", "DCR") if ctx.version >= 11 else "DCR"
    if mode not in ("DCR", "CRD"):
        raise ctx.unsupported(f"mode {mode!r}")

    def run(x):
        b, c, h, w = x.shape
        cc = c // (bs * bs)
        if mode == "DCR":
            tmp = x.reshape(b, bs, bs, cc, h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            tmp = x.reshape(b, cc, bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
        return tmp.reshape(b, cc, h * bs, w * bs)

    return run


@register("SpaceToDepth", 1, 13, 28)
def space_to_depth(ctx: KernelContext):
    """The inverse of DepthToSpace with the same mode (mode exists from v28, DCR before)."""
    bs = ctx.attr("blocksize")
    mode = ctx.attr("mode", "DCR") if ctx.version >= 28 else "DCR"
    if mode not in ("DCR", "CRD"):
        raise ctx.unsupported(f"mode {mode!r}")
    perm = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)

    def run(x):
        b, c, h, w = x.shape
        tmp = x.reshape(b, c, h // bs, bs, w // bs, bs).transpose(perm)
        return tmp.reshape(b, c * bs * bs, h // bs, w // bs)

    return run


# --------------------------------------------------------------------------- sequences of rows


@register("ReverseSequence", 10, 28)
def reverse_sequence(ctx: KernelContext):
    """One gather along the time axis with, per batch row, a reversed prefix of source steps."""
    batch_axis, time_axis = ctx.attr("batch_axis", 1), ctx.attr("time_axis", 0)
    if {batch_axis, time_axis} != {0, 1}:
        raise ctx.unsupported("batch_axis and time_axis must be 0 and 1")

    def run(x, lens):
        steps = np.arange(x.shape[time_axis])
        lens = lens.astype(np.int64).reshape(-1, 1)
        src = np.where(steps < lens, lens - 1 - steps, steps)  # (batch, time)
        if time_axis == 0:
            src = src.T
        src = src.reshape(src.shape + (1,) * (x.ndim - 2))
        return np.take_along_axis(x, src, axis=time_axis)

    return run


@register("Unique", 11, 28, multi_output=True)
def unique(ctx: KernelContext):
    """numpy's sorted unique, reordered by first occurrence when ``sorted`` is 0."""
    axis = ctx.attr("axis", None)
    is_sorted = ctx.attr("sorted", 1)

    def run(x):
        y, first, inverse, counts = np.unique(
            x, return_index=True, return_inverse=True, return_counts=True, axis=axis
        )
        inverse = inverse.reshape(-1)
        if not is_sorted:
            order = np.argsort(first, kind="stable")
            y = y.take(order, axis=0 if axis is None else axis)
            first, counts = first[order], counts[order]
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            inverse = rank[inverse]
        i64 = np.int64
        return y, first.astype(i64), inverse.astype(i64), counts.astype(i64)

    return run


# --------------------------------------------------------------------------- Dropout


@register("Dropout", 1, 6, 7, 10, 12, 13, 22, multi_output=True)
def dropout(ctx: KernelContext):
    """Inference Dropout is the identity, with an all-true (v10+) or all-ones mask.

    Training mode (v12+, ``training_mode`` true, ratio above 0) keeps an element where
    ``numpy.random.RandomState(seed).uniform(0, 1, shape) >= ratio`` and scales the kept ones by
    1 / (1 - ratio). The generator is seeded anew on each run, as onnx's reference evaluator
    does: with a ``seed`` attribute every run, on any stream, gives the same mask (the one the
    ONNX backend test data holds; onnxruntime draws from its own generator, so its masks differ);
    without one the seed comes from the OS, as the spec allows. Versions before 7 have no seed,
    and their ``is_test`` defaults to training: that is refused, not guessed.
    """
    want_mask = ctx.has_output(1)
    mask_dtype = np.bool_ if ctx.version >= 10 else None
    seed = ctx.attr("seed", None)
    seed = None if seed is None else int(seed) % 2**32  # RandomState takes 32 bits

    def outputs(x):
        if not want_mask:
            return (x,)
        return x, np.ones(x.shape, dtype=mask_dtype or x.dtype)

    def drop(x, ratio):
        keep = np.random.RandomState(seed).uniform(0.0, 1.0, x.shape) >= ratio
        y = keep * x * x.dtype.type(1.0 / (1.0 - ratio))
        return (y, keep) if want_mask else (y,)

    if ctx.version < 7:
        if not ctx.attr("is_test", 0) and ctx.attr("ratio", 0.5) > 0:
            raise ctx.unsupported("training-mode Dropout (is_test=0) with ratio > 0")
        return outputs
    if ctx.version < 12 or not ctx.has_input(2):
        return lambda x, *_: outputs(x)
    training = ctx.constant(2)
    if training is not None and not bool(training.reshape(-1)[0]):
        return lambda x, *_: outputs(x)

    node = ctx.name

    def run(x, r=None, train=None):
        ratio = 0.5 if r is None else float(r.reshape(-1)[0])
        if train is None or not bool(train.reshape(-1)[0]) or ratio == 0.0:
            return outputs(x)
        if not 0.0 < ratio < 1.0:
            raise InvalidInput(f"node {node!r} (Dropout): ratio {ratio} is outside [0, 1)")
        return drop(x, ratio)

    return run
