"""Shape and data-movement ops: reshape, slice, gather, scatter, pad, and friends."""

from __future__ import annotations

import numpy as np
from plugserve.plugins.numpy.kernels.registry import KernelContext, register


@register("Identity", 1, 13, 14, 16, 19, 21, 23, 24, 25)
def identity(ctx: KernelContext):
    return lambda x: x


@register("Constant", 1, 9, 11, 12, 13, 19, 21, 23, 24, 25)
def constant(ctx: KernelContext):
    value = constant_value(ctx)
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
