"""A Hugging Face decoder's forward in plain torch, from its ``config.json`` and safetensors.

The families transformers writes as a Llama-style decoder (pre-norm blocks of GQA attention
with rotary positions and a gated MLP) differ in a few switches, read here from the config,
never from the architecture's name beyond choosing the switches:

==========  =====================================================================
llama       RMSNorm, rotary (``rope_theta``, ``rope_scaling`` linear or llama3),
            SwiGLU, ``attention_bias`` / ``mlp_bias``, head tied or not
mistral     llama's, with ``sliding_window`` (keys older than the window masked)
qwen2       biased q/k/v (never o), tied head when the config says so
qwen3       llama's with an RMSNorm over each head of q and k before the rotary
gemma       embeddings scaled by sqrt(hidden), RMSNorm as ``x * (1 + w)``, GeLU (tanh)
            gate, tied head
phi3        fused ``qkv_proj`` and ``gate_up_proj`` (split at load), partial rotary
==========  =====================================================================

Anything else a config asks for that this forward does not compute (another rope scaling,
soft-capping, a sliding window on some layers only) is refused at load with what it was,
never run wrong.

Numbers as transformers computes them, so greedy ids in f32 are transformers' own: the norms
in float32 then cast back, the rotary's cos/sin computed in float32 from the positions, the
attention by ``scaled_dot_product_attention`` (transformers' default ``sdpa``) with the keys'
heads shared (GQA), the logits in float32.

The forward (:meth:`DecoderModel.forward`) takes a step's tokens of any number of sequences
one after the other (decoding rows one token each, prompt chunks several) and the cache
(:class:`KVTensors`: per layer a key and a value tensor ``[slots, kv_heads, capacity,
head_dim]``), writes each token's keys and values at its slot and position, and returns the
logits of each sequence's last token only (the LM head runs on those rows, not on every
prompt position).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidModel

__all__ = [
    "DecoderModel",
    "KVTensors",
    "ModelShape",
    "safetensors_files",
    "weight_bytes",
]

#: the model types this forward computes
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")
_INDEX = "model.safetensors.index.json"
#: the MLP gate's activations (transformers' ACT2FN names): torch's function and its keywords
_ACTIVATIONS = {
    "silu": ("silu", {}),
    "gelu": ("gelu", {}),
    "gelu_pytorch_tanh": ("gelu", {"approximate": "tanh"}),
    "gelu_new": ("gelu", {"approximate": "tanh"}),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the forward needs of ``config.json`` (checked at load)."""

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int
    context: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    act: str  # a key of _ACTIVATIONS
    sliding_window: int  # 0: none
    embed_scale: bool
    norm_plus_one: bool

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = "config.json") -> ModelShape:
        family = config.get("model_type")
        if family not in FAMILIES:
            raise InvalidModel(
                f"{where}: model_type {family!r} is not one the torch decoder computes "
                f"({', '.join(FAMILIES)})"
            )

        def need(key: str) -> int:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidModel(f"{where}: {key} must be a positive integer, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise InvalidModel(
                f"{where}: {heads} attention heads do not share {kv_heads} key/value heads evenly"
            )
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if config.get(key):
                raise InvalidModel(f"{where}: {key} is not computed by the torch decoder")
        scaling = config.get("rope_scaling") or None
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise InvalidModel(
                f"{where}: rope_scaling of type {kind!r} is not computed by the torch decoder "
                "(default, linear and llama3 are)"
            )
        window = 0
        if family == "mistral" or (
            family in ("qwen2", "qwen3") and config.get("use_sliding_window")
        ):
            window = int(config.get("sliding_window") or 0)
            if family != "mistral" and config.get("max_window_layers", 0) < need(
                "num_hidden_layers"
            ):
                raise InvalidModel(f"{where}: a sliding window on some layers only is not computed")
        act = config.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise InvalidModel(
                f"{where}: hidden_act {act!r} is not computed (these are: "
                f"{', '.join(_ACTIVATIONS)})"
            )
        partial = float(config.get("partial_rotary_factor") or 1.0)
        bias = bool(config.get("attention_bias", False))
        return cls(
            family=family,
            vocab=need("vocab_size"),
            hidden=hidden,
            layers=need("num_hidden_layers"),
            heads=heads,
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate=need("intermediate_size"),
            eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=float(config.get("rope_theta") or 10000.0),
            rope_scaling=scaling if kind != "default" else None,
            rotary_dim=int(head_dim * partial),
            context=int(config.get("max_position_embeddings") or 0),
            tied=bool(config.get("tie_word_embeddings", family in ("gemma",))),
            qkv_bias=family == "qwen2" or bias,
            o_bias=bias and family != "qwen2",
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            act=act,
            sliding_window=window,
            embed_scale=family == "gemma",
            norm_plus_one=family == "gemma",
        )

    @property
    def bytes_per_token(self) -> int:
        """Cache elements a token takes across every layer (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: ``model.safetensors``, or the shards its index names
    (InvalidModel for an index naming a file that is not there)."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / _INDEX
    if not index.is_file():
        raise InvalidModel(f"{folder}: neither model.safetensors nor {_INDEX}")
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidModel(f"{index}: not a safetensors index ({exc})") from None
    files = []
    for name in names:
        path = folder / name
        if "/" in name or not path.is_file():
            raise InvalidModel(f"{index}: names {name!r}, which is not a file of the folder")
        files.append(path)
    return files


def _headers(files: Sequence[Path]) -> dict[str, tuple[str, list[int]]]:
    """``{name: (dtype, shape)}`` of every tensor, from the files' headers (nothing else read)."""
    out: dict[str, tuple[str, list[int]]] = {}
    for path in files:
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if size <= 0 or size > 100 << 20:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as exc:
            raise InvalidModel(f"{path}: not a safetensors file ({exc})") from None
        for name, entry in header.items():
            if name != "__metadata__":
                out[name] = (entry["dtype"], list(entry["shape"]))
    return out


