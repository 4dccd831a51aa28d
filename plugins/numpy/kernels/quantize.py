"""Quantize/dequantize and the integer convolution and matmul ops.

QuantizeLinear and DequantizeLinear take every quantized type the spec lists: int8/uint8,
int16/uint16, int4/uint4, int2/uint2 (rounded half to even and clamped), the float8 family
(rounded to nearest, clamped to the largest finite value when ``saturate``; their zero point must
be 0 and is not added) and float4e2m1 (which has no infinity, so rounding already clamps); int32
for DequantizeLinear. The narrow types are ``ml_dtypes`` arrays (see :mod:`narrow`).

Integer products are computed exactly in float64 (BLAS GEMM; every partial sum of 8/16-bit
products is an integer far below 2**53) and converted back, so ConvInteger, MatMulInteger and
the QLinear ops return exactly what an int32-accumulating runtime returns, at GEMM speed. The
convolutions reuse the float Conv machinery of :mod:`nn`.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from plugserve.plugins.numpy.kernels import narrow
from plugserve.plugins.numpy.kernels.conv import conv_forward, pack_conv_weight
from plugserve.plugins.numpy.kernels.registry import KernelContext, register
from plugserve.plugins.numpy.kernels.window import ConvSpec

_RANGES = {
    np.dtype(np.uint8): (0, 255),
    np.dtype(np.int8): (-128, 127),
    np.dtype(np.uint16): (0, 65535),
    np.dtype(np.int16): (-32768, 32767),
    **{dtype: narrow.narrow_range(dtype) for dtype in narrow.NARROW_INTS},
}
_FLOAT8 = narrow.SATURATING_FLOAT8
_FLOAT4 = frozenset(d for d in narrow.NARROW_FLOATS if d.name == "float4_e2m1fn")


def _onnx_dtype(code: int) -> np.dtype | None:
    """The numpy dtype of an output_dtype / precision attribute's ONNX type code."""
    if code in (TensorProto.UNDEFINED, TensorProto.STRING):
        return None
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(code))
    except (KeyError, ValueError, TypeError):
        return None


def _broadcast_param(value: np.ndarray, shape: tuple, axis: int, block_size: int) -> np.ndarray:
    """A scale or zero point shaped to broadcast against x: per tensor, per axis or blocked."""
    if value.ndim == 0 or (value.size == 1 and not block_size):
        return value.reshape(())
    if not block_size:
        if value.ndim != 1 or value.shape[0] != shape[axis]:
            raise ValueError(
                f"per-axis parameter of shape {value.shape} for axis {axis} of {shape}"
            )
        dims = [1] * len(shape)
        dims[axis] = value.shape[0]
        return value.reshape(dims)
    if value.ndim != len(shape):
        raise ValueError(f"blocked parameter of rank {value.ndim} for input of rank {len(shape)}")
    full = np.repeat(value, block_size, axis=axis)
    if full.shape[axis] < shape[axis]:
        raise ValueError(f"blocked parameter {value.shape} too short for {shape}")
    return np.take(full, np.arange(shape[axis]), axis=axis)


def _axis_attrs(ctx: KernelContext) -> tuple[int, int]:
    axis = int(ctx.attr("axis", 1))
    block_size = int(ctx.attr("block_size", 0)) if ctx.version >= 21 else 0
    if block_size < 0:
        raise ctx.unsupported(f"block_size {block_size}")
    return axis, block_size


