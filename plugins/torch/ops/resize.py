"""Resize in general: one axis after another, each output a weighted sum of its neighbours, the
weights and neighbours computed as ONNX's reference computes them
(``onnx/reference/ops/op_resize.py``: every coordinate transformation, nearest mode, linear
and cubic with antialias and exclude_outside, axes, keep_aspect_ratio_policy, tf_crop_and_resize
with its extrapolation value), in float64. :func:`.nn.resize` takes the cases torch's own
interpolate computes exactly and hands the rest here."""

from __future__ import annotations

import math
from typing import Any

from plugserve.plugins.torch.ops.registry import NodeContext, Refused

_TRANSFORMS = {
    "half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
    "asymmetric", "tf_crop_and_resize",
}  # fmt: skip


def _coeffs(torch: Any, mode: str, nearest: str, a: float, antialias: bool, ratio: Any,
            integer: Any, scale: float) -> Any:  # fmt: skip
    """(outputs, taps) weights for the ratios (the reference's get_coeffs, vectorized)."""
    r = ratio.reshape(-1, 1)
    if mode == "nearest":
        if nearest == "round_prefer_floor":
            up = r > 0.5
        elif nearest == "round_prefer_ceil":
            up = r >= 0.5
        elif nearest == "floor":
            up = torch.zeros_like(r, dtype=torch.bool)
        else:
            up = torch.ones_like(r, dtype=torch.bool)
        up = up | integer.reshape(-1, 1)
        return torch.cat([(~up).to(r.dtype), up.to(r.dtype)], dim=1)
    if mode == "linear" and not antialias:
        return torch.cat([1 - r, r], dim=1)
    if mode == "cubic" and not antialias:
        s, t = r + 1, 1 - r
        return torch.cat(
            [
                ((a * s - 5 * a) * s + 8 * a) * s - 4 * a,
                ((a + 2) * r - (a + 3)) * r * r + 1,
                ((a + 2) * t - (a + 3)) * t * t + 1,
                ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
            ],
            dim=1,
        )
    s = min(scale, 1.0)
    if mode == "linear":
        start = int(math.floor(-1 / s) + 1)
        taps = torch.arange(start, start + 2 - 2 * start, dtype=r.dtype, device=r.device)
        c = torch.clamp(1 - torch.abs((taps - r) * s), 0, 1)
    else:
        start = int(math.floor(-2 / s) + 1)
        taps = torch.arange(start, 2 - start, dtype=r.dtype, device=r.device)
        x = torch.abs(s * (taps - r))
        near = (a + 2) * x**3 - (a + 3) * x**2 + 1
        far = a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
        c = torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))
    return c / c.sum(dim=1, keepdim=True)


