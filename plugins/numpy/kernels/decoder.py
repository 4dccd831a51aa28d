"""onnxruntime's contrib ops (``com.microsoft``) of decoder graphs: what onnxruntime-genai's
model builder writes for a Llama, Qwen2, Mistral or Phi on CPU, so its fp32 and int4 folders
run on NUMPY's own kernels.

- ``GroupQueryAttention``: attention with fewer key/value heads than query heads, its key/value
  cache as ``past_key``/``past_value`` in, ``present_key``/``present_value`` out, rotary
  embeddings inside (``do_rotary`` with cos/sin caches), causal, with ``softcap``,
  ``local_window_size`` (sliding window), ``smooth_softmax``, ``head_sink`` and
  ``attention_bias``. Per batch row, ``seqlens_k[b] + 1`` is the row's total length (past plus
  new tokens); ``total_sequence_length`` is the batch's longest. In the first prompt (its new
  tokens are the whole sequence) there is no past; later each row's past is
  ``seqlens_k[b] + 1 - S`` tokens long, so rows of one batch may have different pasts. The
  builder's CPU graphs use the shared-buffer form: ``past_key`` already has the cache's full
  length and ``present_key`` the same length; a row's new keys go at its own past length.
  ``present`` holds zeros past each row's tokens, as onnxruntime's does when past and present
  are separate buffers (as they are to any caller of ``infer``).
- ``RotaryEmbedding``: rotary position embeddings, halves (``interleaved=0``) or pairs
  (``interleaved=1``), on [B, S, hidden] or [B, N, S, head] inputs, partial rotation
  (``rotary_embedding_dim``), positions as [B, S] ids or one start offset.
- ``GatherBlockQuantized``: an embedding table of 4-bit (or 2- or 8-bit) blocks: int4/uint4
  data, or uint8 packing ``8 / bits`` values a byte (the builder's tied-embedding form, which
  shares the LM head's MatMulNBits weight); scales per block, optional zero points.
- ``MatMulNBits``: A @ B for B of ``bits``-bit blocks [N, K / block, block * bits / 8], low
  bits first; a scale per (n, block), zero points (packed like B, or float; 2^(bits-1) when
  absent), ``g_idx`` (each k's block: GPTQ act-order), bias.

What each costs, and why:

- Everything about a node is decided at load (the rotary cos/sin caches are constants; the
  quantized weights are unpacked), so a run is only the arithmetic; no Python loop runs over
  tokens or heads: Q @ K^T and P @ V are each one batched matmul over (batch, kv head), the
  query heads that share a kv head stacked as rows of one product (the grouped heads read
  their keys once), the causal and window masks one broadcast add. The only Python loops are
  over batch rows for the cache copies, when rows' pasts differ in length.
- Attention reads the cache only up to the batch's longest row, not the buffer's full length,
  and a large ``present`` is a fresh anonymous mapping, whose pages past the rows' tokens stay
  untouched zero pages (:func:`_zeros`: a decode step's 24 presents of a 4,096-position
  buffer cost 4 ms instead of 36).
- The score buffer is at most :data:`SCORE_BYTES` (64 MiB): a longer prompt's queries are
  taken in blocks of rows, so its memory stays linear in the prompt's length, not quadratic.
- Every size a run allocates follows from its input arrays' sizes: ``total_sequence_length``
  above ``past length + S`` (what would let one small request ask for a huge ``present``),
  lengths that do not fit the buffers, or positions beyond the cos/sin caches are refused
  with the values named.
- MatMulNBits dequantizes its constant weight once, at load, into a float32 [K, N] matrix,
  and each run is one BLAS product (split over the request's threads as every GEMM on NUMPY:
  :mod:`plugserve.plugins.numpy.parallel`; a single row, a decode step, is numpy's sgemv,
  2.5-3x faster than sgemm with one row: 13 against 33 ms for a 768 x 32000 head). The
  trade: 4 bytes per weight in memory instead of half a byte (a ~150 M-parameter int4 model
  takes the memory of its fp32 export, 610 MB instead of 180), for the speed of an fp32
  GEMM; numpy has no int4 GEMM, and dequantizing on every run costs more than the product
  itself. That is done when memory allows: when the float32 matrix takes more than half the
  memory free at its load (a model too large for the machine in float32), or the weight is
  not a constant, each run dequantizes it in slabs of output columns of at most
  :data:`BLOCKED_SLAB_BYTES` (16 MiB) and multiplies slab by slab: memory bounded, slower.
- onnxruntime's MatMulNBits with ``accuracy_level=4`` (the builder's CPU default) quantizes
  A to int8 before the product; NUMPY computes the exact product of A and the dequantized
  weight, as the op defines it, so its results differ from onnxruntime's there by that
  rounding (tests compare at the tolerance it needs, and exactly with ``accuracy_level=1``).
"""