@register("QuantizeLinear", 10, 13, 19, 21, 23, 24, 25, 28)
def quantize_linear(ctx: KernelContext):
    """y = saturate(round_half_even(x / scale) + zero_point)."""
    axis, block_size = _axis_attrs(ctx)
    zp_dtype = ctx.input_dtype(2) if ctx.has_input(2) else None
    out_code = int(ctx.attr("output_dtype", 0))
    if zp_dtype is not None:
        out_dtype = np.dtype(zp_dtype)
    elif out_code:
        out_dtype = _onnx_dtype(out_code)
    else:
        out_dtype = ctx.output_dtype(0) or np.dtype(np.uint8)
    if out_dtype not in _RANGES and out_dtype not in _FLOAT8 and out_dtype not in _FLOAT4:
        raise ctx.unsupported(f"quantized type {out_dtype} (ONNX type {out_code})")
    precision = int(ctx.attr("precision", 0))
    prec = _onnx_dtype(precision) if precision else None
    if precision and (prec is None or prec.kind != "f"):
        raise ctx.unsupported(f"precision {precision}")
    saturate = bool(ctx.attr("saturate", 1))

    def scaled(x, scale, ax):
        s = _broadcast_param(scale, x.shape, ax, block_size)
        if prec is not None:
            return x.astype(prec) / s.astype(prec)
        if x.dtype.kind == "f" and s.dtype.kind == "f":
            return x / s
        return x.astype(np.float32) / s.astype(np.float32)

    if out_dtype in _FLOAT8:
        lo, hi = narrow.narrow_range(out_dtype)

        def run_float8(x, scale, zero_point=None):
            q = scaled(x, scale, axis + x.ndim if axis < 0 else axis)
            return (np.clip(q, lo, hi) if saturate else q).astype(out_dtype)

        return run_float8

    if out_dtype in _FLOAT4:

        def run_float4(x, scale, zero_point=None):
            ax = axis + x.ndim if axis < 0 else axis
            q = scaled(x, scale, ax)
            if zero_point is not None:
                zp = _broadcast_param(zero_point, x.shape, ax, block_size)
                q = q + zp.astype(np.float32)
            return q.astype(out_dtype)

        return run_float4

    lo, hi = _RANGES[out_dtype]

    def run(x, scale, zero_point=None):
        ax = axis + x.ndim if axis < 0 else axis
        q = np.rint(scaled(x, scale, ax))
        if zero_point is not None:
            zp = _broadcast_param(zero_point, x.shape, ax, block_size)
            q = q.astype(np.float64) + zp.astype(np.float64)
        # fmax drops NaN (x / scale of inf / inf, or of NaN) to the type's minimum, as
        # onnxruntime's max-then-min clamp does; onnxruntime's static quantizer gives an
        # attention mask's -inf the scale inf, so every such BERT quantizes -inf / inf.
        return np.minimum(np.fmax(q, lo), hi).astype(out_dtype)

    return run


@register("DequantizeLinear", 10, 13, 19, 21, 23, 24, 25, 28)
def dequantize_linear(ctx: KernelContext):
    """y = (x - zero_point) * scale, in the scale's type (or output_dtype)."""
    axis, block_size = _axis_attrs(ctx)
    in_dtype = ctx.input_dtype(0)
    quantized = set(_RANGES) | _FLOAT8 | _FLOAT4 | {np.dtype(np.int32)}
    if in_dtype is not None and np.dtype(in_dtype) not in quantized:
        raise ctx.unsupported(f"quantized type {in_dtype}")
    out_code = int(ctx.attr("output_dtype", 0)) if ctx.version >= 23 else 0
    forced = _onnx_dtype(out_code) if out_code else None
    if out_code and (forced is None or (forced.kind != "f" and not narrow.is_narrow(forced))):
        raise ctx.unsupported(f"output_dtype {out_code}")

    def run(x, scale, zero_point=None):
        ax = axis + x.ndim if axis < 0 else axis
        out_dtype = forced or scale.dtype
        dx = x.astype(np.float32)
        if zero_point is not None and x.dtype not in _FLOAT8:
            zp = _broadcast_param(zero_point, x.shape, ax, block_size)
            dx -= zp.astype(np.float32)
        s = _broadcast_param(scale, x.shape, ax, block_size)
        y = dx * (s.astype(np.float32) if narrow.is_narrow(s.dtype) else s)
        return y.astype(out_dtype, copy=False)

    return run


@register("DynamicQuantizeLinear", 11, multi_output=True)
def dynamic_quantize_linear(ctx: KernelContext):
    """uint8 quantization with scale and zero point from the data's range (which includes 0)."""

    def run(x):
        hi = np.float32(max(0.0, float(np.max(x)))) if x.size else np.float32(0)
        lo = np.float32(min(0.0, float(np.min(x)))) if x.size else np.float32(0)
        scale = np.float32(1.0 if hi == lo else hi - lo) / np.float32(255)
        zp = np.rint(np.clip(np.float32(0) - lo / scale, 0, 255))
        y = np.clip(np.rint(x / scale) + zp, 0, 255).astype(np.uint8)
        return y, np.array(scale, dtype=x.dtype), np.array(zp, dtype=np.uint8)

    return run


# --------------------------------------------------------------------------- integer GEMMs


def _centered(v: np.ndarray, zp) -> np.ndarray:
    """``v - zp`` as exact float64 (the GEMM dtype of the integer ops)."""
    out = v.astype(np.float64)
    if zp is not None:
        out -= zp
    return out


#: for the contrib ops' quantized kernels (plugins/numpy/kernels/contrib.py)
RANGES = _RANGES
centered = _centered


def _check_int8(ctx: KernelContext, *inputs: int) -> None:
    for i in inputs:
        dtype = ctx.input_dtype(i)
        if dtype is not None and dtype not in (np.int8, np.uint8):
            raise ctx.unsupported(f"input {i} dtype {dtype}")


def _weight_zero_point(zp, m: int, ndim: int):
    """A weight zero point, scalar or per output channel, shaped against (M, C, *k)."""
    if zp is None:
        return None
    zp = np.asarray(zp, dtype=np.float64)
    if zp.size == 1:
        return zp.reshape(())
    return zp.reshape((m,) + (1,) * (ndim - 1))


