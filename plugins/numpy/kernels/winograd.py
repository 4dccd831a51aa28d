"""Winograd F(r x r, 3x3) for wide 3x3 stride-1 convolutions."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from plugserve.plugins.numpy.kernels.window import (
    ConvSpec,
)
from plugserve.plugins.numpy.parallel import matmul as _gemm

__all__ = ["WINOGRAD_TRANSFORMS", "Winograd", "winograd_tile", "winograd_weights"]


# --------------------------------------------------------------------------- Winograd

#: Winograd F(r x r, 3x3) transforms (Lavin & Gray 2015): an output tile Y (r x r) of a 3x3
#: conv is A^T [(G w G^T) * (B^T d B)] A for the (r + 2) x (r + 2) input tile d it reads.
#: F(2, 3) uses the points 0, +-1, inf; F(4, 3) the points 0, +-1, +-2, inf (2.25x and 4x fewer
#: multiplications than a direct conv). F(4, 3)'s transforms amplify float32 rounding more:
#: max |y - y_ref| / max |y_ref| measured 4e-6 to 7e-6 per conv against a float64 reference
#: (ResNet-18 shapes, He-initialised weights); the bound test_numpy_conv_fast.py holds it
#: to is 1e-4, per conv and on ResNet-18's logits against onnxruntime.
_WG_MATRICES = {
    2: (
        [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]],
    ),
    4: (
        [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ],
        [
            [1 / 4, 0, 0],
            [-1 / 6, -1 / 6, -1 / 6],
            [-1 / 6, 1 / 6, -1 / 6],
            [1 / 24, 1 / 12, 1 / 6],
            [1 / 24, -1 / 12, 1 / 6],
            [0, 0, 1],
        ],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
    ),
}


class _WinogradTransforms:
    """The matrices of one F(r, 3). The input transform is one small Kronecker-product matrix,
    so it runs as one BLAS GEMM over all tiles and channels at once (on both cores) instead of
    dozens of strided numpy passes; the output transform runs one side at a time (see
    :meth:`Winograd.forward`)."""

    def __init__(self, r: int) -> None:
        bt, g, at = (np.array(m, np.float64) for m in _WG_MATRICES[r])
        self.r, self.a, self.g = r, r + 2, g
        self.kin = np.kron(bt, bt).astype(np.float32)  # (a^2, a^2)
        self.at = at.astype(np.float32)  # (r, a)
        self.at_t = np.ascontiguousarray(self.at.T)


#: The transform matrices of F(2, 3) and F(4, 3), made once (the NCHW and the channel-last
#: Winograd kernels share them).
WINOGRAD_TRANSFORMS = {r: _WinogradTransforms(r) for r in _WG_MATRICES}

#: F(2, 3) needs this many input and output channels before the GEMM saving outweighs the
#: tile transforms and their memory traffic. Measured inside ResNet-18 (per-node best of 40,
#: direct -> F(2, 3)): 64 ch at 56x56 1.25 -> 1.28 ms, 128 ch at 28x28 1.24 -> 1.04 ms,
#: 256 ch at 14x14 1.32 -> 0.99 ms.
_WG_MIN_CHANNELS = 128
#: With fewer F(2, 3) tiles than this (7x7 maps: 16) the 16 GEMMs are too thin for BLAS to
#: run well and the gain is within noise (512 ch at 7x7: 1.57 -> 1.52 ms); one direct GEMM
#: serves.
_WG_MIN_TILES = 32
#: F(4, 3) (6x6 tiles, 36 GEMMs) pays where its GEMMs stay wide: at least this many
#: channels times F(4, 3) tiles per image. Measured inside ResNet-18 (per-node best of 30,
#: direct / F(2, 3) / F(4, 3), ms): 64 ch at 56x56 (196 tiles) 1.20-1.32 / 1.26-1.40 /
#: 1.00-1.15; 128 ch at 28x28 (49 tiles) 1.21 / 0.99-1.04 / 0.80-0.84; 256 ch at 14x14
#: (16 tiles) 1.29 / 0.95 / 1.09; 512 ch at 7x7 (4 tiles) 1.55 / 1.48 / 2.45.
_WG4_MIN_WORK = 128 * 49
_WG4_MIN_CHANNELS = 64


def _winograd_tile(c: int, m: int, spatial: tuple | None) -> int:
    """Which F(r, 3) a conv with ``c`` -> ``m`` channels and input map ``spatial`` (None when
    unknown at load time) runs: r = 4, 2, or 0 for the direct paths. F(2, 3) is not ruled out
    by a small map here: the batch size may make enough tiles (:meth:`Winograd.suits`)."""
    narrow = min(c, m)
    if spatial is not None and None not in spatial:
        tiles4 = math.prod(-(-s // 4) for s in spatial)
        if narrow >= _WG4_MIN_CHANNELS and narrow * tiles4 >= _WG4_MIN_WORK:
            return 4
    return 2 if narrow >= _WG_MIN_CHANNELS else 0


def winograd_weights(
    spec: ConvSpec, w: np.ndarray, groups: int, dtype: np.dtype, in_shape: tuple | None = None
):
    """The Winograd path for a constant-weight conv that qualifies, else None.

    Qualifies: float32, 2-D, 3x3, stride 1, no dilation, one group, and wide enough
    (:func:`_winograd_tile`) that the GEMM saving outweighs the tile transforms. Per request,
    :meth:`Winograd.suits` also asks for enough tiles.
    """
    r = winograd_tile(spec, w, groups, dtype, in_shape)
    return Winograd(w, r) if r else None


def winograd_tile(
    spec: ConvSpec, w: np.ndarray, groups: int, dtype: np.dtype, in_shape: tuple | None = None
) -> int:
    """The r of the F(r, 3) :func:`winograd_weights` would build, 0 for none."""
    if dtype != np.float32 or groups != 1 or w.ndim != 4:
        return 0
    if tuple(w.shape[2:]) != (3, 3):
        return 0
    if any(v != 1 for v in (spec.strides or ())) or any(v != 1 for v in (spec.dilations or ())):
        return 0
    spatial = None
    if in_shape is not None and len(in_shape) == 4:
        spatial = tuple(d if isinstance(d, int) and d > 0 else None for d in in_shape[2:])
    return _winograd_tile(w.shape[1], w.shape[0], spatial)


class _WinogradPlan:
    """Per input shape: tile counts, the padded-input view geometry and the work buffers."""

    def __init__(self, spec: ConvSpec, shape: tuple, m: int, r: int) -> None:
        n, c, h, w = shape
        a = r + 2
        (oh, ow), begin, _, _, _ = spec.resolve((h, w), (3, 3))
        self.n, self.c, self.m, self.h, self.w, self.oh, self.ow = n, c, m, h, w, oh, ow
        self.th, self.tw = -(-oh // r), -(-ow // r)
        self.padded = (n, c, r * self.th + 2, r * self.tw + 2)
        rows, cols = slice(begin[0], begin[0] + h), slice(begin[1], begin[1] + w)
        self.interior = (slice(None), slice(None), rows, cols)
        hp, wp = self.padded[2:]
        item = 4
        self.tile_shape = (a, a, c, n, self.th, self.tw)
        self.tile_strides = tuple(v * item for v in (wp, 1, hp * wp, c * hp * wp, r * wp, r))
        tiles = n * self.th * self.tw
        self.shapes = (
            self.tile_shape,
            (a * a, c, tiles),
            (a * a, m, tiles),
            (r, a, m * tiles),
            (r, m * tiles, r),
        )

    def buffers(self) -> tuple[np.ndarray, ...]:
        """Fresh work buffers. Measured: keeping them across requests (per thread, shared by
        same-shaped convs or per conv) was no faster inside ResNet-18 (glibc reuses the freed
        blocks), and per-conv buffers were slower (a larger working set for the caches)."""
        return (np.zeros(self.padded, np.float32), *(np.empty(s, np.float32) for s in self.shapes))


class Winograd:
    """A 3x3 stride-1 conv as Winograd F(r x r, 3x3): (r + 2)^2 GEMMs of (M, C) x (C, tiles)
    replace 9 of (M, C) x (C, pixels), 2.25x (r = 2) or 4x (r = 4) fewer multiplications,
    which is what bounds these convs (numpy's OpenBLAS runs its AVX2 kernels here)."""

    def __init__(self, w: np.ndarray, r: int = 2) -> None:
        self.t = WINOGRAD_TRANSFORMS[r]
        g = self.t.g
        # G w G^T as two batched matmuls (the einsum of it took 0.26 s for 512 x 512 channels)
        u = (g @ w.astype(np.float64) @ g.T).transpose(2, 3, 0, 1)  # (a, a, m, c)
        self.u = np.ascontiguousarray(u.reshape(self.t.a**2, *w.shape[:2]), dtype=np.float32)
        self.m = w.shape[0]
        self.r = r
        self.plans: dict[tuple, _WinogradPlan] = {}

    def suits(self, shape: tuple) -> bool:
        """Whether this input shape has enough tiles for the path to pay (see _WG_MIN_TILES,
        _WG4_MIN_WORK); other shapes (dynamic ones) take the direct paths."""
        if len(shape) != 4:
            return False
        tiles = shape[0] * -(-shape[2] // self.r) * -(-shape[3] // self.r)
        if self.r == 4:
            return min(self.u.shape[1:]) * tiles >= _WG4_MIN_WORK
        return tiles >= _WG_MIN_TILES

    def forward(self, spec: ConvSpec, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        plan = self.plans.get(x.shape)
        if plan is None:
            plan = self.plans[x.shape] = _WinogradPlan(spec, x.shape, self.m, self.r)
        t, r = self.t, self.r
        xp, d, v, prod, half, y = plan.buffers()
        n, m, th, tw = plan.n, self.m, plan.th, plan.tw
        xp[plan.interior] = x
        np.copyto(d, as_strided(xp, plan.tile_shape, plan.tile_strides, writeable=False))
        _gemm(t.kin, d.reshape(t.a**2, -1), out=v.reshape(t.a**2, -1))
        _gemm(self.u, v, out=prod)
        # The output transform A^T P A runs one side at a time: first over the tile rows (one
        # GEMM), then per output row i over the tile columns with the result's columns j
        # innermost, so y[i] is (m, n, ty, tx, j) and output row r ty + i of every tile is one
        # contiguous run of r tw pixels: r long-run copies (adding the bias on the way), not
        # r^2 strided ones. Measured in ResNet-18's layer shapes, 15-40 % faster than one
        # Kronecker GEMM followed by the r^2 strided copies.
        half = _gemm(t.at, prod.reshape(t.a, -1), out=half.reshape(r, -1))
        np.matmul(half.reshape(r, t.a, -1).transpose(0, 2, 1), t.at_t, out=y)
        rows = y.reshape(r, m, n, th, tw * r)
        out = np.empty((n, m, th, r, tw * r), np.float32)
        for i in range(r):
            src = rows[i].transpose(1, 0, 2, 3)
            if bias is not None:
                np.add(src, bias.reshape(1, m, 1, 1), out=out[:, :, :, i])
            else:
                np.copyto(out[:, :, :, i], src)
        out = out.reshape(n, m, r * th, r * tw)
        if (r * th, r * tw) != (plan.oh, plan.ow):
            out = np.ascontiguousarray(out[:, :, : plan.oh, : plan.ow])
        return out
