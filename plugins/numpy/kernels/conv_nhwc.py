"""Channel-last 2-D convolution: the image as ``(N, H, W, C)``, returned as an NCHW view.

In NCHW every gather a conv needs (im2col columns, Winograd tiles) copies runs of a few pixels
of one channel; channel-last, the same gathers copy runs of C contiguous floats (256 bytes and
more), several times faster in numpy, and a 1x1 conv needs no copy at all. The result is a
``(N, H, W, M)`` buffer handed on as its ``transpose(0, 3, 1, 2)`` view: logically NCHW, so
every other kernel computes on it unchanged (numpy's ufuncs keep the memory order of their
inputs, so Add and Relu after a conv stay channel-last), and the next conv finds its input
already channel-last (:func:`is_channel_last`) and skips the conversion. The layout thus spreads
through a network as far as the convs that chose it (by timing, see ``tuning.py``) and no
further: Flatten, Reshape and the network's outputs see ordinary arrays.

Float32, one group, constant weights; other convs keep the NCHW paths of ``conv.py``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from plugserve.plugins.numpy.kernels.window import ConvSpec
from plugserve.plugins.numpy.kernels.winograd import WINOGRAD_TRANSFORMS
from plugserve.plugins.numpy.parallel import matmul as _gemm

__all__ = [
    "ChannelLastConv",
    "ChannelLastWinograd",
    "channel_last",
    "is_channel_last",
    "suits_winograd",
    "to_channel_last",
]


def is_channel_last(x: np.ndarray) -> bool:
    """Whether a 4-D array is the NCHW view of a contiguous NHWC buffer."""
    return x.ndim == 4 and x.transpose(0, 2, 3, 1).flags.c_contiguous


def channel_last(x: np.ndarray) -> np.ndarray:
    """``x`` (logically NCHW) as a C-contiguous ``(N, H, W, C)`` array, copied only if needed."""
    t = x.transpose(0, 2, 3, 1)
    return t if t.flags.c_contiguous else np.ascontiguousarray(t)


def to_channel_last(y: np.ndarray) -> np.ndarray:
    """``y`` with the same values, stored channel-last (a copy unless it already is)."""
    if y.ndim != 4 or is_channel_last(y):
        return y
    return np.ascontiguousarray(y.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def _finish(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    if bias is not None:
        y += bias
    return y.transpose(0, 3, 1, 2)


class ChannelLastConv:
    """Any 2-D conv as one GEMM ``(N*OH*OW, KH*KW*C) x (KH*KW*C, M)``: a 1x1 conv reads the
    image in place (strided ones subsample first); others copy one shifted view per kernel
    tap into the column buffer, each a run of C floats per pixel."""

    def __init__(self, spec: ConvSpec, w: np.ndarray, bias: np.ndarray | None) -> None:
        self.spec = spec
        m, _, kh, kw = w.shape
        self.kernel = (kh, kw)
        self.m = m
        self.bias = bias
        self._w = w
        self._wcols: np.ndarray | None = None

    def release(self) -> None:
        self._wcols = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        wcols = self._wcols
        if wcols is None:  # rows ordered (tap row, tap column, channel), as the columns'
            kh, kw = self.kernel
            wcols = self._w.transpose(2, 3, 1, 0).reshape(kh * kw * self._w.shape[1], self.m)
            wcols = self._wcols = np.ascontiguousarray(wcols, dtype=np.float32)
        xh = channel_last(x)
        n, h, w, c = xh.shape
        (oh, ow), begin, _, (sh, sw), (dh, dw) = self.spec.resolve((h, w), self.kernel)
        kh, kw = self.kernel
        if (kh, kw) == (1, 1) and not any(begin):
            src = xh[:, : (oh - 1) * sh + 1 : sh, : (ow - 1) * sw + 1 : sw]
            cols = src.reshape(n * oh * ow, c)  # a copy only when strided
        else:
            rows = max(h + begin[0], (oh - 1) * sh + (kh - 1) * dh + 1)
            width = max(w + begin[1], (ow - 1) * sw + (kw - 1) * dw + 1)
            xp = np.zeros((n, rows, width, c), np.float32)
            xp[:, begin[0] : begin[0] + h, begin[1] : begin[1] + w] = xh
            buf = np.empty((n, oh, ow, kh, kw, c), np.float32)
            for i in range(kh):
                for j in range(kw):
                    r0, c0 = i * dh, j * dw
                    buf[:, :, :, i, j] = xp[
                        :, r0 : r0 + (oh - 1) * sh + 1 : sh, c0 : c0 + (ow - 1) * sw + 1 : sw
                    ]
            cols = buf.reshape(n * oh * ow, kh * kw * c)
        y = np.empty((n, oh, ow, self.m), np.float32)
        _gemm(cols, wcols, out=y.reshape(n * oh * ow, self.m))
        return _finish(y, self.bias)


class ChannelLastWinograd:
    """A 3x3 stride-1 conv as Winograd F(r x r, 3x3) over channel-last tiles: the tile gather
    copies runs of C floats, the input and output transforms are one small Kronecker GEMM each
    over every tile and channel, and the (r + 2)^2 products are one batched GEMM
    ``(T, C) x (C, M)``. The transformed weights ((r + 2)^2 / 9 times the conv's) are made on
    first use, so a candidate that loses the timing costs no memory once released."""

    def __init__(self, spec: ConvSpec, w: np.ndarray, bias: np.ndarray | None, r: int) -> None:
        self.spec = spec
        self.r = r
        self.t = WINOGRAD_TRANSFORMS[r]
        self.m = w.shape[0]
        self.bias = bias
        self._w = w
        self._u: np.ndarray | None = None
        self.kout = np.kron(self.t.at, self.t.at).astype(np.float32)  # (r^2, a^2)

    def release(self) -> None:
        self._u = None

    def _weights(self) -> np.ndarray:
        u = self._u  # once: another thread may release it meanwhile
        if u is None:
            g, a = self.t.g, self.t.a
            m, c = self._w.shape[:2]
            full = (g @ self._w.astype(np.float64) @ g.T).transpose(2, 3, 1, 0)  # (a, a, c, m)
            u = self._u = np.ascontiguousarray(full.reshape(a * a, c, m), dtype=np.float32)
        return u

    def __call__(self, x: np.ndarray) -> np.ndarray:
        u = self._weights()
        xh = channel_last(x)
        n, h, w, c = xh.shape
        (oh, ow), begin, _, _, _ = self.spec.resolve((h, w), (3, 3))
        r, a, m = self.r, self.t.a, self.m
        th, tw = -(-oh // r), -(-ow // r)
        xp = np.zeros((n, r * th + 2, r * tw + 2, c), np.float32)
        xp[:, begin[0] : begin[0] + h, begin[1] : begin[1] + w] = xh
        s0, s1, s2, _ = xp.strides
        tiles = as_strided(xp, (a, a, n, th, tw, c), (s1, s2, s0, r * s1, r * s2, 4))
        d = np.ascontiguousarray(tiles)
        count = n * th * tw
        v = _gemm(self.t.kin, d.reshape(a * a, count * c))
        p = _gemm(v.reshape(a * a, count, c), u)
        y = _gemm(self.kout, p.reshape(a * a, count * m)).reshape(r, r, n, th, tw, m)
        full = np.empty((n, th, r, tw, r, m), np.float32)
        src = y.transpose(2, 3, 0, 4, 1, 5)
        if self.bias is not None:
            np.add(src, self.bias, out=full)
        else:
            np.copyto(full, src)
        full = full.reshape(n, th * r, tw * r, m)
        if (th * r, tw * r) != (oh, ow):
            full = np.ascontiguousarray(full[:, :oh, :ow])
        return full.transpose(0, 3, 1, 2)


def suits_winograd(spec: ConvSpec, w: np.ndarray) -> bool:
    """3x3, stride 1, no dilation: the convs Winograd F(r, 3) computes."""
    return (
        w.ndim == 4
        and tuple(w.shape[2:]) == (3, 3)
        and all(v == 1 for v in (spec.strides or ()))
        and all(v == 1 for v in (spec.dilations or ()))
        and math.prod(w.shape[:2]) > 0
    )
