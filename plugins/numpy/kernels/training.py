"""The ai.onnx.preview.training domain (optimizers) and the two loss ops of the standard domain.

The optimizers take a variadic list of tensors grouped by role (all X, then all G, then the
state tensors), so the builder works out the group size once and the kernel slices its
argument tuple.
"""

from __future__ import annotations

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

_TRAINING = "ai.onnx.preview.training"


# --- losses


def _nll_factory(ctx: KernelContext, reduction: str):
    """The NLL computation shared by both loss ops: (log-probs, labels, weights) -> loss."""
    if reduction not in ("none", "sum", "mean"):
        raise ctx.unsupported(f"reduction {reduction!r}")
    ignore = ctx.attr("ignore_index", None)

    def nll(logp, target, weight):
        dtype = logp.dtype
        target = target.astype(np.int64, copy=False)
        if ignore is not None:
            keep = target != ignore
            index = np.where(keep, target, 0)
        else:
            keep = None
            index = target
        picked = np.take_along_axis(logp, np.expand_dims(index, 1), axis=1)
        loss = -np.squeeze(picked, axis=1)
        if weight is not None:
            w = weight[index]
            if keep is not None:
                w = np.where(keep, w, dtype.type(0))
            loss = loss * w
        elif keep is not None:
            w = keep.astype(dtype)
            loss = np.where(keep, loss, dtype.type(0))
        else:
            w = None
        if reduction == "none":
            return loss.astype(dtype, copy=False)
        total = loss.sum(dtype=dtype)
        if reduction == "sum":
            return np.asarray(total, dtype=dtype)
        denom = w.sum(dtype=dtype) if w is not None else dtype.type(loss.size)
        return np.asarray(total / denom, dtype=dtype)

    return nll


@register("NegativeLogLikelihoodLoss", 12, 13, 22)
def negative_log_likelihood_loss(ctx: KernelContext):
    nll = _nll_factory(ctx, ctx.attr("reduction", "mean"))

    def run(x, target, weight=None):
        return nll(x, target, weight)

    return run


@register("SoftmaxCrossEntropyLoss", 12, 13, multi_output=True)
def softmax_cross_entropy_loss(ctx: KernelContext):
    """Loss and (optionally) the log-softmax over axis 1 it was computed from."""
    nll = _nll_factory(ctx, ctx.attr("reduction", "mean"))

    def run(scores, labels, weight=None):
        shifted = scores - scores.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        return nll(logp, labels, weight), logp

    return run


# --- optimizers


def _groups(ctx: KernelContext, per_tensor: int) -> int:
    rest = ctx.num_inputs - 2
    if rest <= 0 or rest % per_tensor:
        raise ctx.unsupported(f"expected 2 + {per_tensor}*n inputs, got {ctx.num_inputs}")
    return rest // per_tensor


@register("Adagrad", 1, domain=_TRAINING, multi_output=True)
def adagrad(ctx: KernelContext):
    n = _groups(ctx, 3)
    decay = ctx.attr("decay_factor", 0.0)
    eps = ctx.attr("epsilon", 0.0)
    norm = ctx.attr("norm_coefficient", 0.0)

    def run(r, t, *tensors):
        rate = float(r) / (1.0 + float(t) * decay)
        xs, gs, hs = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        new_x, new_h = [], []
        for x, g, h in zip(xs, gs, hs):
            g_reg = norm * x + g
            h2 = h + g_reg * g_reg
            new_x.append((x - rate * g_reg / (np.sqrt(h2) + eps)).astype(x.dtype, copy=False))
            new_h.append(h2.astype(h.dtype, copy=False))
        return (*new_x, *new_h)

    return run


@register("Momentum", 1, domain=_TRAINING, multi_output=True)
def momentum(ctx: KernelContext):
    n = _groups(ctx, 3)
    alpha = ctx.attr("alpha")
    beta = ctx.attr("beta")
    norm = ctx.attr("norm_coefficient")
    mode = ctx.attr("mode", "standard")
    if mode not in ("standard", "nesterov"):
        raise ctx.unsupported(f"mode {mode!r}")
    nesterov = mode == "nesterov"

    def run(r, t, *tensors):
        rate = float(r)
        b = beta if int(t) > 0 else 1.0
        xs, gs, vs = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        new_x, new_v = [], []
        for x, g, v in zip(xs, gs, vs):
            g_reg = norm * x + g
            v2 = alpha * v + b * g_reg
            step = g_reg + alpha * v2 if nesterov else v2
            new_x.append((x - rate * step).astype(x.dtype, copy=False))
            new_v.append(v2.astype(v.dtype, copy=False))
        return (*new_x, *new_v)

    return run


@register("Adam", 1, domain=_TRAINING, multi_output=True)
def adam(ctx: KernelContext):
    n = _groups(ctx, 4)
    alpha = ctx.attr("alpha", 0.9)
    beta = ctx.attr("beta", 0.999)
    eps = ctx.attr("epsilon", 1e-6)
    norm = ctx.attr("norm_coefficient", 0.0)
    norm_post = ctx.attr("norm_coefficient_post", 0.0)

    def run(r, t, *tensors):
        rate = float(r)
        step = int(t)
        if step > 0:
            rate = rate * np.sqrt(1.0 - beta**step) / (1.0 - alpha**step)
        xs, gs = tensors[:n], tensors[n : 2 * n]
        vs, hs = tensors[2 * n : 3 * n], tensors[3 * n :]
        new_x, new_v, new_h = [], [], []
        for x, g, v, h in zip(xs, gs, vs, hs):
            g_reg = norm * x + g
            v2 = alpha * v + (1.0 - alpha) * g_reg
            h2 = beta * h + (1.0 - beta) * g_reg * g_reg
            x2 = (x - rate * v2 / (np.sqrt(h2) + eps)) * (1.0 - norm_post)
            new_x.append(x2.astype(x.dtype, copy=False))
            new_v.append(v2.astype(v.dtype, copy=False))
            new_h.append(h2.astype(h.dtype, copy=False))
        return (*new_x, *new_v, *new_h)

    return run
