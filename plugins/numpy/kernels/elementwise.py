"""Element-wise ops: arithmetic, comparison, logic, bitwise, math functions, activations, casts."""

from __future__ import annotations

import numpy as np
from plugserve.plugins.numpy.kernels.registry import KernelContext, register


@register("Add", 7, 13, 14)
def add(ctx: KernelContext):
    return np.add


@register("Relu", 6, 13, 14)
def relu(ctx: KernelContext):
    def run(x):
        return np.maximum(x, x.dtype.type(0))

    return run
