"""Element-wise ops: arithmetic, comparison, logic, bitwise, math functions, activations, casts.

Most ops map onto a numpy ufunc with ONNX's multidirectional broadcasting, which numpy shares.
The work left to the builders is keeping ONNX's result types where numpy's differ:

- a ufunc over 0-d arrays returns a numpy scalar, so kernels whose output may be 0-d are
  wrapped to return an ``np.ndarray`` (:func:`_arrays`);
- integer ``Div`` truncates toward zero (C), where numpy floors;
- ``Pow`` keeps the base's type whatever the exponent's type;
- activations take float attributes that must not promote float16/float32 inputs; float16
  activations run in float32 (their intermediates, e.g. exp(x), overflow float16 early).

Speed: activations chain in-place ufuncs on one fresh buffer, and max(x, 0)-style steps are
``np.clip`` calls, because numpy vectorises clip but neither ``maximum`` against a scalar nor
``where`` (3x and 30x slower here).

When shape inference left an input's dtype unknown, :func:`_by_dtype` picks the specialised
kernel on first use of each dtype instead of at load time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper

from plugserve.plugins.numpy.kernels import narrow
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

Kernel = Callable[..., object]


# --- shared helpers


def _arrays(ctx: KernelContext, fn: Kernel) -> Kernel:
    """``fn`` made to return an ndarray even for 0-d results (ufuncs return numpy scalars)."""
    shape = ctx.output_shape(0)
    if shape is not None and len(shape) > 0:
        return fn

    def run(*args):
        result = fn(*args)
        return result if type(result) is np.ndarray else np.asarray(result)

    return run


def _by_dtype(ctx: KernelContext, choose: Callable[[np.dtype], Kernel], index: int = 0) -> Kernel:
    """The kernel ``choose(dtype)`` for input ``index``'s dtype: chosen now when shape inference
    knows it, else on the first request of each dtype (then cached)."""
    dtype = ctx.input_dtype(index)
    if dtype is not None:
        return choose(np.dtype(dtype))
    cache: dict[np.dtype, Kernel] = {}

    def run(*args):
        dt = args[index].dtype
        fn = cache.get(dt)
        if fn is None:
            fn = cache[dt] = choose(dt)
        return fn(*args)

    return run


def _float_only(ctx: KernelContext, make: Callable[[np.dtype], Kernel]) -> Kernel:
    """A float-typed unary op: ``make(dtype)`` builds the kernel with constants of that dtype.

    Such kernels chain in-place ufuncs (``out=``), which need arrays: a 0-d input runs as a
    1-element vector unless shape inference says the input has a rank.
    """

    def choose(dtype: np.dtype) -> Kernel:
        if dtype.kind != "f":
            raise ctx.unsupported(f"input type {dtype} is not implemented")
        if dtype == np.float16:
            return _via_float32(make(np.dtype(np.float32)))
        return make(dtype)

    fn = _by_dtype(ctx, choose)
    shape = ctx.input_shape(0)
    if shape is not None and len(shape) > 0:
        return fn

    def run(x):
        if x.ndim:
            return fn(x)
        return np.asarray(fn(x.reshape(1))).reshape(())

    return run


def _extremes(dtype: np.dtype) -> tuple[np.generic, np.generic]:
    """The lowest and highest values of ``dtype`` (infinities for floats), as dtype scalars."""
    if dtype.kind == "f":
        return dtype.type(-np.inf), dtype.type(np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.min), dtype.type(info.max)


def _positive_part(dtype: np.dtype) -> Kernel:
    """max(x, 0) as a clip, which numpy vectorises; maximum() with a scalar is ~3x slower."""
    zero, high = dtype.type(0), _extremes(dtype)[1]
    return lambda x: np.clip(x, zero, high)


def _negative_part(dtype: np.dtype) -> Kernel:
    """min(x, 0), as a clip for the same reason."""
    low, zero = _extremes(dtype)[0], dtype.type(0)
    return lambda x: np.clip(x, low, zero)


def _via_float32(fn: Kernel) -> Kernel:
    """float16 through a float32 kernel."""

    def run(x):
        return fn(x.astype(np.float32)).astype(np.float16)

    return run


def _legacy_broadcast(ctx: KernelContext, fn: Kernel) -> Kernel:
    """Binary ops before opset 7: with ``broadcast=1`` and an ``axis``, B's dimensions align with
    A's starting at ``axis`` rather than at the end (without ``axis`` numpy's rule applies)."""
    if ctx.version >= 7 or not ctx.attr("broadcast", 0) or not ctx.has_attr("axis"):
        return fn
    axis = ctx.attr("axis")

    def run(a, b):
        start = axis + a.ndim if axis < 0 else axis
        return fn(a, b.reshape(b.shape + (1,) * (a.ndim - start - b.ndim)))

    return run


def _ufunc_builder(ufunc: Callable[..., object]) -> Callable[[KernelContext], Kernel]:
    def build(ctx: KernelContext) -> Kernel:
        return _arrays(ctx, _legacy_broadcast(ctx, ufunc))

    build.__doc__ = f"Direct ``np.{getattr(ufunc, '__name__', ufunc)}``."
    return build


def _register_ufuncs(table: dict[str, tuple[Callable[..., object], tuple[int, ...]]]) -> None:
    for op_type, (ufunc, versions) in table.items():
        register(op_type, *versions)(_ufunc_builder(ufunc))


_register_ufuncs(
    {
        # arithmetic whose numpy result type and semantics already match ONNX
        "Add": (np.add, (1, 6, 7, 13, 14)),
        "Sub": (np.subtract, (1, 6, 7, 13, 14)),
        "Mul": (np.multiply, (1, 6, 7, 13, 14)),
        # math functions (v1 differs only by the ignorable consumed_inputs attribute)
        "Neg": (np.negative, (1, 6, 13)),
        "Abs": (np.absolute, (1, 6, 13)),
        "Reciprocal": (np.reciprocal, (1, 6, 13)),
        "Floor": (np.floor, (1, 6, 13)),
        "Ceil": (np.ceil, (1, 6, 13)),
        "Round": (np.rint, (11, 22)),  # rint rounds halves to even, as ONNX requires
        "Sqrt": (np.sqrt, (1, 6, 13)),
        "Exp": (np.exp, (1, 6, 13)),
        "Log": (np.log, (1, 6, 13)),
        "Sin": (np.sin, (7, 22)),
        "Cos": (np.cos, (7, 22)),
        "Tan": (np.tan, (7, 22)),
        "Asin": (np.arcsin, (7, 22)),
        "Acos": (np.arccos, (7, 22)),
        "Atan": (np.arctan, (7, 22)),
        "Sinh": (np.sinh, (9, 22)),
        "Cosh": (np.cosh, (9, 22)),
        "Asinh": (np.arcsinh, (9, 22)),
        "Acosh": (np.arccosh, (9, 22)),
        "Atanh": (np.arctanh, (9, 22)),
        "Tanh": (np.tanh, (1, 6, 13)),
        "Sign": (np.sign, (9, 13)),
        "IsNaN": (np.isnan, (9, 13, 20)),
        # logic and bitwise
        "Not": (np.logical_not, (1,)),
        "And": (np.logical_and, (1, 7)),
        "Or": (np.logical_or, (1, 7)),
        "Xor": (np.logical_xor, (1, 7)),
        "BitwiseAnd": (np.bitwise_and, (18,)),
        "BitwiseOr": (np.bitwise_or, (18,)),
        "BitwiseXor": (np.bitwise_xor, (18,)),
        "BitwiseNot": (np.invert, (18,)),
        # comparisons
        "Less": (np.less, (1, 7, 9, 13)),
        "LessOrEqual": (np.less_equal, (12, 16)),
        "Greater": (np.greater, (1, 7, 9, 13)),
        "GreaterOrEqual": (np.greater_equal, (12, 16)),
        "Where": (np.where, (9, 16)),
    }
)


# --- arithmetic


def _truncating_divide(a: np.ndarray, b: np.ndarray):
    q = np.floor_divide(a, b)
    # floor and truncation differ exactly when the quotient is negative and inexact
    q += (q < 0) & (q * b != a)
    return q


@register("Div", 1, 6, 7, 13, 14)
def div(ctx: KernelContext):
    """Float division, or integer division truncating toward zero (C semantics, like ONNX)."""

    def choose(dtype: np.dtype) -> Kernel:
        if dtype.kind == "i":
            return _truncating_divide
        if dtype.kind == "u":
            return np.floor_divide
        return np.divide

    return _arrays(ctx, _legacy_broadcast(ctx, _by_dtype(ctx, choose)))


@register("Pow", 1, 7, 12, 13, 15)
def pow_(ctx: KernelContext):
    """The result has the base's type: an integer base stays integer, a float exponent with an
    integer base is applied in float64 and the result converted back."""

    def choose_base(base: np.dtype) -> Kernel:
        def choose_exponent(exponent: np.dtype) -> Kernel:
            if exponent == base:
                return np.power
            if base.kind == "f":
                if exponent.kind in "iub":
                    return lambda x, y: np.power(x, y.astype(base))
                return lambda x, y: np.power(x, y).astype(base, copy=False)
            if exponent.kind == "f":
                return lambda x, y: np.power(x.astype(np.float64), y.astype(np.float64)).astype(
                    base
                )
            return lambda x, y: np.power(x, y.astype(base))

        return _by_dtype(ctx, choose_exponent, 1)

    return _arrays(ctx, _legacy_broadcast(ctx, _by_dtype(ctx, choose_base)))


@register("Mod", 10, 13, 28)
def mod(ctx: KernelContext):
    """fmod=1: C fmod (sign of the dividend); fmod=0: floored modulo (sign of the divisor)."""
    return _arrays(ctx, np.fmod if ctx.attr("fmod", 0) else np.mod)


@register("BitShift", 11, 28)
def bit_shift(ctx: KernelContext):
    """numpy's shifts already give ONNX's results for out-of-range and negative amounts."""
    direction = ctx.attr("direction")
    if isinstance(direction, bytes):
        direction = direction.decode()
    if direction == "LEFT":
        return _arrays(ctx, np.left_shift)
    if direction == "RIGHT":
        return _arrays(ctx, np.right_shift)
    raise ctx.unsupported(f"direction {direction!r}")


@register("Equal", 1, 7, 11, 13, 19)
def equal(ctx: KernelContext):
    """Strings compare as object arrays; the result is made bool for old numpy."""

    def choose(dtype: np.dtype) -> Kernel:
        if dtype.kind == "O":
            return lambda a, b: np.asarray(np.equal(a, b), dtype=bool)
        return np.equal

    return _arrays(ctx, _legacy_broadcast(ctx, _by_dtype(ctx, choose)))


@register("IsInf", 10, 20)
def is_inf(ctx: KernelContext):
    positive = ctx.attr("detect_positive", 1)
    negative = ctx.attr("detect_negative", 1)
    if positive and negative:
        fn = np.isinf
    elif positive:
        fn = np.isposinf
    elif negative:
        fn = np.isneginf
    else:
        fn = lambda x: np.zeros(x.shape, dtype=bool)  # noqa: E731
    return _arrays(ctx, fn)


# --- variadic


def _variadic(ctx: KernelContext, ufunc: Callable[..., object]) -> Kernel:
    if ctx.num_inputs == 1:
        return lambda x: x
    if ctx.num_inputs == 2:
        return _arrays(ctx, ufunc)
    return _arrays(ctx, lambda *xs: functools.reduce(ufunc, xs))


@register("Max", 1, 6, 8, 12, 13)
def max_(ctx: KernelContext):
    """Before v8 the shapes must be equal, which broadcasting computes the same way."""
    return _variadic(ctx, np.maximum)


@register("Min", 1, 6, 8, 12, 13)
def min_(ctx: KernelContext):
    return _variadic(ctx, np.minimum)


@register("Sum", 1, 6, 8, 13)
def sum_(ctx: KernelContext):
    return _variadic(ctx, np.add)


@register("Mean", 1, 6, 8, 13)
def mean(ctx: KernelContext):
    n = ctx.num_inputs
    if n == 1:
        return lambda x: x
    total = _variadic(ctx, np.add)

    def run(*xs):
        result = total(*xs)
        result /= n  # a fresh float array: in place, keeping its dtype
        return result

    return run


@register("Clip", 1, 6, 11, 12, 13)
def clip(ctx: KernelContext):
    """v1/v6 take the bounds as attributes, v11+ as optional inputs (absent: unbounded).

    np.clip yields ``hi`` everywhere when lo > hi, as ONNX specifies; an absent bound becomes
    the dtype's extreme rather than None, which would take numpy's slow path.
    """
    if ctx.version < 11:
        # v6 defaults to the float32 range; v1 leaves an absent bound unbounded
        limit = np.inf if ctx.version == 1 else 3.4028234663852886e38
        lo = ctx.attr("min", -limit)
        hi = ctx.attr("max", limit)

        def make(dtype: np.dtype) -> Kernel:
            low, high = dtype.type(lo), dtype.type(hi)
            return lambda x: np.clip(x, low, high)

        return _float_only(ctx, make)

    has_lo, has_hi = ctx.has_input(1), ctx.has_input(2)
    if not has_lo and not has_hi:
        return lambda x, lo=None, hi=None: x

    def choose(dtype: np.dtype) -> Kernel:
        low, high = _extremes(dtype)
        if has_lo and has_hi:
            return lambda x, lo, hi: np.clip(x, lo, hi)
        if has_lo:
            return lambda x, lo, hi=None: np.clip(x, lo, high)
        return lambda x, lo, hi: np.clip(x, low, hi)

    return _arrays(ctx, _by_dtype(ctx, choose))


# --- casts

_CASTABLE = {
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.INT8,
    TensorProto.INT16,
    TensorProto.INT32,
    TensorProto.INT64,
    TensorProto.UINT8,
    TensorProto.UINT16,
    TensorProto.UINT32,
    TensorProto.UINT64,
    TensorProto.BOOL,
    TensorProto.STRING,
    TensorProto.BFLOAT16,
    TensorProto.COMPLEX64,
    TensorProto.COMPLEX128,
    *(
        getattr(TensorProto, name)
        for name in (
            "FLOAT8E4M3FN",
            "FLOAT8E4M3FNUZ",
            "FLOAT8E5M2",
            "FLOAT8E5M2FNUZ",
            "FLOAT8E8M0",
            "FLOAT4E2M1",
            "INT4",
            "UINT4",
            "INT2",
            "UINT2",
        )
        if hasattr(TensorProto, name)
    ),
}


def _target_dtype(ctx: KernelContext, to: int) -> np.dtype:
    if to not in _CASTABLE:
        name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else to
        raise ctx.unsupported(f"cast to element type {name} is not implemented")
    if to == TensorProto.STRING:
        return np.dtype(object)
    return np.dtype(helper.tensor_dtype_to_np_dtype(to))


def _parse_strings(x: np.ndarray, target: np.dtype) -> np.ndarray:
    """Numbers from strings: plain and scientific notation, INF/-INF/NaN in any case."""
    if narrow.is_narrow(target):
        return _parse_strings(x, np.dtype(np.float32)).astype(target)
    if target.kind == "f":
        return np.asarray(x.astype(target))
    if target.kind == "b":
        return np.asarray(x.astype(np.float64) != 0)
    try:
        return np.asarray(x.astype(target))
    except ValueError:  # "2.5" and "1e3" are not int() literals: go through float
        return np.asarray(x.astype(np.float64).astype(target))


def _narrow_converter(target: np.dtype, saturate: bool, round_mode: str) -> Callable | None:
    """The conversion into a float8 type that the spec defines differently from a plain
    rounding cast: clamping to the largest finite value (``saturate``, the default) and the
    e8m0 exponent-only type's ``round_mode``. None when a plain ``astype`` is the spec."""
    if target in narrow.SATURATING_FLOAT8 and saturate:
        lo, hi = narrow.narrow_range(target)
        return lambda x: np.clip(x, lo, hi).astype(target)
    if target == np.dtype(ml_dtypes.float8_e8m0fnu):
        from onnx.numpy_helper import to_float8e8m0

        return lambda x: to_float8e8m0(x, saturate, round_mode).astype(target)
    return None