class _IntConv:
    """Integer convolution of (x - x_zp) with (w - w_zp) through the float64 Conv path."""

    def __init__(self, ctx: KernelContext, w_index: int, w_zp_index: int) -> None:
        self.groups = int(ctx.attr("group", 1))
        kernel = ctx.attr("kernel_shape", None)
        self.spec = ConvSpec(ctx, kernel)
        w = ctx.constant(w_index)
        wzp = ctx.constant(w_zp_index)
        self.static = None
        if w is not None and (wzp is not None or not ctx.has_input(w_zp_index)):
            self.static = self.pack(w, wzp)

    def pack(self, w, wzp):
        wc = _centered(w, _weight_zero_point(wzp, w.shape[0], w.ndim))
        m, cg = w.shape[:2]
        dw = None
        if self.groups > 1 and cg == 1:
            dw = np.ascontiguousarray(wc.reshape(self.groups, m // self.groups, -1))
        return tuple(w.shape[2:]), pack_conv_weight(wc, self.groups, np.float64), dw

    def __call__(self, x, xzp, w, wzp, bias=None):
        kernel, packed, dw = self.static if self.static is not None else self.pack(w, wzp)
        xc = _centered(x, None if xzp is None else np.float64(np.asarray(xzp).reshape(())))
        return conv_forward(self.spec, self.groups, xc, packed, kernel, bias, dw)


@register("ConvInteger", 10)
def conv_integer(ctx: KernelContext):
    _check_int8(ctx, 0, 1)
    conv = _IntConv(ctx, 1, 3)

    def run(x, w, x_zero_point=None, w_zero_point=None):
        return conv(x, x_zero_point, w, w_zero_point).astype(np.int32)

    return run


@register("QLinearConv", 10)
def qlinear_conv(ctx: KernelContext):
    """QLinearConv: exact integer conv (+ int32 bias), rescaled by x_scale*w_scale/y_scale,
    rounded half to even and saturated to y's type."""
    _check_int8(ctx, 0, 3)
    conv = _IntConv(ctx, 3, 5)

    def run(x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp=None, b=None):
        bias = None if b is None else b.astype(np.float64)
        acc = conv(x, x_zp, w, w_zp, bias)
        ws = np.asarray(w_scale)
        if ws.size > 1:
            ws = ws.reshape((1, -1) + (1,) * (acc.ndim - 2))
        multiplier = (x_scale * ws / y_scale).astype(np.float32)
        out_dtype = y_zp.dtype if y_zp is not None else x.dtype
        return _requantize(acc, multiplier, y_zp, out_dtype)

    return run


def _requantize(acc: np.ndarray, multiplier, zp, out_dtype: np.dtype) -> np.ndarray:
    lo, hi = _RANGES[np.dtype(out_dtype)]
    y = acc.astype(np.float32) * multiplier
    y = np.rint(y)
    if zp is not None:
        y += np.asarray(zp, np.float32)
    return np.clip(y, lo, hi).astype(out_dtype)


def _rowwise(zp):
    """A's zero point: scalar, or one per row (the M dim) broadcast across K."""
    if zp is None:
        return None
    zp = np.asarray(zp, dtype=np.float64)
    if zp.size == 1:
        return zp.reshape(())
    return zp.reshape((*zp.shape, 1))


@register("MatMulInteger", 10)
def matmul_integer(ctx: KernelContext):
    _check_int8(ctx, 0, 1)
    b_const = ctx.constant(1)
    bzp_const = ctx.constant(3)
    b_ready = None
    if b_const is not None and (bzp_const is not None or not ctx.has_input(3)):
        b_ready = _centered(b_const, bzp_const)

    def run(a, b, a_zero_point=None, b_zero_point=None):
        am = _centered(a, _rowwise(a_zero_point))
        bm = b_ready if b_ready is not None else _centered(b, b_zero_point)
        return np.matmul(am, bm).astype(np.int32)

    return run


@register("QLinearMatMul", 10, 21)
def qlinear_matmul(ctx: KernelContext):
    """QLinearMatMul: exact integer product, rescaled by a_scale*b_scale/y_scale (computed in
    the scales' type, as the reference does), rounded half to even and saturated."""
    _check_int8(ctx, 0, 3)

    def run(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp=None):
        acc = np.matmul(_centered(a, _rowwise(a_zp)), _centered(b, b_zp))
        asc = np.asarray(a_scale)
        if asc.size > 1:
            asc = asc.reshape((*asc.shape, 1))
        multiplier = asc * b_scale / y_scale
        out_dtype = y_zp.dtype if y_zp is not None else a.dtype
        lo, hi = _RANGES[np.dtype(out_dtype)]
        y = acc * multiplier.astype(np.float64)
        if y_zp is not None:
            y += np.asarray(y_zp, np.float64)
        return np.clip(np.rint(y), lo, hi).astype(out_dtype)

    return run
