"""Image ops: resize, grid sampling, RoI align, non-max suppression, and friends.

Resize is separable: every resized axis maps each output index to a few source taps with
weights, decided once per (input shape, scales/sizes, roi) and cached. Nearest is a basic slice
when the taps form a progression (integer downsampling), else one fancy index over the resized
axes. Linear and cubic apply one axis at a time, shrinking axes first: integer factors with
constant per-phase weights (half_pixel 2x and the like) use strided slices; other short axes a
small dense interpolation matrix through BLAS; other long axes a weighted sum of gathered taps.

Opset-10 Resize and Upsample have no coordinate attributes: they use ``asymmetric`` and, for
nearest, onnxruntime's rule (floor when upsampling, ceil when downsampling).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register

# --- Resize / Upsample

_COORD_MODES = {
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_crop_and_resize",
    "tf_half_pixel_for_nn",
}
_NEAREST_MODES = {"round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple"}
_CACHE_LIMIT = 16


def _source_coords(mode, out_int, in_size, scale, roi_lo, roi_hi):
    """Source coordinate of each output index (float64), as the spec's formulas give it."""
    y = np.arange(out_int, dtype=np.float64)
    out_width = scale * in_size
    if mode == "align_corners":
        if out_width == 1:
            return np.zeros(out_int)
        return y * (in_size - 1) / (out_width - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        if out_width == 1:
            x = np.full(out_int, (roi_hi - roi_lo) * (in_size - 1) / 2)
        else:
            x = y * (roi_hi - roi_lo) * (in_size - 1) / (out_width - 1)
        return x + roi_lo * (in_size - 1)
    if mode == "pytorch_half_pixel":
        if out_width == 1:
            return np.full(out_int, -0.5)
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_int / out_width)
        return offset + (y + 0.5) / scale - 0.5
    return (y + 0.5) / scale  # tf_half_pixel_for_nn


def _cubic_kernel(d, a):
    d = np.abs(d)
    d2, d3 = d * d, d * d * d
    near = (a + 2) * d3 - (a + 3) * d2 + 1
    far = a * d3 - 5 * a * d2 + 8 * a * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _linear_kernel(d, a):
    return np.clip(1 - np.abs(d), 0, 1)


class _ResizeConfig:
    def __init__(self, ctx: KernelContext, version: int, op: str) -> None:
        if op == "Upsample" or version == 10:
            self.mode = ctx.attr("mode", "nearest")
            self.coord = "asymmetric"
            self.nearest = "simple"
        else:
            self.mode = ctx.attr("mode", "nearest")
            self.coord = ctx.attr("coordinate_transformation_mode", "half_pixel")
            self.nearest = ctx.attr("nearest_mode", "round_prefer_floor")
        if self.mode == "bilinear":  # Upsample-7 spelling
            self.mode = "linear"
        if self.mode not in ("nearest", "linear", "cubic"):
            raise ctx.unsupported(f"mode {self.mode!r}")
        if self.coord not in _COORD_MODES or (
            self.coord == "tf_half_pixel_for_nn" and version != 11
        ):
            raise ctx.unsupported(f"coordinate_transformation_mode {self.coord!r}")
        if self.nearest not in _NEAREST_MODES:
            raise ctx.unsupported(f"nearest_mode {self.nearest!r}")
        self.cubic_a = float(ctx.attr("cubic_coeff_a", -0.75))
        self.exclude_outside = bool(ctx.attr("exclude_outside", 0))
        self.extrapolation = float(ctx.attr("extrapolation_value", 0.0))
        self.antialias = bool(ctx.attr("antialias", 0)) and self.mode != "nearest"
        self.policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        if self.policy not in ("stretch", "not_larger", "not_smaller"):
            raise ctx.unsupported(f"keep_aspect_ratio_policy {self.policy!r}")
        self.axes = ctx.attr("axes", None)


