"""Sliding-window geometry shared by convolution and pooling: the attributes of a Conv- or
Pool-like node resolved per input shape, constant padding and the per-tap strided views."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def compute_dtype(dtype: np.dtype) -> np.dtype:
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
        if auto_pad not in AUTO_PADS:
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


def pad_constant(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value=0) -> np.ndarray:
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


def window_reach(out: int, stride: int, span: int) -> int:
    """Padded length the windows of one dim touch."""
    return (out - 1) * stride + span


def tap_views(xp: np.ndarray, kernel, out, strides, dilations):
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


def check_float(ctx: KernelContext, allow_int8: bool = False) -> None:
    dtype = ctx.input_dtype(0)
    ok = [np.float16, np.float32, np.float64] + ([np.int8, np.uint8] if allow_int8 else [])
    if dtype is not None and dtype not in ok:
        raise ctx.unsupported(f"input dtype {dtype}")
