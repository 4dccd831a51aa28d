"""Convolution, pooling, Gemm and MatMul.

Convolution is GEMM-based. The builder packs the weights once into ``(groups, M/groups,
prod(kernel) * C/groups)``, tap-major, so each kernel offset's weights are a contiguous column
block. A request then takes one of these paths (chosen once per input shape):

* pointwise (1x1): the input already is the GEMM operand (strided 1x1 convs subsample first);
* "taps" (2-D, stride 1, float32, one group): the padded image is stored with its padded row
  width, so the input rows a kernel offset reads form one BLAS operand in place; one GEMM per
  offset accumulates (beta = 1) into the output. No column buffer is built at all, and the
  copy work an im2col would do runs inside OpenBLAS, on both cores. Needs numpy's bundled
  OpenBLAS through ctypes (numpy's matmul has no beta); otherwise the next path serves;
* "wide" (other 2-D convs): the padded image is split into stride phases so every offset's
  column row is ONE contiguous run; the runs are copied into a column buffer (long memcpys)
  and one matmul covers all groups and batch items;
* im2col (1-D/3-D, and 2-D maps so narrow that wide rows would waste GEMM work): a
  stride-tricks window view copied into one contiguous column buffer, then one matmul;
* Winograd F(4x4, 3x3) or F(2x2, 3x3) (3x3 stride-1 float32 convs with constant weights, wide
  enough to pay; which one, per layer from its channels and map size, is chosen at load time
  by :func:`_winograd_tile`): 4x or 2.25x fewer multiplications, see :class:`Winograd`.

The taps and wide paths compute a few junk columns per output row (padded width minus output
width) that are dropped while the bias is added. A Conv -> [Relu] -> MaxPool the passes fused
(:func:`conv_pool_builder`) pools the raw GEMM output instead, junk columns skipped by a view.
Depthwise convs sum the kernel taps over the whole tensor instead of running one tiny GEMM per
channel.

Everything that depends on the input's shape is planned once per distinct shape and cached, so
a repeated shape costs one dict lookup. float16 is computed in float32 and rounded once at the
end: numpy has no float16 GEMM, and one rounding is closer to what other runtimes return.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from plugserve.plugins.numpy.blas import NO_TRANS as _NO_TRANS
from plugserve.plugins.numpy.blas import ROW_MAJOR as _ROW_MAJOR
from plugserve.plugins.numpy.blas import sgemm as _SGEMM
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

__all__ = [
    "ConvSpec",
    "col2im_add",
    "conv_builder",
    "conv_forward",
    "conv_pool_builder",
    "pack_conv_weight",
]

_AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the math runs in: float16 widens to float32, everything else stays."""
    return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)


# --------------------------------------------------------------------------- window geometry