def _caster(
    target: np.dtype, saturate: bool = True, round_mode: str = "up"
) -> Callable[[np.dtype], Kernel]:
    special = _narrow_converter(target, saturate, round_mode)

    def choose(source: np.dtype) -> Kernel:
        if source == target:
            return lambda x, *_: x
        if target.kind == "O":
            if narrow.is_narrow(source):
                return lambda x, *_: np.asarray(x.astype(np.float32).astype(np.str_).astype(object))
            return lambda x, *_: np.asarray(x.astype(np.str_).astype(object))
        if source.kind == "O":
            return lambda x, *_: _parse_strings(x, target)
        if special is not None and source.kind in "fiub":
            return lambda x, *_: np.asarray(special(x))
        if special is not None:  # from another narrow type: through float32
            return lambda x, *_: np.asarray(special(x.astype(np.float32)))
        return lambda x, *_: np.asarray(x.astype(target))

    return choose


def _cast_modes(ctx: KernelContext) -> tuple[bool, str]:
    return bool(ctx.attr("saturate", 1)), str(ctx.attr("round_mode", "up"))


@register("Cast", 6, 9, 13, 19, 21, 23, 24, 25, 28)
def cast(ctx: KernelContext):
    """Every element type onnx defines except the 6-bit floats. Numbers become strings in
    numpy's shortest round-trip form; float8 targets clamp when ``saturate`` (the default)."""
    return _by_dtype(ctx, _caster(_target_dtype(ctx, ctx.attr("to")), *_cast_modes(ctx)))