def _output_geometry(cfg, shape, scales, sizes, roi):
    """Per-axis (scale, output size, roi lo, roi hi) for the full rank."""
    rank = len(shape)
    axes = [a % rank for a in cfg.axes] if cfg.axes is not None else list(range(rank))
    scale_full = [1.0] * rank
    out_full = list(shape)
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        if len(sizes) != len(axes):
            raise ValueError(f"sizes has {len(sizes)} values for {len(axes)} axes")
        ratios = [sizes[i] / shape[a] for i, a in enumerate(axes)]
        if cfg.policy == "stretch":
            for i, a in enumerate(axes):
                scale_full[a], out_full[a] = ratios[i], sizes[i]
        else:
            s = min(ratios) if cfg.policy == "not_larger" else max(ratios)
            for a in axes:
                scale_full[a], out_full[a] = s, int(s * shape[a] + 0.5)
    else:
        if scales is None or len(scales) != len(axes):
            raise ValueError("Resize needs scales or sizes for every resized axis")
        for i, a in enumerate(axes):
            scale_full[a] = float(scales[i])
            out_full[a] = math.floor(scale_full[a] * shape[a])
    lo = [0.0] * rank
    hi = [1.0] * rank
    if roi is not None and roi.size:
        roi = [float(v) for v in roi.ravel()]
        n = len(axes)
        if len(roi) != 2 * n:
            raise ValueError(f"roi has {len(roi)} values for {n} axes")
        for i, a in enumerate(axes):
            lo[a], hi[a] = roi[i], roi[n + i]
    return axes, scale_full, out_full, lo, hi


