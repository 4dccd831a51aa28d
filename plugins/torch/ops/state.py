"""Ops that carry a state from one call to the next (ONNX 27's linear-attention and state-space
blocks): LinearAttention and CausalConvWithState, as ONNX's reference computes them (the
recurrence in float32 one time step after another, the state cast back at the end)."""

from __future__ import annotations

from typing import Any

from plugserve.plugins.torch.ops.registry import NodeContext, Refused, register

_FLOATS = frozenset({"float32", "float16", "bfloat16"})
_RULES = ("linear", "gated", "delta", "gated_delta")


def _heads(x: Any, heads: int) -> Any:
    """(B, T, H*D) as (B, H, T, D)."""
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).permute(0, 2, 1, 3)


@register("LinearAttention", 27, multi_output=True, types=_FLOATS)
def linear_attention(ctx: NodeContext) -> Any:
    torch = ctx.torch
    rule = ctx.attr("update_rule", "gated_delta")
    q_heads, kv_heads = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
    if rule not in _RULES:
        raise Refused(f"LinearAttention update_rule {rule!r}")
    if q_heads is None or kv_heads is None:
        raise Refused("LinearAttention needs q_num_heads and kv_num_heads")
    q_heads, kv_heads = int(q_heads), int(kv_heads)
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads:
        raise Refused("LinearAttention: q_num_heads must be a multiple of kv_num_heads")
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gating != ctx.has(4) or delta != ctx.has(5):
        raise Refused(f"LinearAttention {rule!r} with its decay/beta inputs mismatched")
    scale_attr = float(ctx.attr("scale", 0.0))
    group = q_heads // kv_heads
    f32 = torch.float32

    def run(query, key, value, past=None, decay=None, beta=None):
        b, t, _ = query.shape
        d_k, d_v = query.shape[-1] // q_heads, value.shape[-1] // kv_heads
        q4, k4 = _heads(query, q_heads).to(f32), _heads(key, kv_heads).to(f32)
        v4 = _heads(value, kv_heads).to(f32)
        if decay is not None:
            if decay.shape[-1] == kv_heads:
                decay = decay.reshape(b, t, kv_heads, 1).permute(0, 2, 1, 3)
            else:
                decay = _heads(decay, kv_heads)
            decay = decay.to(f32)
        if beta is not None:
            beta = beta.reshape(b, t, beta.shape[-1], 1).permute(0, 2, 1, 3).to(f32)
        if past is not None:
            state_dtype, state = past.dtype, past.to(f32).clone()
        else:
            state_dtype = query.dtype
            state = torch.zeros((b, kv_heads, d_k, d_v), dtype=f32, device=query.device)
        scale = scale_attr if scale_attr != 0.0 else 1.0 / float(d_k) ** 0.5
        outputs = []
        for i in range(t):
            q_t, k_t, v_t = q4[:, :, i, :], k4[:, :, i, :], v4[:, :, i, :]
            if decay is not None:
                state = state * torch.exp(decay[:, :, i, :])[..., None]
            if beta is not None:
                retrieved = torch.einsum("bhdm,bhd->bhm", state, k_t)
                v_t = beta[:, :, i, :] * (v_t - retrieved)
            state = state + k_t[..., :, None] * v_t[..., None, :]
            read = state if group == 1 else state.repeat_interleave(group, dim=1)
            outputs.append(scale * torch.einsum("bhd,bhdm->bhm", q_t, read))
        out = torch.stack(outputs, dim=2) if outputs else q4.new_zeros((b, q_heads, 0, d_v))
        out = out.permute(0, 2, 1, 3).reshape(b, t, q_heads * d_v).to(query.dtype)
        return out, state.to(state_dtype)

    return run


@register("CausalConvWithState", 27, multi_output=True, types=_FLOATS)
def causal_conv_with_state(ctx: NodeContext) -> Any:
    torch = ctx.torch
    activation = ctx.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise Refused(f"CausalConvWithState activation {activation!r}")

    def run(x, weight, bias=None, past=None):
        batch, channels, _ = x.shape
        k = weight.shape[2]
        if past is None:
            past = torch.zeros((batch, channels, k - 1), dtype=x.dtype, device=x.device)
        padded = torch.cat([past, x], dim=2)
        y = torch.nn.functional.conv1d(padded, weight, bias, groups=channels)
        if activation != "none":
            y32 = y.to(torch.float32)
            y = (y32 * (1.0 / (1.0 + torch.exp(-y32)))).to(x.dtype)
        return y, padded[:, :, padded.shape[2] - (k - 1) :]

    return run