@register("CastLike", 15, 19, 21, 23, 24, 25)
def cast_like(ctx: KernelContext):
    """Cast to the type of the second input (known from shape inference, else per request)."""
    modes = _cast_modes(ctx)
    target = ctx.input_dtype(1)
    if target is not None:
        target = np.dtype(target)
        to = TensorProto.STRING if target.kind == "O" else helper.np_dtype_to_tensor_dtype(target)
        return _by_dtype(ctx, _caster(_target_dtype(ctx, to), *modes))
    cache: dict[tuple[np.dtype, np.dtype], Kernel] = {}

    def run(x, like):
        key = (x.dtype, like.dtype)
        fn = cache.get(key)
        if fn is None:
            if like.dtype.kind not in "biufcO" and not narrow.is_narrow(like.dtype):
                raise TypeError(f"cast to {like.dtype} is not implemented")
            fn = cache[key] = _caster(like.dtype, *modes)(x.dtype)
        return fn(x, like)

    return run


@register("BitCast", 26)
def bit_cast(ctx: KernelContext):
    """Reinterpret the bytes (little-endian hosts, like numpy's native order here)."""
    target = _target_dtype(ctx, ctx.attr("to"))
    if target.kind == "O":
        raise ctx.unsupported("BitCast to string")

    def choose(source: np.dtype) -> Kernel:
        if source.kind == "O":
            raise ctx.unsupported("BitCast from string")
        if source.itemsize != target.itemsize:
            raise ctx.unsupported(f"BitCast between {source} and {target}: sizes differ")
        if target == np.bool_:
            # numpy would keep a byte like 2 as a non-canonical True
            return lambda x: np.asarray(x.view(np.uint8) != 0)

        def run(x):
            return (x if x.flags.c_contiguous else np.ascontiguousarray(x)).view(target)

        return run

    return _by_dtype(ctx, choose)


