"""A generative model folder made in code in well under a second: for tests of the generation
faces' bounds that need a real model folder but none of the exporters (they run before
``tests/support/llm.py prepare`` is done, and need no venv).

The folder is what optimum's export of a decoder looks like to plugserve (``config.json`` with a
``model_type``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat template,
``model.onnx`` taking ``input_ids``, ``attention_mask``, ``position_ids`` and one layer's
``past_key_values.0.key/value``, giving ``logits`` and ``present.0.key/value``), so it loads as
a ``ConcatDecoder`` on any device. The graph has no attention: each token's logits come from
its own embedding (seeded weights, so answers are the same every run), and the end-of-sequence
token is never likely, so a request generates ``max_tokens``. The tokenizer is a byte-level BPE
without merges (one token per byte of text) plus special tokens and one long added token, so
the model's prompt bound (context x longest token's bytes, ``server/apps/generate/limits.py``) is
``context`` x ``long_token`` bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["optimum_interface", "write"]

HEAD = 8
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)


def optimum_interface(vocab: int, shapes: list[str]) -> tuple[list, list]:
    """The inputs and outputs of optimum's one-layer decoder interface (ids, mask, positions,
    one head of ``HEAD`` as the cache), plus ``shapes``: ``[2]`` int64 outputs a graph gives
    so that its mask and positions are read."""
    from onnx import TensorProto, helper

    cache = ["batch", 1, "past", HEAD]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "all"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("past_key_values.0.value", TensorProto.FLOAT, cache),
    ]
    present = ["batch", 1, "total", HEAD]
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
        helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT, present),
        helper.make_tensor_value_info("present.0.value", TensorProto.FLOAT, present),
        *(helper.make_tensor_value_info(name, TensorProto.INT64, [2]) for name in shapes),
    ]
    return inputs, outputs


def _tokenizer(folder: Path, long_token: int) -> tuple[int, int, int, list[int]]:
    """tokenizer.json and tokenizer_config.json; the vocabulary's size, BOS and EOS ids, and
    the ids of the letters and the space (what the model writes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(["<" + "x" * (long_token - 2) + ">"])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    bos, eos = tokenizer.token_to_id("<|bos|>"), tokenizer.token_to_id("<|eos|>")
    words = [tokenizer.token_to_id(c) for c in "abcdefghijklmnopqrstuvwxyz\u0120"]
    return tokenizer.get_vocab_size(with_added_tokens=True), bos, eos, words


def _graph(vocab: int, words: list[int], seed: int, width: int, eos: int, eos_logit: float | None):
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    embedding = rng.standard_normal((vocab, HEAD)).astype(np.float32)
    inner = (rng.standard_normal((HEAD, width or HEAD)) / np.sqrt(HEAD)).astype(np.float32)
    head = rng.standard_normal((width or HEAD, vocab)).astype(np.float32)
    bias = np.full(vocab, -1e4, np.float32)  # only letters and spaces are ever likely:
    bias[words] = 0.0  # the end of sequence never is, so a request runs to max_tokens
    if eos_logit is not None:  # ... unless asked: then it is a letter, plus ``eos_logit``
        bias[eos] = eos_logit
    nodes = [
        helper.make_node("Gather", ["embedding", "input_ids"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "inner"], ["wide"]),
        helper.make_node("MatMul", ["wide", "head"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["logits"]),
        helper.make_node("Unsqueeze", ["hidden", "axis1"], ["new"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new"], ["present.0.value"], axis=2),
        # the mask and positions are read (a graph's unread inputs may be dropped by a device)
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Shape", ["position_ids"], ["position_shape"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny-decoder",
        *optimum_interface(vocab, ["mask_shape", "position_shape"]),
        [
            numpy_helper.from_array(embedding, "embedding"),
            numpy_helper.from_array(inner, "inner"),
            numpy_helper.from_array(head, "head"),
            numpy_helper.from_array(bias, "bias"),
            numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def write(
    folder: Path,
    context: int = 4096,
    long_token: int = 32,
    seed: int = 0,
    width: int = 0,
    eos_logit: float | None = None,
) -> Path:
    """The model folder at ``folder`` (made): a context of ``context`` tokens, whose longest
    token is ``long_token`` bytes, and a layer ``width`` wide before the logits (0: as wide as
    the embedding, 8): a wide one makes each step compute for a while, in BLAS without the
    GIL, as a small real model's does, instead of racing through thousands of tokens a
    second. ``eos_logit``: added to the end-of-sequence token's logit as a letter's 0, so a
    sampled answer may end before ``max_tokens`` (None: it never does; with seed 0, 2.0 makes
    it 4.4% likely a step on average over the letters, 27% at most, and the greedy choice
    after 2 of the 27 letters and spaces)."""
    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos, words = _tokenizer(folder, long_token)
    onnx.save(_graph(vocab, words, seed, width, eos, eos_logit), str(folder / "model.onnx"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": context,
        "hidden_size": HEAD,
        "head_dim": HEAD,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder
