"""Decoder folders from onnxruntime-genai's model builder, made offline and cached.

A Hugging Face folder is written by transformers from a config (seeded random weights, norm
weights around 1 so a kernel that skips them is wrong) with a byte-level BPE tokenizer trained
by ``tokenizers`` on a few sentences, then exported by ``python -m
onnxruntime_genai.models.builder -e cpu`` in the precision asked (``fp32``, ``int4``) with the
builder's ``--extra_options``. The result is the folder a user gets: ``model.onnx`` (+
``.data``), ``genai_config.json``, the tokenizer. Each recipe is built once into
``$PLUGSERVE_TEST_CACHE/genai-builder/<key>`` (written to a scratch folder and renamed, so
concurrent runs never see half a folder); the key hashes the recipe and the versions of
transformers, onnxruntime-genai and torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(os.environ.get("PLUGSERVE_TEST_CACHE", Path.home() / ".cache" / "plugserve-tests"))
INSTALL = "pip install onnxruntime-genai==0.18.0 'transformers>=5' torch==2.13.0"


@dataclass(frozen=True)
class Recipe:
    family: str  # transformers' model_type: "llama", "qwen2"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 320
    context: int = 256
    tied: bool = False
    seed: int = 0


TINY_LLAMA = Recipe("llama")
TINY_QWEN2 = Recipe("qwen2", seed=1)
TINY_QWEN2_TIED = Recipe("qwen2", tied=True, seed=2)
#: ~153 M parameters: enough weight that a decode step's time is its GEMMs', as in real use
LLAMA_150M = Recipe(
    "llama", hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072, vocab=32000,
    context=2048,
)  # fmt: skip


def missing() -> str | None:
    """Why the builder cannot run here (with the install line), or None."""
    for module in ("onnxruntime_genai", "transformers", "torch", "tokenizers"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed: {INSTALL}"
    return None


def _versions() -> str:
    names = ("onnxruntime-genai", "transformers", "torch", "tokenizers")
    return ",".join(f"{n}={importlib.metadata.version(n)}" for n in names)


def folder(recipe: Recipe, precision: str = "fp32", *options: str) -> Path:
    """The builder's folder for ``recipe`` in ``precision`` with ``options`` (``key=value``
    extra options), built on first use."""
    spec = json.dumps([asdict(recipe), precision, sorted(options), _versions()], sort_keys=True)
    key = hashlib.sha256(spec.encode()).hexdigest()[:16]
    base = ROOT / "genai-builder"
    target = base / f"{recipe.family}-{precision}-{key}"
    if (target / "model.onnx").exists():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "model.onnx").exists():
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=base))
        try:
            hf = scratch / "hf"
            _hf_folder(recipe, hf)
            out = scratch / "out"
            command = [
                sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf),
                "-o", str(out), "-p", precision, "-e", "cpu", "-c", str(scratch / "cache"),
            ]  # fmt: skip
            if options:
                command += ["--extra_options", *options]
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            if done.returncode != 0 or not (out / "model.onnx").exists():
                raise RuntimeError(f"the model builder failed:\n{done.stdout}\n{done.stderr}")
            out.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _hf_folder(recipe: Recipe, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(recipe.seed)
    config = AutoConfig.for_model(
        recipe.family,
        vocab_size=recipe.vocab,
        hidden_size=recipe.hidden,
        intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=recipe.context,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=recipe.tied,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(1.0, 0.1)
            else:
                weight.normal_(0.0, 0.02 if recipe.hidden > 256 else 0.05)
    model.save_pretrained(out)
    PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(min(recipe.vocab, 320)), bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = ["The quick brown fox jumps over the lazy dog.", "How are you today, world?"] * 40
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text, trainer)
    return tokenizer


def cache_shapes(path: Path) -> tuple[int, int, int, int]:
    """(layers, kv heads, head size, context length) from the folder's genai_config.json."""
    model = json.loads((path / "genai_config.json").read_text())["model"]
    decoder = model["decoder"]
    return (
        decoder["num_hidden_layers"],
        decoder["num_key_value_heads"],
        decoder["head_size"],
        model["context_length"],
    )