# --- activations


@register("Relu", 1, 6, 13, 14)
def relu(ctx: KernelContext):
    return _arrays(ctx, _by_dtype(ctx, _positive_part))


@register("LeakyRelu", 1, 6, 16)
def leaky_relu(ctx: KernelContext):
    """max(x, alpha*x) for alpha <= 1 (min otherwise): one pass fewer than a where()."""
    alpha = ctx.attr("alpha", 0.01)
    pick = np.maximum if alpha <= 1 else np.minimum

    def make(dtype: np.dtype) -> Kernel:
        a = dtype.type(alpha)

        def run(x):
            out = np.multiply(x, a)
            return pick(x, out, out=out)

        return run

    return _float_only(ctx, make)


def _elu_like(alpha: float, gamma: float | None) -> Callable[[np.dtype], Kernel]:
    """gamma * (max(x, 0) + alpha * expm1(min(x, 0))): where() would be far slower in numpy."""

    def make(dtype: np.dtype) -> Kernel:
        a = dtype.type(alpha)
        g = None if gamma is None else dtype.type(gamma)
        positive, negative = _positive_part(dtype), _negative_part(dtype)

        def run(x):
            out = negative(x)
            np.expm1(out, out=out)
            out *= a
            out += positive(x)
            if g is not None:
                out *= g
            return out

        return run

    return make


