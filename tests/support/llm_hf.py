"""A Hugging Face model folder made offline, with no torch and no hub: a byte-level BPE tokenizer
trained by ``tokenizers`` on :mod:`llm_text`'s seeded text, the tokenizer and generation configs
with a chat template, ``config.json``, and ``model.safetensors`` of seeded random weights drawn by
numpy under the names transformers' classes load.

The folder is what a user downloads from the hub for a Llama-3-style (GQA, untied head, a BOS
added by the tokenizer, a list of EOS ids) or a Qwen2-style model (biased q/k/v, tied head, ChatML
and no BOS), so an engine that serves both cannot key on one family. Weights are f32.

The random init is scaled so greedy decoding wanders instead of repeating one token: embeddings
of unit variance, projections of variance 1/fan_in with q and k larger (sharp attention, so the
context matters), norm weights around 1 (not all ones, so a kernel that skips them is wrong),
and an output head whose logits have a standard deviation of ``logit_std``. Each tensor draws
from its own generator seeded by (spec seed, tensor name), so a tensor does not change when
another is added.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import llm_bpe
import numpy as np
from llm_text import corpus

from plugserve.server.control.examples.tiny_decoder import TEMPLATE

#: Llama-3's chat format, shortened (plugserve make-model's tiny-llama writes the same): the
#: BOS is part of the rendered text, so the rendered prompt must be tokenized without adding
#: special tokens again (as transformers does)
LLAMA_TEMPLATE = TEMPLATE

#: Qwen2's ChatML with its default system message when the conversation has none
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerStyle:
    """A family's special tokens (appended after the trained vocabulary, as Llama 3's and
    Qwen2's are), which of them are BOS/EOS/PAD, and its chat template."""

    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    #: the EOS ids generation stops at (generation_config.json's list)
    stop: tuple[str, ...]
    template: str
    #: config.json's bos_token_id when the tokenizer adds none (Qwen2 names one all the same)
    config_bos: str | None = None


STYLES = {
    "llama": TokenizerStyle(
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|pad|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|pad|>",
        stop=("<|end_of_text|>", "<|eot_id|>"),
        template=LLAMA_TEMPLATE,
    ),
    "qwen2": TokenizerStyle(
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stop=("<|im_end|>", "<|endoftext|>"),
        template=CHATML_TEMPLATE,
        config_bos="<|endoftext|>",
    ),
}


@dataclass(frozen=True)
class DecoderSpec:
    """One decoder's recipe: everything that decides its files (hashed into its cache key)."""

    family: str  # "llama" or "qwen2" (the tokenizer style and the weights' names)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int  # the tokenizer's size, specials included (config.json's vocab_size)
    context: int
    seed: int = 0
    corpus_lines: int = 20_000
    logit_std: float = 4.0
    qk_gain: float = 2.0
    #: the scale of what attention and the MLP add to the residual stream, relative to unit
    #: variance; a tied head favours the current token's own embedding unless it is small there
    residual_gain: float = 1.0
    #: the EOS token's head row is scaled by this, so greedy answers sometimes end on it
    #: (finish_reason "stop") and sometimes run to the length limit
    eos_gain: float = 1.0
    #: generation_config.json's sampling defaults (greedy tests override them)
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """The number of weights, the tied head counted once."""
        h, kv, i, v = self.hidden, self.kv_heads * self.head_dim, self.intermediate, self.vocab
        layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        if self.family == "qwen2":
            layer += h + 2 * kv
        head = 0 if self.family == "qwen2" else v * h
        return v * h + self.layers * layer + h + head

    def recipe(self) -> dict:
        return asdict(self)


