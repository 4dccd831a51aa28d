"""More transformers architectures, each for the graph pieces its exporters emit that the
BERT/GPT-2/ViT/Wav2Vec2 set does not: a Llama decoder (rotary embeddings, RMSNorm, grouped
key/value heads, its cache with an empty-past prefill), a T5 encoder (relative position
buckets: Log, Min, Where on integer positions), a Whisper encoder (Conv1d front end, GELU,
a fixed-length mel input) and a ResNet (Conv, BatchNorm, MaxPool, global pooling).

Same conventions as torch_models: configs from code with seeded random weights, tiny sizes,
both torch exporters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import ZooModel, entry
from .torch_models import (
    TORCH,
    _both,
    _cache_args,
    _cache_feeds,
    _cache_io,
    _decoder,
    _export,
    _text_args,
    _text_feeds,
    _with_cache,
    _wrap,
)

LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 2, 2, 8
LLAMA = (LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM)


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LLAMA_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=LLAMA_KV_HEADS,  # grouped-query attention: 2 queries per key
        max_position_embeddings=64,
    )
    return _with_cache(LlamaForCausalLM(config), LLAMA_LAYERS)


_decoder("llama_past", _llama, *LLAMA)


def _build_llama_opset23(folder: Path) -> None:
    """At opset 23 the dynamo exporter writes the new fused ops: Attention (grouped, causal,
    with the cache), RotaryEmbedding and RMSNormalization."""
    _export(_llama().eval(), _cache_args(*LLAMA)(), folder, *_cache_io(LLAMA[0]), True, 23)


entry(
    ZooModel(
        "llama_past_opset23",
        "torch",
        _build_llama_opset23,
        _cache_feeds(*LLAMA),
        requires=TORCH,
        batch_axis=None,
    )
)


def _t5():
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    return _wrap(T5EncoderModel(config), ["input_ids", "attention_mask"], lambda out: (out[0],))


_both(
    "t5_encoder",
    _t5,
    _text_args,
    ["input_ids", "attention_mask"],
    ["last_hidden_state"],
    {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
    _text_feeds,
)

MEL_BINS, WHISPER_POSITIONS = 16, 16


def _whisper_encoder():
    import torch
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=100,
        num_mel_bins=MEL_BINS,
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        max_source_positions=WHISPER_POSITIONS,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _wrap(WhisperEncoder(config), ["input_features"], lambda out: (out[0],))


def _mel(batch: int, rng: np.random.Generator | None = None):
    """Whisper reads exactly twice its positions in frames (its stride-2 conv halves them)."""
    shape = (batch, MEL_BINS, 2 * WHISPER_POSITIONS)
    if rng is None:
        import torch

        return (torch.randn(*shape),)
    return {"input_features": rng.normal(size=shape).astype(np.float32)}


_both(
    "whisper_encoder",
    _whisper_encoder,
    lambda: _mel(2),
    ["input_features"],
    ["last_hidden_state"],
    {"input_features": {0: "batch"}},
    lambda rng: _mel(1, rng),
)


def _resnet():
    import torch
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
    )
    return _wrap(ResNetModel(config), ["pixel_values"], lambda out: (out[0], out[1]))


_both(
    "resnet",
    _resnet,
    lambda: (__import__("torch").randn(2, 3, 32, 32),),
    ["pixel_values"],
    ["last_hidden_state", "pooler_output"],
    {"pixel_values": {0: "batch"}},
    lambda rng: {"pixel_values": rng.normal(size=(1, 3, 32, 32)).astype(np.float32)},
)