@register("Elu", 1, 6, 22)
def elu(ctx: KernelContext):
    return _float_only(ctx, _elu_like(ctx.attr("alpha", 1.0), None))


@register("Selu", 1, 6, 22)
def selu(ctx: KernelContext):
    if ctx.version == 1:  # v1 had rounder defaults
        alpha, gamma = ctx.attr("alpha", 1.6732), ctx.attr("gamma", 1.0507)
    else:
        alpha = ctx.attr("alpha", 1.67326319217681884765625)
        gamma = ctx.attr("gamma", 1.05070102214813232421875)
    return _float_only(ctx, _elu_like(alpha, gamma))


@register("Celu", 12, 28)
def celu(ctx: KernelContext):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    alpha = ctx.attr("alpha", 1.0)

    def make(dtype: np.dtype) -> Kernel:
        a = dtype.type(alpha)
        positive, negative = _positive_part(dtype), _negative_part(dtype)

        def run(x):
            out = negative(x)
            out /= a
            np.expm1(out, out=out)
            out *= a
            out += positive(x)
            return out

        return run

    return _float_only(ctx, make)


def _sigmoid_into(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)) into ``out``; exp overflows to inf for very negative x, giving 0."""
    np.negative(x, out=out)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += 1
    return np.reciprocal(out, out=out)


@register("Sigmoid", 1, 6, 13)
def sigmoid(ctx: KernelContext):
    return _float_only(ctx, lambda dtype: lambda x: _sigmoid_into(x, np.empty_like(x)))


@register("Swish", 24)
def swish(ctx: KernelContext):
    """x * sigmoid(alpha * x)."""
    alpha = ctx.attr("alpha", 1.0)

    def make(dtype: np.dtype) -> Kernel:
        a = dtype.type(alpha)

        def run(x):
            out = np.multiply(x, a)
            _sigmoid_into(out, out)
            out *= x
            return out

        return run

    return _float_only(ctx, make)


@register("HardSigmoid", 1, 6, 22)
def hard_sigmoid(ctx: KernelContext):
    """max(0, min(1, alpha * x + beta))."""
    alpha = ctx.attr("alpha", 0.2)
    beta = ctx.attr("beta", 0.5)

    def make(dtype: np.dtype) -> Kernel:
        a, b, zero, one = dtype.type(alpha), dtype.type(beta), dtype.type(0), dtype.type(1)

        def run(x):
            out = np.multiply(x, a)
            out += b
            return np.clip(out, zero, one, out=out)

        return run

    return _float_only(ctx, make)


@register("HardSwish", 14, 22)
def hard_swish(ctx: KernelContext):
    """x * max(0, min(1, x / 6 + 1 / 2))."""

    def make(dtype: np.dtype) -> Kernel:
        a, b, zero, one = dtype.type(1 / 6), dtype.type(0.5), dtype.type(0), dtype.type(1)

        def run(x):
            out = np.multiply(x, a)
            out += b
            np.clip(out, zero, one, out=out)
            out *= x
            return out

        return run

    return _float_only(ctx, make)


@register("Softplus", 1, 22)
def softplus(ctx: KernelContext):
    return _float_only(ctx, _softplus)


def _softplus(dtype: np.dtype) -> Kernel:
    """log(1 + exp(x)) as max(x, 0) + log1p(exp(-|x|)): no overflow, accurate for very negative
    x, and several times faster than np.logaddexp."""
    positive = _positive_part(dtype)

    def run(x):
        out = np.absolute(x)
        np.negative(out, out=out)
        np.exp(out, out=out)
        np.log1p(out, out=out)
        out += positive(x)
        return out

    return run


@register("Softsign", 1, 22)
def softsign(ctx: KernelContext):
    """x / (1 + |x|)."""

    def make(dtype: np.dtype) -> Kernel:
        def run(x):
            out = np.absolute(x)
            out += 1
            return np.divide(x, out, out=out)

        return run

    return _float_only(ctx, make)


@register("ThresholdedRelu", 10, 22)
def thresholded_relu(ctx: KernelContext):
    alpha = ctx.attr("alpha", 1.0)

    def make(dtype: np.dtype) -> Kernel:
        a, zero = dtype.type(alpha), dtype.type(0)
        return lambda x: np.where(x > a, x, zero)

    return _float_only(ctx, make)


@register("Shrink", 9)
def shrink(ctx: KernelContext):
    """x + bias below -lambd, x - bias above lambd, else 0; integer inputs are computed in
    float64 and converted back, since lambd and bias are float attributes."""
    lambd = ctx.attr("lambd", 0.5)
    bias = ctx.attr("bias", 0.0)

    def choose(dtype: np.dtype) -> Kernel:
        if dtype.kind == "f":
            lo, hi, b, zero = dtype.type(-lambd), dtype.type(lambd), dtype.type(bias), dtype.type(0)
            return lambda x: np.where(x < lo, x + b, np.where(x > hi, x - b, zero))

        def run(x):
            f = x.astype(np.float64)
            return np.where(f < -lambd, f + bias, np.where(f > lambd, f - bias, 0.0)).astype(dtype)

        return run

    return _arrays(ctx, _by_dtype(ctx, choose))


@register("Mish", 18, 22)
def mish(ctx: KernelContext):
    """x * tanh(softplus(x))."""

    def make(dtype: np.dtype) -> Kernel:
        softplus = _softplus(dtype)

        def run(x):
            out = softplus(x)
            np.tanh(out, out=out)
            out *= x
            return out

        return run

    return _float_only(ctx, make)


@register("PRelu", 7, 9, 16)
def prelu(ctx: KernelContext):
    """max(x, 0) + slope * min(x, 0), slope broadcast to x (unidirectionally, so the result
    has x's shape); arithmetic rather than where(), which is much slower in numpy."""

    def choose(dtype: np.dtype) -> Kernel:
        positive, negative = _positive_part(dtype), _negative_part(dtype)

        def run(x, slope):
            out = negative(x)
            out *= slope
            out += positive(x)
            return out

        return run

    return _arrays(ctx, _by_dtype(ctx, choose))


# --- erf and Gelu


# A rational approximation of erf for float32 (the one Eigen and XLA use): odd numerator and
# even denominator in x, coefficients highest power first, exact to ~6.5e-8 on [-4, 4] and
# saturated outside. Evaluated in float64 its results are within ~1 ulp of float32.
_ERF_NUMERATOR = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_DENOMINATOR = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def _horner(coefficients: tuple[float, ...], x2: np.ndarray, out: np.ndarray) -> np.ndarray:
    np.multiply(x2, coefficients[0], out=out)
    out += coefficients[1]
    for c in coefficients[2:]:
        out *= x2
        out += c
    return out


_ERF_CLIP = (np.float32(-4), np.float32(4))  # erf is +-1 in float32 beyond
_ERF_NUMERATOR_F32 = tuple(np.float32(c) for c in _ERF_NUMERATOR)
_ERF_DENOMINATOR_F32 = tuple(np.float32(c) for c in _ERF_DENOMINATOR)


def _erf_f32_of_clipped(t: np.ndarray) -> np.ndarray:
    """erf of ``t`` (float32, already clipped to ``_ERF_CLIP``, overwritten: it holds the
    denominator afterwards), as a fresh array.

    The rational approximation is Eigen's float erf, evaluated in float32: absolute error
    <= 4e-7 against the exact erf (a few float32 ulps), at 2.4x the speed of evaluating it in
    float64 (which made erf a third of a transformer encoder's non-GEMM time).
    """
    x2 = np.multiply(t, t)
    p = _horner(_ERF_NUMERATOR_F32, x2, np.empty_like(x2))
    p *= t
    p /= _horner(_ERF_DENOMINATOR_F32, x2, t)
    return p


def _erf_narrow(dtype: np.dtype) -> Kernel:
    """erf for float16/float32 inputs, vectorised (scipy's erf is a slow scalar loop)."""

    def run(x):
        p = _erf_f32_of_clipped(np.clip(x, *_ERF_CLIP, dtype=np.float32))
        return p if dtype == np.float32 else p.astype(dtype)

    return run


@functools.cache
def _erf_exact() -> Callable[[np.ndarray], np.ndarray]:
    """float64 erf: scipy's when scipy is installed (it is optional), else math.erf element by
    element, which is exact too, only slower."""
    try:
        from scipy.special import erf

        return erf
    except ImportError:
        scalar = np.frompyfunc(math.erf, 1, 1)
        return lambda x: np.asarray(scalar(x), dtype=np.float64)


def erf_kernel(dtype: np.dtype) -> Kernel:
    """erf for arrays of ``dtype`` (Erf's kernel, and the reference GELU's)."""
    if dtype.itemsize <= 4:
        return _erf_narrow(dtype)
    fn = _erf_exact()
    return lambda x: np.asarray(fn(x), dtype=dtype)


# erf(sqrt(2) z) ~= tanh(z P(z^2) / (1 + q z^2)), a minimax fit on z in [0, 3] (the argument is
# x / 2, see gelu_erf_halved_f32), with z P / Q >= 9.3 from z = 3 to 30 so tanh saturates to
# exactly +-1 in float32 where erf does; z is clipped to +-30 there so huge inputs stay finite.
# P's leading coefficient is divided out of both (P monic saves its first pass).
_GELU_TANH_P = (
    6.374399451142593e-04,
    -8.340222034525023e-03,
    9.20506861903035e-02,
    7.991998373184652e-01,
    1.5957740731672088,
)
_GELU_TANH_Q = 0.3187302311017982
_GELU_MONIC_P = tuple(np.float32(c / _GELU_TANH_P[0]) for c in _GELU_TANH_P[1:])
_GELU_MONIC_Q = (np.float32(_GELU_TANH_Q / _GELU_TANH_P[0]), np.float32(1 / _GELU_TANH_P[0]))
_GELU_Z_CLIP = (np.float32(-30), np.float32(30))


def gelu_erf_halved_f32(z: np.ndarray) -> np.ndarray:
    """The erf GELU of ``x`` given ``z = x / 2`` (float32; a fresh buffer this function
    overwrites with the result, which it returns).

    GELU(x) = 0.5 x (1 + erf(x / sqrt 2)) = z (1 + erf(sqrt(2) z)), and erf(sqrt(2) z) is
    tanh of a small rational function of z, so the whole GELU is 16 passes over memory (one
    of them numpy's vectorised tanh) instead of the 28 of the rational erf. A producer that
    scales its weights by 1/2 (exact in binary) hands over z at no cost. Error against the
    exact GELU, evaluated in float32: <= 1.2e-6 absolute, at most a few ulps of the result,
    the same as the rational erf's (1.4e-6).
    """
    t = np.clip(z, *_GELU_Z_CLIP)
    s = np.multiply(t, t)
    p = np.add(s, _GELU_MONIC_P[0])
    for c in _GELU_MONIC_P[1:]:
        p *= s
        p += c
    s *= _GELU_MONIC_Q[0]
    s += _GELU_MONIC_Q[1]
    p /= s
    p *= t
    np.tanh(p, out=p)
    p += np.float32(1)
    np.multiply(p, z, out=z)
    return z


def _gelu_erf_f32(x: np.ndarray) -> np.ndarray:
    """float32 erf GELU: halve x into a fresh buffer, then :func:`gelu_erf_halved_f32`."""
    return gelu_erf_halved_f32(np.multiply(x, np.float32(0.5)))


@register("Erf", 9, 13)
def erf(ctx: KernelContext):
    return _float_only(ctx, erf_kernel)


@register("Gelu", 20)
def gelu(ctx: KernelContext):
    """0.5 x (1 + erf(x / sqrt 2)), or with approximate="tanh"
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    approximate = ctx.attr("approximate", "none")
    if isinstance(approximate, bytes):
        approximate = approximate.decode()
    if approximate not in ("none", "tanh"):
        raise ctx.unsupported(f"approximate={approximate!r}")

    def make(dtype: np.dtype) -> Kernel:
        half = dtype.type(0.5)
        if approximate == "tanh":
            c, k = dtype.type(math.sqrt(2 / math.pi)), dtype.type(0.044715)

            def run(x):
                out = np.multiply(x, x)
                out *= k
                out += 1
                out *= x
                out *= c
                np.tanh(out, out=out)
                out += 1
                out *= x
                out *= half
                return out

            return run
        inv_sqrt2 = dtype.type(1 / math.sqrt(2))
        if dtype == np.float32:
            return _gelu_erf_f32
        erf_fn = erf_kernel(dtype)

        def run_erf(x):
            out = erf_fn(x * inv_sqrt2)
            out += 1
            out *= x
            out *= half
            return out

        return run_erf

    return _float_only(ctx, make)