from __future__ import annotations

import math
import mmap
import os

import numpy as np

from plugserve.plugins.numpy.kernels.registry import KernelContext, register
from plugserve.plugins.numpy.parallel import matmul as _matmul

MS = "com.microsoft"
_F32 = np.dtype(np.float32)

#: The most bytes one GroupQueryAttention score block may take; longer prompts run in blocks
#: of query rows (64 MiB: 2,048 prompt tokens x 2,048 keys x 4 heads at once).
SCORE_BYTES = 64 << 20
#: presents at least this large are fresh anonymous mappings (see :func:`_zeros`)
LAZY_ZEROS_BYTES = 1 << 20
#: MatMulNBits without the memory to dequantize at load: float32 slabs of at most this size
BLOCKED_SLAB_BYTES = 16 << 20


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == _F32 else x.astype(_F32)


# ------------------------------------------------------------------ rotary embeddings


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """x rotated by the angles whose cos/sin are given (broadcasting against x[..., :rot/2]);
    the first ``2 * cos.shape[-1]`` features rotate, the rest pass. A new float32 array."""
    half = cos.shape[-1]
    rot = 2 * half
    x = _f32(x)
    out = np.empty(x.shape, _F32)
    if interleaved:
        even, odd = x[..., 0:rot:2], x[..., 1:rot:2]
        np.subtract(even * cos, odd * sin, out=out[..., 0:rot:2])
        np.add(odd * cos, even * sin, out=out[..., 1:rot:2])
    else:
        first, second = x[..., :half], x[..., half:rot]
        np.subtract(first * cos, second * sin, out=out[..., :half])
        np.add(second * cos, first * sin, out=out[..., half:rot])
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


def _angles(cos_cache: np.ndarray, sin_cache: np.ndarray, positions: np.ndarray, half: int):
    """cos and sin at each position ([B, S] -> [B, S, half]); positions beyond the caches are
    refused, naming them."""
    limit = cos_cache.shape[0]
    if positions.size and (positions.min() < 0 or positions.max() >= limit):
        raise ValueError(
            f"rotary position {int(positions.max())} is outside the cos/sin caches of {limit} "
            "positions (the model's context length)"
        )
    return cos_cache[positions, :half], sin_cache[positions, :half]