def train_tokenizer(spec: DecoderSpec):
    """The trained ``tokenizers.Tokenizer``: byte-level BPE (every string encodes, nothing is
    unknown) with GPT-2's pre-tokenizer regex, merges learned by :mod:`llm_bpe` (tokenizers'
    own trainer is not deterministic), the style's specials appended after them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    style = STYLES[spec.family]
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = llm_bpe.count_words(
        corpus(spec.corpus_lines, seed=spec.seed), pre_tokenizer.pre_tokenize_str
    )
    size = spec.vocab - len(style.specials)
    tokens, merges = llm_bpe.train(words, size, initial=pre_tokenizers.ByteLevel.alphabet())
    if len(tokens) != size:
        raise RuntimeError(
            f"the corpus of {spec.corpus_lines} lines trains only {len(tokens)} tokens, "
            f"{size} asked: raise corpus_lines"
        )
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in style.specials]
    )
    steps = [processors.ByteLevel(trim_offsets=False)]
    if style.bos is not None:
        bos = (style.bos, tokenizer.token_to_id(style.bos))
        steps.append(
            processors.TemplateProcessing(
                single=f"{style.bos} $A",
                pair=f"{style.bos} $A:0 {style.bos}:1 $B:1",
                special_tokens=[bos],
            )
        )
    tokenizer.post_processor = processors.Sequence(steps)
    return tokenizer


def _config(spec: DecoderSpec, ids: dict[str, int]) -> dict:
    style = STYLES[spec.family]
    stop = [ids[t] for t in style.stop]
    bos = style.bos or style.config_bos
    common = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context,
        "initializer_range": 0.02,
        "use_cache": True,
        "attention_dropout": 0.0,
        "bos_token_id": ids[bos],
        "torch_dtype": "float32",
    }
    if spec.family == "llama":
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "head_dim": spec.head_dim,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            "eos_token_id": stop,
            "pad_token_id": ids[style.pad],
        }
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **common,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": spec.context,
        "use_sliding_window": False,
        "max_window_layers": spec.layers,
        "tie_word_embeddings": True,
        "eos_token_id": ids[style.eos],
    }


def _tensor(spec: DecoderSpec, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0):
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    return (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def weights(spec: DecoderSpec, eos_id: int | None = None) -> dict[str, np.ndarray]:
    """The state dict under transformers' names ([out, in] projections as torch's Linear);
    ``eos_id``'s head row (the tied embedding's for Qwen2) scaled by ``spec.eos_gain``."""
    h, hd, v, i = spec.hidden, spec.head_dim, spec.vocab, spec.intermediate
    q, kv = spec.heads * hd, spec.kv_heads * hd
    out = {"model.embed_tokens.weight": _tensor(spec, "model.embed_tokens.weight", (v, h), 1.0)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        shapes = {
            "self_attn.q_proj.weight": ((q, h), spec.qk_gain / h**0.5),
            "self_attn.k_proj.weight": ((kv, h), spec.qk_gain / h**0.5),
            "self_attn.v_proj.weight": ((kv, h), 1 / h**0.5),
            "self_attn.o_proj.weight": ((h, q), spec.residual_gain / q**0.5),
            "mlp.gate_proj.weight": ((i, h), 1 / h**0.5),
            "mlp.up_proj.weight": ((i, h), 1 / h**0.5),
            "mlp.down_proj.weight": ((h, i), spec.residual_gain / i**0.5),
        }
        if spec.family == "qwen2":
            shapes |= {
                "self_attn.q_proj.bias": ((q,), 0.5),
                "self_attn.k_proj.bias": ((kv,), 0.5),
                "self_attn.v_proj.bias": ((kv,), 0.1),
            }
        for name, (shape, std) in shapes.items():
            out[p + name] = _tensor(spec, p + name, shape, std)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + name] = _tensor(spec, p + name, (h,), 0.2, mean=1.0)
    out["model.norm.weight"] = _tensor(spec, "model.norm.weight", (h,), 0.2, mean=1.0)
    if spec.family == "qwen2":
        # tied: the head is the embedding, whose logits' spread is fixed by its unit variance;
        # scale the final norm instead so the logits have logit_std
        out["model.norm.weight"] *= spec.logit_std / h**0.5
    else:
        out["lm_head.weight"] = _tensor(spec, "lm_head.weight", (v, h), spec.logit_std / h**0.5)
    if eos_id is not None and spec.eos_gain != 1.0:
        head = out["lm_head.weight" if "lm_head.weight" in out else "model.embed_tokens.weight"]
        head[eos_id] *= spec.eos_gain
    return out


def write(spec: DecoderSpec, folder: Path) -> None:
    """Write the model folder: tokenizer.json, tokenizer_config.json (with the chat template),
    chat_template.jinja, special_tokens_map.json, config.json, generation_config.json and
    model.safetensors."""
    from safetensors.numpy import save_file

    style = STYLES[spec.family]
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec)
    tokenizer.save(str(folder / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in style.specials}
    special_map = {"eos_token": style.eos, "pad_token": style.pad}
    if style.bos is not None:
        special_map["bos_token"] = style.bos
    tokenizer_config = {
        "add_bos_token": style.bos is not None,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in style.specials
        },
        "bos_token": style.bos,
        "eos_token": style.eos,
        "pad_token": style.pad,
        "chat_template": style.template,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": spec.context,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {
        "bos_token_id": ids[style.bos or style.config_bos],
        "eos_token_id": [ids[t] for t in style.stop],
        "pad_token_id": ids[style.pad],
        **({"do_sample": True, **dict(spec.sampling)} if spec.sampling else {}),
    }
    files = {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_map,
        "config.json": _config(spec, ids),
        "generation_config.json": generation,
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(style.template)
    tensors = weights(spec, eos_id=ids[style.eos])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
