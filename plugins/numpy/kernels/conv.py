"""Convolution (Conv, the fused Conv -> MaxPool, ConvTranspose, Col2Im, DeformConv).

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
  in `winograd.py`): 4x or 2.25x fewer multiplications, see :class:`Winograd`.

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

from plugserve.plugins.numpy import parallel
from plugserve.plugins.numpy.blas import NO_TRANS as _NO_TRANS
from plugserve.plugins.numpy.blas import ROW_MAJOR as _ROW_MAJOR
from plugserve.plugins.numpy.blas import sgemm as _SGEMM
from plugserve.plugins.numpy.kernels.conv_nhwc import (
    ChannelLastConv,
    ChannelLastWinograd,
    is_channel_last,
    suits_winograd,
    to_channel_last,
)
from plugserve.plugins.numpy.kernels.pool import pool_reduce, separable_max, separable_max_plan
from plugserve.plugins.numpy.kernels.registry import KernelContext, register
from plugserve.plugins.numpy.kernels.window import (
    AUTO_PADS,
    ConvSpec,
    check_float,
    compute_dtype,
    pad_constant,
    tap_views,
    window_reach,
)
from plugserve.plugins.numpy.kernels.winograd import Winograd, winograd_tile, winograd_weights
from plugserve.plugins.numpy.parallel import matmul as _gemm
from plugserve.plugins.numpy.tuning import input_key

__all__ = ["col2im_add", "conv_builder", "conv_forward", "conv_pool_builder", "pack_conv_weight"]


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
        window_reach(o, s, sp) - size - b
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
        xp = pad_constant(x, begin, end)
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
        return _gemm(packed[0], cols[0, 0])
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

        def slab(b: int, lo: int, hi: int):
            """Output columns [lo, hi) of image b: every tap's GEMM over those columns."""
            base = phases.ctypes.data + (b * c * size + lo) * 4
            out = y.ctypes.data + (b * m * run + lo) * 4

            def job():
                for t, (_, _, _, _, off) in enumerate(taps):
                    _SGEMM(
                        _ROW_MAJOR, _NO_TRANS, _NO_TRANS, m, hi - lo, c, 1.0, a0 + t * c * 4,
                        lda, base + off * 4, size, 1.0 if t else 0.0, out, run,
                    )  # fmt: skip

            return job

        width = parallel.width()
        parts = width * parallel.CHUNKS_PER_THREAD if m * run * c * len(taps) > 4_000_000 else 1
        step = max(16, -(-run // parts))
        jobs = [slab(b, lo, min(run, lo + step)) for b in range(n) for lo in range(0, run, step)]
        parallel.run_jobs(jobs)
    elif groups == 1 and parallel.width() > 1 and m * run * packed.shape[2] > 4_000_000:
        y = _wide_slabs(phases, packed[0], taps, n, x.shape[1], run, size)
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


def _wide_slabs(phases, w, taps, n, c, run, size):
    """The "wide" path of a one-group conv in slabs of output columns, each a job of the
    request's threads: copy the slab's tap runs into a column buffer small enough to stay in
    cache, then one GEMM into the slab. The copies run on both threads (numpy releases the GIL
    in them) instead of one, and the GEMM reads columns just written (ResNet-18's stem: 7.6 MB
    of columns copied by one thread before, then read back by the GEMM)."""
    m = w.shape[0]
    y = np.empty((n, m, run), phases.dtype)
    flat = phases.reshape(*phases.shape[:2], n, c, size)
    parts = parallel.width() * parallel.CHUNKS_PER_THREAD * 2
    step = max(64, -(-run // parts))

    def slab(b: int, lo: int, hi: int):
        def job():
            cols = np.empty((len(taps), c, hi - lo), phases.dtype)
            for t, (_, _, ph, pw, off) in enumerate(taps):
                cols[t] = flat[ph, pw, b, :, off + lo : off + hi]
            np.matmul(w, cols.reshape(len(taps) * c, hi - lo), out=y[b, :, lo:hi])

        return job

    parallel.run_jobs(
        [slab(b, lo, min(run, lo + step)) for b in range(n) for lo in range(0, run, step)]
    )
    return y


def _depthwise(xp, weights, kernel, out_sp, strides, dilations, bias):
    """Depthwise conv: out[n, c, j] = sum over taps of x_tap[n, c] * w[c, j, tap]."""
    n, c = xp.shape[:2]
    mult = weights.shape[1]
    wshape = (1, c, mult) + (1,) * len(out_sp)
    y = np.zeros((n, c, mult, *out_sp), xp.dtype)
    tmp = np.empty_like(y)
    for index, (_, tap) in enumerate(tap_views(xp, kernel, out_sp, strides, dilations)):
        np.multiply(tap[:, :, None], weights[:, :, index].reshape(wshape), out=tmp)
        y += tmp
    y = y.reshape((n, c * mult, *out_sp))
    if bias is not None:
        y += bias.reshape((1, -1) + (1,) * len(out_sp))
    return y


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
    site = ctx.site if b_const is not None or not ctx.has_input(2) else None
    return _conv_runner(spec, groups, w_const, b_const, dtype, ctx.input_shape(0), site)


def _conv_runner(spec, groups, w_const, b_const, dtype, in_shape=None, site=None):
    cdt = compute_dtype(dtype) if dtype is not None else None

    def prepare(w, cdt):
        kernel = tuple(w.shape[2:])
        m, cg = w.shape[:2]
        dw = None
        if groups > 1 and cg == 1 and m % groups == 0:
            dw = np.ascontiguousarray(w.reshape(groups, m // groups, -1), dtype=cdt)
        packed = pack_conv_weight(w, groups, cdt)
        return kernel, packed, dw

    if w_const is not None and cdt is not None:
        bias = None if b_const is None else np.ascontiguousarray(b_const, dtype=cdt)
        tunable = dtype == np.float32 and groups == 1 and w_const.ndim == 4
        site = site() if site is not None and tunable else None
        if site is not None:
            candidates = _candidates(spec, w_const, bias, in_shape, site)

            def run_tuned(x, w, b=None):
                if x.dtype != cdt:  # a float64 input to a float32 model: the plain path
                    return candidates["nchw"](x.astype(cdt)).astype(x.dtype)
                layout = "nhwc" if is_channel_last(x) else "nchw"
                return site.run(input_key(x, layout), candidates, x)

            return run_tuned
        kernel, packed, dw = prepare(w_const, cdt)
        wino = winograd_weights(spec, w_const, groups, cdt, in_shape)
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
        c = compute_dtype(x.dtype)
        kernel, packed, dw = prepare(w, c)
        bb = None if b is None else b.astype(c, copy=False)
        y = conv_forward(spec, groups, x.astype(c, copy=False), packed, kernel, bb, dw)
        return y if y.dtype == out_dtype else y.astype(out_dtype)

    return run_dynamic


register("Conv", 1, 11, 22)(conv_builder)


def _candidates(spec, w, bias, in_shape, site) -> dict:
    """The kernels that compute a float32, one-group, 2-D constant-weight conv, for its tuning
    site to time; the first (the NCHW paths as :func:`conv_forward` picks them) serves where
    nothing is timed. Each makes its weights on first use and drops them when it loses, so a
    conv holds the weights of the kernels it chose only."""
    candidates: dict = {"nchw": _Nchw(spec, w, bias, in_shape, site, winograd=True)}
    if winograd_tile(spec, w, 1, np.dtype(np.float32), in_shape):
        candidates["nchw-direct"] = _Nchw(spec, w, bias, in_shape, site, winograd=False)
    candidates["nhwc-gemm"] = ChannelLastConv(spec, w, bias)
    if suits_winograd(spec, w):
        candidates["nhwc-wino2"] = ChannelLastWinograd(spec, w, bias, 2)
        candidates["nhwc-wino4"] = ChannelLastWinograd(spec, w, bias, 4)
    return candidates


class _Nchw:
    """The NCHW paths of :func:`conv_forward` as a tuning candidate. In a channel-last network
    (``site.channel_last``) it converts its result, and its timing measures that too."""

    def __init__(self, spec, w, bias, in_shape, site, winograd: bool) -> None:
        self.spec, self.w, self.bias, self.in_shape, self.site = spec, w, bias, in_shape, site
        self.winograd = winograd
        self.kernel = tuple(w.shape[2:])
        self._weights: tuple | None = None

    def release(self) -> None:
        self._weights = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        weights = self._weights
        if weights is None:
            f32 = np.dtype(np.float32)
            wino = (
                winograd_weights(self.spec, self.w, 1, f32, self.in_shape)
                if self.winograd
                else None
            )
            weights = self._weights = (pack_conv_weight(self.w, 1, f32), wino)
        y = conv_forward(self.spec, 1, x, weights[0], self.kernel, self.bias, None, weights[1])
        return to_channel_last(y) if self.site.channel_last else y


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
    site = ctx.site()  # only for the network's layout: a stem's pooled map feeds its convs

    def finish(y, axes, bias=bias):
        """Pool, bias and activation of the channels of ``y`` (``bias``: theirs)."""
        if axes:
            p = separable_max(y, axes)
        else:
            p = pool_reduce(pool_spec, np.ascontiguousarray(y), pool_kernel, -np.inf, np.maximum)
        if bias is not None:
            p += bias.reshape((1, -1) + (1,) * (p.ndim - 2))
        if activation == "Relu":
            np.maximum(p, 0, out=p)
        return p

    def run(x, w, b=None):
        y = conv_forward(spec, groups, x, packed, kernel, None, dw, wino, raw=True)
        axes = separable_max_plan(pool_spec, y.shape, pool_kernel) if y.ndim > 2 else None
        channel_last = site is not None and site.channel_last
        if not axes or y.ndim != 4 or parallel.width() <= 1 or y.size < 1 << 18:
            p = finish(y, axes)
            return to_channel_last(p) if channel_last else p
        return _pool_in_parts(y, axes, finish, bias, channel_last)

    return run


def _pool_in_parts(y, axes, finish, bias, channel_last):
    """FusedConvPool's pooling of a large map (the stem: 3.3 MB at batch 1) split by channels
    over the request's threads (numpy releases the GIL in its ufunc loops), each part written
    straight into the (channel-last, when the network is) output."""
    n, m = y.shape[:2]
    out_sp = separable_max(y[:1, :1], axes).shape[2:]
    out = np.empty((n, *out_sp, m) if channel_last else (n, m, *out_sp), np.float32)
    view = out.transpose(0, 3, 1, 2) if channel_last else out
    parts = parallel.width() * parallel.CHUNKS_PER_THREAD
    step = max(8, -(-m // parts))

    def part(lo: int, hi: int):
        def job():
            view[:, lo:hi] = finish(y[:, lo:hi], axes, None if bias is None else bias[lo:hi])

        return job

    parallel.run_jobs([part(lo, min(m, lo + step)) for lo in range(0, m, step)])
    return view


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
    if auto_pad not in AUTO_PADS:
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
    cdt = compute_dtype(dtype) if dtype is not None else None

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
        c = compute_dtype(x.dtype)
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
    check_float(ctx)
    groups = int(ctx.attr("group", 1))
    offset_groups = int(ctx.attr("offset_group", 1))
    kernel_attr = ctx.attr("kernel_shape", None)
    strides_attr = ctx.attr("strides", None)
    dil_attr = ctx.attr("dilations", None)
    pads_attr = ctx.attr("pads", None)

    def run(x, w, offset, b=None, mask=None):
        out_dtype = x.dtype
        c = compute_dtype(x.dtype)
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
