"""Moving values: constants, shapes, Reshape/Transpose/Concat/Split/Slice/Gather..., Pad."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from plugserve.plugins.torch.ops.bounds import checker
from plugserve.plugins.torch.ops.elementwise import FLOATS, NUMBERS
from plugserve.plugins.torch.ops.registry import NodeContext, Refused, ints, register


@register("Constant", 1, 9, 11, 12, 13, 19, 21, 23, 24, 25)
def constant(ctx: NodeContext) -> Any:
    attrs = ctx.node.attrs
    if "value" in attrs:
        value = np.asarray(ctx.attr("value"))
    elif "value_float" in attrs:
        value = np.array(ctx.attr("value_float"), np.float32)
    elif "value_floats" in attrs:
        value = np.array(ctx.attr("value_floats"), np.float32)
    elif "value_int" in attrs:
        value = np.array(ctx.attr("value_int"), np.int64)
    elif "value_ints" in attrs:
        value = np.array(ctx.attr("value_ints"), np.int64)
    else:
        raise Refused("Constant of strings or sparse values")
    if value.dtype.kind in "OUS":
        raise Refused("Constant of strings")
    tensor = ctx.tensor(value)

    def run() -> Any:
        return tensor

    run.value = value  # type: ignore[attr-defined]
    return run


@register("Shape", 1, 13, 15, 19, 21, 23, 24, 25)
def shape(ctx: NodeContext) -> Any:
    torch, device = ctx.torch, ctx.device
    start, end = ctx.attr("start", 0), ctx.attr("end")

    def run(x: Any) -> Any:
        dims = list(x.shape)[start:end]
        return torch.tensor(dims, dtype=torch.int64, device=device)

    return run


@register("Size", 1, 13, 19, 21, 23, 24, 25)
def size(ctx: NodeContext) -> Any:
    torch, device = ctx.torch, ctx.device
    return lambda x: torch.tensor(x.numel(), dtype=torch.int64, device=device)


@register("Reshape", 5, 13, 14, 19, 21, 23, 24, 25)
def reshape(ctx: NodeContext) -> Any:
    allowzero = int(ctx.attr("allowzero", 0))

    def run(x: Any, shape: Any) -> Any:
        dims = ints(shape)
        if not allowzero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return x.reshape(dims)

    return run


@register("Transpose", 1, 13, 21, 23, 24, 25)
def transpose(ctx: NodeContext) -> Any:
    perm = ctx.attr("perm")

    def run(x: Any) -> Any:
        order = perm if perm is not None else list(reversed(range(x.dim())))
        return x.permute(*order)

    return run


@register("Concat", 4, 11, 13)
def concat(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis"))
    return lambda *xs: torch.cat([x for x in xs if x is not None], dim=axis)


@register("Split", 2, 11, 13, 18, multi_output=True)
def split(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", 0))
    count = len(ctx.node.outputs)
    attr_split = ctx.attr("split")
    chunks = ctx.attr("num_outputs")

    def run(x: Any, sizes: Any = None) -> Any:
        parts = ints(sizes) if sizes is not None else attr_split
        if parts is None:
            n = x.shape[axis]
            k = int(chunks or count)
            step = -(-n // k)
            parts = [min(step, n - i * step) for i in range(k)]
        return tuple(torch.split(x, list(parts), dim=axis))

    return run


@register("Slice", 1, 10, 11, 13)
def slice_(ctx: NodeContext) -> Any:
    if ctx.opset < 10:
        starts_a, ends_a, axes_a = ctx.attr("starts"), ctx.attr("ends"), ctx.attr("axes")

        def old(x: Any) -> Any:
            return _slice(x, starts_a, ends_a, axes_a, None)

        return old

    def run(x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> Any:
        return _slice(
            x, ints(starts), ints(ends), ints(axes) if axes is not None else None,
            ints(steps) if steps is not None else None,
        )  # fmt: skip

    return run


def _slice(x: Any, starts: list[int], ends: list[int], axes: list[int] | None,
           steps: list[int] | None) -> Any:  # fmt: skip
    import torch

    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    index: list[Any] = [slice(None)] * x.dim()
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= x.dim()
        n = x.shape[axis]
        if step > 0:
            s = max(0, min(n, start + n if start < 0 else start))
            e = max(0, min(n, end + n if end < 0 else end))
            index[axis] = slice(s, max(s, e), step)
        else:  # torch has no negative steps: take forward, then flip
            s = max(-1, min(n - 1, start + n if start < 0 else start))
            e = max(-1, min(n - 1, end + n if end < 0 else end))
            picked = list(range(s, e, step))
            index[axis] = slice(0, 0) if not picked else slice(picked[-1], picked[0] + 1, -step)
            flips.append(axis)
    y = x[tuple(index)]
    return torch.flip(y, flips) if flips else y


@register("Gather", 1, 11, 13)
def gather(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", 0))
    check = checker(ctx)  # an index out of range: INVALID_ARGUMENT, never a device assert

    def run(x: Any, indices: Any) -> Any:
        a = axis % x.dim()
        n = x.shape[a]
        idx = check(torch.where(indices < 0, indices + n, indices).to(torch.int64), n)
        flat = torch.index_select(x, a, idx.reshape(-1))
        return flat.reshape((*x.shape[:a], *indices.shape, *x.shape[a + 1 :]))

    return run


@register("GatherElements", 11, 13)
def gather_elements(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", 0))
    check = checker(ctx)

    def run(x: Any, indices: Any) -> Any:
        n = x.shape[axis]
        idx = check(torch.where(indices < 0, indices + n, indices).to(torch.int64), n)
        return torch.gather(x, axis, idx)

    return run


@register("GatherND", 11, 12, 13)
def gather_nd(ctx: NodeContext) -> Any:
    batch = int(ctx.attr("batch_dims", 0))
    check = checker(ctx)

    def run(x: Any, indices: Any) -> Any:
        k = indices.shape[-1]
        idx = indices.to(x.device).long()
        shape = x.shape
        idx = check(idx, tuple(int(d) for d in shape[batch : batch + k]))  # negatives wrapped
        lead = shape[:batch]
        b = int(np.prod(lead, dtype=np.int64))
        xb = x.reshape(b, *shape[batch:])
        ib = idx.reshape(b, -1, k)
        import torch

        rows = torch.arange(b, device=x.device).unsqueeze(1).expand(b, ib.shape[1])
        picked = xb[(rows, *ib.unbind(-1))]
        return picked.reshape(*indices.shape[:-1], *shape[batch + k :])

    return run


@register("Unsqueeze", 1, 11, 13, 21, 23, 24, 25)
def unsqueeze(ctx: NodeContext) -> Any:
    attr_axes = ctx.attr("axes")

    def run(x: Any, axes: Any = None) -> Any:
        wanted = ints(axes) if axes is not None else list(attr_axes)
        rank = x.dim() + len(wanted)
        for axis in sorted(a % rank for a in wanted):
            x = x.unsqueeze(axis)
        return x

    return run


@register("Squeeze", 1, 11, 13, 21, 23, 24, 25)
def squeeze(ctx: NodeContext) -> Any:
    attr_axes = ctx.attr("axes")

    def run(x: Any, axes: Any = None) -> Any:
        wanted = ints(axes) if axes is not None else attr_axes
        if wanted is None:
            return x.reshape([d for d in x.shape if d != 1])
        drop = {a % x.dim() for a in wanted}
        if any(x.shape[a] != 1 for a in drop):
            raise ValueError(f"Squeeze of an axis of size other than 1 ({list(x.shape)})")
        return x.reshape([d for i, d in enumerate(x.shape) if i not in drop])

    return run


@register("Expand", 8, 13)
def expand(ctx: NodeContext) -> Any:
    def run(x: Any, shape: Any) -> Any:
        dims = ints(shape)
        rank = max(len(dims), x.dim())
        dims = [1] * (rank - len(dims)) + dims
        have = [1] * (rank - x.dim()) + list(x.shape)
        target = [h if d == 1 else d for h, d in zip(have, dims)]
        return x.reshape(have).expand(target)

    return run


@register("Tile", 6, 13)
def tile(ctx: NodeContext) -> Any:
    return lambda x, repeats: x.repeat(*ints(repeats)) if x.dim() else x


@register("ConstantOfShape", 9, 20, 21, 23, 24, 25)
def constant_of_shape(ctx: NodeContext) -> Any:
    torch = ctx.torch
    value = ctx.attr("value")
    array = np.asarray(value) if value is not None else np.zeros(1, np.float32)
    dtype = ctx.dtype(array.dtype)
    fill = array.ravel()[0].item()
    device = ctx.device
    return lambda shape: torch.full(ints(shape), fill, dtype=dtype, device=device)


@register("Range", 11, 27, types=NUMBERS)
def range_(ctx: NodeContext) -> Any:
    torch = ctx.torch
    if ctx.in_type(0).name in ("float16", "bfloat16"):  # 27's stash_type: not measured here
        raise Refused(f"Range of {ctx.in_type(0)}")

    device = ctx.device
    # the output's dtype on this node's device: the bounds may be held wider (float32 shape
    # values on the host, .hostvalues, where the device computes in f16 or bf16)
    dtype = ctx.dtype(ctx.out_type(0))

    def run(start: Any, limit: Any, delta: Any) -> Any:
        # read on the host (free: the program holds shape values there, .hostvalues); the
        # output made on this node's device from them, one kernel, no copy
        s, e, d = start.item(), limit.item(), delta.item()
        count = max(int(np.ceil((e - s) / d)), 0)
        return (torch.arange(count, device=device, dtype=dtype) * d) + s

    return run


@register("Pad", 2, 11, 13, 18, 19, 21, 23, 24, 25)
def pad(ctx: NodeContext) -> Any:
    torch = ctx.torch
    F = torch.nn.functional
    mode = ctx.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise Refused(f"Pad mode {mode!r}")
    if ctx.opset < 11:
        pads_attr = list(ctx.attr("pads"))
        fill = float(ctx.attr("value", 0.0))

        def old(x: Any) -> Any:
            return _pad(torch, F, x, pads_attr, None, fill, mode)

        return old

    def run(x: Any, pads: Any, value: Any = None, axes: Any = None) -> Any:
        fill = value.item() if value is not None and value.numel() else 0
        return _pad(torch, F, x, ints(pads), ints(axes) if axes is not None else None,
                    fill, mode)  # fmt: skip

    return run


def _pad(torch: Any, F: Any, x: Any, pads: list[int], axes: list[int] | None, fill: Any,
         mode: str) -> Any:  # fmt: skip
    rank = x.dim()
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))
    full = [0] * (2 * rank)
    for i, axis in enumerate(axes):
        full[axis], full[axis + rank] = pads[i], pads[i + len(axes)]
    if mode == "constant":
        spec: list[int] = []
        for axis in reversed(range(rank)):
            spec += [full[axis], full[axis + rank]]
        return F.pad(x, spec, value=fill) if any(spec) else x.clone()
    for axis in range(rank):
        begin, end = full[axis], full[axis + rank]
        if not begin and not end:
            continue
        n = x.shape[axis]
        # the source positions made on the device (no copy from the host: capturable)
        positions = torch.arange(-begin, n + end, device=x.device)
        if mode == "edge":
            index = positions.clamp(0, n - 1)
        elif mode == "wrap":
            index = positions % n  # floored, as numpy's
        else:  # reflect
            period = 2 * (n - 1) if n > 1 else 1
            folded = positions.abs() % period
            index = torch.where(folded >= n, period - folded, folded)
        x = torch.index_select(x, axis, index)
    return x


@register("TopK", 1, 10, 11, 24, multi_output=True, types=NUMBERS)
def top_k(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", -1))
    largest = bool(int(ctx.attr("largest", 1)))
    # sorted=0 leaves the order to the implementation: sorted is one
    attr_k = ctx.attr("k")

    def run(x: Any, k: Any = None) -> Any:
        count = int(k.reshape(-1)[0].item()) if k is not None else int(attr_k)
        # stable ties: the lower index first, as ONNX asks
        order = torch.sort(x, dim=axis, descending=largest, stable=True)
        values = order.values.narrow(axis, 0, count)
        indices = order.indices.narrow(axis, 0, count)
        return values, indices

    return run


def _arg(op: str, fn_name: str) -> None:
    @register(op, 1, 11, 12, 13, types=NUMBERS)
    def convert(ctx: NodeContext) -> Any:
        torch = ctx.torch
        axis = int(ctx.attr("axis", 0))
        keep = bool(int(ctx.attr("keepdims", 1)))
        last = bool(int(ctx.attr("select_last_index", 0)))
        fn = getattr(torch, fn_name)

        def run(x: Any) -> Any:
            if last:
                flipped = torch.flip(x, [axis])
                index = fn(flipped, dim=axis, keepdim=keep)
                return x.shape[axis] - 1 - index
            if x.dtype in (torch.float16, torch.bfloat16) and x.device.type == "cpu":
                x = x.float()
            return fn(x, dim=axis, keepdim=keep)

        return run

    convert.__name__ = f"convert_{op}"


_arg("ArgMax", "argmax")
_arg("ArgMin", "argmin")


def _cumulative(op: str, versions: tuple[int, ...], fn_name: str, undo: str) -> None:
    @register(op, *versions, types=FLOATS | {"int32", "int64"})
    def convert(ctx: NodeContext) -> Any:
        return _cumulative_step(ctx, fn_name, undo)

    convert.__name__ = f"convert_{op}"


def _cumulative_step(ctx: NodeContext, fn_name: str, undo: str) -> Any:
    torch = ctx.torch
    cumulate = getattr(torch, fn_name)
    exclusive = bool(int(ctx.attr("exclusive", 0)))
    reverse = bool(int(ctx.attr("reverse", 0)))

    def run(x: Any, axis: Any) -> Any:
        a = int(axis.reshape(-1)[0].item()) % x.dim()
        y = torch.flip(x, [a]) if reverse else x
        out = cumulate(y, dim=a).to(x.dtype)
        if exclusive:  # the running result before each element: shifted by one
            first = torch.ones_like if undo == "div" else torch.zeros_like
            head = first(y.narrow(a, 0, 1))
            out = torch.cat([head, out.narrow(a, 0, y.shape[a] - 1)], dim=a)
        return torch.flip(out, [a]) if reverse else out

    return run


_cumulative("CumSum", (11, 14), "cumsum", "sub")
_cumulative("CumProd", (26,), "cumprod", "div")


@register("Trilu", 14)
def trilu(ctx: NodeContext) -> Any:
    torch = ctx.torch
    upper = bool(int(ctx.attr("upper", 1)))

    def run(x: Any, k: Any = None) -> Any:
        diagonal = int(k.item()) if k is not None else 0
        if x.dtype == torch.bool:
            return (torch.triu if upper else torch.tril)(x.to(torch.uint8), diagonal).bool()
        return (torch.triu if upper else torch.tril)(x, diagonal)

    return run


@register("OneHot", 9, 11, 28)
def one_hot(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", -1))

    def run(indices: Any, depth: Any, values: Any) -> Any:
        d = int(depth.reshape(-1)[0].item())
        idx = indices.to(torch.int64)
        idx = torch.where(idx < 0, idx + d, idx)
        valid = (idx >= 0) & (idx < d)
        hot = torch.nn.functional.one_hot(torch.where(valid, idx, 0), d).bool()
        hot &= valid.unsqueeze(-1)
        out = torch.where(hot, values[1], values[0])
        rank = out.dim()
        return out if axis in (-1, rank - 1) else out.movedim(-1, axis % rank)

    return run


@register("ScatterND", 11, 13, 16, 18)
def scatter_nd(ctx: NodeContext) -> Any:
    reduction = ctx.attr("reduction", "none")
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise Refused(f"ScatterND reduction={reduction!r}")

    check = checker(ctx)

    def run(x: Any, indices: Any, updates: Any) -> Any:
        out = x.clone()
        k = indices.shape[-1]
        idx = indices.reshape(-1, k).long()
        idx = check(idx, tuple(int(d) for d in x.shape[:k]))  # negatives wrapped
        upd = updates.reshape(idx.shape[0], *x.shape[k:])
        key = tuple(idx.unbind(-1))
        if reduction == "none":
            out[key] = upd
        elif reduction == "add":
            out.index_put_(key, upd, accumulate=True)
        else:
            for i in range(idx.shape[0]):
                where = tuple(int(v) for v in idx[i].tolist())
                if reduction == "mul":
                    out[where] = out[where] * upd[i]
                elif reduction == "max":
                    out[where] = out[where].maximum(upd[i])
                else:
                    out[where] = out[where].minimum(upd[i])
        return out

    return run


@register("ScatterElements", 11, 13, 16, 18)
def scatter_elements(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", 0))
    reduction = ctx.attr("reduction", "none")
    table = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}
    if reduction != "none" and reduction not in table:
        raise Refused(f"ScatterElements reduction={reduction!r}")

    check = checker(ctx)

    def run(x: Any, indices: Any, updates: Any) -> Any:
        n = x.shape[axis]
        idx = check(torch.where(indices < 0, indices + n, indices).long(), n)
        if reduction == "none":
            return x.scatter(axis, idx, updates)
        return x.scatter_reduce(axis, idx, updates, table[reduction], include_self=True)

    return run


@register("NonZero", 9, 13)
def non_zero(ctx: NodeContext) -> Any:
    torch = ctx.torch
    return lambda x: (
        torch.stack(torch.nonzero(x, as_tuple=True))
        if x.dim()
        else (torch.zeros((0, int(bool(x.item()))), dtype=torch.int64, device=x.device))
    )


@register("EyeLike", 9, 22)
def eye_like(ctx: NodeContext) -> Any:
    torch = ctx.torch
    k = int(ctx.attr("k", 0))
    to = ctx.attr("dtype")
    dtype = ctx.onnx_dtype(int(to)) if to is not None else None

    def run(x: Any) -> Any:
        rows, cols = x.shape
        eye = torch.ones(rows, cols, dtype=torch.uint8, device=x.device).triu(k).tril(k)
        return eye.to(dtype if dtype is not None else x.dtype)

    return run


@register("Scatter", 9, 11)
def scatter(ctx: NodeContext) -> Any:
    """Scatter: ScatterElements' old name (no reduction)."""
    return scatter_elements(ctx)


