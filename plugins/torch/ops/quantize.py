"""QDQ: QuantizeLinear and DequantizeLinear (int8/uint8, per tensor or per axis), and
DynamicQuantizeLinear, so int8 models exported as QDQ run here whole (their integer
arithmetic exact, the float parts in the compute precision)."""

from __future__ import annotations

from typing import Any

import numpy as np

from plugserve.plugins.torch.ops.nn import conv_step
from plugserve.plugins.torch.ops.registry import NodeContext, Refused, register

_Q = frozenset({"int8", "uint8", "int16", "uint16", "int32"})
_F = frozenset({"float32", "float16", "bfloat16"})


def _axis_view(ctx: NodeContext, x: Any, param: Any, axis: int) -> Any:
    """A per-axis scale or zero point shaped to broadcast along ``axis`` of ``x``; a blocked
    one (``block_size``: as many dims as x, one value per block along ``axis``) repeated over
    its block."""
    block = int(ctx.attr("block_size", 0))
    if block and param.dim() == x.dim() and param.dim() > 0:
        dim = axis % x.dim()
        return param.repeat_interleave(block, dim=dim).narrow(dim, 0, x.shape[dim])
    if param.dim() == 0 or param.numel() == 1:
        return param.reshape(())
    shape = [1] * x.dim()
    shape[axis % x.dim()] = param.numel()
    return param.reshape(shape)


def _check_blocks(ctx: NodeContext) -> None:
    if int(ctx.attr("block_size", 0)) < 0:
        raise Refused(f"{ctx.node.op_type} with a negative block_size")
    # output_dtype only names y's type (without a zero point): ctx.out_type() is it


@register("QuantizeLinear", 10, 13, 19, 21, 23, 24, 25, 28, types=_Q | _F)
def quantize_linear(ctx: NodeContext) -> Any:
    _check_blocks(ctx)
    torch = ctx.torch
    axis = int(ctx.attr("axis", 1))
    out = ctx.out_type()
    if out is None or out.name not in ("int8", "uint8", "int16", "uint16"):
        raise Refused(f"QuantizeLinear to {out}")
    if int(ctx.attr("saturate", 1)) != 1:
        raise Refused("QuantizeLinear saturate=0")
    info = np.iinfo(out)  # uint16 is held in int32: the declared type's bounds
    dtype = ctx.dtype(out)

    def run(x: Any, scale: Any, zero: Any = None) -> Any:
        s = _axis_view(ctx, x, scale, axis).to(torch.float32)
        q = torch.round(x.to(torch.float32) / s)  # round half to even, as ONNX
        if zero is not None:
            q = q + _axis_view(ctx, x, zero, axis).to(torch.float32)
        return torch.clamp(q, info.min, info.max).to(dtype)

    return run


@register("DequantizeLinear", 10, 13, 19, 21, 23, 24, 25, 28, types=_Q | _F)
def dequantize_linear(ctx: NodeContext) -> Any:
    _check_blocks(ctx)
    torch = ctx.torch
    axis = int(ctx.attr("axis", 1))
    out = ctx.dtype(ctx.out_type())

    def run(x: Any, scale: Any, zero: Any = None) -> Any:
        v = x.to(torch.int32)
        if zero is not None:
            v = v - _axis_view(ctx, x, zero, axis).to(torch.int32)
        return (v.to(torch.float32) * _axis_view(ctx, x, scale, axis).to(torch.float32)).to(out)

    return run


@register("DynamicQuantizeLinear", 11, multi_output=True, types=frozenset({"float32", "uint8"}))
def dynamic_quantize_linear(ctx: NodeContext) -> Any:
    torch = ctx.torch
    if ctx.compute != torch.float32:
        raise Refused("DynamicQuantizeLinear below f32 (its scale is a float32 output)")

    def run(x: Any) -> Any:
        x = x.to(torch.float32)
        lo = torch.clamp(x.min(), max=0.0)
        hi = torch.clamp(x.max(), min=0.0)
        scale = (hi - lo) / 255.0
        # a zero scale (x all zero) chosen on the device, not read on the host: capturable
        given = scale != 0
        safe = torch.where(given, scale, torch.ones_like(scale))
        zero = torch.where(given, torch.clamp(torch.round(-lo / safe), 0, 255), lo * 0)
        y = torch.where(given, torch.clamp(torch.round(x / safe) + zero, 0, 255), x * 0 + zero)
        return y.to(torch.uint8), scale.reshape(()), zero.to(torch.uint8).reshape(())

    return run


def _centered(torch: Any, x: Any, zero: Any, axis: int | None) -> Any:
    """``x - zero`` exact, in float64 (int8 products summed over thousands of terms pass
    float32's 2^24; float64 holds them exactly, and torch multiplies it on every device)."""
    v = x.to(torch.float64)
    if zero is None:
        return v
    z = zero.to(torch.float64)
    if axis is not None and z.dim() == 1 and z.numel() > 1:
        shape = [1] * v.dim()
        shape[axis] = z.numel()
        z = z.reshape(shape)
    return v - z


@register("MatMulInteger", 10, types=frozenset({"int8", "uint8", "int32"}))
def matmul_integer(ctx: NodeContext) -> Any:
    torch = ctx.torch

    def run(a: Any, b: Any, a_zero: Any = None, b_zero: Any = None) -> Any:
        # a's zero point is per row (its axis -2) when a vector, b's per column (its last)
        left = _centered(torch, a, a_zero, a.dim() - 2 if a.dim() > 1 else None)
        right = _centered(torch, b, b_zero, b.dim() - 1)
        return torch.matmul(left, right).to(torch.int32)

    return run


@register("ConvInteger", 10, types=frozenset({"int8", "uint8", "int32"}))
def conv_integer(ctx: NodeContext) -> Any:
    torch = ctx.torch
    step = conv_step(ctx)

    def run(x: Any, w: Any, x_zero: Any = None, w_zero: Any = None) -> Any:
        if x_zero is not None and x_zero.numel() != 1:
            raise ValueError("ConvInteger with a zero point per channel of its input")
        left = _centered(torch, x, x_zero, None)
        right = _centered(torch, w, w_zero, 0)
        return step(left, right).to(torch.int32)

    return run


@register("QLinearMatMul", 10, 21, types=frozenset({"int8", "uint8"}))
def qlinear_matmul(ctx: NodeContext) -> Any:
    """As ONNX's reference: the integer product (exact in float64: no integer matmul on CUDA)
    times a_scale * b_scale / y_scale (in the scales' precision), plus y's zero point,
    rounded half to even and saturated."""
    torch = ctx.torch
    out = ctx.out_type()
    info = np.iinfo(out)
    f64 = torch.float64

    def run(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero=None):
        a = a.to(f64) - (a_zero.to(f64) if a_zero is not None else 0)
        b = b.to(f64) - (b_zero.to(f64) if b_zero is not None else 0)
        factor = (a_scale * b_scale / y_scale).to(f64)
        d = torch.matmul(a, b) * factor
        if y_zero is not None:
            d = d + y_zero.to(f64)
        return torch.clamp(torch.round(d), info.min, info.max).to(ctx.dtype(out))

    return run
