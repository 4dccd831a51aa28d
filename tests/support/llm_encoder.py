"""A sentence-transformers encoder folder made offline, with no torch: a BERT-style model of
seeded random weights, a WordPiece tokenizer trained by ``tokenizers`` on :mod:`llm_text`'s
seeded text (lower-cased, ``[CLS] ... [SEP]``, as BERT's), and the sentence-transformers files
that say how a sentence's vector is made: ``modules.json`` (Transformer, Pooling, and
Normalize when asked), ``1_Pooling/config.json`` (mean or CLS), ``sentence_bert_config.json``
and ``config_sentence_transformers.json``, as all-MiniLM-L6-v2's and BGE's repositories have.

Weights: embeddings of standard deviation 1, projections of variance 1/fan_in, LayerNorm
weights around 1 and biases around 0 (neither exactly, so a kernel that drops them is wrong);
each tensor from its own generator seeded by (seed, name).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import llm_bpe
import numpy as np
from llm_text import corpus

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class EncoderSpec:
    pooling: str  # "mean" or "cls"
    normalize: bool
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 128
    vocab: int = 1024
    context: int = 512
    max_seq_length: int = 128
    seed: int = 0
    corpus_lines: int = 5000

    def recipe(self) -> dict:
        return asdict(self)


def train_tokenizer(spec: EncoderSpec):
    """BERT's WordPiece (lower-cased, ``##`` continuations, ``[CLS] ... [SEP]``), its
    vocabulary learned by :mod:`llm_bpe` as tokenizers' WordPieceTrainer would (a BPE with the
    ``##`` prefix; that trainer itself is not deterministic)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = llm_bpe.count_words(
        (normalizer.normalize_str(t) for t in corpus(spec.corpus_lines, seed=spec.seed)),
        pre_tokenizer.pre_tokenize_str,
    )
    size = spec.vocab - len(SPECIALS)
    tokens, _ = llm_bpe.train(words, size, prefix="##")
    if len(tokens) != size:
        raise RuntimeError(f"WordPiece trained {len(tokens)} tokens, not {size}")
    vocab = {t: i for i, t in enumerate([*SPECIALS, *tokens])}
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tokenizer.enable_truncation(spec.max_seq_length)
    return tokenizer


def weights(spec: EncoderSpec) -> dict[str, np.ndarray]:
    """BertModel's state dict (no ``bert.`` prefix, as sentence-transformers' repositories)."""
    h, i = spec.hidden, spec.intermediate

    def t(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
        return (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    out = {
        "embeddings.word_embeddings.weight": t("word", (spec.vocab, h), 1.0),
        "embeddings.position_embeddings.weight": t("position", (spec.context, h), 0.5),
        "embeddings.token_type_embeddings.weight": t("type", (2, h), 0.5),
        "embeddings.LayerNorm.weight": t("eln.w", (h,), 0.1, 1.0),
        "embeddings.LayerNorm.bias": t("eln.b", (h,), 0.1),
    }
    for n in range(spec.layers):
        p = f"encoder.layer.{n}."
        shapes = {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "intermediate.dense": (i, h),
            "output.dense": (h, i),
        }
        for name, shape in shapes.items():
            gain = 2.0 if name.endswith(("query", "key")) else 1.0
            out[p + name + ".weight"] = t(p + name + ".w", shape, gain / shape[1] ** 0.5)
            out[p + name + ".bias"] = t(p + name + ".b", (shape[0],), 0.1)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[p + name + ".weight"] = t(p + name + ".w", (h,), 0.1, 1.0)
            out[p + name + ".bias"] = t(p + name + ".b", (h,), 0.1)
    out["pooler.dense.weight"] = t("pooler.w", (h, h), 1 / h**0.5)
    out["pooler.dense.bias"] = t("pooler.b", (h,), 0.1)
    return out


def write(spec: EncoderSpec, folder: Path) -> None:
    """Write config.json, tokenizer.json, vocab.txt, tokenizer_config.json,
    special_tokens_map.json, model.safetensors and the sentence-transformers files."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec)
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    (folder / "vocab.txt").write_text("".join(token + "\n" for token, _ in vocab))
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "intermediate_size": spec.intermediate,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": spec.context,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
    }
    tokenizer_config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "tokenize_chinese_chars": True,
        "strip_accents": None,
        "clean_up_tokenization_spaces": True,
        "model_max_length": spec.max_seq_length,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }
    special = {
        k: tokenizer_config[k]
        for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    }
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if spec.normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    pooling = {
        "word_embedding_dimension": spec.hidden,
        "pooling_mode_cls_token": spec.pooling == "cls",
        "pooling_mode_mean_tokens": spec.pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    files = {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
        "modules.json": modules,
        "sentence_bert_config.json": {
            "max_seq_length": spec.max_seq_length,
            "do_lower_case": False,
        },
        "config_sentence_transformers.json": {
            "prompts": {},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
        "1_Pooling/config.json": pooling,
    }
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    if spec.normalize:
        (folder / "2_Normalize").mkdir()
    save_file(weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