def _axis_taps(cfg, in_size, out_int, scale, lo, hi):
    """(indices [out, n], weights [out, n] float64, extrapolated mask or None) for one axis."""
    x = _source_coords(cfg.coord, out_int, in_size, scale, lo, hi)
    mask = None
    if cfg.coord == "tf_crop_and_resize":
        mask = (x < 0) | (x > in_size - 1)
        if not mask.any():
            mask = None
    if cfg.mode == "nearest":
        nm = cfg.nearest
        if nm == "simple":
            nm = "floor" if scale >= 1 else "ceil"
        rounder = {
            "round_prefer_floor": lambda v: np.ceil(v - 0.5),
            "round_prefer_ceil": lambda v: np.floor(v + 0.5),
            "floor": np.floor,
            "ceil": np.ceil,
        }[nm]
        idx = np.clip(rounder(x), 0, in_size - 1).astype(np.intp)
        return idx[:, None], np.ones((out_int, 1)), mask
    base = np.ceil(x) - 1  # the tap left of x; x - base is in (0, 1]
    r = x - base
    kernel = _cubic_kernel if cfg.mode == "cubic" else _linear_kernel
    support = 2.0 if cfg.mode == "cubic" else 1.0
    s = min(scale, 1.0) if cfg.antialias else 1.0
    start = int(math.floor(-support / s) + 1)
    n = 2 - 2 * start
    k = np.arange(start, start + n, dtype=np.float64)
    w = kernel((k[None, :] - r[:, None]) * s, cfg.cubic_a)
    if cfg.antialias:
        w = w / w.sum(axis=1, keepdims=True)
    pos = base[:, None].astype(np.int64) + np.arange(start, start + n)[None, :]
    if cfg.exclude_outside:
        w = np.where((pos < 0) | (pos >= in_size), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    idx = np.clip(pos, 0, in_size - 1).astype(np.intp)
    return idx, w, mask


class _ResizePlan:
    """Everything a Resize call needs for one input shape and one set of scales/sizes/roi."""

    def __init__(self, cfg, shape, dtype, scales, sizes, roi) -> None:
        axes, scale_full, out_full, lo, hi = _output_geometry(cfg, shape, scales, sizes, roi)
        self.out_shape = tuple(out_full)
        self.compute = np.float64 if dtype == np.float64 or dtype.kind in "iu" else np.float32
        self.int_out = dtype.kind in "iu"
        self.dtype = dtype
        self.nearest = cfg.mode == "nearest"
        self.fill = cfg.extrapolation
        self.steps = []  # (axis, indices, weights or dense matrix, extrapolation mask)
        self.empty = 0 in self.out_shape
        # Interpolation is separable and the axes commute: shrink first and grow last so the
        # passes touch as little data as possible; on ties do the last (slowest, strided)
        # axis while the tensor is smallest.
        order = sorted(axes, key=lambda a: (out_full[a] / max(shape[a], 1), a != len(shape) - 1))
        for a in order:
            if self.empty:
                break
            if out_full[a] == shape[a] and scale_full[a] == 1.0 and lo[a] == 0.0 and hi[a] == 1.0:
                continue
            idx, w, mask = _axis_taps(cfg, shape[a], out_full[a], scale_full[a], lo[a], hi[a])
            if self.nearest:
                self.steps.append((a, idx[:, 0], None, mask))
                continue
            n = idx.shape[1]
            last = a == len(shape) - 1
            periodic = _Periodic.detect(idx, w, shape[a], self.compute)
            if periodic is not None and not (last and shape[a] <= 64 * n):
                # strided slices beat everything except a GEMM over a short last axis
                self.steps.append((a, periodic, None, mask))
            elif shape[a] <= 64 * n:
                dense = np.zeros((out_full[a], shape[a]), dtype=np.float64)
                np.add.at(dense, (np.repeat(np.arange(out_full[a]), n), idx.ravel()), w.ravel())
                self.steps.append((a, None, dense.astype(self.compute), mask))
            else:
                self.steps.append((a, idx, w.astype(self.compute), mask))
        self.ndim = len(shape)
        self._nearest_index = None
        self._copy = False
        if self.nearest and self.steps:
            resized = [s[0] for s in self.steps]
            strided = [_as_slice(s[1]) for s in self.steps]
            if all(sl is not None for sl in strided):
                index = [slice(None)] * self.ndim
                for a, sl in zip(resized, strided):
                    index[a] = sl
                self._nearest_index = tuple(index)
                self._copy = True
            elif resized == list(range(resized[0], resized[0] + len(resized))) and (
                math.prod(out_full[a] for a in resized) <= 65536
            ):
                # one fancy index over the block of resized axes; faster than chained takes
                # while the index mesh is small, slower on large planes
                mesh = np.ix_(*[s[1] for s in self.steps])
                self._nearest_index = (slice(None),) * resized[0] + mesh

    def __call__(self, x):
        if self.empty:
            return np.zeros(self.out_shape, dtype=self.dtype)
        if not self.steps:
            return x.copy()
        if self.nearest:
            if self._nearest_index is not None:
                y = x[self._nearest_index]
                if self._copy:
                    y = y.copy()
            else:
                y = x
                for a, idx, _, _ in self.steps:
                    y = np.take(y, idx, axis=a)
            for a, _, _, mask in self.steps:
                if mask is not None:
                    y[(slice(None),) * a + (mask,)] = self.fill
            return y
        y = x.astype(self.compute, copy=False)
        for a, idx, w, mask in self.steps:
            y = _apply_axis(y, a, idx, w)
            if mask is not None:
                y[(slice(None),) * a + (mask,)] = self.fill
        if self.int_out:
            info = np.iinfo(self.dtype)
            return np.clip(np.round(y), info.min, info.max).astype(self.dtype)
        return y.astype(self.dtype, copy=False)


def _as_slice(idx):
    """A basic slice equal to an arithmetic-progression index array (e.g. 2x downsampling)."""
    if len(idx) < 2:
        return slice(int(idx[0]), int(idx[0]) + 1) if len(idx) else None
    step = int(idx[1] - idx[0])
    if step <= 0 or not np.array_equal(np.diff(idx), np.full(len(idx) - 1, step)):
        return None
    return slice(int(idx[0]), int(idx[-1]) + 1, step)


class _Periodic:
    """Taps that repeat with a fixed period: integer-factor up- or downsampling.

    Output index ``k * out_step + p`` reads source ``k * in_step + offset`` for each tap of
    phase ``p``, with the same weight for every k. The interior is computed from strided
    slices (no gathers, no padded copy: fresh large temporaries cost page faults); only the
    few edge outputs whose taps clamp go through a gather.
    """

    def __init__(self, out_step, in_step, phases, in_size, count):
        self.out_step = out_step
        self.in_step = in_step
        self.count = count  # outputs per phase
        self.in_size = in_size
        self.phases = []  # per phase: (taps, interior k range, edge ks)
        for taps in phases:
            # k * in_step + off must lie in [0, in_size - 1] for every tap
            k_lo = max(0, *(-(off // in_step) for off, _ in taps))
            k_hi = min(count - 1, *((in_size - 1 - off) // in_step for off, _ in taps))
            edges = np.array([k for k in range(count) if k < k_lo or k > k_hi], dtype=np.intp)
            self.phases.append((taps, k_lo, k_hi, edges))

    @classmethod
    def detect(cls, idx, w, in_size, dtype):
        out_size = idx.shape[0]
        if out_size % in_size == 0:
            out_step, in_step = out_size // in_size, 1
        elif in_size % out_size == 0:
            out_step, in_step = 1, in_size // out_size
        else:
            return None
        count = out_size // out_step
        k = np.arange(count) * in_step
        mid = count // 2
        phases = []
        for p in range(out_step):
            rows, weights = idx[p::out_step], w[p::out_step]
            taps = []
            for j in range(idx.shape[1]):
                col = weights[:, j]
                if np.ptp(col) > 1e-12:
                    return None
                if col[mid] == 0:
                    continue
                off = int(rows[mid, j] - k[mid])
                if not np.array_equal(rows[:, j], np.clip(k + off, 0, in_size - 1)):
                    return None
                taps.append((off, dtype(col[mid])))
            if not taps:
                return None
            phases.append(taps)
        return cls(out_step, in_step, phases, in_size, count)

    def apply(self, y, a):
        lead = (slice(None),) * a
        step, ins = self.out_step, self.in_step
        out = np.empty((*y.shape[:a], self.count * step, *y.shape[a + 1 :]), dtype=y.dtype)
        for p, (taps, k_lo, k_hi, edges) in enumerate(self.phases):
            if k_hi >= k_lo:
                dst = out[(*lead, slice(p + k_lo * step, p + k_hi * step + 1, step))]
                for j, (off, weight) in enumerate(taps):
                    src = y[(*lead, slice(k_lo * ins + off, k_hi * ins + off + 1, ins))]
                    if j == 0:
                        np.multiply(src, weight, out=dst)
                    else:
                        dst += src * weight
            if edges.size:
                acc = None
                for off, weight in taps:
                    src = np.take(y, np.clip(edges * ins + off, 0, self.in_size - 1), axis=a)
                    acc = src * weight if acc is None else acc + src * weight
                out[(*lead, p + edges * step)] = acc
        return out


def _apply_axis(y, a, idx, w):
    """Interpolate along axis ``a``: dense matrix (idx None) or gathered taps."""
    last = a == y.ndim - 1
    if idx is None:
        if last:
            return y @ w.T
        lead = math.prod(y.shape[:a])
        trail = math.prod(y.shape[a + 1 :])
        out = np.matmul(w, y.reshape(lead, y.shape[a], trail))
        return out.reshape(*y.shape[:a], w.shape[0], *y.shape[a + 1 :])
    if isinstance(idx, _Periodic):
        return idx.apply(y, a)
    shape = (1,) * a + (w.shape[0],) + (1,) * (y.ndim - a - 1)
    out = np.take(y, idx[:, 0], axis=a)
    out *= w[:, 0].reshape(shape)
    for j in range(1, idx.shape[1]):
        out += np.take(y, idx[:, j], axis=a) * w[:, j].reshape(shape)
    return out


def _resize_builder(ctx: KernelContext, op: str):
    version = ctx.version
    cfg = _ResizeConfig(ctx, version, op)
    if op == "Upsample" and version == 7:
        attr_scales = np.asarray(ctx.attr("scales"), dtype=np.float32)
        positions = None
    elif op == "Upsample" or version == 10:
        attr_scales = None
        positions = (None, 1, None)
    else:
        attr_scales = None
        positions = (1, 2, 3)

    def const(i):
        if i is None or not ctx.has_input(i):
            return None
        return ctx.constant(i)

    cache: dict = {}
    static = positions is None or all(
        i is None or not ctx.has_input(i) or const(i) is not None for i in positions
    )

    def plan_for(x, roi, scales, sizes):
        if sizes is not None and sizes.size == 0:
            sizes = None
        if scales is not None and scales.size == 0:
            scales = None
        if cfg.coord != "tf_crop_and_resize":
            roi = None
        key = (
            (x.shape, x.dtype.str)
            if static
            else (
                x.shape,
                x.dtype.str,
                None if roi is None else roi.tobytes(),
                None if scales is None else scales.tobytes(),
                None if sizes is None else sizes.tobytes(),
            )
        )
        plan = cache.get(key)
        if plan is None:
            if len(cache) >= _CACHE_LIMIT:
                cache.clear()
            plan = _ResizePlan(cfg, x.shape, x.dtype, scales, sizes, roi)
            cache[key] = plan
        return plan

    if positions is None:

        def run7(x):
            return plan_for(x, None, attr_scales, None)(x)

        return run7
    if positions[0] is None:

        def run10(x, scales):
            return plan_for(x, None, scales, None)(x)

        return run10

    def run(x, roi=None, scales=None, sizes=None):
        return plan_for(x, roi, scales, sizes)(x)

    return run


@register("Resize", 10, 11, 13, 18, 19)
def resize(ctx: KernelContext):
    return _resize_builder(ctx, "Resize")


@register("Upsample", 7, 9, 10)
def upsample(ctx: KernelContext):
    return _resize_builder(ctx, "Upsample")


# --- GridSample / AffineGrid


def _reflect(v, lo, hi):
    """Fold coordinates outside [lo, hi] back in by repeated reflection at the borders."""
    rng = hi - lo
    if rng <= 0:
        return np.where((v < lo) | (v > hi), lo, v)
    below = v < lo
    dx = np.where(below, lo - v, v - hi)
    n = np.trunc(dx / rng)
    r = dx - n * rng
    even = n % 2 == 0
    folded = np.where(below, np.where(even, lo + r, hi - r), np.where(even, hi - r, lo + r))
    return np.where((v < lo) | (v > hi), folded, v)


def _cubic_weights(t, a=-0.75):
    """Keys cubic weights for taps at offsets -1, 0, 1, 2 from floor(x), t = x - floor(x)."""
    return [
        _cubic_kernel(t + 1, a),
        _cubic_kernel(t, a),
        _cubic_kernel(1 - t, a),
        _cubic_kernel(2 - t, a),
    ]


@register("GridSample", 16, 20, 22)
def grid_sample(ctx: KernelContext):
    """Sample X (N, C, *spatial) at grid (N, *out, r) locations; grid[..., 0] indexes the last
    spatial axis. Any spatial rank: taps are gathered from the flattened spatial plane, one
    gather per tap combination (2**r for linear, 4**r for cubic)."""
    mode = ctx.attr("mode", "bilinear" if ctx.version == 16 else "linear")
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    if mode not in ("linear", "nearest", "cubic"):
        raise ctx.unsupported(f"mode {mode!r}")
    padding = ctx.attr("padding_mode", "zeros")
    if padding not in ("zeros", "border", "reflection"):
        raise ctx.unsupported(f"padding_mode {padding!r}")
    align = bool(ctx.attr("align_corners", 0))

    def run(x, grid):
        n, c = x.shape[:2]
        dims = x.shape[2:]
        r = len(dims)
        out_sp = grid.shape[1:-1]
        if grid.shape[-1] != r:
            raise ValueError(f"grid last dim {grid.shape[-1]} != spatial rank {r}")
        flat = x.reshape(n, c, -1)
        if flat.shape[2] == 0 or math.prod(out_sp) == 0:
            return np.zeros((n, c, *out_sp), dtype=x.dtype)
        g = grid.reshape(n, -1, r)
        coords, los, his = [], [], []
        for i, d in enumerate(dims):
            v = g[..., r - 1 - i]
            v = (v + 1) / 2 * (d - 1) if align else ((v + 1) * d - 1) / 2
            lo, hi = (0.0, d - 1.0) if align else (-0.5, d - 0.5)
            if mode == "nearest":
                v = np.rint(v)
            if padding == "border":
                v = np.where((v < lo) | (v > hi), np.clip(v, 0, d - 1), v)
            elif padding == "reflection":
                v = _reflect(v.astype(np.float64), lo, hi).astype(v.dtype)
            coords.append(v)
            los.append(lo)
            his.append(hi)

        def tap_index(i, idx):
            """(clamped index, valid mask or None) for integer taps along spatial dim i."""
            d = dims[i]
            if padding == "zeros":
                valid = (idx >= 0) & (idx < d)
                return np.clip(idx, 0, d - 1), valid
            if padding == "border":
                return np.clip(idx, 0, d - 1), None
            folded = np.trunc(_reflect(idx.astype(np.float64), los[i], his[i]))
            return np.clip(folded.astype(np.int64), 0, d - 1), None

        per_dim = []  # per spatial dim: list of (index, weight or None, valid or None)
        for i, v in enumerate(coords):
            if mode == "nearest":
                per_dim.append([(*tap_index(i, v.astype(np.int64)), None)])
                continue
            base = np.floor(v)
            t = (v - base).astype(x.dtype)
            base = base.astype(np.int64)
            if mode == "linear":
                offsets, weights = (0, 1), (1 - t, t)
            else:
                offsets, weights = (-1, 0, 1, 2), _cubic_weights(t)
            taps = []
            for off, w in zip(offsets, weights):
                idx, valid = tap_index(i, base + off)
                taps.append((idx, valid, w.astype(x.dtype, copy=False)))
            per_dim.append(taps)

        strides = [math.prod(dims[i + 1 :]) for i in range(r)]
        out = np.zeros((n, c, g.shape[1]), dtype=x.dtype)
        for combo in itertools.product(*per_dim):
            flat_idx = sum(idx * s for (idx, _, _), s in zip(combo, strides))
            vals = np.take_along_axis(flat, flat_idx[:, None, :], axis=2)
            weight = None
            valid = None
            for _, ok, w in combo:
                if w is not None:
                    weight = w if weight is None else weight * w
                if ok is not None:
                    valid = ok if valid is None else valid & ok
            if valid is not None:
                vals = np.where(valid[:, None, :], vals, x.dtype.type(0))
            if weight is not None:
                vals = vals * weight[:, None, :]
            out += vals
        return out.reshape(n, c, *out_sp)

    return run


@register("AffineGrid", 20)
def affine_grid(ctx: KernelContext):
    """Grid (N, *spatial, r) of theta applied to the normalized [-1, 1] coordinates."""
    align = bool(ctx.attr("align_corners", 0))

    def axis_coords(d, dtype):
        if align:
            return (
                np.linspace(-1, 1, d, dtype=np.float64).astype(dtype)
                if d > 1
                else np.zeros(d, dtype)
            )
        return ((np.arange(d, dtype=np.float64) * 2 + 1) / d - 1).astype(dtype)

    def run(theta, size):
        size = [int(v) for v in size]
        n, spatial = size[0], size[2:]
        r = len(spatial)
        if theta.shape[1:] != (r, r + 1):
            raise ValueError(f"theta shape {theta.shape} does not fit size {size}")
        axes = [axis_coords(d, theta.dtype) for d in spatial]
        mesh = np.meshgrid(*axes, indexing="ij")
        # homogeneous coordinates, innermost (x) first as the grid convention wants
        base = np.stack([m for m in reversed(mesh)] + [np.ones_like(mesh[0])], axis=-1)
        base = base.reshape(-1, r + 1)
        grid = np.einsum("pk,njk->npj", base, theta)
        return grid.reshape(n, *spatial, r).astype(theta.dtype, copy=False)

    return run


# --- NonMaxSuppression, RoiAlign, MaxRoiPool


def _corners(boxes, center_point_box):
    """(x_min, y_min, x_max, y_max) columns of a (N, 4) box array in either box convention."""
    if center_point_box:
        xc, yc, w, h = boxes[:, 0], boxes[:, 1], boxes[:, 2] / 2, boxes[:, 3] / 2
        return xc - w, yc - h, xc + w, yc + h
    y1, x1, y2, x2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    return np.minimum(x1, x2), np.minimum(y1, y2), np.maximum(x1, x2), np.maximum(y1, y2)


@register("NonMaxSuppression", 10, 11)
def non_max_suppression(ctx: KernelContext):
    """Greedy per-(batch, class) NMS; candidates ordered by score, ties by lower box index.

    Each selected box suppresses the remaining candidates whose IoU with it exceeds the
    threshold, so the loop runs once per *selected* box with a vectorized IoU row.
    """
    center = int(ctx.attr("center_point_box", 0))
    if center not in (0, 1):
        raise ctx.unsupported(f"center_point_box {center}")

    def run(boxes, scores, max_out=None, iou_thr=None, score_thr=None):
        limit = int(max_out.ravel()[0]) if max_out is not None and max_out.size else 0
        iou_t = float(iou_thr.ravel()[0]) if iou_thr is not None and iou_thr.size else 0.0
        use_score = score_thr is not None and score_thr.size > 0
        score_t = score_thr.ravel()[0] if use_score else None
        selected = []
        if limit > 0:
            for b in range(boxes.shape[0]):
                x0, y0, x1, y1 = _corners(boxes[b], center)
                area = (x1 - x0) * (y1 - y0)
                for c in range(scores.shape[1]):
                    s = scores[b, c]
                    order = np.argsort(-s, kind="stable")
                    if use_score:
                        order = order[s[order] > score_t]
                    count = 0
                    while order.size and count < limit:
                        i = order[0]
                        selected.append((b, c, i))
                        count += 1
                        rest = order[1:]
                        iw = np.minimum(x1[i], x1[rest]) - np.maximum(x0[i], x0[rest])
                        ih = np.minimum(y1[i], y1[rest]) - np.maximum(y0[i], y0[rest])
                        inter = iw * ih
                        union = area[i] + area[rest] - inter
                        with np.errstate(divide="ignore", invalid="ignore"):
                            iou = inter / union
                        suppress = (
                            (iw > 0) & (ih > 0) & (area[i] > 0) & (area[rest] > 0) & (union > 0)
                        ) & (iou > iou_t)
                        order = rest[~suppress]
        return np.array(selected, dtype=np.int64).reshape(-1, 3)

    return run


def _roi_samples(start, size, pooled, grid, limit):
    """Bilinear taps of the sampling points along one axis of one RoI.

    Returns (low index, high index, low weight, high weight), each (pooled, grid); points
    beyond the [-1, limit] margin get zero weights, as in the reference implementation.
    """
    bin_size = size / pooled
    p = np.arange(pooled)[:, None]
    i = np.arange(grid)[None, :]
    v = start + p * bin_size + (i + 0.5) * bin_size / grid
    outside = (v < -1.0) | (v > limit)
    v = np.maximum(v, 0.0)
    low = v.astype(np.int64)
    at_edge = low >= limit - 1
    low = np.where(at_edge, limit - 1, low)
    high = np.where(at_edge, limit - 1, low + 1)
    v = np.where(at_edge, low, v)
    frac = v - low
    w_high = np.where(outside, 0.0, frac)
    w_low = np.where(outside, 0.0, 1.0 - frac)
    return low, high, w_low, w_high


@register("RoiAlign", 10, 16, 22)
def roi_align(ctx: KernelContext):
    """Average mode is separable (a y-matrix and an x-matrix per RoI); max mode takes, as the
    reference does, the max over samples of the largest weighted corner value."""
    mode = ctx.attr("mode", "avg")
    if mode not in ("avg", "max"):
        raise ctx.unsupported(f"mode {mode!r}")
    out_h = int(ctx.attr("output_height", 1))
    out_w = int(ctx.attr("output_width", 1))
    ratio = int(ctx.attr("sampling_ratio", 0))
    scale = float(ctx.attr("spatial_scale", 1.0))
    ctm = ctx.attr("coordinate_transformation_mode", "half_pixel" if ctx.version >= 16 else "")
    if ctm not in ("half_pixel", "output_half_pixel", ""):
        raise ctx.unsupported(f"coordinate_transformation_mode {ctm!r}")
    half = ctm == "half_pixel"
    offset = 0.5 if half else 0.0

    def run(x, rois, batch_indices):
        _, c, h, w = x.shape
        out = np.empty((rois.shape[0], c, out_h, out_w), dtype=x.dtype)
        for r in range(rois.shape[0]):
            x1, y1, x2, y2 = (float(v) * scale - offset for v in rois[r, :4])
            rw, rh = x2 - x1, y2 - y1
            if not half:
                rw, rh = max(rw, 1.0), max(rh, 1.0)
            gh = ratio if ratio > 0 else math.ceil(rh / out_h)
            gw = ratio if ratio > 0 else math.ceil(rw / out_w)
            ylo, yhi, wylo, wyhi = _roi_samples(y1, rh, out_h, gh, h)
            xlo, xhi, wxlo, wxhi = _roi_samples(x1, rw, out_w, gw, w)
            img = x[int(batch_indices[r])]
            if mode == "avg":
                ay = np.zeros((out_h, h))
                rows = np.repeat(np.arange(out_h), gh)
                np.add.at(ay, (rows, ylo.ravel()), wylo.ravel())
                np.add.at(ay, (rows, yhi.ravel()), wyhi.ravel())
                ax = np.zeros((out_w, w))
                cols = np.repeat(np.arange(out_w), gw)
                np.add.at(ax, (cols, xlo.ravel()), wxlo.ravel())
                np.add.at(ax, (cols, xhi.ravel()), wxhi.ravel())
                ay /= max(gh * gw, 1)
                out[r] = ay.astype(x.dtype) @ img @ ax.T.astype(x.dtype)
                continue
            if gh == 0 or gw == 0:
                out[r] = 0
                continue
            best = None
            for yi, wy in ((ylo, wylo), (yhi, wyhi)):
                for xi, wx in ((xlo, wxlo), (xhi, wxhi)):
                    vals = img[:, yi[:, :, None, None], xi[None, None, :, :]]
                    vals = vals * (wy[:, :, None, None] * wx[None, None, :, :])
                    best = vals if best is None else np.maximum(best, vals)
            out[r] = best.max(axis=(2, 4))
        return out

    return run


@register("MaxRoiPool", 1, 22)
def max_roi_pool(ctx: KernelContext):
    """Caffe-style RoI max pooling: integer (rounded) RoI corners, floor/ceil bin edges,
    empty bins give 0."""
    pooled_h, pooled_w = (int(v) for v in ctx.attr("pooled_shape"))
    scale = float(ctx.attr("spatial_scale", 1.0))

    def cround(v):
        return math.floor(v + 0.5) if v >= 0 else math.ceil(v - 0.5)

    def run(x, rois):
        _, c, h, w = x.shape
        out = np.zeros((rois.shape[0], c, pooled_h, pooled_w), dtype=x.dtype)
        for r in range(rois.shape[0]):
            b = int(rois[r, 0])
            x1, y1, x2, y2 = (cround(float(v) * scale) for v in rois[r, 1:5])
            bin_h = max(y2 - y1 + 1, 1) / pooled_h
            bin_w = max(x2 - x1 + 1, 1) / pooled_w
            for ph in range(pooled_h):
                hs = min(max(math.floor(ph * bin_h) + y1, 0), h)
                he = min(max(math.ceil((ph + 1) * bin_h) + y1, 0), h)
                for pw in range(pooled_w):
                    ws = min(max(math.floor(pw * bin_w) + x1, 0), w)
                    we = min(max(math.ceil((pw + 1) * bin_w) + x1, 0), w)
                    if he > hs and we > ws:
                        out[r, :, ph, pw] = x[b, :, hs:he, ws:we].max(axis=(1, 2))
        return out

    return run