def _along(torch: Any, data: Any, axis: int, scale: float, out_len: int, how: dict,
           roi: tuple[float, float] | None) -> Any:  # fmt: skip
    in_len = data.shape[axis]
    if out_len == 0:
        shape = list(data.shape)
        shape[axis] = 0
        return data.new_zeros(shape)
    f64, device = torch.float64, data.device
    y = torch.arange(out_len, dtype=f64, device=device)
    out_w = scale * in_len
    mode = how["transform"]
    outside = None
    if mode == "align_corners":
        x = torch.zeros_like(y) if out_w == 1 else y * (in_len - 1) / (out_w - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi  # type: ignore[misc]
        if out_w == 1:
            x = torch.full_like(y, (hi - lo) * (in_len - 1) / 2)
        else:
            x = y * (hi - lo) * (in_len - 1) / (out_w - 1)
        x = x + lo * (in_len - 1)
        outside = (x < 0) | (x > in_len - 1)
    elif mode == "pytorch_half_pixel":
        x = torch.full_like(y, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    else:  # half_pixel_symmetric
        offset = in_len / 2 * (1 - out_len / out_w)
        x = offset + (y + 0.5) / scale - 0.5
    floor = torch.floor(x)
    integer = x == floor
    ratio = torch.where(integer, torch.ones_like(x), x - floor)
    coeffs = _coeffs(
        torch, how["mode"], how["nearest"], how["a"], how["antialias"], ratio, integer, scale
    )
    n = coeffs.shape[1]
    pad = math.ceil(n / 2)
    padded = x + pad
    p = torch.floor(padded)
    frac = padded - p
    if n % 2 == 0:
        start = torch.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        start = torch.where(frac <= 0.5, base, base + 1)
    idx = (p.long() + start.long()).reshape(-1, 1) + torch.arange(n, device=device) - pad
    if how["exclude"]:
        coeffs = torch.where((idx < 0) | (idx >= in_len), torch.zeros_like(coeffs), coeffs)
        total = coeffs.sum(dim=1, keepdim=True)
        coeffs = coeffs / torch.where(total == 0, torch.ones_like(total), total)
    idx = idx.clamp(0, in_len - 1)
    moved = data.movedim(axis, -1)
    gathered = moved[..., idx.reshape(-1)].reshape(*moved.shape[:-1], out_len, n)
    result = (gathered * coeffs).sum(dim=-1)
    if outside is not None:
        result = torch.where(outside, torch.full_like(result, how["extrapolation"]), result)
    return result.movedim(-1, axis)


def general_resize(ctx: NodeContext) -> Any:
    """The step of a Resize of floats by the reference's own arithmetic."""
    torch = ctx.torch
    if ctx.in_type(0).kind != "f":
        raise Refused(f"Resize of {ctx.in_type(0)} in the general path")
    how = {
        "mode": ctx.attr("mode", "nearest"),
        "nearest": ctx.attr("nearest_mode", "round_prefer_floor"),
        "transform": ctx.attr("coordinate_transformation_mode", "half_pixel"),
        "a": float(ctx.attr("cubic_coeff_a", -0.75)),
        "antialias": bool(int(ctx.attr("antialias", 0))),
        "exclude": bool(int(ctx.attr("exclude_outside", 0))),
        "extrapolation": float(ctx.attr("extrapolation_value", 0.0)),
    }
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    axes_attr = ctx.attr("axes")
    if how["mode"] not in ("nearest", "linear", "cubic") or how["transform"] not in _TRANSFORMS:
        raise Refused(f"Resize mode {how['mode']!r} with {how['transform']!r}")
    if how["mode"] == "nearest" and how["antialias"]:
        raise Refused("Resize nearest with antialias")
    if how["nearest"] not in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
        raise Refused(f"Resize nearest_mode {how['nearest']!r}")
    if policy not in ("stretch", "not_larger", "not_smaller"):
        raise Refused(f"Resize keep_aspect_ratio_policy {policy!r}")
    if ctx.opset < 11:
        raise Refused("Resize before opset 11 in the general path")

    def run(x: Any, roi: Any = None, scales: Any = None, sizes: Any = None) -> Any:
        rank = x.dim()
        axes = list(range(rank)) if axes_attr is None else [a % rank for a in axes_attr]
        roi_full = None
        if roi is not None and roi.numel():
            values = [float(v) for v in roi.reshape(-1).tolist()]
            roi_full = [0.0] * rank + [1.0] * rank
            for i, d in enumerate(axes):
                roi_full[d], roi_full[rank + d] = values[i], values[len(axes) + i]
        if sizes is not None and sizes.numel():
            size = list(x.shape)
            for i, d in enumerate(axes):
                size[d] = int(sizes.reshape(-1)[i])
            factors = [size[i] / x.shape[i] for i in range(rank)]
            if policy != "stretch":
                pick = min if policy == "not_larger" else max
                scale = pick(factors[a] for a in axes)
                factors = [scale if i in axes else 1.0 for i in range(rank)]
                size = [int(scale * x.shape[i] + 0.5) if i in axes else x.shape[i]
                        for i in range(rank)]  # fmt: skip
        else:
            factors = [1.0] * rank
            given = [float(v) for v in scales.reshape(-1).tolist()]
            for i, d in enumerate(axes):
                factors[d] = given[i]
            size = [int(f * n) for f, n in zip(factors, x.shape)]
        result = x.to(torch.float64)
        for axis in axes:
            window = None if roi_full is None else (roi_full[axis], roi_full[axis + rank])
            if (
                math.isclose(factors[axis], 1.0)
                and size[axis] == result.shape[axis]
                and (window is None or (math.isclose(window[0], 0.0)
                                        and math.isclose(window[1], 1.0)))
            ):  # fmt: skip
                continue
            result = _along(torch, result, axis, factors[axis], size[axis], how, window)
        return result.to(x.dtype)

    return run
