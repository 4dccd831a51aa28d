"""Attention (ONNX 23, 24, 25): scaled dot-product attention with its masks, caches, grouped
key/value heads, softcap and the optional ``qk_matmul_output``, step for step as ONNX's
reference computes it (``onnx/reference/ops/op_attention.py``): the scale's square root on
both Q and K, softcap before the mask, a fully masked row (its bias all -inf) gives zeros."""

from __future__ import annotations

import math
from typing import Any

from plugserve.plugins.torch.ops.elementwise import FLOATS
from plugserve.plugins.torch.ops.registry import NodeContext, Refused, register


def _heads(x: Any, heads: int) -> Any:
    """(batch, seq, hidden) as (batch, heads, seq, head_size)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).permute(0, 2, 1, 3)


def _allowed_bias(torch: Any, allowed: Any, dtype: Any) -> Any:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=allowed.device))


def _band(torch: Any, q: int, kv: int, offset: Any, device: Any) -> Any:
    """``(i + offset) - j`` for query i and key j: (q, kv), or (batch, 1, q, kv) for a
    per-batch offset."""
    i = torch.arange(q, device=device).reshape(q, 1)
    j = torch.arange(kv, device=device).reshape(1, kv)
    if isinstance(offset, int):
        return (i + offset) - j
    return ((i + offset.reshape(-1, 1, 1)) - j).reshape(-1, 1, q, kv)


@register("Attention", 23, 24, 25, multi_output=True, types=FLOATS)
def attention(ctx: NodeContext) -> Any:
    torch = ctx.torch
    scale_attr = ctx.attr("scale")
    causal = bool(int(ctx.attr("is_causal", 0)))
    q_heads, kv_heads = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
    softcap = float(ctx.attr("softcap", 0.0))
    mode = int(ctx.attr("qk_matmul_output_mode", 0))
    left = int(ctx.attr("left_window_size", -1))
    right = int(ctx.attr("right_window_size", -1))
    precision = ctx.attr("softmax_precision")
    soft_dtype = ctx.onnx_dtype(int(precision)) if precision is not None else None
    if mode not in (0, 1, 2, 3):
        raise Refused(f"Attention qk_matmul_output_mode={mode}")
    if left < -1 or right < -1:
        raise Refused("Attention window sizes below -1")
    if ctx.has(4) != ctx.has(5):
        raise Refused("Attention with only one of past_key and past_value")
    if ctx.has(6) and ctx.has(4):
        raise Refused("Attention with both nonpad_kv_seqlen and a past cache")
    window = left >= 0 or right >= 0

    def run(q, k, v, mask=None, past_k=None, past_v=None, nonpad=None):
        dtype, device = q.dtype, q.device
        three_d = q.dim() == 3
        if three_d:
            if q_heads is None or kv_heads is None:
                raise ValueError("Attention of 3-D inputs needs q_num_heads and kv_num_heads")
            q, k, v = _heads(q, int(q_heads)), _heads(k, int(kv_heads)), _heads(v, int(kv_heads))
        scale = scale_attr if scale_attr is not None else 1 / math.sqrt(q.shape[3])
        # a fill kernel (no copy from the host: capturable), rounded to float32 as before
        root = torch.full((), math.sqrt(scale), dtype=torch.float32, device=device).to(dtype)
        if past_k is not None:
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        present_k, present_v = k, v
        nq, nkv = q.shape[2], k.shape[2]
        bias = torch.zeros((nq, nkv), dtype=dtype, device=device)
        if mask is not None and mask.shape[-1] < nkv:
            width = nkv - mask.shape[-1]
            fill = False if mask.dtype == torch.bool else -math.inf
            mask = torch.nn.functional.pad(mask, (0, width), value=fill)
        if past_k is None and nonpad is not None:
            offset: Any = nonpad.reshape(-1).to(torch.int64) - nq
        else:
            offset = past_k.shape[2] if past_k is not None else 0
        if causal:
            if mask is not None and mask.dtype == torch.bool:
                mask = _allowed_bias(torch, mask, dtype)
            base = bias if mask is None else mask.to(dtype)
            if window:
                base = bias + base
            bias = base + _allowed_bias(torch, _band(torch, nq, nkv, offset, device) >= 0, dtype)
        elif mask is not None:
            if mask.dtype == torch.bool:
                mask = _allowed_bias(torch, mask, dtype)
            bias = bias + mask.to(dtype)
        if window:
            diff = _band(torch, nq, nkv, offset, device)
            allowed = torch.ones_like(diff, dtype=torch.bool)
            if left >= 0:
                allowed &= diff <= left
            if right >= 0:
                allowed &= -diff <= right
            bias = bias + _allowed_bias(torch, allowed, dtype)
        if nonpad is not None:
            keep = torch.arange(nkv, device=device) < nonpad.reshape(-1, 1)
            bias = bias + _allowed_bias(torch, keep, dtype).reshape(q.shape[0], 1, 1, nkv)
        n_q = q.shape[1] if q_heads is None else int(q_heads)
        n_kv = k.shape[1] if kv_heads is None else int(kv_heads)
        if n_q != n_kv and n_q % n_kv == 0:
            k = k.repeat_interleave(n_q // n_kv, dim=1)
            v = v.repeat_interleave(n_q // n_kv, dim=1)
        qk = torch.matmul(q * root, k.transpose(2, 3) * root)
        if softcap > 0:
            qk = torch.tanh(qk / softcap) * softcap
        with_bias = qk + bias
        exposed = with_bias if mode == 2 else qk
        scores = with_bias if soft_dtype is None else with_bias.to(soft_dtype)
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
        exp = torch.exp(scores - top)
        total = exp.sum(dim=-1, keepdim=True)
        probs = exp / torch.where(total == 0, torch.ones_like(total), total)
        masked_row = torch.isneginf(bias.amax(dim=-1, keepdim=True))
        probs = torch.where(masked_row, torch.zeros_like(probs), probs)
        if mode == 3:
            exposed = probs
        y = torch.matmul(probs.to(dtype), v)
        if three_d:
            y = y.permute(0, 2, 1, 3)
            y = y.reshape(y.shape[0], y.shape[1], -1)
        return y, present_k, present_v, exposed.to(dtype)

    return run


@register("RotaryEmbedding", 23, types=FLOATS)
def rotary_embedding(ctx: NodeContext) -> Any:
    torch = ctx.torch
    interleaved = bool(int(ctx.attr("interleaved", 0)))
    dim_attr = int(ctx.attr("rotary_embedding_dim", 0))
    num_heads = int(ctx.attr("num_heads", 0))

    def run(x: Any, cos: Any, sin: Any, positions: Any = None) -> Any:
        shape = x.shape
        if x.dim() == 4:  # (batch, heads, seq, head) -> (batch, seq, heads, head)
            x = x.permute(0, 2, 1, 3)
        else:
            if not num_heads:
                raise ValueError("RotaryEmbedding of 3-D input needs num_heads")
            x = x.reshape(shape[0], shape[1], num_heads, shape[2] // num_heads)
        dim = dim_attr or x.shape[3]
        rotate, keep = x[..., :dim], x[..., dim:]
        if positions is not None:
            cos, sin = cos[positions.long()], sin[positions.long()]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        if interleaved:
            x1, x2 = rotate[..., 0::2], rotate[..., 1::2]
        else:
            x1, x2 = rotate[..., : dim // 2], rotate[..., dim // 2 :]
        real = cos * x1 - sin * x2
        imag = sin * x1 + cos * x2
        if interleaved:
            rotated = torch.stack([real, imag], dim=-1).reshape(rotate.shape)
        else:
            rotated = torch.cat([real, imag], dim=-1)
        out = torch.cat([rotated, keep], dim=-1)
        return out.reshape(shape) if len(shape) == 3 else out.permute(0, 2, 1, 3)

    return run
