"""Network layers: convolutions, GEMMs, normalizations, softmax, pools, Resize, Einsum."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from plugserve.plugins.torch import layout
from plugserve.plugins.torch.ops.elementwise import FLOATS
from plugserve.plugins.torch.ops.registry import NodeContext, Refused, ints, register
from plugserve.plugins.torch.ops.resize import general_resize


def _weight_kernel(ctx: NodeContext) -> list[int]:
    """The kernel's spatial sizes from the weight: its value or its declared shape."""
    weight = ctx.const(1)
    if weight is not None:
        return list(weight.shape[2:])
    spec = ctx.graph.spec(ctx.inputs[1])
    if spec is None or spec.shape is None or any(not isinstance(d, int) for d in spec.shape[2:]):
        raise Refused(f"{ctx.node.op_type}: kernel_shape unknown at load")
    return list(spec.shape[2:])


def _same_pads(size: list[int], kernel: list[int], strides: list[int], dilations: list[int],
               upper: bool) -> list[int]:  # fmt: skip
    """ONNX's SAME_UPPER/SAME_LOWER pads (begins then ends) for these input sizes."""
    begins, ends = [], []
    for n, k, s, d in zip(size, kernel, strides, dilations):
        out = -(-n // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        small = total // 2
        begins.append(small if upper else total - small)
        ends.append(total - small if upper else small)
    return begins + ends


def _torch_pad(pads: list[int]) -> list[int]:
    """ONNX pads (all begins, then all ends) as F.pad's (last axis first, begin then end)."""
    half = len(pads) // 2
    out: list[int] = []
    for axis in reversed(range(half)):
        out += [pads[axis], pads[axis + half]]
    return out


def _pads(ctx: NodeContext, dims: int, kernel: list[int] | None, strides: list[int],
          dilations: list[int]) -> Any:  # fmt: skip
    """A function of the input's spatial sizes giving ONNX pads (begins, ends)."""
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = list(ctx.attr("pads", [0] * (2 * dims)))
        return lambda size, kernel=kernel: pads
    if auto == "VALID":
        return lambda size, kernel=kernel: [0] * (2 * dims)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        upper = auto == "SAME_UPPER"
        return lambda size, kernel=kernel: _same_pads(size, kernel, strides, dilations, upper)
    raise Refused(f"{ctx.node.op_type} auto_pad={auto!r}")


@register("Conv", 1, 11, 22, types=FLOATS)
def conv(ctx: NodeContext) -> Any:
    return conv_step(ctx)


def conv_step(ctx: NodeContext) -> Any:
    """Conv's step (ConvInteger's too, over its centered values): ONNX's attributes and pads,
    asymmetric ones padded before torch's convolution."""
    F = ctx.torch.nn.functional
    weight = ctx.const(1)
    kernel = ctx.attr("kernel_shape")
    if kernel is None:
        if weight is None:
            wtype = ctx.graph.spec(ctx.inputs[1])
            if (
                wtype is None
                or wtype.shape is None
                or any(not isinstance(d, int) for d in wtype.shape[2:])
            ):
                raise Refused("Conv: kernel_shape unknown at load")
            kernel = list(wtype.shape[2:])
        else:
            kernel = list(weight.shape[2:])
    dims = len(kernel)
    if dims not in (1, 2, 3):
        raise Refused(f"Conv of {dims} spatial dimensions")
    strides = list(ctx.attr("strides", [1] * dims))
    dilations = list(ctx.attr("dilations", [1] * dims))
    group = int(ctx.attr("group", 1))
    pads_of = _pads(ctx, dims, kernel, strides, dilations)
    fn = [F.conv1d, F.conv2d, F.conv3d][dims - 1]
    # CUDA at f16/bf16: channels-last (plugins/torch/layout.py); a no-op once the input is
    nhwc = dims == 2 and layout.wanted(ctx.torch, ctx.device, ctx.compute)

    def run(x: Any, w: Any, b: Any = None) -> Any:
        if nhwc:
            x = layout.input_channels_last(ctx.torch, x)
        pads = pads_of(list(x.shape[2:]))
        if pads[:dims] == pads[dims:]:
            return fn(x, w, b, strides, pads[:dims], dilations, group)
        x = F.pad(x, _torch_pad(pads))
        return fn(x, w, b, strides, 0, dilations, group)

    return run


@register("ConvTranspose", 1, 11, 22, types=FLOATS)
def conv_transpose(ctx: NodeContext) -> Any:
    F = ctx.torch.nn.functional
    kernel = ctx.attr("kernel_shape") or _weight_kernel(ctx)
    dims = len(kernel)
    if dims not in (1, 2, 3):
        raise Refused(f"ConvTranspose of {dims} spatial dimensions")
    strides = list(ctx.attr("strides", [1] * dims))
    dilations = list(ctx.attr("dilations", [1] * dims))
    group = int(ctx.attr("group", 1))
    auto = ctx.attr("auto_pad", "NOTSET")
    output_padding = list(ctx.attr("output_padding", [0] * dims))
    output_shape = ctx.attr("output_shape")
    if auto not in ("NOTSET", ""):
        raise Refused(f"ConvTranspose auto_pad={auto!r}")
    pads = list(ctx.attr("pads", [0] * (2 * dims)))
    fn = [F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d][dims - 1]

    def run(x: Any, w: Any, b: Any = None) -> Any:
        p, extra = list(pads), list(output_padding)
        if output_shape is not None:
            for i in range(dims):
                full = (x.shape[2 + i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1
                total = full + extra[i] - output_shape[len(output_shape) - dims + i]
                p[i], p[i + dims] = total - total // 2, total // 2
        fits = all(e < max(s, d) for e, s, d in zip(extra, strides, dilations))
        if p[:dims] == p[dims:] and min(p) >= 0 and fits:
            return fn(x, w, b, strides, p[:dims], extra, group, dilations)
        # the full result, output_padding's zeros at the ends, then cut (or widened) by pads
        y = fn(x, w, None, strides, 0, 0, group, dilations)
        y = F.pad(y, _torch_pad([-v for v in p[:dims]] + [e - v for e, v in zip(extra, p[dims:])]))
        if b is not None:
            y = y + b.reshape(1, -1, *([1] * dims))
        return y

    return run


@register("Gemm", 7, 9, 11, 13, types=FLOATS)
def gemm(ctx: NodeContext) -> Any:
    torch = ctx.torch
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    ta, tb = int(ctx.attr("transA", 0)), int(ctx.attr("transB", 0))

    def run(a: Any, b: Any, c: Any = None) -> Any:
        if ta:
            a = a.t()
        if tb:
            b = b.t()
        y = torch.matmul(a, b)
        if alpha != 1.0:
            y = y * alpha
        if c is not None:
            y = y + (c * beta if beta != 1.0 else c)
        return y

    return run


@register("MatMul", 1, 9, 13, types=FLOATS)
def matmul(ctx: NodeContext) -> Any:
    return ctx.torch.matmul


@register("Einsum", 12, 28, types=FLOATS | {"int32", "int64"})
def einsum(ctx: NodeContext) -> Any:
    torch = ctx.torch
    equation = str(ctx.attr("equation")).replace(" ", "")
    if "->" not in equation:  # implicit output: letters seen once, sorted
        letters = equation.replace(",", "").replace(".", "")
        once = sorted(c for c in set(letters) if letters.count(c) == 1)
        equation = f"{equation}->{'...' if '...' in equation else ''}{''.join(once)}"
    return lambda *xs: torch.einsum(equation, *xs)


@register("BatchNormalization", 9, 14, 15, multi_output=True, types=FLOATS)
def batch_norm(ctx: NodeContext) -> Any:
    training = bool(int(ctx.attr("training_mode", 0)))
    if ctx.opset < 14 and len([o for o in ctx.node.outputs if o]) > 1:
        raise Refused("BatchNormalization 9's training outputs")
    eps = float(ctx.attr("epsilon", 1e-5))
    momentum = float(ctx.attr("momentum", 0.9))
    F = ctx.torch.nn.functional

    def run(x: Any, scale: Any, bias: Any, mean: Any, var: Any) -> Any:
        dtype = x.dtype
        if not training:
            return (F.batch_norm(x, mean.to(dtype), var.to(dtype), scale.to(dtype),
                                 bias.to(dtype), False, 0.0, eps),)  # fmt: skip
        # 14's training mode as ONNX's reference: the batch's mean and (population)
        # variance normalize; the running statistics move by momentum
        dims = [d for d in range(x.dim()) if d != 1]
        batch_mean = x.mean(dim=dims)
        batch_var = x.var(dim=dims, unbiased=False)
        y = F.batch_norm(x, batch_mean, batch_var, scale.to(dtype), bias.to(dtype), False, 0.0,
                         eps)  # fmt: skip
        return (y, mean * momentum + batch_mean * (1 - momentum),
                var * momentum + batch_var * (1 - momentum))  # fmt: skip

    return run


@register("InstanceNormalization", 6, 22, types=FLOATS)
def instance_norm(ctx: NodeContext) -> Any:
    eps = float(ctx.attr("epsilon", 1e-5))
    F = ctx.torch.nn.functional
    return lambda x, scale, bias: F.instance_norm(x, weight=scale, bias=bias, eps=eps)


@register("LayerNormalization", 17, multi_output=True, types=FLOATS)
def layer_norm(ctx: NodeContext) -> Any:
    axis = int(ctx.attr("axis", -1))
    eps = float(ctx.attr("epsilon", 1e-5))
    torch = ctx.torch
    F = torch.nn.functional
    stats = any(ctx.node.outputs[1:])

    def run(x: Any, scale: Any, bias: Any = None) -> Any:
        start = axis % x.dim()
        shape = tuple(x.shape[start:])
        if (
            not stats
            and tuple(scale.shape) == shape
            and (bias is None or tuple(bias.shape) == shape)
        ):
            return (F.layer_norm(x, shape, scale, bias, eps),)
        dims = tuple(range(start, x.dim()))
        mean = x.mean(dim=dims, keepdim=True)
        centered = x - mean
        inv = torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + eps)
        y = centered * inv * scale
        if bias is not None:
            y = y + bias
        return y, mean, inv

    return run


@register("RMSNormalization", 23, types=FLOATS)
def rms_norm(ctx: NodeContext) -> Any:
    axis = int(ctx.attr("axis", -1))
    eps = float(ctx.attr("epsilon", 1e-5))
    torch = ctx.torch

    def run(x: Any, scale: Any) -> Any:
        dims = tuple(range(axis % x.dim(), x.dim()))
        wide = x.to(torch.float32) if x.dtype != torch.float64 else x
        inv = torch.rsqrt((wide * wide).mean(dim=dims, keepdim=True) + eps)
        return (wide * inv).to(x.dtype) * scale

    return run


@register("GroupNormalization", 21, types=FLOATS)
def group_norm(ctx: NodeContext) -> Any:
    groups = int(ctx.attr("num_groups"))
    eps = float(ctx.attr("epsilon", 1e-5))
    F = ctx.torch.nn.functional
    return lambda x, scale, bias: F.group_norm(x, groups, scale, bias, eps)


def _softmax(op: str, fn_name: str) -> None:
    @register(op, 1, 11, 13, types=FLOATS)
    def convert(ctx: NodeContext) -> Any:
        torch = ctx.torch
        fn = getattr(torch, fn_name)
        if op == "Softmax" and ctx.rounds_to_f16(ctx.out_type()):
            fn = _half_softmax(torch)  # float16 held in float32: rounded as the reference
        if ctx.opset >= 13:
            axis = int(ctx.attr("axis", -1))
            return lambda x: fn(x, axis)
        axis = int(ctx.attr("axis", 1))

        def run(x: Any) -> Any:
            a = axis % x.dim() if x.dim() else 0
            flat = x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), -1)
            return fn(flat, 1).reshape(x.shape)

        return run

    convert.__name__ = f"convert_{op}"