@register("Compress", 9, 11, 28)
def compress(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = ctx.attr("axis")

    def run(x: Any, condition: Any) -> Any:
        data = x.reshape(-1) if axis is None else x
        dim = 0 if axis is None else int(axis) % x.dim()
        keep = torch.nonzero(condition.reshape(-1).to(torch.bool)).reshape(-1)
        keep = keep[keep < data.shape[dim]]  # a condition longer than the axis: numpy's cut
        return torch.index_select(data, dim, keep)

    return run


@register("ReverseSequence", 10, 28)
def reverse_sequence(ctx: NodeContext) -> Any:
    torch = ctx.torch
    batch_axis, time_axis = int(ctx.attr("batch_axis", 1)), int(ctx.attr("time_axis", 0))

    def run(x: Any, lens: Any) -> Any:
        t = torch.arange(x.shape[time_axis], device=x.device).reshape(-1, 1)  # (time, batch)
        n = lens.to(torch.int64).reshape(1, -1)
        src = torch.where(t < n, n - 1 - t, t)
        if time_axis > batch_axis:
            src = src.t()
        shape = [1] * x.dim()
        shape[time_axis], shape[batch_axis] = x.shape[time_axis], x.shape[batch_axis]
        return torch.gather(x, time_axis, src.reshape(shape).expand(x.shape))

    return run


@register("CenterCropPad", 18)
def center_crop_pad(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axes_attr = ctx.attr("axes")

    def run(x: Any, shape: Any) -> Any:
        rank = x.dim()
        axes = list(range(rank)) if axes_attr is None else [a % rank for a in axes_attr]
        out_shape, src, dst = list(x.shape), [slice(None)] * rank, [slice(None)] * rank
        for a, want in zip(axes, ints(shape)):
            have = x.shape[a]
            out_shape[a] = want
            if want < have:
                start = (have - want) // 2
                src[a] = slice(start, start + want)
            elif want > have:
                start = (want - have) // 2
                dst[a] = slice(start, start + have)
        out = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
        out[tuple(dst)] = x[tuple(src)]
        return out

    return run


@register("TensorScatter", 24)
def tensor_scatter(ctx: NodeContext) -> Any:
    torch = ctx.torch
    mode = ctx.attr("mode", "linear")
    axis_attr = int(ctx.attr("axis", -2))
    if mode not in ("linear", "circular"):
        raise Refused(f"TensorScatter mode {mode!r}")

    def run(cache: Any, update: Any, write: Any = None) -> Any:
        axis = axis_attr % cache.dim()
        batch, length, steps = cache.shape[0], cache.shape[axis], update.shape[axis]
        if write is None:
            write = torch.zeros(batch, dtype=torch.int64, device=cache.device)
        pos = write.to(torch.int64).reshape(-1, 1) + torch.arange(steps, device=cache.device)
        if mode == "circular":
            pos = pos % length
        shape = [1] * cache.dim()
        shape[0], shape[axis] = batch, steps
        index = pos.reshape(shape).expand(update.shape)
        return cache.scatter(axis, index, update)

    return run


@register("Unique", 11, 28, multi_output=True)
def unique(ctx: NodeContext) -> Any:
    """numpy's unique (the reference's): Y, first indices, inverse indices, counts; with
    sorted=0 in the order of first occurrence. Without an axis numpy counts every NaN as one
    value, sorted last (torch keeps each apart: they are merged here); along an axis
    neither merges rows holding NaNs."""
    torch = ctx.torch
    axis = ctx.attr("axis")
    ordered = bool(int(ctx.attr("sorted", 1)))

    def run(x: Any) -> Any:
        data = x.reshape(-1) if axis is None else x
        dim = 0 if axis is None else int(axis) % x.dim()
        nan = torch.isnan(data) if axis is None and data.is_floating_point() else None
        if nan is not None and bool(nan.any()):
            y, inverse, counts = torch.unique(
                torch.where(nan, torch.full_like(data, math.inf), data),
                sorted=True, return_inverse=True, return_counts=True,
            )  # fmt: skip
            inf_count = int((torch.isinf(data) & (data > 0)).sum())
            if inf_count:  # +inf kept, the NaNs after it
                counts = torch.cat([counts[:-1], counts.new_tensor([inf_count])])
            else:
                y, counts = y[:-1], counts[:-1]
            y = torch.cat([y, data.new_tensor([math.nan])])
            counts = torch.cat([counts, counts.new_tensor([int(nan.sum())])])
            inverse = torch.where(nan, torch.full_like(inverse, y.numel() - 1), inverse)
        else:
            y, inverse, counts = torch.unique(
                data, sorted=True, return_inverse=True, return_counts=True, dim=dim
            )
        inverse = inverse.reshape(-1)
        positions = torch.arange(inverse.numel(), device=x.device)
        first = torch.full((counts.numel(),), inverse.numel(), device=x.device)
        first = first.scatter_reduce(0, inverse, positions, "amin")
        if not ordered:
            order = torch.argsort(first)
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.numel(), device=x.device)
            first, counts, inverse = first[order], counts[order], rank[inverse]
            y = torch.index_select(data, dim, first)
        return y, first, inverse, counts

    return run


@register("BitCast", 26)
def bit_cast(ctx: NodeContext) -> Any:
    torch = ctx.torch
    src, dst = ctx.in_type(0), ctx.out_type()
    if src.itemsize != dst.itemsize or "bool" in (src.name, dst.name):
        raise Refused(f"BitCast of {src} to {dst}")
    if "float32" in (src.name, dst.name) and ctx.compute != torch.float32:
        raise Refused("BitCast of float32 held in a narrower precision")
    # the bits' own width: float16 may be held in float32, uint16/32 in int32/64
    narrow = {"float16": torch.float16, "uint16": torch.int16, "uint32": torch.int32}
    src_t = narrow.get(src.name) or ctx.dtype(src)
    dst_t = narrow.get(dst.name) or ctx.dtype(dst)
    held = ctx.dtype(dst)
    return lambda x: x.to(src_t).contiguous().view(dst_t).to(held)  # (channels-last)
