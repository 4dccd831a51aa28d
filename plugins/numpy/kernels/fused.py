"""Kernels for the fused ops the passes create (domain ``ai.plugserve``), registered when the
kernels package is imported.

``FusedConv``, ``FusedGemm`` and ``FusedMatMul`` are the standard op followed by an activation
applied in place on the op's fresh output, so the activation costs no extra allocation. The base
op is built by its own registered kernel; only the activation is added here. ``FusedConvPool``
(Conv -> [Relu] -> MaxPool) is built by :func:`kernels.conv.conv_pool_builder`.
``Gelu`` is the five-op erf GELU the passes found, run by ONNX Gelu's kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from plugserve.plugins.numpy.kernels.attention import register_attention
from plugserve.plugins.numpy.kernels.conv import conv_pool_builder
from plugserve.plugins.numpy.kernels.registry import KernelContext, Registry, default_registry
from plugserve.plugins.passes.fusion import FUSED_DOMAIN

__all__ = ["register_fused"]


def _relu(y: np.ndarray) -> np.ndarray:
    return np.maximum(y, 0, out=y)


def _sigmoid(y: np.ndarray) -> np.ndarray:
    np.negative(y, out=y)
    np.exp(y, out=y)
    y += 1
    return np.reciprocal(y, out=y)


def _tanh(y: np.ndarray) -> np.ndarray:
    return np.tanh(y, out=y)


def _leaky(alpha: float) -> Callable[[np.ndarray], np.ndarray]:
    def run(y: np.ndarray) -> np.ndarray:
        return np.where(y < 0, y * y.dtype.type(alpha), y)

    return run


def _hard_sigmoid(alpha: float, beta: float) -> Callable[[np.ndarray], np.ndarray]:
    def run(y: np.ndarray) -> np.ndarray:
        y *= y.dtype.type(alpha)
        y += y.dtype.type(beta)
        return np.clip(y, 0, 1, out=y)

    return run


def _activation(name: str, params: list[float]) -> Callable[[np.ndarray], np.ndarray]:
    table: dict[str, Callable[[], Callable[[np.ndarray], np.ndarray]]] = {
        "Relu": lambda: _relu,
        "Sigmoid": lambda: _sigmoid,
        "Tanh": lambda: _tanh,
        "LeakyRelu": lambda: _leaky(*params),
        "HardSigmoid": lambda: _hard_sigmoid(*params),
    }
    return table[name]()


def register_fused(registry: Registry) -> None:
    for base in ("Conv", "Gemm", "MatMul"):
        registry.register(f"Fused{base}", 1, domain=FUSED_DOMAIN)(_builder(registry))
    registry.register("Gelu", 1, domain=FUSED_DOMAIN)(_standard_builder(registry))
    registry.register("FusedConvPool", 1, domain=FUSED_DOMAIN)(conv_pool_builder)
    register_attention(registry, FUSED_DOMAIN)


def _standard_builder(registry: Registry) -> Callable[[KernelContext], Callable[..., np.ndarray]]:
    """A fused node that computes exactly a standard op (the erf GELU the passes spell as one
    node): built by that op's own kernel, at the version the pass recorded."""

    def build(ctx: KernelContext) -> Callable[..., np.ndarray]:
        base_op = ctx.node.metadata.get("base_op", ctx.op_type)
        opset = int(ctx.node.metadata.get("opset", 0)) or ctx.opset
        entry = registry.lookup("", base_op, opset)
        if entry is None:
            raise ctx.unsupported(registry.why_unsupported("", base_op, opset))
        return entry.build(ctx.derive(base_op, "", opset))

    return build


def _builder(registry: Registry) -> Callable[[KernelContext], Callable[..., np.ndarray]]:
    def build(ctx: KernelContext) -> Callable[..., np.ndarray]:
        base_op = ctx.node.metadata.get("base_op", ctx.op_type.removeprefix("Fused"))
        opset = int(ctx.node.metadata.get("opset", 0)) or ctx.opset
        entry = registry.lookup("", base_op, opset)
        if entry is None:
            raise ctx.unsupported(registry.why_unsupported("", base_op, opset))
        base = entry.build(ctx.derive(base_op, "", opset, ("activation", "activation_params")))
        act = _activation(ctx.attr("activation"), list(ctx.attr("activation_params", [])))

        def run(*inputs: np.ndarray) -> np.ndarray:
            y = base(*inputs)
            if not (isinstance(y, np.ndarray) and y.flags.writeable):
                y = np.array(y)
            return act(y)

        return run

    return build


register_fused(default_registry)