class ConvSpec:
    """The sliding-window attributes of a Conv/Pool-like node, resolved per input shape.

    ``pads`` are ONNX-ordered (all begins, then all ends). ``resolve`` returns
    ``(out_shape, pads_begin, pads_end, strides, dilations)`` for one spatial input shape and
    kernel; ``plans`` caches the per-shape execution plans of the op owning the spec.
    """

    def __init__(
        self,
        ctx: KernelContext,
        kernel: Sequence[int] | None,
        ceil_mode: bool = False,
        pooling: bool = False,
    ) -> None:
        auto_pad = ctx.attr("auto_pad", "NOTSET")
        if isinstance(auto_pad, bytes):
            auto_pad = auto_pad.decode()
        auto_pad = auto_pad or "NOTSET"
        if auto_pad not in _AUTO_PADS:
            raise ctx.unsupported(f"auto_pad {auto_pad!r}")
        self.auto_pad = auto_pad
        self.kernel = tuple(int(k) for k in kernel) if kernel is not None else None
        self.strides = ctx.attr("strides", None)
        self.dilations = ctx.attr("dilations", None)
        self.pads = ctx.attr("pads", None)
        self.ceil_mode = ceil_mode
        # Conv clamps a negative SAME padding to zero (as onnxruntime does); for pooling the
        # runtimes disagree, so that case is refused rather than guessed.
        self.clamp_same = not pooling
        if (
            pooling
            and auto_pad in ("SAME_UPPER", "SAME_LOWER")
            and any(d != 1 for d in self.dilations or ())
        ):
            raise ctx.unsupported("pooling with auto_pad SAME and dilations (ambiguous size)")
        for name in ("strides", "dilations"):
            values = getattr(self, name)
            if values is not None and any(v < 1 for v in values):
                raise ctx.unsupported(f"{name} must be positive, got {values}")
        if self.pads is not None and any(p < 0 for p in self.pads):
            raise ctx.unsupported(f"negative pads {self.pads}")
        self._cache: dict[tuple, tuple] = {}
        self.plans: dict[tuple, object] = {}  # per-shape plans of the op using this spec

    def resolve(self, spatial: Sequence[int], kernel: Sequence[int] | None = None):
        kernel = tuple(kernel if kernel is not None else self.kernel)
        key = (tuple(spatial), kernel)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._resolve(tuple(spatial), kernel)
        return hit

    def _resolve(self, spatial: tuple, kernel: tuple):
        n = len(spatial)
        strides = tuple(self.strides or (1,) * n)
        dilations = tuple(self.dilations or (1,) * n)
        pads = tuple(self.pads or (0,) * (2 * n))
        if len(strides) != n or len(dilations) != n or len(pads) != 2 * n or len(kernel) != n:
            raise ValueError(
                f"attribute lengths do not match {n} spatial dims "
                f"(kernel {kernel}, strides {strides}, dilations {dilations}, pads {pads})"
            )
        out, begin, end = [], [], []
        for i in range(n):
            size, k, s, d = spatial[i], kernel[i], strides[i], dilations[i]
            span = (k - 1) * d + 1
            if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
                o = -(-size // s)
                total = (o - 1) * s + span - size
                if total < 0 and not self.clamp_same:
                    raise ValueError(
                        f"auto_pad {self.auto_pad} with kernel {k} smaller than stride {s} "
                        "(negative padding) is not implemented"
                    )
                total = max(total, 0)
                small = total // 2
                b = small if self.auto_pad == "SAME_UPPER" else total - small
                e = total - b
            elif self.auto_pad == "VALID":
                b = e = 0
                o = (size - span) // s + 1
            else:
                b, e = pads[i], pads[n + i]
                room = size + b + e - span
                if self.ceil_mode:
                    o = -(-room // s) + 1
                    if (o - 1) * s >= size + b:  # the last window must start inside the data
                        o -= 1
                else:
                    o = room // s + 1
            if o < 1:
                raise ValueError(f"input size {size} is too small for kernel {k} (dim {i})")
            out.append(o)
            begin.append(b)
            end.append(e)
        return tuple(out), tuple(begin), tuple(end), strides, dilations


def _pad(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value=0) -> np.ndarray:
    """``x`` with its trailing len(begin) dims padded by a constant (no copy when no pad)."""
    if not any(begin) and not any(end):
        return x
    n = len(begin)
    lead = x.shape[: x.ndim - n]
    shape = lead + tuple(s + b + e for s, b, e in zip(x.shape[x.ndim - n :], begin, end))
    out = np.zeros(shape, x.dtype) if value == 0 else np.full(shape, value, x.dtype)
    inner = (Ellipsis, *(slice(b, b + s) for b, s in zip(begin, x.shape[x.ndim - n :])))
    out[inner] = x
    return out


def _reach(out: int, stride: int, span: int) -> int:
    """Padded length the windows of one dim touch."""
    return (out - 1) * stride + span


def _tap_views(xp: np.ndarray, kernel, out, strides, dilations):
    """For each kernel offset, the strided view of ``xp`` that offset reads (no copies)."""
    n = len(kernel)
    for offset in itertools.product(*(range(k) for k in kernel)):
        index = (
            Ellipsis,
            *(
                slice(o * d, o * d + (size - 1) * s + 1, s)
                for o, d, size, s in zip(offset, dilations, out, strides)
            ),
        )
        yield offset, xp[index] if n else xp


# --------------------------------------------------------------------------- Conv


def pack_conv_weight(w: np.ndarray, groups: int, dtype: np.dtype) -> np.ndarray:
    """Conv weights ``(M, C/g, *k)`` as contiguous GEMM operands ``(g, M/g, prod(k) * C/g)``.

    Columns are tap-major (kernel offset, then channel), so one tap's weights are the
    contiguous column block ``[t * C/g, (t + 1) * C/g)``: a plain BLAS operand.
    """
    m, cg = w.shape[:2]
    ksize = math.prod(w.shape[2:])
    tapped = w.reshape(groups, m // groups, cg, ksize).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(tapped, dtype=dtype).reshape(groups, m // groups, ksize * cg)


class _ConvPlan:
    """How one input shape is convolved: padding, the column layout and the output shape."""

    __slots__ = (
        "cols_shape",
        "interior",
        "mode",
        "out_sp",
        "padded",
        "strides",
        "trim",
        "view_shape",
        "view_strides",
        "wide",
    )


def _conv_plan(spec: ConvSpec, shape: tuple, kernel: tuple, groups: int, dtype: np.dtype):
    n, c = shape[:2]
    cg = c // groups
    itemsize = dtype.itemsize
    spatial = shape[2:]
    out_sp, begin, _, strides, dil = spec.resolve(spatial, kernel)
    plan = _ConvPlan()
    plan.out_sp = out_sp
    plan.strides = strides
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    # Pad the end only as far as the windows reach; a reach short of the data trims it.
    reach = [
        _reach(o, s, sp) - size - b
        for o, s, sp, size, b in zip(out_sp, strides, spans, spatial, begin)
    ]
    plan.trim = None
    if any(r < 0 for r in reach):
        plan.trim = (
            Ellipsis,
            *(slice(0, size + min(r, 0)) for size, r in zip(spatial, reach)),
        )
        spatial = tuple(size + min(r, 0) for size, r in zip(spatial, reach))
    end = [max(r, 0) for r in reach]
    padded = [size + b + e for size, b, e in zip(spatial, begin, end)]
    ksize = math.prod(kernel)
    length = math.prod(out_sp)
    unit = all(s == 1 for s in strides)
    # "Wide" columns (2-D): the padded image is split into stride phases (one phase when the
    # stride is 1), each stored with a common row width, so every tap's column row is ONE
    # contiguous run of a phase and the copy is a few long memcpys instead of a gather with a
    # strided inner loop. The GEMM then also computes (row width - out width) junk columns per
    # output row, dropped when the bias is added.
    sh, sw = (*strides, 1, 1)[:2]
    hq, wq = (-(-padded[0] // sh), -(-padded[1] // sw)) if len(padded) == 2 else (0, 0)
    junk = wq - out_sp[1] if len(padded) == 2 else 0
    # Per-tap BLAS accumulation reads the image in place, so it tolerates more junk columns
    # than a copied column buffer does before the extra GEMM work outweighs the saved copy.
    blas = _SGEMM is not None and dtype == np.float32 and groups == 1 and unit
    wide = len(spatial) == 2 and ksize > 1 and junk * (4 if blas else 8) <= out_sp[1]
    copy = any(begin) or any(end) or plan.trim is not None
    plan.padded = (n, c, *padded) if copy and not wide else None
    plan.interior = (Ellipsis, *(slice(b, b + size) for b, size in zip(begin, spatial)))
    plan.wide = None
    if ksize == 1:
        plan.mode = "pointwise" if unit else "pointwise_strided"
        plan.cols_shape = (n, groups, cg, length)
    elif wide:
        run = out_sp[0] * wq
        size = (hq + 1) * wq  # + 1 slack row: the last taps' runs read past the last row
        plan.padded = (sh, sw, n, c, hq + 1, wq)
        fills = []
        for ph, pw in itertools.product(range(sh), range(sw)):
            src, dst = [], []
            for phase, stride, pad, extent in zip((ph, pw), (sh, sw), begin, spatial):
                first = (phase - pad) % stride  # first input index landing in this phase
                count = len(range(first, extent, stride))
                start = (first + pad) // stride
                src.append(slice(first, extent, stride))
                dst.append(slice(start, start + count))
            if all(d.stop > d.start for d in dst):
                fills.append(((ph, pw, Ellipsis, *dst), (Ellipsis, *src)))
        taps = []
        for i, j in itertools.product(range(kernel[0]), range(kernel[1])):
            oi, oj = i * dil[0], j * dil[1]
            taps.append((i, j, oi % sh, oj % sw, (oi // sh) * wq + oj // sw))
        plan.interior = fills
        plan.wide = (wq, run, size, taps)
        plan.mode = "taps" if blas else "wide"
        plan.view_shape = (n, groups, *kernel, cg, run)
        plan.view_strides = tuple(
            v * itemsize for v in (c * size, cg * size, dil[0] * wq, dil[1], size, 1)
        )
        plan.cols_shape = (n, groups, ksize * cg, run)
    else:
        plan.mode = "im2col"
        plane = math.prod(padded)
        st = [math.prod(padded[i + 1 :]) for i in range(len(padded))]
        plan.view_shape = (n, groups, *kernel, cg, *out_sp)
        plan.view_strides = tuple(
            v * itemsize
            for v in (
                (
                    c * plane,
                    cg * plane,
                    *(a * d for a, d in zip(st, dil)),
                    plane,
                    *(a * s for a, s in zip(st, strides)),
                )
            )
        )
        plan.cols_shape = (n, groups, ksize * cg, length)
    return plan


def conv_forward(
    spec: ConvSpec,
    groups: int,
    x: np.ndarray,
    packed: np.ndarray,
    kernel: tuple,
    bias: np.ndarray | None,
    depthwise: np.ndarray | None = None,
    winograd: Winograd | None = None,
    raw: bool = False,
) -> np.ndarray:
    """Convolution of ``x`` (already in the compute dtype) with packed weights.

    ``packed`` comes from :func:`pack_conv_weight`; ``bias`` is ``(M,)`` in the compute dtype
    or None; ``depthwise`` is the weight as ``(C, mult, prod(k))`` when the node is depthwise
    (groups == C, one input channel each); ``winograd`` the transformed weights of a conv
    :func:`winograd_weights` accepted. Returns a fresh array ``(N, M, *out)``; with ``raw``
    (and no bias) it may instead be a read-only-by-convention strided view of a fresh buffer (the
    "wide" paths' GEMM output with its junk columns skipped), for a consumer such as a fused
    max pool that reads it once and saves the copy.
    """
    if winograd is not None and x.dtype == np.float32 and winograd.suits(x.shape):
        return winograd.forward(spec, x, bias)
    if depthwise is not None:
        out_sp, begin, end, strides, dil = spec.resolve(x.shape[2:], kernel)
        xp = _pad(x, begin, end)
        return _depthwise(xp, depthwise, kernel, out_sp, strides, dil, bias)
    key = (x.shape, kernel, x.dtype)
    plan = spec.plans.get(key)
    if plan is None:
        plan = spec.plans[key] = _conv_plan(spec, x.shape, kernel, groups, x.dtype)
    if plan.trim is not None:
        x = x[plan.trim]
    if plan.wide is not None:
        return _conv_wide(plan, x, packed, groups, bias, raw)
    if plan.padded is not None:
        xp = _pad_into(plan, x)
    elif x.flags.c_contiguous:
        xp = x
    else:
        xp = np.ascontiguousarray(x)  # the column views assume C order
    if plan.mode == "pointwise":
        cols = xp.reshape(plan.cols_shape)
    elif plan.mode == "pointwise_strided":
        sub = xp[(Ellipsis, *(slice(None, None, s) for s in plan.strides))]
        cols = np.ascontiguousarray(sub).reshape(plan.cols_shape)
    else:
        view = as_strided(xp, plan.view_shape, plan.view_strides, writeable=False)
        cols = np.empty(plan.view_shape, xp.dtype)
        np.copyto(cols, view)
        cols = cols.reshape(plan.cols_shape)
    y = _grouped_matmul(packed, cols, groups)
    n, m = x.shape[0], packed.shape[0] * packed.shape[1]
    y = y.reshape(n, m, -1)
    if bias is not None:
        y += bias[:, None]
    return y.reshape((n, m, *plan.out_sp))


def _pad_into(plan, x):
    xp = np.zeros(plan.padded, x.dtype)
    xp[plan.interior] = x
    return xp


def _grouped_matmul(packed, cols, groups):
    """(g, M/g, K) x (N, g, K, L) -> (N, g, M/g, L) as few BLAS calls as numpy allows."""
    if groups == 1 and cols.shape[0] == 1:
        return np.matmul(packed[0], cols[0, 0])
    if groups == 1:
        return np.matmul(packed[0], cols[:, 0])
    return np.matmul(packed, cols)


def _conv_wide(plan, x, packed, groups, bias, raw=False):
    """The "wide" paths of :func:`_conv_plan` (2-D convs): fill the stride phases, then either
    accumulate one BLAS GEMM per tap straight from them ("taps") or copy the tap runs into a
    column buffer for one matmul ("wide"); finally drop the junk columns while adding bias."""
    phases = np.zeros(plan.padded, x.dtype)
    for dst, src in plan.interior:
        phases[dst] = x[src]
    wq, run, size, taps = plan.wide
    n = x.shape[0]
    m = packed.shape[0] * packed.shape[1]
    if plan.mode == "taps":
        y = np.empty((n, m, run), x.dtype)
        c = x.shape[1]
        lda = packed.shape[2]
        a0 = packed.ctypes.data
        for b in range(n):
            base = phases.ctypes.data + b * c * size * 4
            out = y.ctypes.data + b * m * run * 4
            for t, (_, _, _, _, off) in enumerate(taps):
                _SGEMM(
                    _ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, run, c, 1.0, a0 + t * c * 4, lda,
                    base + off * 4, size, 1.0 if t else 0.0, out, run,
                )  # fmt: skip
    else:
        cols = np.empty(plan.view_shape, x.dtype)
        if phases.shape[0] * phases.shape[1] == 1:
            np.copyto(cols, as_strided(phases, plan.view_shape, plan.view_strides))
        else:
            flat = phases.reshape(phases.shape[:2] + cols.shape[:2] + (-1, size))
            for i, j, ph, pw, off in taps:
                cols[:, :, i, j] = flat[ph, pw, :, :, :, off : off + run]
        y = _grouped_matmul(packed, cols.reshape(plan.cols_shape), groups)
    out_sp = plan.out_sp
    valid = y.reshape((n, m, out_sp[0], wq))[..., : out_sp[1]]
    if raw and bias is None:
        return valid
    out = np.empty((n, m, *out_sp), y.dtype)
    if bias is not None:
        np.add(valid, bias.reshape(m, 1, 1), out=out)
    else:
        np.copyto(out, valid)
    return out


def _depthwise(xp, weights, kernel, out_sp, strides, dilations, bias):
    """Depthwise conv: out[n, c, j] = sum over taps of x_tap[n, c] * w[c, j, tap]."""
    n, c = xp.shape[:2]
    mult = weights.shape[1]
    wshape = (1, c, mult) + (1,) * len(out_sp)
    y = np.zeros((n, c, mult, *out_sp), xp.dtype)
    tmp = np.empty_like(y)
    for index, (_, tap) in enumerate(_tap_views(xp, kernel, out_sp, strides, dilations)):
        np.multiply(tap[:, :, None], weights[:, :, index].reshape(wshape), out=tmp)
        y += tmp
    y = y.reshape((n, c * mult, *out_sp))
    if bias is not None:
        y += bias.reshape((1, -1) + (1,) * len(out_sp))
    return y


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


_WG = {r: _WinogradTransforms(r) for r in _WG_MATRICES}

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
    if dtype != np.float32 or groups != 1 or w.ndim != 4:
        return None
    if tuple(w.shape[2:]) != (3, 3):
        return None
    if any(v != 1 for v in (spec.strides or ())) or any(v != 1 for v in (spec.dilations or ())):
        return None
    spatial = None
    if in_shape is not None and len(in_shape) == 4:
        spatial = tuple(d if isinstance(d, int) and d > 0 else None for d in in_shape[2:])
    r = _winograd_tile(w.shape[1], w.shape[0], spatial)
    return Winograd(w, r) if r else None


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
        self.t = _WG[r]
        g = self.t.g
        u = np.einsum("ai,mcij,bj->abmc", g, w.astype(np.float64), g)
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
        np.matmul(t.kin, d.reshape(t.a**2, -1), out=v.reshape(t.a**2, -1))
        np.matmul(self.u, v, out=prod)
        # The output transform A^T P A runs one side at a time: first over the tile rows (one
        # GEMM), then per output row i over the tile columns with the result's columns j
        # innermost, so y[i] is (m, n, ty, tx, j) and output row r ty + i of every tile is one
        # contiguous run of r tw pixels: r long-run copies (adding the bias on the way), not
        # r^2 strided ones. Measured in ResNet-18's layer shapes, 15-40 % faster than one
        # Kronecker GEMM followed by the r^2 strided copies.
        half = np.matmul(t.at, prod.reshape(t.a, -1), out=half.reshape(r, -1))
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


def conv_builder(ctx: KernelContext):
    """Conv (1D/2D/3D, groups, pads, auto_pad, strides, dilations, optional bias).

    Kept a plain function so a fused Conv+activation op can build it and wrap the kernel.
    """
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype not in (np.float16, np.float32, np.float64):
        raise ctx.unsupported(f"input dtype {dtype}")
    groups = int(ctx.attr("group", 1))
    w_const = ctx.constant(1)
    b_const = ctx.constant(2)
    kernel_attr = ctx.attr("kernel_shape", None)
    if w_const is not None:
        kernel_attr = kernel_attr or tuple(w_const.shape[2:])
        if tuple(kernel_attr) != tuple(w_const.shape[2:]):
            raise ctx.unsupported("kernel_shape differs from the weight's shape")
    spec = ConvSpec(ctx, kernel_attr)
    return _conv_runner(spec, groups, w_const, b_const, dtype, ctx.input_shape(0))


def _conv_runner(spec, groups, w_const, b_const, dtype, in_shape=None):
    cdt = _compute_dtype(dtype) if dtype is not None else None

    def prepare(w, cdt):
        kernel = tuple(w.shape[2:])
        m, cg = w.shape[:2]
        dw = None
        if groups > 1 and cg == 1 and m % groups == 0:
            dw = np.ascontiguousarray(w.reshape(groups, m // groups, -1), dtype=cdt)
        packed = pack_conv_weight(w, groups, cdt)
        return kernel, packed, dw

    if w_const is not None and cdt is not None:
        kernel, packed, dw = prepare(w_const, cdt)
        wino = winograd_weights(spec, w_const, groups, cdt, in_shape)
        bias = None if b_const is None else np.ascontiguousarray(b_const, dtype=cdt)
        out_dtype = np.dtype(dtype)

        def run(x, w, b=None):
            if x.dtype != cdt:
                x = x.astype(cdt)
            bb = bias if bias is not None or b is None else b.astype(cdt, copy=False)
            y = conv_forward(spec, groups, x, packed, kernel, bb, dw, wino)
            return y if y.dtype == out_dtype else y.astype(out_dtype)

        return run

    def run_dynamic(x, w, b=None):
        out_dtype = x.dtype
        c = _compute_dtype(x.dtype)
        kernel, packed, dw = prepare(w, c)
        bb = None if b is None else b.astype(c, copy=False)
        y = conv_forward(spec, groups, x.astype(c, copy=False), packed, kernel, bb, dw)
        return y if y.dtype == out_dtype else y.astype(out_dtype)

    return run_dynamic


register("Conv", 1, 11, 22)(conv_builder)


class _PrefixedAttrs:
    """A KernelContext seen through an attribute-name prefix (a fused node's pool_* attributes
    as the MaxPool attributes :class:`ConvSpec` reads)."""

    def __init__(self, ctx: KernelContext, prefix: str) -> None:
        self.ctx, self.prefix = ctx, prefix

    def attr(self, name: str, default=None):
        return self.ctx.attr(self.prefix + name, default)

    def unsupported(self, why: str):
        return self.ctx.unsupported(why)


def conv_pool_builder(ctx: KernelContext):
    """FusedConvPool: Conv [-> Relu] -> MaxPool (a ResNet stem) as one kernel.

    The max pool runs on the conv's raw GEMM output, before bias and Relu, which are then
    applied to the pooled map only: both are monotone per channel, so max(relu(y + b)) is
    exactly relu(max(y) + b), and the full-size map (4x the pooled one in ResNet) skips the
    bias/junk-column copy and the Relu pass. Needs constant float32 weights (the fusion pass
    checks).
    """
    dtype = ctx.input_dtype(0)
    w_const = ctx.constant(1)
    b_const = ctx.constant(2)
    if dtype != np.float32 or w_const is None or (ctx.has_input(2) and b_const is None):
        raise ctx.unsupported("FusedConvPool needs float32 input and constant weights")
    activation = ctx.attr("activation", None)
    if activation not in (None, "Relu"):
        raise ctx.unsupported(f"activation {activation!r} before a max pool")
    groups = int(ctx.attr("group", 1))
    kernel = tuple(w_const.shape[2:])
    spec = ConvSpec(ctx, ctx.attr("kernel_shape", None) or kernel)
    pool_kernel = tuple(int(k) for k in ctx.attr("pool_kernel_shape"))
    pool_spec = ConvSpec(
        _PrefixedAttrs(ctx, "pool_"),  # type: ignore[arg-type]
        pool_kernel,
        ceil_mode=bool(ctx.attr("pool_ceil_mode", 0)),
        pooling=True,
    )
    f32 = np.dtype(np.float32)
    m, cg = w_const.shape[:2]
    dw = None
    if groups > 1 and cg == 1 and m % groups == 0:
        dw = np.ascontiguousarray(w_const.reshape(groups, m // groups, -1), dtype=f32)
    packed = pack_conv_weight(w_const, groups, f32)
    wino = winograd_weights(spec, w_const, groups, f32, ctx.input_shape(0))
    bias = None if b_const is None else np.ascontiguousarray(b_const, dtype=f32)

    def run(x, w, b=None):
        y = conv_forward(spec, groups, x, packed, kernel, None, dw, wino, raw=True)
        axes = _separable_max_plan(pool_spec, y.shape, pool_kernel) if y.ndim > 2 else None
        if axes:
            p = _separable_max(y, axes)
        else:
            p = _pool_reduce(pool_spec, np.ascontiguousarray(y), pool_kernel, -np.inf, np.maximum)
        if bias is not None:
            p += bias.reshape((1, -1) + (1,) * (p.ndim - 2))
        if activation == "Relu":
            np.maximum(p, 0, out=p)
        return p

    return run


# --------------------------------------------------------------------------- ConvTranspose


def col2im_add(
    cols: np.ndarray,
    kernel: Sequence[int],
    out_sp: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    full_sp: Sequence[int],
) -> np.ndarray:
    """Scatter-add column blocks ``(*lead, *kernel, *out)`` into ``(*lead, *full_sp)``.

    The inverse of the im2col window view: each kernel offset adds one strided slab.
    """
    n = len(kernel)
    lead = cols.shape[: cols.ndim - 2 * n]
    full = np.zeros(lead + tuple(full_sp), cols.dtype)
    for offset in itertools.product(*(range(k) for k in kernel)):
        index = (
            Ellipsis,
            *(
                slice(o * d, o * d + (size - 1) * s + 1, s)
                for o, d, size, s in zip(offset, dilations, out_sp, strides)
            ),
        )
        full[index] += cols[(Ellipsis,) + offset + (slice(None),) * n]
    return full


@register("ConvTranspose", 1, 11, 22)
def conv_transpose(ctx: KernelContext):
    """ConvTranspose as GEMM (W^T x per group) followed by a col2im scatter-add.

    With ``output_shape`` (or auto_pad SAME, whose output is input * stride) the pads are
    generated from the size difference and explicit pads are ignored.
    """
    dtype = ctx.input_dtype(0)
    if dtype is not None and dtype not in (np.float16, np.float32, np.float64):
        raise ctx.unsupported(f"input dtype {dtype}")
    groups = int(ctx.attr("group", 1))
    auto_pad = ctx.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in _AUTO_PADS:
        raise ctx.unsupported(f"auto_pad {auto_pad!r}")
    strides_attr = ctx.attr("strides", None)
    dil_attr = ctx.attr("dilations", None)
    pads_attr = ctx.attr("pads", None)
    out_pad_attr = ctx.attr("output_padding", None)
    out_shape_attr = ctx.attr("output_shape", None)
    kernel_attr = ctx.attr("kernel_shape", None)
    cache: dict[tuple, tuple] = {}

    def geometry(in_sp: tuple, kernel: tuple):
        n = len(in_sp)
        strides = tuple(strides_attr or (1,) * n)
        dil = tuple(dil_attr or (1,) * n)
        opad = tuple(out_pad_attr or (0,) * n)
        if len(opad) == 2 * n:  # some exporters write begin+end; only the end counts
            opad = opad[n:]
        full = tuple((in_sp[i] - 1) * strides[i] + (kernel[i] - 1) * dil[i] + 1 for i in range(n))
        if out_shape_attr is not None:
            target = tuple(out_shape_attr[-n:])
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = tuple(in_sp[i] * strides[i] for i in range(n))
        else:
            target = None
        if target is not None:
            totals = [full[i] + opad[i] - target[i] for i in range(n)]
            if auto_pad == "SAME_UPPER":
                begin = tuple(t // 2 for t in totals)
            elif auto_pad == "SAME_LOWER":
                begin = tuple(t - t // 2 for t in totals)
            else:
                # output_shape without auto_pad: centred with the odd unit at the end and
                # a larger-than-natural output zero-extended at the end, as onnxruntime and
                # the conformance data do (the spec's text puts the odd unit first).
                begin = tuple(max(t, 0) // 2 for t in totals)
            out = target
        else:
            pads = tuple(pads_attr or (0,) * 2 * n)
            begin = pads[:n]
            out = target or tuple(full[i] + opad[i] - pads[i] - pads[n + i] for i in range(n))
        return full, begin, out, strides, dil

    w_const = ctx.constant(1)
    packed_const = None
    cdt = _compute_dtype(dtype) if dtype is not None else None

    def pack(w, c):
        # (C, M/g, *k) -> (g, M/g * prod(k), C/g): the GEMM operand that maps x to columns.
        cin, mg = w.shape[:2]
        return np.ascontiguousarray(
            w.reshape(groups, cin // groups, mg * math.prod(w.shape[2:])).transpose(0, 2, 1),
            dtype=c,
        )

    if w_const is not None and cdt is not None:
        packed_const = pack(w_const, cdt)

    def run(x, w, b=None):
        out_dtype = x.dtype
        c = _compute_dtype(x.dtype)
        kernel = tuple(kernel_attr or w.shape[2:])
        packed = packed_const if packed_const is not None else pack(w, c)
        key = (x.shape[2:], kernel)
        geo = cache.get(key)
        if geo is None:
            geo = cache[key] = geometry(tuple(x.shape[2:]), kernel)
        full, begin, out, strides, dil = geo
        n, cin = x.shape[:2]
        mg = w.shape[1]
        in_sp = x.shape[2:]
        xs = x.astype(c, copy=False).reshape(n, groups, cin // groups, math.prod(in_sp))
        cols = np.matmul(packed, xs)  # (n, g, mg*K, L)
        cols = cols.reshape((n, groups * mg, *kernel, *in_sp))
        buf = col2im_add(cols, kernel, in_sp, strides, dil, full)
        y = np.zeros((n, groups * mg, *out), c)
        src, dst = [], []
        for i in range(len(out)):
            lo, hi = max(begin[i], 0), min(begin[i] + out[i], full[i])
            src.append(slice(lo, max(hi, lo)))
            dst.append(slice(lo - begin[i], lo - begin[i] + max(hi - lo, 0)))
        y[(Ellipsis, *dst)] = buf[(Ellipsis, *src)]
        if b is not None:
            y += b.astype(c, copy=False).reshape((1, -1) + (1,) * len(out))
        return y if y.dtype == out_dtype else y.astype(out_dtype)

    return run


# --------------------------------------------------------------------------- pooling


def _pool_kernel(ctx: KernelContext) -> tuple:
    kernel = ctx.attr("kernel_shape", None)
    if not kernel:
        raise ctx.unsupported("kernel_shape is required")
    return tuple(int(k) for k in kernel)


def _check_float(ctx: KernelContext, allow_int8: bool = False) -> None:
    dtype = ctx.input_dtype(0)
    ok = [np.float16, np.float32, np.float64] + ([np.int8, np.uint8] if allow_int8 else [])
    if dtype is not None and dtype not in ok:
        raise ctx.unsupported(f"input dtype {dtype}")


def _pool_setup(spec: ConvSpec, x: np.ndarray, kernel: tuple, pad_value):
    """Pad ``x`` so every window of the resolved geometry fits; returns the pieces."""
    out, begin, end, strides, dil = spec.resolve(x.shape[2:], kernel)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    reach_end = tuple(
        max(_reach(o, s, sp) - size - b, 0)
        for o, s, sp, size, b in zip(out, strides, spans, x.shape[2:], begin)
    )
    xp = _pad(x, begin, reach_end, pad_value)
    return xp, out, begin, end, strides, dil


def _window_counts(spatial, out, begin, end, kernel, strides, dil, include_pad) -> np.ndarray:
    """How many window elements count for the average, per output position (separable)."""
    result = np.ones((), np.float64)
    for size, o, b, e, k, s, d in zip(spatial, out, begin, end, kernel, strides, dil):
        pos = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
        lo, hi = (-b, size + e) if include_pad else (0, size)
        counts = ((pos >= lo) & (pos < hi)).sum(axis=1)
        result = np.multiply.outer(result, counts)
    return result


def _pool_taps(spec: ConvSpec, shape: tuple, kernel: tuple):
    """How a pool reads its windows without materialising a padded copy. Cached per shape.

    Per kernel offset: the output slices it contributes to and the input slices it reads,
    clipped to the data. A strided pool first splits the input into stride phases
    (``x[..., a::s]`` copied contiguously), so every tap reads a unit-stride slice of one
    phase: numpy's strided loops are several times slower than contiguous ones.
    """
    key = ("pool", shape, kernel)
    hit = spec.plans.get(key)
    if hit is not None:
        return hit
    out, begin, _, strides, dil = spec.resolve(shape[2:], kernel)
    spatial = shape[2:]
    phased = any(s > 1 for s in strides)
    counts = [[len(range(a, size, s)) for a in range(s)] for size, s in zip(spatial, strides)]
    fills = []
    for phase in itertools.product(*(range(s) for s in strides)):
        dst = tuple(slice(0, counts[d][a]) for d, a in enumerate(phase))
        src = tuple(slice(a, None, s) for a, s in zip(phase, strides))
        if all(sl.stop > 0 for sl in dst):
            fills.append(((*phase, Ellipsis, *dst), (Ellipsis, *src)))
    taps = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        dst, src, phase = [Ellipsis], [Ellipsis], []
        for d, (o, b, k, s, dl) in enumerate(zip(out, begin, offset, strides, dil)):
            first = k * dl - b  # input position read for output 0
            a, q0 = first % s, first // s
            lo, hi = max(0, -q0), min(o, counts[d][a] - q0)
            if hi <= lo:
                break
            dst.append(slice(lo, hi))
            src.append(slice(q0 + lo, q0 + hi))
            phase.append(a)
        else:
            taps.append((tuple(dst), (*phase, *src) if phased else tuple(src)))
    shape_ph = (*strides, *shape[:2], *(max(c) for c in counts)) if phased else None
    whole = (Ellipsis, *(slice(0, o) for o in out))
    cover = next((i for i, (dst, _) in enumerate(taps) if dst == whole), None)
    hit = spec.plans[key] = (out, shape_ph, fills, taps, cover)
    return hit


def _pool_reduce(spec: ConvSpec, x: np.ndarray, kernel: tuple, init, combine) -> np.ndarray:
    """``combine`` (np.maximum or np.add) of every window, starting from ``init``."""
    out, shape_ph, fills, taps, cover = _pool_taps(spec, x.shape, kernel)
    src = x
    if shape_ph is not None:
        src = np.empty(shape_ph, x.dtype)
        for dst, part in fills:
            src[dst] = x[part]
    if cover is None:
        y = np.full((*x.shape[:2], *out), init, x.dtype)
    else:  # a tap that covers every output (the centre one, usually) initialises y
        y = src[taps[cover][1]].copy()
    for i, (dst, part) in enumerate(taps):
        if i != cover:
            combine(y[dst], src[part], out=y[dst])
    return y


def _axis_taps(size: int, out: int, begin: int, k: int, stride: int, dil: int):
    """For one axis of a pool: per kernel offset, the outputs ``[lo, hi)`` it reaches inside
    the data and the input slice they read; plus the index of an offset covering all outputs
    (None if none does)."""
    taps = []
    for t in range(k):
        first = t * dil - begin  # the input index output 0 reads at this offset
        lo = max(0, -(first // stride))
        hi = min(out, (size - 1 - first) // stride + 1)
        if hi > lo:
            taps.append((lo, hi, slice(first + lo * stride, first + (hi - 1) * stride + 1, stride)))
    cover = next((i for i, (lo, hi, _) in enumerate(taps) if (lo, hi) == (0, out)), None)
    return taps, cover


def _separable_max_plan(spec: ConvSpec, shape: tuple, kernel: tuple):
    """Per spatial axis, the taps of :func:`_axis_taps`, or None when an axis has no covering
    offset. Cached per shape. Outer axes go first: their passes read whole contiguous rows,
    and the strided innermost axis is then reduced on the already smaller array."""
    key = ("separable", shape, kernel)
    if key not in spec.plans:
        out, begin, _, strides, dil = spec.resolve(shape[2:], kernel)
        axes = []
        for axis in range(len(kernel)):
            args = (shape[2 + axis], out[axis], begin[axis], kernel[axis])
            taps, cover = _axis_taps(*args, strides[axis], dil[axis])
            if cover is None:
                axes = None
                break
            axes.append((2 + axis, taps, cover))
        spec.plans[key] = axes
    return spec.plans[key]


def _separable_max(x: np.ndarray, axes) -> np.ndarray:
    """Max pooling one axis at a time: a k x k window costs 2(k - 1) passes, not k^2 - 1 (the
    3x3 stride-2 pool after ResNet's stem: 0.39 ms instead of 0.56). Windows are clipped to
    the data, which is what padding with -inf means for a max."""
    for axis, taps, cover in axes:
        pre = (slice(None),) * axis
        y = x[(*pre, taps[cover][2])].copy()
        for i, (lo, hi, src) in enumerate(taps):
            if i != cover:
                dst = y[(*pre, slice(lo, hi))]
                np.maximum(dst, x[(*pre, src)], out=dst)
        x = y
    return x


@register("MaxPool", 1, 8, 10, 11, 12, 22, multi_output=True)
def max_pool(ctx: KernelContext):
    """MaxPool; the Indices output (flat index into the input, row- or column-major spatial
    order per storage_order) is only computed when the node asks for it."""
    _check_float(ctx, allow_int8=True)
    kernel = _pool_kernel(ctx)
    spec = ConvSpec(ctx, kernel, ceil_mode=bool(ctx.attr("ceil_mode", 0)), pooling=True)
    storage_order = int(ctx.attr("storage_order", 0))
    want_indices = ctx.has_output(1)

    def fill_value(dtype):
        return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min

    def run(x):
        if not want_indices:
            axes = _separable_max_plan(spec, x.shape, kernel) if x.ndim > 2 else None
            if axes:
                return (_separable_max(x, axes),)
            return (_pool_reduce(spec, x, kernel, fill_value(x.dtype), np.maximum),)
        xp, out, begin, _, strides, dil = _pool_setup(spec, x, kernel, fill_value(x.dtype))
        taps = _tap_views(xp, kernel, out, strides, dil)
        _, first = next(taps)
        y = first.copy()
        best = np.zeros(y.shape, np.int64)
        for index, (_, tap) in enumerate(taps, start=1):
            mask = tap > y
            np.copyto(y, tap, where=mask)
            best[mask] = index
        return y, _max_indices(best, x.shape, kernel, out, begin, strides, dil, storage_order)

    return run


def _max_indices(best, shape, kernel, out, begin, strides, dil, storage_order) -> np.ndarray:
    """Flat input indices of the chosen window element (per ONNX MaxPool Indices)."""
    n, c = shape[:2]
    spatial = shape[2:]
    offsets = np.unravel_index(best, kernel)
    grids = np.meshgrid(*(np.arange(o) for o in out), indexing="ij")
    pos = [grids[i] * strides[i] - begin[i] + offsets[i] * dil[i] for i in range(len(kernel))]
    if storage_order == 0:
        flat = np.zeros(best.shape, np.int64)
        for i, p in enumerate(pos):
            flat = flat * spatial[i] + p
    else:
        flat = np.zeros(best.shape, np.int64)
        for i in reversed(range(len(pos))):
            flat = flat * spatial[i] + pos[i]
    plane = math.prod(spatial)
    base = (np.arange(n * c, dtype=np.int64) * plane).reshape((n, c) + (1,) * len(spatial))
    return flat + base


@register("AveragePool", 1, 7, 10, 11, 19, 22)
def average_pool(ctx: KernelContext):
    """AveragePool: window sums divided by a per-position count (count_include_pad counts the
    explicit pads but never the extra reach ceil_mode adds)."""
    _check_float(ctx)
    kernel = _pool_kernel(ctx)
    spec = ConvSpec(ctx, kernel, ceil_mode=bool(ctx.attr("ceil_mode", 0)), pooling=True)
    include_pad = bool(ctx.attr("count_include_pad", 0))
    divisors: dict[tuple, np.ndarray] = {}

    def run(x):
        c = _compute_dtype(x.dtype)
        xc = x.astype(c, copy=False)
        y = _pool_reduce(spec, xc, kernel, 0, np.add)
        out = y.shape[2:]
        key = x.shape[2:]
        div = divisors.get(key)
        if div is None:
            _, begin, end, strides, dil = spec.resolve(x.shape[2:], kernel)
            counts = _window_counts(x.shape[2:], out, begin, end, kernel, strides, dil, include_pad)
            div = divisors[key] = (1.0 / np.maximum(counts, 1)).astype(c)
        y *= div
        return y.astype(x.dtype, copy=False)

    return run


@register("LpPool", 1, 2, 11, 18, 22)
def lp_pool(ctx: KernelContext):
    """LpPool: (sum over the window of |x|^p)^(1/p); pads contribute zero."""
    _check_float(ctx)
    kernel = _pool_kernel(ctx)
    p = float(ctx.attr("p", 2.0 if ctx.version == 1 else 2))
    spec = ConvSpec(ctx, kernel, ceil_mode=bool(ctx.attr("ceil_mode", 0)), pooling=True)

    def run(x):
        c = _compute_dtype(x.dtype)
        xa = np.abs(x.astype(c, copy=False))
        powered = xa * xa if p == 2 else xa**p
        y = _pool_reduce(spec, powered, kernel, 0, np.add)
        y = np.sqrt(y) if p == 2 else y ** (1.0 / p)
        return y.astype(x.dtype, copy=False)

    return run


def _spatial_axes(x: np.ndarray) -> tuple:
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", 1, 22)
def global_average_pool(ctx: KernelContext):
    _check_float(ctx)

    def run(x):
        y = x.mean(axis=_spatial_axes(x), keepdims=True, dtype=_compute_dtype(x.dtype))
        return y.astype(x.dtype, copy=False)

    return run


@register("GlobalMaxPool", 1, 22)
def global_max_pool(ctx: KernelContext):
    _check_float(ctx)
    return lambda x: x.max(axis=_spatial_axes(x), keepdims=True)


@register("GlobalLpPool", 1, 2, 22)
def global_lp_pool(ctx: KernelContext):
    _check_float(ctx)
    p = float(ctx.attr("p", 2.0 if ctx.version == 1 else 2))

    def run(x):
        xa = np.abs(x.astype(_compute_dtype(x.dtype), copy=False))
        y = (xa**p).sum(axis=_spatial_axes(x), keepdims=True) ** (1.0 / p)
        return y.astype(x.dtype, copy=False)

    return run


@register("MaxUnpool", 9, 11, 22)
def max_unpool(ctx: KernelContext):
    """MaxUnpool: scatter X into zeros at the flat Indices MaxPool produced, in the shape that
    inverts the pool's size formula."""
    kernel = _pool_kernel(ctx)
    strides = tuple(ctx.attr("strides", None) or (1,) * len(kernel))
    pads = tuple(ctx.attr("pads", None) or (0,) * (2 * len(kernel)))
    n = len(kernel)

    def run(x, indices, output_shape=None):
        inferred = x.shape[:2] + tuple(
            (x.shape[2 + i] - 1) * strides[i] - pads[i] - pads[n + i] + kernel[i] for i in range(n)
        )
        y = np.zeros(math.prod(inferred), x.dtype)
        y[indices.reshape(-1)] = x.reshape(-1)
        y = y.reshape(inferred)
        if output_shape is None:
            return y
        shape = tuple(int(s) for s in output_shape)
        if shape == inferred:
            return y
        # As the reference and the conformance data do: the unpooled block is placed at the
        # origin of the requested shape (indices stay relative to the inferred shape).
        out = np.zeros(shape, x.dtype)
        common = tuple(slice(0, min(a, b)) for a, b in zip(shape, inferred))
        out[common] = y[common]
        return out

    return run


# --------------------------------------------------------------------------- Gemm, MatMul


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype == np.float16:
        return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
    return np.matmul(a, b)


@register("MatMul", 1, 9, 13)
def matmul(ctx: KernelContext):
    dtype = ctx.input_dtype(0)
    b_const = ctx.constant(1)
    if dtype == np.float16:
        if b_const is not None:
            b32 = np.ascontiguousarray(b_const, dtype=np.float32)
            return lambda a, b: np.matmul(a.astype(np.float32), b32).astype(np.float16)
        return _matmul
    if b_const is not None and b_const.ndim == 2 and not b_const.flags.c_contiguous:
        b_c = np.ascontiguousarray(b_const)
        return lambda a, b: np.matmul(a, b_c)
    return np.matmul if dtype is not None else _matmul


@register("Gemm", 1, 6, 7, 9, 11, 13)
def gemm(ctx: KernelContext):
    """Y = alpha * A' B' + beta * C. A constant B is transposed and pre-scaled by alpha once and
    a constant C pre-scaled by beta, so a request is one matmul and one in-place add."""
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    trans_a = bool(ctx.attr("transA", 0))
    trans_b = bool(ctx.attr("transB", 0))
    dtype = ctx.input_dtype(0)
    is_float = dtype is None or dtype.kind == "f"
    if dtype is not None and dtype.kind not in "fiu":
        raise ctx.unsupported(f"input dtype {dtype}")
    b_const = ctx.constant(1)
    c_const = ctx.constant(2)
    cdt = _compute_dtype(dtype) if dtype is not None else None

    b_ready = None
    if b_const is not None and is_float and cdt is not None:
        bm = b_const.T if trans_b else b_const
        b_ready = np.ascontiguousarray(bm if alpha == 1 else bm * alpha, dtype=cdt)
    c_ready = None
    if c_const is not None and is_float and cdt is not None:
        c_ready = np.asarray(c_const if beta == 1 else c_const * beta, dtype=cdt)

    def run(a, b, c=None):
        out_dtype = a.dtype
        work = _compute_dtype(a.dtype)
        am = (a.T if trans_a else a).astype(work, copy=False)
        if b_ready is not None:
            y = np.matmul(am, b_ready)
        else:
            bm = (b.T if trans_b else b).astype(work, copy=False)
            y = np.matmul(am, bm)
            if alpha != 1:
                y = y * alpha if y.dtype.kind == "f" else (y * alpha).astype(work)
        if c is not None and beta != 0:
            if c_ready is not None:
                cc = c_ready
            else:
                cc = c.astype(work, copy=False)
                if beta != 1:
                    cc = cc * beta if cc.dtype.kind == "f" else (cc * beta).astype(work)
            if cc.shape == y.shape or np.broadcast_shapes(cc.shape, y.shape) == y.shape:
                y += cc
            else:
                y = y + cc
        return y if y.dtype == out_dtype else y.astype(out_dtype)

    return run


# --------------------------------------------------------------------------- Col2Im


@register("Col2Im", 18)
def col2im(ctx: KernelContext):
    """Col2Im: inverse of im2col, overlapping block contributions summed."""
    dil_attr = ctx.attr("dilations", None)
    pads_attr = ctx.attr("pads", None)
    strides_attr = ctx.attr("strides", None)

    def run(x, image_shape, block_shape):
        image = tuple(int(v) for v in image_shape)
        block = tuple(int(v) for v in block_shape)
        n = len(image)
        dil = tuple(dil_attr or (1,) * n)
        pads = tuple(pads_attr or (0,) * 2 * n)
        strides = tuple(strides_attr or (1,) * n)
        padded = tuple(image[i] + pads[i] + pads[n + i] for i in range(n))
        out = tuple((padded[i] - ((block[i] - 1) * dil[i] + 1)) // strides[i] + 1 for i in range(n))
        batch = x.shape[0]
        channels = x.shape[1] // math.prod(block)
        cols = x.reshape((batch, channels, *block, *out))
        full = col2im_add(cols, block, out, strides, dil, padded)
        inner = (Ellipsis, *(slice(pads[i], pads[i] + image[i]) for i in range(n)))
        return np.ascontiguousarray(full[inner])

    return run


# --------------------------------------------------------------------------- DeformConv


@register("DeformConv", 19, 22)
def deform_conv(ctx: KernelContext):
    """DeformConv (2D): bilinear samples at offset kernel positions, then a grouped GEMM."""
    _check_float(ctx)
    groups = int(ctx.attr("group", 1))
    offset_groups = int(ctx.attr("offset_group", 1))
    kernel_attr = ctx.attr("kernel_shape", None)
    strides_attr = ctx.attr("strides", None)
    dil_attr = ctx.attr("dilations", None)
    pads_attr = ctx.attr("pads", None)

    def run(x, w, offset, b=None, mask=None):
        out_dtype = x.dtype
        c = _compute_dtype(x.dtype)
        if x.ndim != 4:
            raise ValueError("only 2-D DeformConv is implemented")
        n, cin, h, wd = x.shape
        m = w.shape[0]
        kh, kw = tuple(kernel_attr or w.shape[2:])
        sh, sw = tuple(strides_attr or (1, 1))
        dh, dw = tuple(dil_attr or (1, 1))
        pt, pl, pb, pr = tuple(pads_attr or (0, 0, 0, 0))
        oh = (h + pt + pb - ((kh - 1) * dh + 1)) // sh + 1
        ow = (wd + pl + pr - ((kw - 1) * dw + 1)) // sw + 1
        k = kh * kw
        off = offset.astype(c, copy=False).reshape(n, offset_groups, k, 2, oh, ow)
        base_y = (np.arange(oh) * sh - pt)[:, None] + (np.arange(kh) * dh)[:, None, None]
        base_x = (np.arange(ow) * sw - pl)[None, :] + (np.arange(kw) * dw)[:, None, None]
        # per kernel tap (k) the sampling grid (oh, ow)
        base_y = np.repeat(base_y[:, None], kw, axis=1).reshape(k, oh, 1)
        base_x = np.tile(base_x[:, None], (kh, 1, 1, 1)).reshape(k, 1, ow)
        py = base_y + off[:, :, :, 0]  # (n, og, k, oh, ow)
        px = base_x + off[:, :, :, 1]
        sampled = _bilinear(x.astype(c, copy=False), py, px, offset_groups)  # (n, C, k, oh, ow)
        if mask is not None:
            mk = mask.astype(c, copy=False).reshape(n, offset_groups, 1, k, oh, ow)
            cpg = cin // offset_groups
            sampled = (sampled.reshape(n, offset_groups, cpg, k, oh, ow) * mk).reshape(
                n, cin, k, oh, ow
            )
        cols = sampled.reshape(n, groups, (cin // groups) * k, oh * ow)
        packed = w.astype(c, copy=False).reshape(groups, m // groups, -1)
        y = np.matmul(packed, cols).reshape(n, m, oh, ow)
        if b is not None:
            y += b.astype(c, copy=False).reshape(1, m, 1, 1)
        return y.astype(out_dtype, copy=False)

    return run


def _bilinear(x: np.ndarray, py: np.ndarray, px: np.ndarray, offset_groups: int) -> np.ndarray:
    """Bilinear samples of x (n, C, H, W) at (py, px) (n, og, k, oh, ow); zero outside."""
    n, cin, h, w = x.shape
    og = offset_groups
    cpg = cin // og
    y0 = np.floor(py)
    x0 = np.floor(px)
    fy = py - y0
    fx = px - x0
    y0 = y0.astype(np.int64)
    x0 = x0.astype(np.int64)
    xg = x.reshape(n, og, cpg, h * w)
    result = np.zeros((n, og, cpg, *py.shape[2:]), x.dtype)
    nidx = np.arange(n)[:, None, None, None, None]
    gidx = np.arange(og)[None, :, None, None, None]
    for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
        yy = y0 + dy
        xx = x0 + dx
        weight = (fy if dy else 1 - fy) * (fx if dx else 1 - fx)
        valid = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < w)
        flat = np.where(valid, yy * w + xx, 0)
        vals = xg[nidx, gidx, :, flat]  # (n, og, k, oh, ow, cpg)
        contrib = vals * np.where(valid, weight, 0)[..., None].astype(x.dtype)
        result += np.moveaxis(contrib, -1, 2)
    return result.reshape(n, cin, *py.shape[2:])