def _half_softmax(torch: Any) -> Any:
    """Softmax of float16 values held in float32, each step rounded to float16 as the ONNX
    reference's float16 arithmetic rounds it (one rounding at the end differs by an ulp)."""

    def half(t: Any) -> Any:
        return t.to(torch.float16).to(t.dtype)

    def run(x: Any, axis: int) -> Any:
        e = half(torch.exp(half(x - x.amax(dim=axis, keepdim=True))))
        return e / half(e.sum(dim=axis, keepdim=True))

    return run


_softmax("Softmax", "softmax")
_softmax("LogSoftmax", "log_softmax")


@register("Hardmax", 13, types=FLOATS)
def hardmax(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axis = int(ctx.attr("axis", -1))

    def run(x: Any) -> Any:
        index = torch.argmax(x, dim=axis, keepdim=True)
        return torch.zeros_like(x).scatter_(axis, index, 1)

    return run


def _pool_geometry(ctx: NodeContext) -> tuple[list[int], list[int], list[int], int]:
    kernel = list(ctx.attr("kernel_shape"))
    dims = len(kernel)
    if dims not in (1, 2, 3):
        raise Refused(f"{ctx.node.op_type} of {dims} spatial dimensions")
    strides = list(ctx.attr("strides", [1] * dims))
    dilations = list(ctx.attr("dilations", [1] * dims))
    return kernel, strides, dilations, dims


def _ceil_extra(size: list[int], pads: list[int], kernel: list[int], strides: list[int],
                dilations: list[int], ceil: bool) -> list[int]:  # fmt: skip
    """More end padding that makes a floor-mode pool give ONNX's ceil-mode output size (the
    last window starting inside the input or its begin padding)."""
    dims = len(size)
    extra = []
    for i in range(dims):
        span = (kernel[i] - 1) * dilations[i] + 1
        room = size[i] + pads[i] + pads[i + dims] - span
        if not ceil or room < 0:
            extra.append(0)
            continue
        out = -(-room // strides[i]) + 1
        if (out - 1) * strides[i] >= size[i] + pads[i]:
            out -= 1
        extra.append(max(0, (out - 1) * strides[i] + span - (size[i] + pads[i] + pads[i + dims])))
    return extra


@register("MaxPool", 8, 10, 11, 12, 22, multi_output=True, types=FLOATS | {"int8", "uint8"})
def max_pool(ctx: NodeContext) -> Any:
    if len([o for o in ctx.node.outputs if o]) > 1:
        return _max_pool_indices(ctx)
    torch = ctx.torch
    F = torch.nn.functional
    kernel, strides, dilations, dims = _pool_geometry(ctx)
    ceil = bool(int(ctx.attr("ceil_mode", 0)))
    pads_of = _pads(ctx, dims, kernel, strides, dilations)
    fn = [F.max_pool1d, F.max_pool2d, F.max_pool3d][dims - 1]

    def run(x: Any) -> Any:
        size = list(x.shape[2:])
        pads = pads_of(size)
        extra = _ceil_extra(size, pads, kernel, strides, dilations, ceil)
        full = pads[:dims] + [p + e for p, e in zip(pads[dims:], extra)]
        wide = x.dtype in (torch.int8, torch.uint8)
        if wide:
            low = float(torch.iinfo(x.dtype).min)
            y = x.to(torch.float32)
        else:
            low = float("-inf")
            y = x
        if any(full):
            y = F.pad(y, _torch_pad(full), value=low)
        y = fn(y, kernel, strides, 0, dilations)
        return (y.to(x.dtype) if wide else y,)

    return run


def _max_pool_indices(ctx: NodeContext) -> Any:
    """MaxPool with its Indices output: torch's own (its padding is symmetric and at most half
    the kernel, no ceil mode), the indices made ONNX's: over the whole tensor, row- or
    column-major (storage_order)."""
    torch = ctx.torch
    F = torch.nn.functional
    kernel, strides, dilations, dims = _pool_geometry(ctx)
    pads = list(ctx.attr("pads", [0] * (2 * dims)))
    column = int(ctx.attr("storage_order", 0))
    if ctx.attr("auto_pad", "NOTSET") not in ("NOTSET", "") or int(ctx.attr("ceil_mode", 0)):
        raise Refused("MaxPool's Indices output with auto_pad or ceil_mode")
    if pads[:dims] != pads[dims:] or any(2 * p > k for p, k in zip(pads, kernel)):
        raise Refused("MaxPool's Indices output with asymmetric or wide pads")
    if column and dims != 2:
        raise Refused("MaxPool's Indices output column-major of other than 2 spatial axes")
    if ctx.in_type(0).kind != "f":
        raise Refused(f"MaxPool's Indices output of {ctx.in_type(0)}")
    fn = [F.max_pool1d, F.max_pool2d, F.max_pool3d][dims - 1]

    def run(x: Any) -> Any:
        y, idx = fn(x, kernel, strides, pads[:dims], dilations, return_indices=True)
        plane = int(np.prod(x.shape[2:]))
        if column:
            h, w = x.shape[2], x.shape[3]
            idx = (idx % w) * h + idx // w
        n, c = x.shape[:2]
        base = torch.arange(n * c, device=x.device).reshape(n, c, *([1] * dims)) * plane
        return y, idx + base

    return run


def _window_sum(torch: Any, x: Any, kernel: list[int], strides: list[int],
                dilations: list[int]) -> Any:  # fmt: skip
    """The sum of every (dilated) pooling window: a convolution of each channel with ones."""
    F = torch.nn.functional
    conv = [F.conv1d, F.conv2d, F.conv3d][len(kernel) - 1]
    n, c = x.shape[:2]
    ones = torch.ones((1, 1, *kernel), dtype=x.dtype, device=x.device)
    y = conv(x.reshape(n * c, 1, *x.shape[2:]), ones, stride=strides, dilation=dilations)
    return y.reshape(n, c, *y.shape[2:])


def _average_step(ctx: NodeContext) -> Any:
    """AveragePool's step (LpPool's average of powers too)."""
    torch = ctx.torch
    F = torch.nn.functional
    kernel, strides, dilations, dims = _pool_geometry(ctx)
    ceil = bool(int(ctx.attr("ceil_mode", 0)))
    include = bool(int(ctx.attr("count_include_pad", 0)))
    pads_of = _pads(ctx, dims, kernel, strides, dilations)
    fn = [F.avg_pool1d, F.avg_pool2d, F.avg_pool3d][dims - 1]
    window = int(np.prod(kernel))
    dilated = any(d != 1 for d in dilations)

    def total(x: Any) -> Any:
        if dilated:
            return _window_sum(torch, x, kernel, strides, dilations)
        return fn(x, kernel, strides) * window

    def run(x: Any) -> Any:
        size = list(x.shape[2:])
        pads = pads_of(size)
        extra = _ceil_extra(size, pads, kernel, strides, dilations, ceil)
        if not any(pads) and not any(extra) and not dilated:
            return fn(x, kernel, strides)
        full = pads[:dims] + [p + e for p, e in zip(pads[dims:], extra)]
        summed = total(F.pad(x, _torch_pad(full)))
        ones = torch.ones((1, 1, *size), dtype=x.dtype, device=x.device)
        if include:
            ones = F.pad(ones, _torch_pad(pads), value=1.0)
            ones = F.pad(ones, _torch_pad([0] * dims + extra))
        else:
            ones = F.pad(ones, _torch_pad(full))
        return summed / total(ones)

    return run


@register("AveragePool", 7, 10, 11, 19, 22, types=FLOATS)
def average_pool(ctx: NodeContext) -> Any:
    return _average_step(ctx)


@register("LpPool", 2, 11, 18, 22, types=FLOATS)
def lp_pool(ctx: NodeContext) -> Any:
    """The p-norm of every window, padding counted as zeros (the suite's expected values;
    the reference's scaled average differs where a window covers padding)."""
    torch = ctx.torch
    F = torch.nn.functional
    p = float(ctx.attr("p", 2))
    kernel, strides, dilations, dims = _pool_geometry(ctx)
    ceil = bool(int(ctx.attr("ceil_mode", 0)))
    pads_of = _pads(ctx, dims, kernel, strides, dilations)

    def run(x: Any) -> Any:
        size = list(x.shape[2:])
        pads = pads_of(size)
        extra = _ceil_extra(size, pads, kernel, strides, dilations, ceil)
        full = pads[:dims] + [q + e for q, e in zip(pads[dims:], extra)]
        powered = F.pad(torch.pow(torch.abs(x), p), _torch_pad(full))
        return torch.pow(_window_sum(torch, powered, kernel, strides, dilations), 1.0 / p)

    return run


@register("GlobalAveragePool", 1, 22, types=FLOATS)
def global_average_pool(ctx: NodeContext) -> Any:
    return lambda x: x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@register("GlobalMaxPool", 1, 22, types=FLOATS)
def global_max_pool(ctx: NodeContext) -> Any:
    return lambda x: x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


@register("LpNormalization", 1, 22, types=FLOATS)
def lp_normalization(ctx: NodeContext) -> Any:
    axis, p = int(ctx.attr("axis", -1)), int(ctx.attr("p", 2))
    if p not in (1, 2):
        raise Refused(f"LpNormalization p={p}")
    torch = ctx.torch

    def run(x: Any) -> Any:
        norm = torch.linalg.vector_norm(x, ord=p, dim=axis, keepdim=True)
        return torch.where(norm == 0, x, x / torch.where(norm == 0, 1, norm))

    return run


@register("LRN", 1, 13, types=FLOATS)
def lrn(ctx: NodeContext) -> Any:
    size = int(ctx.attr("size"))
    alpha, beta = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75))
    bias = float(ctx.attr("bias", 1.0))
    torch = ctx.torch
    F = torch.nn.functional
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2

    def run(x: Any) -> Any:
        square = (x * x).unsqueeze(1)
        pad = [0, 0] * (x.dim() - 2) + [before, after]
        square = F.pad(square, pad)
        summed = (
            F.avg_pool3d(
                square.reshape(x.shape[0], 1, square.shape[2], x.shape[2], -1), (size, 1, 1), 1
            ).reshape(x.shape)
            * size
        )
        return x / (bias + alpha / size * summed) ** beta

    return run


