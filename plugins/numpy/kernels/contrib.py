"""onnxruntime's contrib ops (domain ``com.microsoft``) that its own tools write into models.

onnxruntime's transformer optimizer fuses a BERT's or GPT-2's subgraphs into
SkipLayerNormalization, BiasGelu, FastGelu, Gelu, Attention and EmbedLayerNormalization; its
quantizer writes QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearConcat, QGemm and
QAttention (QOperator format) and MatMulInteger16; onnxruntime-genai's model builder writes
SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization (its attention, rotary and
quantized-weight ops are :mod:`decoder`'s). A model saved by those tools runs on NUMPY with
these, each as onnxruntime's ContribOperators.md
defines it (the specification), checked against onnxruntime on real optimized and quantized
exports (tests/plugins/numpy_device/test_contrib.py, the zoo's ``*_ortopt`` and ``*_qop`` models).

Float ops compute in float32 (float16 in and out, as the model says); quantized ops compute the
exact integer products in float64 (as :mod:`quantize` does) and round half to even, as
onnxruntime's requantization does.
"""

from __future__ import annotations

import math

import numpy as np

from plugserve.plugins.numpy.kernels.elementwise import gelu_erf_halved_f32
from plugserve.plugins.numpy.kernels.quantize import RANGES, centered
from plugserve.plugins.numpy.kernels.registry import KernelContext, register

MS = "com.microsoft"


def gelu_erf_f32(x32: np.ndarray) -> np.ndarray:
    return gelu_erf_halved_f32(np.multiply(x32, np.float32(0.5)))


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def _like(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    return y if y.dtype == x.dtype else y.astype(x.dtype)


# ------------------------------------------------------------------ normalizations


def _layer_norm(x: np.ndarray, gamma, beta, eps: float, simplified: bool):
    """(y, mean, inv_std) over the last axis, in float32."""
    x32 = _f32(x)
    if simplified:
        mean = None
        var = np.mean(np.square(x32), axis=-1, keepdims=True)
        centered = x32
    else:
        mean = np.mean(x32, axis=-1, keepdims=True)
        centered = x32 - mean
        var = np.mean(np.square(centered), axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt(var + np.float32(eps))
    y = centered * inv * _f32(np.asarray(gamma))
    if beta is not None:
        y += _f32(np.asarray(beta))
    return y, mean, inv


def _skip_norm(ctx: KernelContext, simplified: bool):
    """Skip(Simplified)LayerNormalization: the norm of input + skip (+ bias); outputs y, mean,
    inv_std_var and the sum (each as far as the node asks)."""
    eps = float(ctx.attr("epsilon", 1e-12 if not simplified else 1e-6))
    beta_at, bias_at = (None, 3) if simplified else (3, 4)
    outputs = ctx.num_outputs

    def run(x, skip, gamma, *rest):
        beta = rest[beta_at - 3] if beta_at is not None and len(rest) > beta_at - 3 else None
        bias = rest[bias_at - 3] if len(rest) > bias_at - 3 else None
        total = _f32(x) + _f32(skip)
        if bias is not None:
            total = total + _f32(bias)
        y, mean, inv = _layer_norm(total, gamma, beta, eps, simplified)
        results = [_like(y, x)]
        shape = (*x.shape[:-1], 1)
        if outputs > 1:
            results.append(np.zeros(shape, np.float32) if mean is None else mean)
        if outputs > 2:
            results.append(inv.reshape(shape))
        if outputs > 3:
            results.append(_like(total, x))
        return tuple(results)

    return run


@register("SkipLayerNormalization", 1, domain=MS, multi_output=True)
def skip_layer_normalization(ctx: KernelContext):
    return _skip_norm(ctx, simplified=False)


@register("SkipSimplifiedLayerNormalization", 1, domain=MS, multi_output=True)
def skip_simplified_layer_normalization(ctx: KernelContext):
    return _skip_norm(ctx, simplified=True)


@register("SimplifiedLayerNormalization", 1, multi_output=True)
def simplified_layer_normalization(ctx: KernelContext):
    """RMS normalization over ``[axis, rank)`` (onnxruntime registers it in the ONNX domain)."""
    axis = ctx.attr("axis", -1)
    eps = float(ctx.attr("epsilon", 1e-5))
    outputs = ctx.num_outputs

    def run(x, scale):
        a = axis + x.ndim if axis < 0 else axis
        flat = _f32(x).reshape(math.prod(x.shape[:a]), -1)
        inv = 1.0 / np.sqrt(np.mean(np.square(flat), axis=-1, keepdims=True) + np.float32(eps))
        y = (flat * inv).reshape(x.shape) * _f32(scale)
        if outputs == 1:
            return (_like(y, x),)
        return _like(y, x), inv.reshape(x.shape[:a] + (1,) * (x.ndim - a))

    return run


# ------------------------------------------------------------------ activations


def _gelu_tanh(x32: np.ndarray) -> np.ndarray:
    inner = np.float32(math.sqrt(2 / math.pi)) * (x32 + np.float32(0.044715) * x32 * x32 * x32)
    return np.float32(0.5) * x32 * (np.float32(1.0) + np.tanh(inner))


@register("Gelu", 1, domain=MS)
def gelu(ctx: KernelContext):
    return lambda x: _like(gelu_erf_f32(_f32(x)), x)


@register("BiasGelu", 1, domain=MS)
def bias_gelu(ctx: KernelContext):
    return lambda a, b: _like(gelu_erf_f32(_f32(a) + _f32(b)), a)


@register("FastGelu", 1, domain=MS)
def fast_gelu(ctx: KernelContext):
    def run(x, bias=None):
        x32 = _f32(x) if bias is None else _f32(x) + _f32(bias)
        return _like(_gelu_tanh(x32), x)

    return run


@register("QuickGelu", 1, domain=MS)
def quick_gelu(ctx: KernelContext):
    alpha = np.float32(ctx.attr("alpha", 1.702))

    def run(x):
        x32 = _f32(x)
        return _like(x32 / (np.float32(1.0) + np.exp(-alpha * x32)), x)

    return run


@register("BiasAdd", 1, domain=MS)
def bias_add(ctx: KernelContext):
    return lambda x, bias, skip: _like(_f32(x) + _f32(bias) + _f32(skip), x)


@register("FusedMatMul", 1, domain=MS)
def fused_matmul(ctx: KernelContext):
    """alpha * op(A) @ op(B), op a transpose of the last two axes when transA/transB."""
    alpha = float(ctx.attr("alpha", 1.0))
    ta, tb = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))
    if ctx.attr("transBatchA", 0) or ctx.attr("transBatchB", 0):
        raise ctx.unsupported("transBatchA / transBatchB")

    def run(a, b):
        if ta:
            a = np.swapaxes(a, -1, -2)
        if tb:
            b = np.swapaxes(b, -1, -2)
        y = np.matmul(a, b)
        if alpha != 1.0:
            y = y * y.dtype.type(alpha)
        return y

    return run


