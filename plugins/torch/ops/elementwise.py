"""Element-wise ops: math, activations, comparisons and logic, Cast, Where, Clip."""

from __future__ import annotations

from typing import Any

import onnx

from plugserve.plugins.torch.ops.registry import NodeContext, Refused, register

FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})
INTS = frozenset({"int8", "uint8", "int16", "int32", "int64", "uint16", "uint32"})
NUMBERS = FLOATS | INTS
BOOL = frozenset({"bool"})


def _unary(op: str, versions: tuple[int, ...], name: str, types: frozenset[str] = FLOATS) -> None:
    @register(op, *versions, types=types)
    def convert(ctx: NodeContext) -> Any:
        fn = getattr(ctx.torch, name)
        return fn

    convert.__name__ = f"convert_{op}"


for _op, _versions, _name in [
    ("Exp", (6, 13), "exp"), ("Log", (6, 13), "log"), ("Sqrt", (6, 13), "sqrt"),
    ("Sin", (7, 22), "sin"), ("Cos", (7, 22), "cos"), ("Tan", (7, 22), "tan"),
    ("Asin", (7, 22), "asin"), ("Acos", (7, 22), "acos"), ("Atan", (7, 22), "atan"),
    ("Sinh", (9, 22), "sinh"), ("Cosh", (9, 22), "cosh"),
    ("Asinh", (9, 22), "asinh"), ("Acosh", (9, 22), "acosh"), ("Atanh", (9, 22), "atanh"),
    ("Erf", (9, 13), "erf"), ("Sigmoid", (6, 13), "sigmoid"), ("Tanh", (6, 13), "tanh"),
    ("Floor", (6, 13), "floor"), ("Ceil", (6, 13), "ceil"), ("Round", (11, 22), "round"),
]:  # fmt: skip
    _unary(_op, _versions, _name)

_unary("Abs", (6, 13), "abs", NUMBERS)
_unary("Neg", (6, 13), "neg", FLOATS | frozenset({"int8", "int16", "int32", "int64"}))
_unary("Sign", (9, 13), "sign", NUMBERS)
_unary("Not", (1,), "logical_not", BOOL)
_unary("Relu", (6, 13, 14), "relu", FLOATS | frozenset({"int8", "int16", "int32", "int64"}))


@register("Reciprocal", 6, 13, types=FLOATS)
def reciprocal(ctx: NodeContext) -> Any:
    return ctx.torch.reciprocal


@register("IsNaN", 9, 13, 20, types=FLOATS | BOOL)
def is_nan(ctx: NodeContext) -> Any:
    return ctx.torch.isnan


@register("IsInf", 10, 20, types=FLOATS | BOOL)
def is_inf(ctx: NodeContext) -> Any:
    torch = ctx.torch
    neg, pos = int(ctx.attr("detect_negative", 1)), int(ctx.attr("detect_positive", 1))
    if neg and pos:
        return torch.isinf
    if pos:
        return torch.isposinf
    if neg:
        return torch.isneginf
    return lambda x: torch.zeros_like(x, dtype=torch.bool)


@register("Identity", 1, 13, 14, 16, 19, 21, 23, 24, 25)
def identity(ctx: NodeContext) -> Any:
    return lambda x: x


@register("Softplus", 1, 22, types=FLOATS)
def softplus(ctx: NodeContext) -> Any:
    torch = ctx.torch
    return lambda x: torch.log1p(torch.exp(-torch.abs(x))) + torch.clamp(x, min=0)


@register("Softsign", 1, 22, types=FLOATS)
def softsign(ctx: NodeContext) -> Any:
    return lambda x: x / (1 + x.abs())


@register("LeakyRelu", 6, 16, types=FLOATS)
def leaky_relu(ctx: NodeContext) -> Any:
    alpha = float(ctx.attr("alpha", 0.01))
    fn = ctx.torch.nn.functional.leaky_relu
    return lambda x: fn(x, alpha)


@register("Elu", 6, 22, types=FLOATS)
def elu(ctx: NodeContext) -> Any:
    alpha = float(ctx.attr("alpha", 1.0))
    torch = ctx.torch
    return lambda x: torch.where(x > 0, x, alpha * torch.expm1(x))


@register("Celu", 12, 28, types=FLOATS)
def celu(ctx: NodeContext) -> Any:
    alpha = float(ctx.attr("alpha", 1.0))
    fn = ctx.torch.nn.functional.celu
    return lambda x: fn(x, alpha)