@register("RotaryEmbedding", 1, domain=MS)
def rotary_embedding(ctx: KernelContext):
    """Inputs: x [B, S, hidden] or [B, N, S, head], position_ids ([B, S], or [1]: the first
    token's position, the others following), cos_cache and sin_cache [positions, rot / 2]."""
    interleaved = bool(ctx.attr("interleaved", 0))
    rot_dim = int(ctx.attr("rotary_embedding_dim", 0))
    num_heads = int(ctx.attr("num_heads", 0))
    if ctx.attr("is_packed_batching", 0):
        raise ctx.unsupported("is_packed_batching (ragged batches)")
    caches = [ctx.constant(2), ctx.constant(3)]

    def run(x, position_ids, cos_cache, sin_cache):
        cos_cache = caches[0] if caches[0] is not None else cos_cache
        sin_cache = caches[1] if caches[1] is not None else sin_cache
        half = (rot_dim // 2) if rot_dim else cos_cache.shape[1]
        if x.ndim == 4:
            b, _, s, _ = x.shape
        else:
            b, s, hidden = x.shape
            head = hidden // num_heads if num_heads else 2 * cos_cache.shape[1]
            if not head or hidden % head:
                raise ValueError(f"hidden size {hidden} is not a whole number of heads of {head}")
        ids = np.asarray(position_ids).astype(np.int64, copy=False)
        if ids.size == 1:
            positions = np.broadcast_to(ids.reshape(()) + np.arange(s), (b, s))
        else:
            positions = np.broadcast_to(ids, (b, s))
        cos, sin = _angles(_f32(cos_cache), _f32(sin_cache), positions, half)
        if x.ndim == 4:  # [B, N, S, head]: the angles broadcast over the heads
            y = rotate(x, cos[:, None], sin[:, None], interleaved)
        else:
            y = rotate(x.reshape(b, s, -1, head), cos[:, :, None], sin[:, :, None], interleaved)
            y = y.reshape(x.shape)
        return y if y.dtype == x.dtype else y.astype(x.dtype)

    return run


# ------------------------------------------------------------------ grouped-query attention


def _positions(seqlens_k, total_seqlen, s: int, b: int, past_capacity: int):
    """(past length per row, total length per row, first prompt?) from GQA's length inputs,
    each checked against what the buffers hold."""
    totals = np.asarray(seqlens_k).reshape(-1).astype(np.int64) + 1
    if totals.shape[0] != b:
        raise ValueError(f"seqlens_k has {totals.shape[0]} values for a batch of {b}")
    total = int(np.asarray(total_seqlen).reshape(-1)[0])
    first = s == total
    past = np.zeros(b, np.int64) if first else totals - s
    if total > past_capacity + s:
        raise ValueError(
            f"total_sequence_length {total} is more than the past's {past_capacity} positions "
            f"plus the {s} new tokens"
        )
    if totals.min() < 1 or totals.max() > total or past.min() < 0 or past.max() > past_capacity:
        raise ValueError(
            f"seqlens_k {(totals - 1).tolist()} do not fit: each row's total length "
            f"(seqlens_k + 1) must lie in [{s if not first else 1}, {total}] "
            f"(total_sequence_length) and its past within the {past_capacity} cached positions"
        )
    return past, totals, first, total


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros whose pages the kernel never touches cost nothing: a present of the builder's
    shared buffer (a 4,096-position context: 4 MiB a layer's keys) holds a few hundred tokens.
    np.zeros of such a size comes from the heap once glibc has freed a few (its mmap threshold
    grows), and is memset whole: 1.5 ms each, 36 ms a decode step for 12 layers, more than
    half the step. An anonymous mapping is zero pages until written: the same present costs
    0.16 ms with its past copied in. Small arrays stay np.zeros."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < LAZY_ZEROS_BYTES:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


def _present(past, new, past_len: np.ndarray, length: int, uniform: bool) -> np.ndarray:
    """[B, kv, length, head]: each row's past (its first past_len[b] positions), its new
    tokens after it, zeros after those."""
    b, s, kv, d = new.shape
    dtype = past.dtype if past is not None else new.dtype
    present = _zeros((b, kv, length, d), dtype)
    if past is not None and past_len.max() > 0:
        if uniform:
            p = int(past_len[0])
            present[:, :, :p] = past[:, :, :p]
        else:
            for row, p in enumerate(past_len.tolist()):
                present[row, :, :p] = past[row, :, :p]
    if uniform:
        p = int(past_len[0])
        present[:, :, p : p + s] = new.transpose(0, 2, 1, 3)
    else:
        slots = past_len[:, None] + np.arange(s)  # [B, S]
        present[np.arange(b)[:, None], :, slots] = new  # advanced dims first: [B, S, kv, d]
    return present


def _softmax_rows(scores: np.ndarray, sink: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis, in place; with ``sink`` (broadcasting against the rows'
    maxima) an extra logit of that value joins each row's denominator (smooth softmax: 0)."""
    top = scores.max(axis=-1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, sink)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if sink is not None:
        total += np.exp(sink - top)
    scores /= total
    return scores


@register("GroupQueryAttention", 1, domain=MS, multi_output=True)
def group_query_attention(ctx: KernelContext):
    """Inputs: query [B, S, N*h] (or packed Q, K, V [B, S, (N + 2 Nkv) * h] with no key and
    value), key and value [B, S, Nkv*h], past_key and past_value [B, Nkv, P, h], seqlens_k [B],
    total_sequence_length, cos_cache and sin_cache, then position_ids, attention_bias and
    head_sink. Outputs: [B, S, N*h], present_key and present_value [B, Nkv, max(T, P), h]."""
    heads = int(ctx.attr("num_heads"))
    kv_heads = int(ctx.attr("kv_num_heads"))
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ctx.unsupported(f"num_heads {heads} is not a multiple of kv_num_heads {kv_heads}")
    group = heads // kv_heads
    scale_attr = float(ctx.attr("scale", 0.0))
    softcap = float(ctx.attr("softcap", 0.0))
    window = int(ctx.attr("local_window_size", -1))
    do_rotary = bool(ctx.attr("do_rotary", 0))
    interleaved = bool(ctx.attr("rotary_interleaved", 0))
    smooth = int(ctx.attr("smooth_softmax", 0)) == 1
    if int(ctx.attr("causal", 1)) != 1:
        raise ctx.unsupported("causal=0 (bidirectional attention)")
    if int(ctx.attr("qk_output", 0)):
        raise ctx.unsupported("qk_output (the attention scores as an output)")
    if int(ctx.attr("sliding_window_cache", 0)):
        raise ctx.unsupported("sliding_window_cache (a window-sized cache)")
    for attr in ("k_quant_type", "v_quant_type"):
        if str(ctx.attr(attr, "NONE")).upper() != "NONE":
            raise ctx.unsupported(f"{attr} {ctx.attr(attr)!r} (a quantized KV cache)")
    for index, what in ((9, "position_ids"), (12, "k_scale"), (13, "v_scale"),
                        (14, "q_norm_weight"), (15, "k_norm_weight")):  # fmt: skip
        if ctx.has_input(index):
            raise ctx.unsupported(f"input {what}")
    if do_rotary and not (ctx.has_input(7) and ctx.has_input(8)):
        raise ctx.unsupported("do_rotary needs cos_cache and sin_cache")
    caches = [ctx.constant(7), ctx.constant(8)]
    caches = [None if c is None else _f32(c) for c in caches]
    outputs = ctx.num_outputs

    def run(query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
            total_seqlen=None, cos_cache=None, sin_cache=None, _position_ids=None,
            attention_bias=None, head_sink=None, *_rest):  # fmt: skip
        b, s = query.shape[:2]
        if key is None:
            head = query.shape[2] // (heads + 2 * kv_heads)
            qkv = query.reshape(b, s, heads + 2 * kv_heads, head)
            q, k, v = np.split(qkv, [heads, heads + kv_heads], axis=2)
        else:
            head = query.shape[2] // heads
            q = query.reshape(b, s, heads, head)
            k = key.reshape(b, s, kv_heads, head)
            v = value.reshape(b, s, kv_heads, head)
        capacity = past_key.shape[2] if past_key is not None else 0
        past_len, _, _, total = _positions(seqlens_k, total_seqlen, s, b, capacity)
        positions = past_len[:, None] + np.arange(s)  # padding rows too, as onnxruntime
        if do_rotary:
            cc = caches[0] if caches[0] is not None else _f32(cos_cache)
            sc = caches[1] if caches[1] is not None else _f32(sin_cache)
            cos, sin = _angles(cc, sc, positions, cc.shape[1])
            cos, sin = cos[:, :, None], sin[:, :, None]
            q, k = rotate(q, cos, sin, interleaved), rotate(k, cos, sin, interleaved)
        uniform = bool((past_len == past_len[0]).all())
        length = max(total, capacity)
        present_k = _present(past_key, k, past_len, length, uniform)
        present_v = _present(past_value, v, past_len, length, uniform)
        y = _attend(q, present_k, present_v, past_len, head, attention_bias, head_sink)
        y = y.reshape(b, s, heads * head)
        out = y if y.dtype == query.dtype else y.astype(query.dtype)
        results = (out, present_k, present_v)
        return results[:outputs]

    def _attend(q, present_k, present_v, past_len, head, attention_bias, head_sink):
        """softmax(scale * Q K^T + masks) V for [B, S, N, h] queries: [B, S, N, h]."""
        b, s = q.shape[:2]
        ends = past_len + s  # one past each row's last key
        keys = int(ends.max())
        kt = present_k[:, :, :keys].swapaxes(2, 3)  # [B, kv, h, L]
        vv = present_v[:, :, :keys]
        if kt.dtype != _F32:
            kt, vv = _f32(kt), _f32(vv)
        scale = scale_attr or 1.0 / math.sqrt(head)
        # [B, S, kv, G, h] -> [B, kv, G, S, h]: the G heads sharing a kv head are one product
        qg = _f32(q).reshape(b, s, kv_heads, group, head).transpose(0, 2, 3, 1, 4)
        out = np.empty((b, s, kv_heads, group, head), _F32)
        sink = None
        if head_sink is not None:
            sink = _f32(head_sink).reshape(1, kv_heads, group, 1, 1)
        elif smooth:
            sink = np.zeros((1, 1, 1, 1, 1), _F32)
        bias = None
        if attention_bias is not None:  # [B or 1, N or 1, S, T]
            ab = _f32(attention_bias)[..., :keys]
            bias = (
                ab.reshape(ab.shape[0], -1, 1, s, keys)
                if ab.shape[1] == 1
                else ab.reshape(ab.shape[0], kv_heads, group, s, keys)
            )
        per_row = b * heads * keys * 4
        block = max(1, min(s, SCORE_BYTES // max(1, per_row)))
        col = np.arange(keys)
        for lo in range(0, s, block):  # one block unless the prompt is long
            hi = min(s, lo + block)
            rows = hi - lo
            qb = qg[:, :, :, lo:hi].reshape(b, kv_heads, group * rows, head)
            scores = _matmul(qb, kt).reshape(b, kv_heads, group, rows, keys)
            scores *= _F32.type(scale)
            if softcap > 0:
                np.tanh(scores / _F32.type(softcap), out=scores)
                scores *= _F32.type(softcap)
            if bias is not None:
                scores += bias[..., lo:hi, :]
            last = (past_len[:, None] + np.arange(lo, hi))[:, :, None]  # [B, rows, 1]
            allowed = col <= last
            if window > 0:
                allowed &= col > last - window  # window keys, this one included
            if not allowed.all():
                scores += np.where(allowed, _F32.type(0), _F32.type(-np.inf))[:, None, None]
            _softmax_rows(scores, sink)
            ctxt = _matmul(scores.reshape(b, kv_heads, group * rows, keys), vv)
            out[:, lo:hi] = ctxt.reshape(b, kv_heads, group, rows, head).transpose(0, 3, 1, 2, 4)
        return out

    return run


# ------------------------------------------------------------------ block-quantized weights


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """uint8 bytes holding 8 / bits values each, low bits first: the values, int16, the last
    axis cut to ``count``."""
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    values = values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
    return values[..., :count].astype(np.int16)


@register("GatherBlockQuantized", 1, domain=MS)
def gather_block_quantized(ctx: KernelContext):
    """Gather rows of a block-quantized table, dequantized: ``(q - zero_point) * scale`` with
    one scale (and zero point) per ``block_size`` values along ``quantize_axis``. The table
    stays quantized in memory (unpacked to int16 at load, 2 bytes per value); only the
    gathered rows are dequantized, per run."""
    gather_axis = int(ctx.attr("gather_axis", 0))
    quantize_axis = int(ctx.attr("quantize_axis", 1))
    block = int(ctx.attr("block_size", 128))
    bits = int(ctx.attr("bits", 4))
    if bits not in (2, 4, 8) or block < 16 or block & (block - 1):
        raise ctx.unsupported(f"bits {bits} with block_size {block}")
    data, scales, zps = ctx.constant(0), ctx.constant(2), ctx.constant(3)
    if data is None or scales is None or (ctx.has_input(3) and zps is None):
        raise ctx.unsupported("the quantized table, its scales and zero points must be constants")
    rank = data.ndim
    gather_axis %= rank
    quantize_axis %= rank
    if gather_axis == quantize_axis:
        raise ctx.unsupported("gather_axis equals quantize_axis")
    dtype = np.dtype(data.dtype)
    if dtype == np.uint8 and quantize_axis == rank - 1:
        # packed: 8 / bits values a byte along the last axis; unsigned, centred on 2^(bits-1)
        width = scales.shape[quantize_axis] * block
        width = min(width, data.shape[-1] * (8 // bits))
        values = _unpack(data, bits, width)
        default_zp = 1 << (bits - 1)
        zp = None if zps is None else _unpack(zps, bits, scales.shape[-1])
    elif dtype.name in ("int4", "uint4", "int8", "uint8"):
        values = data.astype(np.int16)
        default_zp = 0  # onnxruntime: no zero point is 0 for the ONNX int types
        zp = None if zps is None else zps.astype(np.int16)
    else:
        raise ctx.unsupported(f"table of type {dtype}")
    size = values.shape[quantize_axis]
    scale = _f32(scales)
    zero = np.int16(default_zp) if zp is None else zp
    out_dtype = scales.dtype

    def expand(per_block: np.ndarray, axis: int) -> np.ndarray:
        """One value per block along ``axis`` -> one per element."""
        return np.repeat(per_block, block, axis=axis).take(np.arange(size), axis=axis)

    def run(_data, indices, _scales=None, _zps=None):
        idx = np.asarray(indices).astype(np.int64, copy=False)
        limit = values.shape[gather_axis]
        if idx.size and (idx.min() < -limit or idx.max() >= limit):
            raise ValueError(f"index out of range [-{limit}, {limit - 1}]")
        idx = np.where(idx < 0, idx + limit, idx)
        # the quantized axis, after the gather replaced its axis by the indices' axes
        axis = quantize_axis + (idx.ndim - 1 if quantize_axis > gather_axis else 0)
        q = np.take(values, idx, axis=gather_axis)
        sc = expand(np.take(scale, idx, axis=gather_axis), axis)
        if isinstance(zero, np.ndarray):
            y = (q - expand(np.take(zero, idx, axis=gather_axis), axis)).astype(_F32)
        else:
            y = (q - zero).astype(_F32)
        y *= sc
        return y if y.dtype == out_dtype else y.astype(out_dtype)

    return run


def dequantize_nbits(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    g_idx: np.ndarray | None,
    k: int,
    n: int,
    bits: int,
    block: int,
) -> np.ndarray:
    """MatMulNBits' B as a float32 [K, N] matrix (C-ordered)."""
    blocks = -(-k // block)
    values = _unpack(np.asarray(b, np.uint8).reshape(n, blocks * (block * bits // 8)), bits, k)
    scale = _f32(np.asarray(scales)).reshape(n, -1)
    if zero_points is None:
        zp = np.full((n, scale.shape[1]), 1 << (bits - 1), _F32)
    elif zero_points.dtype == np.uint8:
        zp = _unpack(np.asarray(zero_points).reshape(n, -1), bits, scale.shape[1]).astype(_F32)
    else:
        zp = _f32(np.asarray(zero_points)).reshape(n, -1)
    if g_idx is None:
        group = np.arange(k) // block
    else:
        group = np.asarray(g_idx).reshape(-1).astype(np.int64)
        if group.shape[0] != k or group.min() < 0 or group.max() >= scale.shape[1]:
            raise ValueError(f"g_idx must give each of the {k} rows a block in [0, {blocks})")
    weights = (values.astype(_F32) - zp[:, group]) * scale[:, group]  # [N, K]
    return np.ascontiguousarray(weights.T)


def _free_memory() -> int:
    """Bytes of memory free now (not counting the page cache): what a load may still take."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def _blocked_product(a2, b, scales, zero_points, g_idx, k, n, bits, block) -> np.ndarray:
    """a2 @ B with B dequantized a slab of output columns at a time (at most
    :data:`BLOCKED_SLAB_BYTES` of float32 each): memory bounded, each run pays the unpacking."""
    rows_per_n = np.asarray(b).reshape(n, -1)
    per_n_scales = np.asarray(scales).reshape(n, -1)
    per_n_zps = None if zero_points is None else np.asarray(zero_points).reshape(n, -1)
    step = max(16, BLOCKED_SLAB_BYTES // (4 * k))
    y = np.empty((a2.shape[0], n), _F32)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        zps = None if per_n_zps is None else per_n_zps[lo:hi]
        slab = dequantize_nbits(
            rows_per_n[lo:hi], per_n_scales[lo:hi], zps, g_idx, k, hi - lo, bits, block
        )
        y[:, lo:hi] = _matmul(a2, slab)
    return y


@register("MatMulNBits", 1, domain=MS)
def matmul_nbits(ctx: KernelContext):
    """A [..., K] @ B (dequantized, see :func:`dequantize_nbits`) + bias: [..., N]."""
    k, n = int(ctx.attr("K")), int(ctx.attr("N"))
    bits, block = int(ctx.attr("bits", 4)), int(ctx.attr("block_size"))
    if bits not in (2, 4, 8):
        raise ctx.unsupported(f"bits={bits}")
    if block < 16 or block & (block - 1):
        raise ctx.unsupported(f"block_size={block} (a power of two from 16)")
    consts = {i: ctx.constant(i) for i in (1, 2, 3, 4, 5)}
    if ctx.has_input(3) and ctx.has_input(4) and ctx.input_dtype(3) == np.uint8:
        raise ctx.unsupported(
            "packed uint8 zero points with g_idx: onnxruntime ignores such zero points (it "
            "takes 2^(bits-1)), so the model's numbers are undefined; store them as floats"
        )
    ready = None
    constant = all(consts[i] is not None or not ctx.has_input(i) for i in (1, 2, 3, 4))
    # dequantized once when the float32 matrix fits in half the memory free now (so the
    # nodes loaded first take what they need and the later ones see what is left)
    if constant and 4 * k * n <= _free_memory() // 2:
        ready = dequantize_nbits(consts[1], consts[2], consts[3], consts[4], k, n, bits, block)
        ready.setflags(write=False)
    bias = consts[5]
    if bias is not None:
        bias = np.ascontiguousarray(_f32(bias).reshape(n))

    def run(a, b, scales, zero_points=None, g_idx=None, b_bias=None):
        lead = a.shape[:-1]
        rows = math.prod(lead)
        a2 = np.ascontiguousarray(_f32(a).reshape(rows, k))
        add = bias if bias is not None else (None if b_bias is None else _f32(b_bias).reshape(n))
        if ready is not None:
            y = _matmul(a2, ready)  # one row (a decode step): numpy's sgemv, ~3x sgemm's speed
        else:
            y = _blocked_product(a2, b, scales, zero_points, g_idx, k, n, bits, block)
        if add is not None:
            y += add
        y = y.reshape(*lead, n)
        return y if y.dtype == a.dtype else y.astype(a.dtype)

    return run