# ------------------------------------------------------------------ attention


def _attention(q, k, v, num_heads: int, mask_add, scale: float | None, causal: bool):
    """Multi-head attention of [B, S, H] q and [B, L, H] k, v (L: past + new): [B, S, H]."""
    b, s, hidden = q.shape
    length = k.shape[1]
    head = hidden // num_heads
    qh = q.reshape(b, s, num_heads, head).transpose(0, 2, 1, 3)
    kh = k.reshape(b, length, num_heads, -1).transpose(0, 2, 3, 1)
    vh = v.reshape(b, length, num_heads, -1).transpose(0, 2, 1, 3)
    scores = np.matmul(qh, kh) * np.float32(scale if scale else 1.0 / math.sqrt(head))
    if mask_add is not None:
        scores = scores + mask_add
    if causal:
        past = length - s
        rows = np.arange(s)[:, None] + past
        scores = np.where(np.arange(length)[None, :] > rows, np.float32(-1e4), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, vh)  # [B, N, S, head_v]
    return out.transpose(0, 2, 1, 3).reshape(b, s, -1)


def _mask_add(mask, b: int, s: int, length: int, filter_value: float):
    """onnxruntime's mask_index forms as an additive [B, 1, S or 1, L] mask (None: none):
    [B] right-padding lengths, [2B] end and start positions, [B, L] or [B, S, L] 0/1."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    keep: np.ndarray
    if mask.ndim == 1 and mask.shape[0] == b:
        keep = np.arange(length)[None, :] < mask[:, None]
        keep = keep[:, None, None, :]
    elif mask.ndim == 1 and mask.shape[0] == 2 * b:
        ends, starts = mask[:b], mask[b:]
        pos = np.arange(length)[None, :]
        keep = ((pos < ends[:, None]) & (pos >= starts[:, None]))[:, None, None, :]
    elif mask.ndim == 2:
        keep = (mask != 0)[:, None, None, :]
    elif mask.ndim == 3:
        keep = (mask != 0)[:, None, :, :]
    else:
        raise ValueError(f"mask_index of shape {list(mask.shape)} is not supported")
    return np.where(keep, np.float32(0.0), np.float32(filter_value))


def _attention_op(ctx: KernelContext, quantized: bool):
    num_heads = int(ctx.attr("num_heads"))
    causal = bool(ctx.attr("unidirectional", 0))
    sizes = ctx.attr("qkv_hidden_sizes", None)
    scale = float(ctx.attr("scale", 0.0)) or None
    filter_value = float(ctx.attr("mask_filter_value", -10000.0))
    outputs = ctx.num_outputs

    def split(qkv: np.ndarray):
        if sizes:
            q_size, k_size, _ = (int(v) for v in sizes)
            return (
                qkv[..., :q_size],
                qkv[..., q_size : q_size + k_size],
                qkv[..., q_size + k_size :],
            )
        return np.split(qkv, 3, axis=-1)

    def attend(x, weights, bias, mask, past, attention_bias=None):
        qkv = np.matmul(_f32(x), _f32(weights))
        if bias is not None:
            qkv += _f32(bias)
        q, k, v = split(qkv)
        b, s, _ = q.shape
        head = k.shape[-1] // num_heads
        if past is not None and past.size:  # [2, B, N, P, head]
            pk = past[0].transpose(0, 2, 1, 3).reshape(b, -1, num_heads * head)
            pv = (
                past[1].transpose(0, 2, 1, 3).reshape(b, -1, num_heads * (v.shape[-1] // num_heads))
            )
            k, v = np.concatenate([_f32(pk), k], 1), np.concatenate([_f32(pv), v], 1)
        length = k.shape[1]
        add = _mask_add(mask, b, s, length, filter_value)
        if attention_bias is not None:
            add = _f32(attention_bias) if add is None else add + _f32(attention_bias)
        y = _attention(q, k, v, num_heads, add, scale, causal)
        results = [y if x.dtype != np.float16 else y.astype(np.float16)]
        if outputs > 1:
            present = np.stack(
                [
                    k.reshape(b, length, num_heads, -1).transpose(0, 2, 1, 3),
                    v.reshape(b, length, num_heads, -1).transpose(0, 2, 1, 3),
                ]
            )
            results.append(present.astype(results[0].dtype))
        return tuple(results)

    if not quantized:

        def run(x, weights, bias=None, mask=None, past=None, attention_bias=None, *_):
            return attend(x, weights, bias, mask, past, attention_bias)

        return run

    def run_quantized(
        x, weight, bias, x_scale, w_scale, mask=None, x_zp=None, w_zp=None, past=None
    ):
        xs = centered(x, x_zp) * np.float64(np.asarray(x_scale).reshape(()))
        ws = centered(weight, w_zp) * np.asarray(w_scale, np.float64)
        return attend(xs.astype(np.float32), ws.astype(np.float32), bias, mask, past)

    return run_quantized


@register("Attention", 1, domain=MS, multi_output=True)
def attention(ctx: KernelContext):
    return _attention_op(ctx, quantized=False)


@register("QAttention", 1, domain=MS, multi_output=True)
def qattention(ctx: KernelContext):
    return _attention_op(ctx, quantized=True)


@register("EmbedLayerNormalization", 1, domain=MS, multi_output=True)
def embed_layer_normalization(ctx: KernelContext):
    """Word + position (+ segment) embeddings, layer-normalized; the mask's row sums as int32
    mask_index (zeros without a mask), and the sum before the norm when asked."""
    eps = float(ctx.attr("epsilon", 1e-12))
    outputs = ctx.num_outputs

    def run(ids, segments, words, positions, segment_table, gamma, beta, mask=None, pos_ids=None):
        b, s = ids.shape
        total = _f32(words)[ids]
        if pos_ids is None:
            total = total + _f32(positions)[:s][None]
        else:
            pos_ids = np.broadcast_to(pos_ids, (b, s))
            total = total + _f32(positions)[pos_ids]
        if segments is not None and segment_table is not None:
            total = total + _f32(segment_table)[segments]
        y, _, _ = _layer_norm(total, gamma, beta, eps, simplified=False)
        index = (
            np.zeros(b, np.int32) if mask is None else np.asarray(mask).sum(axis=1).astype(np.int32)
        )
        results = [y.astype(words.dtype), index]
        if outputs > 2:
            results.append(total.astype(words.dtype))
        return tuple(results)

    return run


# ------------------------------------------------------------------ quantized (QOperator)


def _dequant(x, scale, zp) -> np.ndarray:
    return centered(x, zp) * np.asarray(scale, np.float64)


def _quant(y: np.ndarray, scale, zp, dtype: np.dtype) -> np.ndarray:
    lo, hi = RANGES[np.dtype(dtype)]
    q = np.rint(y / np.asarray(scale, np.float64))
    if zp is not None:
        q += np.asarray(zp, np.float64)
    return np.clip(q, lo, hi).astype(dtype)


def _qlinear_binary(ufunc):
    def build(ctx: KernelContext):
        def run(a, a_scale, a_zp, b, b_scale, b_zp, c_scale, c_zp=None):
            y = ufunc(_dequant(a, a_scale, a_zp), _dequant(b, b_scale, b_zp))
            return _quant(y, c_scale, c_zp, c_zp.dtype if c_zp is not None else a.dtype)

        return run

    return build


register("QLinearAdd", 1, domain=MS)(_qlinear_binary(np.add))
register("QLinearMul", 1, domain=MS)(_qlinear_binary(np.multiply))


@register("QLinearGlobalAveragePool", 1, domain=MS)
def qlinear_global_average_pool(ctx: KernelContext):
    last = bool(ctx.attr("channels_last", 0))

    def run(x, x_scale, x_zp, y_scale, y_zp):
        axes = tuple(range(1, x.ndim - 1)) if last else tuple(range(2, x.ndim))
        mean = _dequant(x, x_scale, x_zp).mean(axis=axes, keepdims=True)
        return _quant(mean, y_scale, y_zp, y_zp.dtype if y_zp is not None else x.dtype)

    return run


@register("QLinearConcat", 1, domain=MS)
def qlinear_concat(ctx: KernelContext):
    axis = int(ctx.attr("axis"))

    def run(y_scale, y_zp, *triples):
        parts = [
            _dequant(triples[i], triples[i + 1], triples[i + 2]) for i in range(0, len(triples), 3)
        ]
        return _quant(np.concatenate(parts, axis), y_scale, y_zp, y_zp.dtype)

    return run


def _qlinear_unary(fn):
    def build(ctx: KernelContext):
        alpha = float(ctx.attr("alpha", 0.01))

        def run(x, x_scale, x_zp, y_scale, y_zp=None):
            y = fn(_dequant(x, x_scale, x_zp), alpha)
            return _quant(y, y_scale, y_zp, y_zp.dtype if y_zp is not None else x.dtype)

        return run

    return build


register("QLinearSigmoid", 1, domain=MS)(_qlinear_unary(lambda x, _: 1.0 / (1.0 + np.exp(-x))))
register("QLinearLeakyRelu", 1, domain=MS)(
    _qlinear_unary(lambda x, alpha: np.where(x >= 0, x, alpha * x))
)


@register("QGemm", 1, domain=MS)
def qgemm(ctx: KernelContext):
    """alpha * (A - a_zp) (B - b_zp) * a_scale * b_scale + C (int32, at scale a_scale*b_scale),
    quantized with y_scale, y_zp when they are given, else float32."""
    alpha = float(ctx.attr("alpha", 1.0))
    ta, tb = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))

    def run(a, a_scale, a_zp, b, b_scale, b_zp, c=None, y_scale=None, y_zp=None):
        am = centered(a.T if ta else a, a_zp)
        bm = centered(b.T if tb else b, _column(b_zp, tb))
        scale = np.asarray(a_scale, np.float64) * _column(np.asarray(b_scale, np.float64), tb)
        acc = np.matmul(am, bm)
        if c is not None:
            acc = acc + np.asarray(c, np.float64)
        y = acc * scale * alpha
        if y_scale is None:
            return y.astype(np.float32)
        return _quant(y, y_scale, y_zp, y_zp.dtype if y_zp is not None else a.dtype)

    return run


def _column(value, transposed: bool):
    """A per-column parameter of B (N values) as it broadcasts over [M, N]."""
    if value is None:
        return None
    value = np.asarray(value)
    return value.reshape(()) if value.size == 1 else value.reshape(1, -1)


@register("MatMulInteger16", 1, domain=MS)
def matmul_integer16(ctx: KernelContext):
    return lambda a, b: np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.int32)