@register("Selu", 6, 22, types=FLOATS)
def selu(ctx: NodeContext) -> Any:
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    torch = ctx.torch
    return lambda x: gamma * torch.where(x > 0, x, alpha * torch.expm1(x))


@register("ThresholdedRelu", 10, 22, types=FLOATS)
def thresholded_relu(ctx: NodeContext) -> Any:
    alpha = float(ctx.attr("alpha", 1.0))
    torch = ctx.torch
    return lambda x: torch.where(x > alpha, x, torch.zeros_like(x))


@register("HardSigmoid", 6, 22, types=FLOATS)
def hard_sigmoid(ctx: NodeContext) -> Any:
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    torch = ctx.torch
    return lambda x: torch.clamp(alpha * x + beta, 0, 1)


@register("HardSwish", 14, 22, types=FLOATS)
def hard_swish(ctx: NodeContext) -> Any:
    torch = ctx.torch
    return lambda x: x * torch.clamp(x / 6 + 0.5, 0, 1)


@register("Mish", 18, 22, types=FLOATS)
def mish(ctx: NodeContext) -> Any:
    fn = ctx.torch.nn.functional.mish
    return fn


@register("Gelu", 20, types=FLOATS)
def gelu(ctx: NodeContext) -> Any:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise Refused(f"Gelu approximate={approximate!r}")
    fn = ctx.torch.nn.functional.gelu
    return lambda x: fn(x, approximate=approximate)


@register("PRelu", 7, 9, 16, types=FLOATS)
def prelu(ctx: NodeContext) -> Any:
    torch = ctx.torch
    return lambda x, slope: torch.where(x < 0, x * slope, x)


@register("Clip", 6, 11, 12, 13, types=NUMBERS)
def clip(ctx: NodeContext) -> Any:
    torch = ctx.torch
    if ctx.opset < 11:
        lo, hi = (
            float(ctx.attr("min", -3.4028234663852886e38)),
            float(ctx.attr("max", 3.4028234663852886e38)),
        )
        return lambda x: torch.clamp(x, lo, hi)

    def run(x: Any, lo: Any = None, hi: Any = None) -> Any:
        if lo is not None:
            x = torch.maximum(x, lo.to(x.dtype))
        if hi is not None:
            x = torch.minimum(x, hi.to(x.dtype))
        return x

    return run


def _binary(op: str, versions: tuple[int, ...], fn_name: str, types: frozenset[str]) -> None:
    @register(op, *versions, types=types)
    def convert(ctx: NodeContext) -> Any:
        return getattr(ctx.torch, fn_name)

    convert.__name__ = f"convert_{op}"


_binary("Add", (7, 13, 14), "add", NUMBERS)
_binary("Sub", (7, 13, 14), "sub", NUMBERS)
_binary("Mul", (7, 13, 14), "mul", NUMBERS)
_binary("And", (7,), "logical_and", BOOL)
_binary("Or", (7,), "logical_or", BOOL)
_binary("Xor", (7,), "logical_xor", BOOL)
_binary("Equal", (11, 13, 19), "eq", NUMBERS | BOOL)
_binary("Greater", (9, 13), "gt", NUMBERS | BOOL)
_binary("Less", (9, 13), "lt", NUMBERS | BOOL)
_binary("GreaterOrEqual", (12, 16), "ge", NUMBERS | BOOL)
_binary("LessOrEqual", (12, 16), "le", NUMBERS | BOOL)


@register("Div", 7, 13, 14, types=NUMBERS)
def div(ctx: NodeContext) -> Any:
    torch = ctx.torch
    kind = ctx.out_type().kind
    if kind in "iu":  # ONNX (and numpy's reference) truncate integer division
        return lambda a, b: torch.div(a, b, rounding_mode="trunc")
    return torch.div


@register("Mod", 10, 13, 28, types=NUMBERS)
def mod(ctx: NodeContext) -> Any:
    torch = ctx.torch
    if int(ctx.attr("fmod", 0)):
        return torch.fmod
    if ctx.out_type().kind != "f":
        return torch.remainder

    def floored(a: Any, b: Any) -> Any:  # numpy's mod (28 spells it out): fmod moved to b's sign
        m = torch.fmod(a, b)
        m = torch.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)
        return torch.where(m == 0, torch.copysign(torch.zeros_like(m), b), m)

    return floored