def weight_bytes(files: Sequence[Path], itemsize: int) -> int:
    """The bytes the weights take once loaded at ``itemsize`` bytes an element."""
    return sum(math.prod(shape) for _d, shape in _headers(files).values()) * itemsize


class KVTensors:
    """The cache: per layer a key and a value tensor ``[slots, kv_heads, capacity, head_dim]``
    in the model's dtype on its device. On the CPU the memory is numpy's ``np.zeros`` (pages
    mapped on first write, as the other backends' caches), shared with torch."""

    def __init__(self, shape: ModelShape, rows: int, capacity: int, dtype: Any, device: Any):
        import torch

        dims = (rows, shape.kv_heads, capacity, shape.head_dim)
        self.keys: list[Any] = []
        self.values: list[Any] = []
        for _layer in range(shape.layers):
            for target in (self.keys, self.values):
                if device.type == "cpu":
                    itemsize = torch.empty((), dtype=dtype).element_size()
                    raw = np.zeros(dims, np.dtype(f"u{itemsize}"))
                    target.append(torch.from_numpy(raw).view(dtype))
                else:
                    target.append(torch.zeros(dims, dtype=dtype, device=device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class DecoderModel:
    """The weights on their device and the forward; built by :meth:`load`."""

    def __init__(self, shape: ModelShape, weights: dict[str, Any], device: Any, dtype: Any):
        import torch

        self.shape = shape
        self.device = device
        self.dtype = dtype
        self.w = weights
        self.torch = torch
        s = shape
        inv = 1.0 / (
            s.rope_theta
            ** (torch.arange(0, s.rotary_dim, 2, dtype=torch.int64).float() / s.rotary_dim)
        )
        self.inv_freq = _scaled(inv, s.rope_scaling).to(device)
        self.scale = s.head_dim**-0.5
        self.embed_normalizer = torch.tensor(s.hidden**0.5, dtype=dtype) if s.embed_scale else None
        #: the low-precision forward (bf16, f16): fewer, fused kernels (:meth:`_layer_fused`);
        #: f32 keeps transformers' own op order, so its greedy ids stay transformers' ids
        self.fused = dtype != torch.float32 and not s.norm_plus_one and not s.qk_norm
        if self.fused:
            _fuse(s, weights)

    # --- loading

    @classmethod
    def load(cls, folder: Path, config: dict[str, Any], device: Any, dtype: Any) -> DecoderModel:
        """The folder's weights read to ``device`` in ``dtype`` (each tensor converted as it
        is read, so the host never holds the whole model in another precision)."""
        from safetensors import safe_open

        shape = ModelShape.from_config(config, str(folder / "config.json"))
        files = safetensors_files(folder)
        expected = _names(shape, fused=True)
        weights: dict[str, Any] = {}
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is no mapping
                    key = name.removeprefix("language_model.")
                    if key not in expected and not key.startswith("model."):
                        key = f"model.{key}" if f"model.{key}" in expected else key
                    if key not in expected:
                        continue  # rotary buffers, a vision tower's weights...
                    tensor = f.get_tensor(name)
                    weights[key] = tensor.to(device=device, dtype=dtype)
        _split_fused(shape, weights)
        if shape.tied and "model.embed_tokens.weight" in weights:  # transformers ties them
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        missing = sorted(k for k in _names(shape, fused=False) if k not in weights)
        if missing:
            raise InvalidModel(
                f"{folder}: the safetensors lack {len(missing)} weight(s) the {shape.family} "
                f"config needs, e.g. {missing[:3]}"
            )
        for key, want in _expected_shapes(shape).items():
            got = tuple(weights[key].shape)
            if got != want:
                raise InvalidModel(
                    f"{folder}: {key} has shape {list(got)}, the config says {list(want)}"
                )
        return cls(shape, weights, device, dtype)

    # --- the forward

    def plan(
        self, starts: Sequence[int], counts: Sequence[int], rows: Sequence[int], positions: Any
    ) -> _AttentionPlan:
        """A step's attention: sequence ``i`` is ``counts[i]`` tokens of slot ``rows[i]``
        from position ``starts[i]`` (``positions``: each token's, on the device); the leading
        sequences of one token each (decoding rows) attend as one batch, the others one by
        one."""
        decoding = 0
        while decoding < len(counts) and counts[decoding] == 1:
            decoding += 1
        plan = _AttentionPlan(self, positions.device)
        ends = [s + c for s, c in zip(starts, counts)]
        plan.decode(
            self.torch.as_tensor(list(rows[:decoding]), device=positions.device),
            positions[:decoding],
            max(ends[:decoding], default=0),
        )
        plan.chunks(starts[decoding:], counts[decoding:], rows[decoding:])
        return plan

    def decode_plan(
        self, rows: Any, positions: Any, width: int, front: bool = False
    ) -> _AttentionPlan:
        """A step of decoding rows only, its shapes fixed (``width``: the keys each row reads,
        masked past its position), as a CUDA graph captures it. ``front``: row ``i`` is slot
        ``i`` for every real row, so the keys are read in place (``keys[:B]``), not gathered;
        a padding row reads whatever slot its index is (its logits are dropped)."""
        plan = _AttentionPlan(self, positions.device)
        plan.decode(rows, positions, width, front)
        return plan

    def forward(self, cache: KVTensors, ids: Any, positions: Any, slots: Any, plan: Any) -> Any:
        """``ids`` ([T] int64 on the device): the tokens of the step's sequences one after
        the other; ``positions`` and ``slots`` ([T]) each token's position and cache row;
        ``plan`` the step's attention (:meth:`plan`). Returns the float32 logits of each
        sequence's last token ``[S, vocab]``."""
        torch = self.torch
        s = self.shape
        w = self.w
        h = torch.nn.functional.embedding(ids, w["model.embed_tokens.weight"])
        if self.embed_normalizer is not None:
            h = h * self.embed_normalizer
        cos, sin = self._rotary(positions)
        act_name, act_keywords = _ACTIVATIONS[s.act]
        act = getattr(torch.nn.functional, act_name)
        if self.fused:
            # rotate_half(x) * sin == roll(x, half) * [-sin_1, sin_2]: one roll, no neg or cat
            half = s.rotary_dim // 2
            signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            for layer in range(s.layers):
                h = self._layer_fused(layer, h, cache, positions, slots, plan, cos, signed, act)
            h = torch.nn.functional.rms_norm(
                h[plan.last], (s.hidden,), w["model.norm.weight"], s.eps
            )
            return torch.nn.functional.linear(h, w["lm_head.weight"]).float()
        for layer in range(s.layers):
            p = f"model.layers.{layer}."
            x = self._norm(h, w[p + "input_layernorm.weight"])
            q = _linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"))
            k = _linear(x, w[p + "self_attn.k_proj.weight"], w.get(p + "self_attn.k_proj.bias"))
            v = _linear(x, w[p + "self_attn.v_proj.weight"], w.get(p + "self_attn.v_proj.bias"))
            q = q.view(-1, s.heads, s.head_dim)
            k = k.view(-1, s.kv_heads, s.head_dim)
            v = v.view(-1, s.kv_heads, s.head_dim)
            if s.qk_norm:
                q = self._norm(q, w[p + "self_attn.q_norm.weight"])
                k = self._norm(k, w[p + "self_attn.k_norm.weight"])
            q, k = _rotate(q, cos, sin, s.rotary_dim), _rotate(k, cos, sin, s.rotary_dim)
            keys, values = cache.keys[layer], cache.values[layer]
            keys[slots, :, positions] = k
            values[slots, :, positions] = v
            out = plan.attend(q, keys, values)
            h = h + _linear(
                out, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias")
            )
            x = self._norm(h, w[p + "post_attention_layernorm.weight"])
            gate = _linear(x, w[p + "mlp.gate_proj.weight"], w.get(p + "mlp.gate_proj.bias"))
            up = _linear(x, w[p + "mlp.up_proj.weight"], w.get(p + "mlp.up_proj.bias"))
            gate = act(gate, **act_keywords)
            h = h + _linear(
                gate * up, w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias")
            )
        last = plan.last
        h = self._norm(h[last], w["model.norm.weight"])
        return torch.nn.functional.linear(h, w["lm_head.weight"]).float()

    def _layer_fused(
        self, layer: int, h: Any, cache: KVTensors, positions: Any, slots: Any, plan: Any,
        cos: Any, signed: Any, act: Any,
    ) -> Any:  # fmt: skip
        """One layer in about half the kernels of transformers' order (measured on an H100,
        2026-11-26: a 220 M decoder's decode step was 43 kernels a layer and 1.32 ms of card
        time, kernel-bound, not bandwidth-bound): the norms as one fused ``rms_norm`` (float32
        inside, one rounding), q, k and v as one matrix product and rotated together, gate and
        up as one. The numbers differ from transformers' by bf16 rounding only."""
        torch = self.torch
        F = torch.nn.functional
        s = self.shape
        w = self.w
        p = f"model.layers.{layer}."
        q_end, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        x = F.rms_norm(h, (s.hidden,), w[p + "input_layernorm.weight"], s.eps)
        qkv = F.linear(x, w[p + "qkv"], w.get(p + "qkv.bias"))
        qk = qkv[:, : q_end + kv].view(-1, s.heads + s.kv_heads, s.head_dim)
        qk = _rotate_signed(qk, cos, signed, s.rotary_dim)
        q, k = qk[:, : s.heads], qk[:, s.heads :]
        v = qkv[:, q_end + kv :].view(-1, s.kv_heads, s.head_dim)
        keys, values = cache.keys[layer], cache.values[layer]
        keys[slots, :, positions] = k
        values[slots, :, positions] = v
        out = plan.attend(q, keys, values)
        h = h + F.linear(out, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
        x = F.rms_norm(h, (s.hidden,), w[p + "post_attention_layernorm.weight"], s.eps)
        gate_up = F.linear(x, w[p + "gate_up"], w.get(p + "gate_up.bias"))
        gate, up = gate_up[:, : s.intermediate], gate_up[:, s.intermediate :]
        return h + F.linear(
            act(gate, **_ACTIVATIONS[s.act][1]) * up,
            w[p + "mlp.down_proj.weight"], w.get(p + "mlp.down_proj.bias"),
        )  # fmt: skip

    def _norm(self, x: Any, weight: Any) -> Any:
        """transformers' RMSNorm: in float32, cast back before the weight (gemma: after
        ``1 + w``, in float32)."""
        torch = self.torch
        dtype = x.dtype
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.shape.eps)
        if self.shape.norm_plus_one:
            return (y * (1.0 + weight.float())).to(dtype)
        return weight * y.to(dtype)

    def _rotary(self, positions: Any) -> tuple[Any, Any]:
        torch = self.torch
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]


class _AttentionPlan:
    """A step's attention: the decoding rows' keys gathered once per layer into one batch
    (masked past each row's position), then each prompt chunk against its own slot's first
    positions (causal from its start)."""

    def __init__(self, model: DecoderModel, device: Any) -> None:
        self.torch = model.torch
        self.model = model
        self.device = device
        self.window = model.shape.sliding_window
        self.decoding = 0
        self.sequences: list[tuple[int, int, int, int, Any]] = []  # row, start, count, offset, mask
        self.lasts: list[Any] = []

    def decode(self, rows: Any, positions: Any, width: int, front: bool = False) -> None:
        """Decoding rows ``rows`` (a tensor), one token each at ``positions`` (``front``:
        :meth:`DecoderModel.decode_plan`)."""
        torch = self.torch
        self.decoding = int(rows.shape[0])
        if not self.decoding:
            return
        self.decode_rows = rows
        self.front = front
        self.width = width
        columns = torch.arange(width, device=self.device)
        allowed = columns[None, :] <= positions[:, None]
        if self.window:
            allowed &= columns[None, :] > positions[:, None] - self.window
        self.decode_mask = self._additive(allowed)[:, None, None, :]  # [B, 1, 1, L]
        self.lasts.append(torch.arange(self.decoding, device=self.device))

    def chunks(self, starts: Sequence[int], counts: Sequence[int], rows: Sequence[int]) -> None:
        """Prompt chunks after the decoding rows: ``counts[i]`` tokens of slot ``rows[i]``
        from position ``starts[i]``."""
        torch = self.torch
        offset = self.decoding
        ends = []
        for row, start, count in zip(rows, starts, counts):
            mask = None  # from position 0 without a window: plain causal, as transformers runs
            if start or self.window:
                q_pos = torch.arange(start, start + count, device=self.device)[:, None]
                k_pos = torch.arange(start + count, device=self.device)[None, :]
                allowed = k_pos <= q_pos
                if self.window:
                    allowed &= k_pos > q_pos - self.window
                mask = self._additive(allowed)[None, None]
            self.sequences.append((int(row), int(start), int(count), offset, mask))
            offset += int(count)
            ends.append(offset - 1)
        if ends:
            self.lasts.append(torch.as_tensor(ends, device=self.device))

    def _additive(self, allowed: Any) -> Any:
        """``allowed`` as the additive mask SDPA adds to the scores (0 or -inf in the model's
        dtype), made once a step for every layer: with a boolean one, the CPU's attention
        takes 4-9% longer at bench-llama's shapes, the answers equal
        (tests/benchmarks/bench_attention_mask.py)."""
        torch = self.torch
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=self.device)
        return mask.masked_fill_(~allowed, float("-inf"))

    @property
    def last(self) -> Any:
        """Each sequence's last token's index in the step's tokens."""
        return self.lasts[0] if len(self.lasts) == 1 else self.torch.cat(self.lasts)

    def attend(self, q: Any, keys: Any, values: Any) -> Any:
        """``q`` [T, heads, d] of the step's tokens; the attention output [T, heads x d]."""
        torch = self.torch
        sdpa = torch.nn.functional.scaled_dot_product_attention
        s = self.model.shape
        gqa = s.heads != s.kv_heads
        scale = self.model.scale
        outs = []
        b = self.decoding
        if b:
            if self.front:  # views: no copy of the rows' keys
                k, v = keys[:b, :, : self.width], values[:b, :, : self.width]
            else:
                k = keys[self.decode_rows, :, : self.width]
                v = values[self.decode_rows, :, : self.width]
            qd = q[:b].unsqueeze(2)  # [B, heads, 1, d]
            out = sdpa(qd, k, v, attn_mask=self.decode_mask, scale=scale, enable_gqa=gqa)
            outs.append(out.reshape(b, -1))
        for row, start, count, offset, mask in self.sequences:
            qc = q[offset : offset + count].transpose(0, 1).unsqueeze(0)
            k = keys[row, :, : start + count].unsqueeze(0)
            v = values[row, :, : start + count].unsqueeze(0)
            out = sdpa(
                qc, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )
            outs.append(out[0].transpose(0, 1).reshape(count, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _linear(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def _rotate(x: Any, cos: Any, sin: Any, dim: int) -> Any:
    """The rotary embedding on the first ``dim`` features of each head (all of them but for
    a partial rotary)."""
    import torch

    if dim < x.shape[-1]:
        return torch.cat((_rotate(x[..., :dim], cos, sin, dim), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_signed(x: Any, cos: Any, signed: Any, dim: int) -> Any:
    """:func:`_rotate` with ``signed`` = ``[-sin_1, sin_2]``: ``x * cos + roll(x) * signed``
    (three kernels where :func:`_rotate` takes five)."""
    import torch

    if dim < x.shape[-1]:
        return torch.cat((_rotate_signed(x[..., :dim], cos, signed, dim), x[..., dim:]), dim=-1)
    return torch.addcmul(x * cos, torch.roll(x, dim // 2, dims=-1), signed)


def _fuse(shape: ModelShape, weights: dict[str, Any]) -> None:
    """Each layer's q, k, v weights (and biases) as one tensor ``qkv`` and gate and up as
    ``gate_up``; the single names kept as views into them (no second copy): one matrix
    product where there were three and two. The inverse of :func:`_split_fused`."""
    import torch

    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        for fused, parts in (
            ("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            for suffix, key in ((".weight", fused), (".bias", fused + ".bias")):
                names = [p + part + suffix for part in parts]
                if not all(n in weights for n in names):
                    continue
                joined = torch.cat([weights.pop(n) for n in names])
                weights[p + key] = joined
                start = 0
                for n, part in zip(names, parts):
                    size = _fused_rows(shape, part)
                    weights[n] = joined[start : start + size]
                    start += size


def _fused_rows(shape: ModelShape, part: str) -> int:
    """The output rows of one projection in a fused tensor."""
    if part.endswith("q_proj"):
        return shape.heads * shape.head_dim
    if part.endswith(("k_proj", "v_proj")):
        return shape.kv_heads * shape.head_dim
    return shape.intermediate


def _scaled(inv_freq: Any, scaling: dict[str, Any] | None) -> Any:
    """The inverse frequencies under ``rope_scaling`` (transformers' linear and llama3)."""
    if not scaling:
        return inv_freq
    import torch

    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _names(shape: ModelShape, fused: bool) -> set[str]:
    """The weight names of the folder (``fused``: phi3's fused projections as its files have
    them) or of the forward (split, the head always present)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"}
        if shape.family == "phi3" and fused:
            names |= {p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"}
        else:
            names |= {p + f"self_attn.{x}_proj.weight" for x in "qkv"}
            names |= {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}
        if shape.qkv_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if shape.o_bias:
            names.add(p + "self_attn.o_proj.bias")
        if shape.mlp_bias:
            names |= {p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
        if shape.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def _expected_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    s = shape
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {"model.embed_tokens.weight": (s.vocab, s.hidden), "lm_head.weight": (s.vocab, s.hidden)}
    for layer in range(s.layers):
        p = f"model.layers.{layer}."
        out |= {
            p + "self_attn.q_proj.weight": (q, s.hidden),
            p + "self_attn.k_proj.weight": (kv, s.hidden),
            p + "self_attn.v_proj.weight": (kv, s.hidden),
            p + "self_attn.o_proj.weight": (s.hidden, q),
            p + "mlp.gate_proj.weight": (s.intermediate, s.hidden),
            p + "mlp.up_proj.weight": (s.intermediate, s.hidden),
            p + "mlp.down_proj.weight": (s.hidden, s.intermediate),
        }
    return out


def _split_fused(shape: ModelShape, weights: dict[str, Any]) -> None:
    """phi3's ``qkv_proj`` and ``gate_up_proj`` split into llama's names (views, no copy)."""
    if shape.family != "phi3":
        return
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for layer in range(shape.layers):
        p = f"model.layers.{layer}."
        qkv = weights.pop(p + "self_attn.qkv_proj.weight", None)
        if qkv is not None:
            weights[p + "self_attn.q_proj.weight"] = qkv[:q]
            weights[p + "self_attn.k_proj.weight"] = qkv[q : q + kv]
            weights[p + "self_attn.v_proj.weight"] = qkv[q + kv :]
        gate_up = weights.pop(p + "mlp.gate_up_proj.weight", None)
        if gate_up is not None:
            weights[p + "mlp.gate_proj.weight"] = gate_up[: shape.intermediate]
            weights[p + "mlp.up_proj.weight"] = gate_up[shape.intermediate :]
