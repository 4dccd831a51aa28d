"""What a Hugging Face model folder holds, as the repository and the engine need to know it.

A folder is a *transformers folder* when its ``config.json`` names a ``model_type`` (what
``transformers`` writes; plugserve's own ``config.json`` never has that key), or it is an
onnxruntime-genai model builder's output (``genai_config.json``, which the builder writes
instead), and it holds a graph. The graph is looked for in this order, the first found taken:

==================================  =====================================================
``genai_config.json``               onnxruntime-genai's model builder: its
                                    ``model.decoder.filename`` (``model.onnx``)
``openvino_model.xml``              optimum-intel's OpenVINO IR (stateful)
``model.onnx``                      optimum's ONNX export
``decoder_model_merged.onnx``       optimum's older merged decoder
``onnx/model.onnx``                 onnx-community's layout (``onnx/model*.onnx`` when
                                    it is the only one)
``model.safetensors``               the weights as published (or the shards that
                                    ``model.safetensors.index.json`` names), for a decoder
                                    family the torch decoder computes
                                    (``plugins/torch/decoder_model.py``) or any
                                    ``*ForCausalLM``, with a ``tokenizer.json``: served
                                    by TORCH's and GPU's ``load_decoder``
==================================  =====================================================

Whether the graph is a decoder (generation) or an encoder (embeddings) is decided when it is
loaded, from its inputs (``past_key_values.*``): scanning a repository reads no graph.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from plugserve.plugins.api import InvalidModel
from plugserve.server.apps.generate.text.tokenizer import read_json

__all__ = ["HF_CONFIG", "ModelFolder", "graph_of", "is_transformers_folder"]

HF_CONFIG = "config.json"
GENAI_CONFIG = "genai_config.json"
OPENVINO_IR = "openvino_model.xml"
_ONNX_NAMES = ("model.onnx", "decoder_model_merged.onnx", "onnx/model.onnx")
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
#: the model types the torch decoder computes (decoder_model.FAMILIES, kept here so a scan
#: imports no torch)
TORCH_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3")


def _hf_config(folder: Path) -> dict[str, Any] | None:
    """``config.json`` when it is transformers' (has ``model_type``), else, in a model
    builder's folder (which has none), what its ``genai_config.json`` says of the model
    (``model.type``, the decoder's sizes, the context length); None otherwise. Never raises
    (a scan meets all kinds of folders)."""
    try:
        raw = read_json(folder / HF_CONFIG)
        if isinstance(raw.get("model_type"), str):
            return raw
        genai = read_json(folder / GENAI_CONFIG).get("model")
    except InvalidModel:
        return None
    if not isinstance(genai, dict) or not isinstance(genai.get("type"), str):
        return None
    decoder = genai.get("decoder") if isinstance(genai.get("decoder"), dict) else {}
    config = {
        "model_type": genai["type"],
        "vocab_size": genai.get("vocab_size"),
        "max_position_embeddings": genai.get("context_length"),
        "eos_token_id": genai.get("eos_token_id"),
        "bos_token_id": genai.get("bos_token_id"),
        "hidden_size": decoder.get("hidden_size"),
        "num_attention_heads": decoder.get("num_attention_heads"),
        "num_key_value_heads": decoder.get("num_key_value_heads"),
        "head_dim": decoder.get("head_size"),
        "num_hidden_layers": decoder.get("num_hidden_layers"),
    }
    return {k: v for k, v in config.items() if v is not None}


def graph_of(folder: Path) -> tuple[str, Path] | None:
    """``(kind, path)`` of the folder's graph: kind ``genai``, ``openvino``, ``onnx``, or
    ``safetensors`` (the weights of a decoder, no graph: :func:`_safetensors_of`)."""
    if (folder / GENAI_CONFIG).is_file():
        try:
            name = read_json(folder / GENAI_CONFIG)["model"]["decoder"]["filename"]
        except (InvalidModel, KeyError, TypeError):
            name = None
        if isinstance(name, str) and "/" not in name and (folder / name).is_file():
            return "genai", folder / name
    if (folder / OPENVINO_IR).is_file():
        return "openvino", folder / OPENVINO_IR
    for name in _ONNX_NAMES:
        if (folder / name).is_file():
            return "onnx", folder / name
    found = sorted((folder / "onnx").glob("model*.onnx")) if (folder / "onnx").is_dir() else []
    if len(found) == 1:
        return "onnx", found[0]
    return _safetensors_of(folder)


def _safetensors_of(folder: Path) -> tuple[str, Path] | None:
    """``("safetensors", weights)`` for a decoder's weights as published: a safetensors file
    (or index), a ``tokenizer.json``, and a ``config.json`` whose ``model_type`` the torch
    decoder computes or whose architecture is a ``*ForCausalLM`` (its load then says whether
    it is computed); None otherwise, so an encoder's weights are not taken for a decoder."""
    weights = next((folder / n for n in SAFETENSORS if (folder / n).is_file()), None)
    if weights is None or not (folder / "tokenizer.json").is_file():
        return None
    try:
        config = read_json(folder / HF_CONFIG)
    except InvalidModel:
        return None
    architectures = config.get("architectures")
    causal = isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures
    )
    if config.get("model_type") in TORCH_FAMILIES or causal:
        return "safetensors", weights
    return None


def is_transformers_folder(folder: str | Path) -> bool:
    """Whether a repository entry's folder is a transformers folder with a graph."""
    folder = Path(folder)
    return folder.is_dir() and _hf_config(folder) is not None and graph_of(folder) is not None


@dataclasses.dataclass
class ModelFolder:
    """A transformers folder read for loading: its config, generation config and graph."""

    path: Path
    config: dict[str, Any]
    generation_config: dict[str, Any]
    kind: str
    graph: Path
    genai_config: dict[str, Any]

    @classmethod
    def read(cls, folder: str | Path) -> ModelFolder:
        folder = Path(folder)
        config = _hf_config(folder)
        if config is None:
            raise InvalidModel(
                f"{folder}: not a transformers model folder (no {HF_CONFIG} with model_type)"
            )
        found = graph_of(folder)
        if found is None:
            raise InvalidModel(
                f"{folder}: no graph found; expected one of {GENAI_CONFIG} (onnxruntime-genai), "
                f"{OPENVINO_IR} (optimum-intel), {', '.join(_ONNX_NAMES)}, a single "
                "onnx/model*.onnx (optimum, onnx-community), or a decoder's model.safetensors "
                "with its tokenizer.json"
            )
        kind, graph = found
        genai = read_json(folder / GENAI_CONFIG) if kind == "genai" else {}
        return cls(folder, config, read_json(folder / "generation_config.json"), kind, graph, genai)

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's part of the config (multimodal configs nest it)."""
        nested = self.config.get("text_config")
        return nested if isinstance(nested, dict) else self.config

    @property
    def context_length(self) -> int:
        """The longest sequence the model was made for (0: the config does not say)."""
        config = self.text_config
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        context = self.genai_config.get("model", {}).get("context_length")
        return context if isinstance(context, int) and context > 0 else 0