@register("Pow", 7, 12, 13, 15, types=NUMBERS)
def power(ctx: NodeContext) -> Any:
    torch = ctx.torch
    out = ctx.out_type()
    if out.kind in "iu" and ctx.in_type(1).kind not in "iu":
        raise Refused("Pow of integers to a float exponent")

    def run(x: Any, y: Any) -> Any:
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return torch.pow(x, y)

    return run


def _variadic(op: str, versions: tuple[int, ...], combine: str, types: frozenset[str]) -> None:
    @register(op, *versions, types=types)
    def convert(ctx: NodeContext) -> Any:
        torch = ctx.torch
        pair = getattr(torch, combine)

        def run(*xs: Any) -> Any:
            result = xs[0]
            for x in xs[1:]:
                result = pair(result, x)
            if op == "Mean":
                result = result / len(xs)
            return result if len(xs) > 1 else result.clone()

        return run

    convert.__name__ = f"convert_{op}"


_variadic("Sum", (8, 13), "add", FLOATS)
_variadic("Mean", (8, 13), "add", FLOATS)
_variadic("Max", (8, 12, 13), "maximum", NUMBERS)
_variadic("Min", (8, 12, 13), "minimum", NUMBERS)


@register("Where", 9, 16)
def where(ctx: NodeContext) -> Any:
    return ctx.torch.where


@register("Cast", 6, 9, 13, 19, 21, 23, 24, 25, 28)
def cast(ctx: NodeContext) -> Any:
    to = int(ctx.attr("to"))
    target = ctx.onnx_dtype(to)
    if ctx.rounds_to_f16(onnx.helper.tensor_dtype_to_np_dtype(to)):
        torch = ctx.torch
        return lambda x: x.to(torch.float16).to(target)
    return lambda x: x.to(target)


@register("CastLike", 15, 19, 21, 23, 24, 25)
def cast_like(ctx: NodeContext) -> Any:
    like = ctx.in_type(1)
    if like is not None and ctx.rounds_to_f16(like):
        torch = ctx.torch
        return lambda x, like: x.to(torch.float16).to(like.dtype)
    return lambda x, like: x.to(like.dtype)


_binary("BitwiseAnd", (18,), "bitwise_and", INTS)
_binary("BitwiseOr", (18,), "bitwise_or", INTS)
_binary("BitwiseXor", (18,), "bitwise_xor", INTS)
_unary("BitwiseNot", (18,), "bitwise_not", INTS)


@register("BitShift", 11, 28, types=INTS)
def bit_shift(ctx: NodeContext) -> Any:
    """28 adds signed types and defines shifts by a negative or too large amount: 0, or -1
    for a negative value shifted right (torch's own results there are undefined)."""
    torch = ctx.torch
    left = ctx.attr("direction") == "LEFT"
    if ctx.in_type(0).kind == "i" and ctx.opset < 28:
        raise Refused(f"BitShift of {ctx.in_type(0)} before opset 28")
    bits = ctx.in_type(0).itemsize * 8

    def run(x: Any, y: Any) -> Any:
        x, y = torch.broadcast_tensors(x, y)
        outside = (y < 0) | (y >= bits)
        amount = torch.where(outside, torch.zeros_like(y), y)
        if left:
            return torch.where(outside, torch.zeros_like(x), torch.bitwise_left_shift(x, amount))
        fill = torch.where(x < 0, torch.full_like(x, -1), torch.zeros_like(x))
        return torch.where(outside, fill, torch.bitwise_right_shift(x, amount))

    return run


def _swish_alpha(ctx: NodeContext) -> float:
    return float(ctx.attr("alpha", 1.0))


@register("Swish", 24, types=FLOATS)
def swish(ctx: NodeContext) -> Any:
    alpha = _swish_alpha(ctx)
    torch = ctx.torch
    return lambda x: x * torch.sigmoid(alpha * x)


@register("Shrink", 9, types=NUMBERS)
def shrink(ctx: NodeContext) -> Any:
    torch = ctx.torch
    lambd, bias = float(ctx.attr("lambd", 0.5)), float(ctx.attr("bias", 0.0))

    def run(x: Any) -> Any:
        zero = torch.zeros_like(x)
        shrunk = torch.where(x > lambd, x - bias, zero)
        return torch.where(x < -lambd, x + bias, shrunk).to(x.dtype)

    return run


@register("SwiGLU", 28, types=FLOATS)
def swiglu(ctx: NodeContext) -> Any:
    torch = ctx.torch
    alpha = float(ctx.attr("alpha", 1.0))
    return lambda a, b: a * torch.sigmoid(alpha * a) * b