@register("Dropout", 7, 10, 12, 13, 22, multi_output=True)
def dropout(ctx: NodeContext) -> Any:
    training = ctx.const(2)
    if ctx.has(2) and (training is None or bool(np.asarray(training))):
        ratio = ctx.const(1)
        if not ctx.has(1) or ratio is None or float(np.asarray(ratio)) != 0.0:
            raise Refused("Dropout in training mode (random) unless its ratio is 0")
    torch = ctx.torch
    if len(ctx.node.outputs) > 1 and ctx.node.outputs[1]:
        return lambda x, *_: (x, torch.ones_like(x, dtype=torch.bool))
    return lambda x, *_: (x,)


@register("Flatten", 1, 9, 11, 13, 21, 23, 24, 25)
def flatten(ctx: NodeContext) -> Any:
    axis = int(ctx.attr("axis", 1))

    def run(x: Any) -> Any:
        a = axis % x.dim() if axis < 0 else axis
        outer = int(np.prod(x.shape[:a], dtype=np.int64))
        return x.reshape(outer, int(np.prod(x.shape[a:], dtype=np.int64)))

    return run


@register("DepthToSpace", 1, 11, 13, 28)
def depth_to_space(ctx: NodeContext) -> Any:
    b = int(ctx.attr("blocksize"))
    crd = ctx.attr("mode", "DCR") == "CRD"

    def run(x: Any) -> Any:
        n, c, h, w = x.shape
        if crd:
            y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
        else:
            y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
        return y.reshape(n, c // (b * b), h * b, w * b)

    return run


@register("SpaceToDepth", 1, 13, 28)
def space_to_depth(ctx: NodeContext) -> Any:
    b = int(ctx.attr("blocksize"))
    mode = ctx.attr("mode", "DCR")  # CRD since 28
    if mode not in ("DCR", "CRD"):
        raise Refused(f"SpaceToDepth mode {mode!r}")
    order = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)

    def run(x: Any) -> Any:
        n, c, h, w = x.shape
        y = x.reshape(n, c, h // b, b, w // b, b).permute(*order)
        return y.reshape(n, c * b * b, h // b, w // b)

    return run


#: for an integer upscale every one of these gives floor(x / scale) (no rounding tie falls on
#: an output position), which is torch's "nearest"
_NEAREST_ANY = ("half_pixel", "pytorch_half_pixel", "asymmetric", "tf_half_pixel_for_nn")

_RESIZE_LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


@register("Resize", 11, 13, 18, 19, types=FLOATS | {"int64"})
def resize(ctx: NodeContext) -> Any:
    """torch's interpolate where it computes ONNX's Resize exactly; the rest of float Resize
    by the reference's arithmetic (:mod:`.resize`)."""
    try:
        return _interpolate_resize(ctx)
    except Refused:
        return general_resize(ctx)


def _interpolate_mode(
    ctx: NodeContext, mode: str, transform: str, nearest: str, integer_up: bool
) -> tuple[str, bool]:
    """torch's interpolate mode (and align_corners) that computes ONNX's Resize ``mode`` under
    its coordinate transformation exactly; Refused where none does."""
    if mode == "nearest":
        if transform == "asymmetric" and nearest == "floor":
            return "nearest", False
        if transform in ("half_pixel", "pytorch_half_pixel") and nearest == "round_prefer_ceil":
            return "nearest-exact", False
        if integer_up and transform in _NEAREST_ANY and nearest != "ceil":
            return "nearest", False
        raise Refused(f"Resize nearest with {transform} and {nearest}")
    if mode not in ("linear", "cubic"):
        raise Refused(f"Resize mode {mode!r}")
    if mode == "cubic" and float(ctx.attr("cubic_coeff_a", -0.75)) != -0.75:
        raise Refused("Resize cubic with cubic_coeff_a other than -0.75")
    if transform != "align_corners" and transform not in ("half_pixel", "pytorch_half_pixel"):
        raise Refused(f"Resize {mode} with {transform}")
    return ("linear" if mode == "linear" else "bicubic"), transform == "align_corners"


def _interpolate_resize(ctx: NodeContext) -> Any:
    torch = ctx.torch
    F = torch.nn.functional
    mode = ctx.attr("mode", "nearest")
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel")
    nearest = ctx.attr("nearest_mode", "round_prefer_floor")
    if int(ctx.attr("antialias", 0)) or int(ctx.attr("exclude_outside", 0)):
        raise Refused("Resize with antialias or exclude_outside")
    if ctx.attr("axes") is not None:
        raise Refused("Resize with axes")
    if ctx.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise Refused("Resize keep_aspect_ratio_policy other than stretch")
    scales_in, sizes_in = 2, 3
    if ctx.opset == 10:
        scales_in, sizes_in = 1, 9
    scales_const = ctx.const(scales_in)
    sizes_const = ctx.const(sizes_in)
    if transform == "tf_crop_and_resize":
        raise Refused("Resize tf_crop_and_resize")
    for known, what in ((scales_const, "scales"), (sizes_const, "sizes")):
        if known is not None and known.size:
            x_spec = ctx.graph.spec(ctx.inputs[0])
            lead = np.asarray(known).ravel()[:2].tolist()
            want = [1.0, 1.0] if what == "scales" else list(x_spec.shape[:2]) if (
                x_spec is not None and x_spec.shape is not None) else None  # fmt: skip
            if want is not None and lead != want:
                raise Refused(f"Resize of the batch or channel axes ({what} {lead})")
    by_sizes = ctx.has(sizes_in)
    if transform == "pytorch_half_pixel" and not (
        (sizes_const is not None and 1 not in sizes_const[2:].tolist())
        or (not by_sizes and scales_const is not None and all(scales_const[2:] >= 1))
    ):
        raise Refused("Resize pytorch_half_pixel unless no output length can be 1")
    if mode in ("linear", "cubic") and transform == "align_corners" and not by_sizes:
        raise Refused("Resize align_corners by scales (torch recomputes the scale)")
    integer_up = (
        scales_const is not None
        and scales_const.size
        and all(float(s) >= 1 and float(s).is_integer() for s in np.asarray(scales_const).ravel())
    )
    how, align = _interpolate_mode(ctx, mode, transform, nearest, bool(integer_up))
    pytorch_half = transform == "pytorch_half_pixel"

    def run(x: Any, roi: Any = None, scales: Any = None, sizes: Any = None) -> Any:
        rank = x.dim()
        spatial = rank - 2
        kw: dict[str, Any] = {}
        if sizes is not None and sizes.numel():
            size = [int(v) for v in sizes.tolist()]
            if size[:2] != list(x.shape[:2]):
                raise ValueError("Resize of the batch or channel axes")
            if pytorch_half and any(s == 1 for s in size[2:]):
                raise ValueError("Resize pytorch_half_pixel to length 1")
            kw["size"] = size[2:]
        else:
            factors = [float(v) for v in scales.tolist()]
            if factors[:2] != [1.0, 1.0]:
                raise ValueError("Resize of the batch or channel axes")
            kw["scale_factor"] = factors[2:]
            kw["recompute_scale_factor"] = False
            out = [math.floor(n * f) for n, f in zip(x.shape[2:], factors[2:])]
            if pytorch_half and any(s == 1 for s in out):
                raise ValueError("Resize pytorch_half_pixel to length 1")
        mode_name = how
        if how == "linear":
            mode_name = _RESIZE_LINEAR.get(spatial, "")
            if not mode_name:
                raise ValueError(f"Resize linear of {spatial} spatial axes")
        if how == "bicubic" and spatial != 2:
            raise ValueError("Resize cubic of other than 2 spatial axes")
        extra = {"align_corners": align} if how in ("linear", "bicubic") else {}
        source = x
        if x.dtype == torch.int64:
            source = x.to(torch.float64)
        y = F.interpolate(source, mode=mode_name, **kw, **extra)
        return y.to(x.dtype) if y.dtype != x.dtype else y

    return run


def _loss_common(ctx: NodeContext) -> tuple[str, int | None]:
    reduction = ctx.attr("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise Refused(f"{ctx.node.op_type} reduction={reduction!r}")
    ignore = ctx.attr("ignore_index")
    return reduction, int(ignore) if ignore is not None else None


def _nll(torch: Any, log_prob: Any, target: Any, weight: Any, reduction: str,
         ignore: int | None) -> Any:  # fmt: skip
    """ONNX's NegativeLogLikelihoodLoss: -input[n, target[n], ...] * weight[target], the mean
    divided by the weights of the targets not ignored."""
    target = target.long()
    keep = torch.ones_like(target, dtype=torch.bool) if ignore is None else target != ignore
    safe = torch.where(keep, target, 0)
    picked = -torch.gather(log_prob, 1, safe.unsqueeze(1)).squeeze(1)
    w = weight[safe] if weight is not None else torch.ones_like(picked)
    w = torch.where(keep, w, torch.zeros_like(w))
    loss = picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w.sum()


@register("NegativeLogLikelihoodLoss", 12, 13, 22, types=FLOATS)
def nll_loss(ctx: NodeContext) -> Any:
    reduction, ignore = _loss_common(ctx)
    torch = ctx.torch

    def run(x: Any, target: Any, weight: Any = None) -> Any:
        return _nll(torch, x, target, weight, reduction, ignore)

    return run


@register("SoftmaxCrossEntropyLoss", 12, 13, multi_output=True, types=FLOATS)
def softmax_cross_entropy(ctx: NodeContext) -> Any:
    reduction, ignore = _loss_common(ctx)
    torch = ctx.torch

    def run(x: Any, target: Any, weight: Any = None) -> Any:
        log_prob = torch.log_softmax(x, dim=1)
        return _nll(torch, log_prob, target, weight, reduction, ignore), log_prob

    return run


@register("GridSample", 16, 20, 22, types=FLOATS)
def grid_sample(ctx: NodeContext) -> Any:
    mode = ctx.attr("mode", "bilinear" if ctx.opset < 20 else "linear")
    mode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode)
    if mode not in ("bilinear", "nearest", "bicubic"):
        raise Refused(f"GridSample mode {mode!r}")
    padding = ctx.attr("padding_mode", "zeros")
    if padding not in ("zeros", "border", "reflection"):
        raise Refused(f"GridSample padding_mode {padding!r}")
    if mode == "nearest" and padding == "reflection":  # ONNX rounds before reflecting
        raise Refused("GridSample nearest with reflection padding")
    align = bool(int(ctx.attr("align_corners", 0)))
    torch = ctx.torch
    F = torch.nn.functional

    def run(x: Any, grid: Any) -> Any:
        if x.dim() != 4 and mode == "bicubic":
            raise ValueError("GridSample cubic of other than 2 spatial axes")
        return F.grid_sample(x, grid.to(x.dtype), mode=mode, padding_mode=padding,
                             align_corners=align)  # fmt: skip

    return run


@register("MeanVarianceNormalization", 9, 13, types=FLOATS)
def mean_variance_normalization(ctx: NodeContext) -> Any:
    torch = ctx.torch
    axes = tuple(ctx.attr("axes", [0, 2, 3]))

    def run(x: Any) -> Any:
        mean = x.mean(dim=axes, keepdim=True)
        var = (x * x).mean(dim=axes, keepdim=True) - mean * mean
        return (x - mean) / (torch.sqrt(var) + 1e-9)

    return run


@register("Col2Im", 18, types=FLOATS)
def col2im(ctx: NodeContext) -> Any:
    """Every block's column added back at its place in the padded image (any number of
    spatial axes, asymmetric pads), the padding cut off."""
    torch = ctx.torch
    dil_attr, pads_attr, strides_attr = (
        ctx.attr("dilations"), ctx.attr("pads"), ctx.attr("strides"))  # fmt: skip

    def run(x: Any, image_shape: Any, block_shape: Any) -> Any:
        shape, kernel = ints(image_shape), ints(block_shape)
        nd, device = len(shape), x.device
        dil = list(dil_attr) if dil_attr else [1] * nd
        pads = list(pads_attr) if pads_attr else [0] * (2 * nd)
        strides = list(strides_attr) if strides_attr else [1] * nd
        padded = [shape[d] + pads[d] + pads[d + nd] for d in range(nd)]
        blocks = [(padded[d] - dil[d] * (kernel[d] - 1) - 1) // strides[d] + 1 for d in range(nd)]
        pitch = [int(np.prod(padded[d + 1 :])) for d in range(nd)]
        k_grid = torch.meshgrid(*[torch.arange(k, device=device) for k in kernel], indexing="ij")
        b_grid = torch.meshgrid(*[torch.arange(b, device=device) for b in blocks], indexing="ij")
        k_at = sum(k_grid[d].reshape(-1) * dil[d] * pitch[d] for d in range(nd))
        b_at = sum(b_grid[d].reshape(-1) * strides[d] * pitch[d] for d in range(nd))
        index = (k_at.reshape(-1, 1) + b_at.reshape(1, -1)).reshape(-1)
        n = x.shape[0]
        channels = x.shape[1] // int(np.prod(kernel))
        src = x.reshape(n, channels, -1)
        image = x.new_zeros((n, channels, int(np.prod(padded))))
        image = image.scatter_add(2, index.reshape(1, 1, -1).expand(n, channels, -1), src)
        image = image.reshape(n, channels, *padded)
        crop = tuple(slice(pads[d], pads[d] + shape[d]) for d in range(nd))
        return image[(slice(None), slice(None), *crop)]

    return run


@register("AffineGrid", 20, types=FLOATS)
def affine_grid(ctx: NodeContext) -> Any:
    """torch's affine_grid: the same normalized base grid (pixel centres, or corners with
    align_corners) times theta."""
    F = ctx.torch.nn.functional
    align = bool(int(ctx.attr("align_corners", 0)))
    return lambda theta, size: F.affine_grid(theta, ints(size), align_corners=align)


@register("MaxUnpool", 9, 11, 22, types=FLOATS)
def max_unpool(ctx: NodeContext) -> Any:
    """As ONNX's reference: each value put at its index (over the whole tensor) of the shape the
    pool came from, that placed at the start of output_shape when one is given."""
    kernel = list(ctx.attr("kernel_shape"))
    dims = len(kernel)
    strides = list(ctx.attr("strides", [1] * dims))
    pads = list(ctx.attr("pads", [0] * (2 * dims)))

    def run(x: Any, indices: Any, output_shape: Any = None) -> Any:
        inferred = [x.shape[0], x.shape[1]] + [
            (x.shape[d + 2] - 1) * strides[d] - (pads[d] + pads[dims + d]) + kernel[d]
            for d in range(dims)
        ]
        y = x.new_zeros(int(np.prod(inferred)))
        y = y.scatter(0, indices.reshape(-1).long(), x.reshape(-1)).reshape(inferred)
        if output_shape is None:
            return y
        out = x.new_zeros(ints(output_shape))
        out[tuple(slice(0, n) for n in inferred)] = y
        return out

    return run
