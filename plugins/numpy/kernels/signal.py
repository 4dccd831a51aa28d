"""Signal processing: DFT, STFT, window functions, mel weight matrix.

Complex tensors are ONNX-style real tensors with a trailing dimension of 2 (real, imaginary);
a trailing dimension of 1 means a real signal. numpy's FFT does the transforms in complex128,
and results are cast back to the input's float type.
"""

from __future__ import annotations

import numpy as np
from onnx.helper import tensor_dtype_to_np_dtype

from plugserve.plugins.numpy.kernels.registry import KernelContext, register


def _to_complex(x: np.ndarray) -> np.ndarray:
    """Drop the trailing (1 or 2) dimension: real array or complex array."""
    if x.shape[-1] == 1:
        return x[..., 0]
    if x.shape[-1] == 2:
        return x[..., 0] + 1j * x[..., 1]
    raise ValueError(f"last dimension must be 1 (real) or 2 (complex), got {x.shape[-1]}")


def _from_complex(z: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = np.empty((*z.shape, 2), dtype=dtype)
    out[..., 0] = z.real
    out[..., 1] = z.imag
    return out


def _dft(x, length, axis, inverse, onesided):
    """One DFT along ``axis`` (an axis of ``x`` other than the last)."""
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        raise ValueError("the DFT axis cannot be the last (complex) dimension")
    real_input = x.shape[-1] == 1
    signal = _to_complex(x)
    if inverse:
        if onesided:  # one-sided spectrum back to a full real signal
            n = length if length is not None else 2 * (x.shape[axis] - 1)
            return np.fft.irfft(signal, n=n, axis=axis).astype(x.dtype)[..., None]
        n = length if length is not None else x.shape[axis]
        return _from_complex(np.fft.ifft(signal, n=n, axis=axis), x.dtype)
    n = length if length is not None else x.shape[axis]
    if onesided and real_input:
        return _from_complex(np.fft.rfft(signal, n=n, axis=axis), x.dtype)
    spectrum = np.fft.fft(signal, n=n, axis=axis)
    if onesided:
        spectrum = np.take(spectrum, np.arange(n // 2 + 1), axis=axis)
    return _from_complex(spectrum, x.dtype)


def _scalar(v) -> int | None:
    if v is None or v.size == 0:
        return None
    return int(np.asarray(v).ravel()[0])


@register("DFT", 17, 20)
def dft(ctx: KernelContext):
    """Opset 17 takes ``axis`` as an attribute (default 1); opset 20 as input 2 (default -2).
    Axes count the trailing complex dimension, as the spec says."""
    inverse = bool(ctx.attr("inverse", 0))
    onesided = bool(ctx.attr("onesided", 0))
    if ctx.version == 17:
        axis_attr = int(ctx.attr("axis", 1))

        def run17(x, dft_length=None):
            return _dft(x, _scalar(dft_length), axis_attr, inverse, onesided)

        return run17

    def run20(x, dft_length=None, axis=None):
        a = _scalar(axis)
        return _dft(x, _scalar(dft_length), -2 if a is None else a, inverse, onesided)

    return run20


@register("STFT", 17)
def stft(ctx: KernelContext):
    """Frames [batch, frames, frame_length] (strided view), windowed, then one batched FFT."""
    onesided = bool(ctx.attr("onesided", 1))

    def run(signal, frame_step, window=None, frame_length=None):
        step = _scalar(frame_step)
        length = _scalar(frame_length)
        if length is None:
            length = window.shape[0] if window is not None else signal.shape[-2]
        real_input = signal.shape[-1] == 1
        sig = _to_complex(signal)
        n_frames = 1 + (sig.shape[1] - length) // step
        starts = np.arange(n_frames) * step
        frames = sig[:, starts[:, None] + np.arange(length)[None, :]]
        if window is not None:
            frames = frames * window.astype(np.float64)
        if onesided and real_input:
            spectrum = np.fft.rfft(frames, n=length, axis=-1)
        else:
            spectrum = np.fft.fft(frames, n=length, axis=-1)
            if onesided:
                spectrum = spectrum[..., : length // 2 + 1]
        return _from_complex(spectrum, signal.dtype)

    return run


def _window_builder(ctx: KernelContext, terms: tuple[float, ...]):
    """sum_k terms[k] * cos(2 pi k n / N) with alternating signs, N = size or size - 1."""
    dtype = np.dtype(tensor_dtype_to_np_dtype(int(ctx.attr("output_datatype", 1))))
    periodic = bool(ctx.attr("periodic", 1))

    def run(size):
        n = int(np.asarray(size).ravel()[0])
        denom = n if periodic else n - 1
        k = np.arange(n, dtype=np.float64)
        out = np.zeros(n, dtype=np.float64)
        for i, a in enumerate(terms):
            out += (-1) ** i * a * np.cos(2 * np.pi * i * k / denom)
        return out.astype(dtype)

    return run


@register("HannWindow", 17)
def hann_window(ctx: KernelContext):
    return _window_builder(ctx, (0.5, 0.5))


@register("HammingWindow", 17)
def hamming_window(ctx: KernelContext):
    return _window_builder(ctx, (25 / 46, 1 - 25 / 46))


@register("BlackmanWindow", 17)
def blackman_window(ctx: KernelContext):
    return _window_builder(ctx, (0.42, 0.5, 0.08))


@register("MelWeightMatrix", 17)
def mel_weight_matrix(ctx: KernelContext):
    """Triangular filters on integer spectrogram bins, placed evenly on the mel scale."""
    dtype = np.dtype(tensor_dtype_to_np_dtype(int(ctx.attr("output_datatype", 1))))

    def run(num_mel_bins, dft_length, sample_rate, lower_hz, upper_hz):
        bins = int(np.asarray(num_mel_bins).ravel()[0])
        length = int(np.asarray(dft_length).ravel()[0])
        rate = np.asarray(sample_rate).ravel()[0]
        lo, hi = (np.asarray(v).ravel()[0] for v in (lower_hz, upper_hz))
        lo_mel = 2595 * np.log1p(lo / 700) / np.log(10)
        hi_mel = 2595 * np.log1p(hi / 700) / np.log(10)
        points = np.arange(bins + 2) * ((hi_mel - lo_mel) / (bins + 2)) + lo_mel
        hz = 700 * np.expm1(points / 2595 * np.log(10))
        edges = (((length + 1) * hz) // rate).astype(np.int64)
        out = np.zeros((length // 2 + 1, bins))
        j = np.arange(length // 2 + 1)
        for i in range(bins):
            left, center, right = edges[i], edges[i + 1], edges[i + 2]
            if center == left:
                out[center, i] = 1
            else:
                rise = (j >= left) & (j <= center)
                out[rise, i] = (j[rise] - left) / (center - left)
            if right > center:
                fall = (j >= center) & (j < right)
                out[fall, i] = (right - j[fall]) / (right - center)
        return out.astype(dtype)

    return run
