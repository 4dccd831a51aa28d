"""Element types numpy lacks: bfloat16, the float8 family, float4e2m1, int4/uint4, int2/uint2.

They come from ``ml_dtypes`` (onnx's own dependency, the library jax and onnx use for the same
types), so arrays of them are ordinary numpy arrays with a foreign dtype. Casts, quantization and
data movement handle them bit-exactly; every other kernel computes them *widened*: narrow floats
as float32 and narrow ints as int8/uint8, rounded back to the narrow type once per node. That is
what onnxruntime does for bfloat16 on CPU, and it stays within one rounding of the reference,
which evaluates each numpy ufunc in the narrow type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from plugserve.plugins.ir import NARROW_FLOATS, NARROW_INTS, is_narrow

__all__ = [
    "NARROW_FLOATS",
    "NARROW_INTS",
    "SATURATING_FLOAT8",
    "is_narrow",
    "narrow_range",
    "wide_dtype",
    "widened",
]

#: The float8 types whose casts clamp to the largest finite value when ``saturate`` is set.
SATURATING_FLOAT8 = frozenset(
    d for d in NARROW_FLOATS if d.name.startswith("float8_") and d.name != "float8_e8m0fnu"
)

#: Ops that move or reinterpret elements without arithmetic, or handle narrow types
#: themselves: they see the narrow dtype unchanged.
EXACT_OPS = frozenset(
    {
        "Cast",
        "CastLike",
        "QuantizeLinear",
        "DequantizeLinear",
        "Identity",
        "Reshape",
        "Shape",
        "Size",
        "Constant",
        "Flatten",
        "Squeeze",
        "Unsqueeze",
        "Transpose",
        "Concat",
        "Split",
        "Slice",
        "Gather",
        "GatherBlockQuantized",
        "Expand",
        "Tile",
        "BitCast",
        "If",
        "Loop",
        "Scan",
    }
)


def wide_dtype(dtype: np.dtype) -> np.dtype:
    """The numpy dtype a narrow type is computed in (the dtype itself otherwise)."""
    dtype = np.dtype(dtype)
    if dtype in NARROW_FLOATS:
        return np.dtype(np.float32)
    return NARROW_INTS.get(dtype, dtype)


def narrow_range(dtype: np.dtype) -> tuple[float, float] | None:
    """The finite range of a narrow type, None for the others."""
    dtype = np.dtype(dtype)
    if dtype in NARROW_FLOATS:
        info = ml_dtypes.finfo(dtype)
        return float(info.min), float(info.max)
    if dtype in NARROW_INTS:
        iinfo = ml_dtypes.iinfo(dtype)
        return int(iinfo.min), int(iinfo.max)
    return None


def _widen(value: Any) -> Any:
    if isinstance(value, np.ndarray) and is_narrow(value.dtype):
        return value.astype(wide_dtype(value.dtype))
    return value


def widened(
    build: Callable[[Any], Callable[..., Any]], ctx: Any, multi_output: bool
) -> Callable[..., Any]:
    """The kernel of ``build`` for a node with narrow-typed values, computing them widened.

    The builder sees the wide dtypes (and widened constants) in its context; the kernel's
    arguments are widened per call and each output goes back to its declared narrow type (or,
    when shape inference gave none, to the first narrow input's type if it came out widened).
    """
    in_specs = [_wide_spec(s) for s in ctx._input_specs]
    out_specs = [_wide_spec(s) for s in ctx._output_specs]
    targets = [s.dtype if s is not None and is_narrow(s.dtype) else None for s in ctx._output_specs]
    fallback = next(
        (np.dtype(s.dtype) for s in ctx._input_specs if s is not None and is_narrow(s.dtype)),
        None,
    )
    constants = {k: _widen(v) for k, v in ctx._constants.items()}
    wide_ctx = type(ctx)(ctx.node, ctx.opset, in_specs, out_specs, constants, ctx._subgraph_factory)
    fn = build(wide_ctx)

    def back(i: int, value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        target = targets[i] if i < len(targets) else None
        if (
            target is None
            and not any(targets)
            and fallback is not None
            and value.dtype == wide_dtype(fallback)
        ):
            target = fallback
        return value.astype(target) if target is not None else value

    def run(*args: Any) -> Any:
        out = fn(*(_widen(a) for a in args))
        if multi_output:
            return tuple(back(i, v) for i, v in enumerate(out))
        return back(0, out)

    return run


def _wide_spec(spec: Any) -> Any:
    if spec is None or not is_narrow(spec.dtype):
        return spec
    import dataclasses

    return dataclasses.replace(spec, dtype=wide_dtype(spec.dtype))
