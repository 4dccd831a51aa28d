"""``plugserve make-model tiny-llama DIR``: a small generative model folder, made offline.

What a user downloads from the Hugging Face hub for a Llama-style decoder (``config.json``,
``tokenizer.json``, ``tokenizer_config.json`` with its chat template, ``chat_template.jinja``,
``generation_config.json``, ``special_tokens_map.json`` and optimum's ``model.onnx`` with its
key/value cache), made here in about a second with what ``plugserve[generate]`` already has:
a byte-level BPE tokenizer trained by ``tokenizers`` on seeded sentences, and the decoder
graph written op by op with ``onnx.helper`` over seeded random weights (numpy). No internet,
no torch, no exporter's virtual environment. Its answers are fluent nonsense: it is for trying
the server, its OpenAI routes and clients where no model can be downloaded.

The graph is optimum's ``text-generation-with-past`` interface (``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.N.key/value`` in; ``logits`` and
``present.N.key/value`` out, the cache concatenated), computed from standard ONNX ops at
opset 17, so every device runs it: RMSNorm, rotary embeddings (rotate-half, Llama's), grouped
query attention with a causal and padding mask, a SiLU-gated MLP, an untied head.

Size (``TINY``): 64 wide, 2 layers, 4 heads over 2 key/value heads, a 1,024-token vocabulary,
512 positions: 0.23 M parameters, a 1 MB folder.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from plugserve.server.control.examples.files import OPSET, write_if_changed

__all__ = ["TINY", "DecoderSize", "make_tiny_llama"]

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|pad|>")  # fmt: skip
BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>"
#: generation stops at either, as Llama 3's generation_config.json lists them
STOP = ("<|end_of_text|>", "<|eot_id|>")
#: Llama 3's chat format, shortened
TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
#: the words the tokenizer's sentences are made of
WORDS = """
the a an and or but of to in on at for with from by as is was are be it this that there here
once upon time day night story tale king queen robot sea moon sun town city hello name my your
our their what who why how where when can could will would say said write read tell told ask
answer question capital france paris oslo rome cold warm quiet loud small big old new good bad
happy sad apple apples book books bird birds box list number one two three four five six seven
eight nine ten count please thank you yes no
"""


@dataclass(frozen=True)
class DecoderSize:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = DecoderSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192, vocab=1024,
                   context=512)  # fmt: skip


def _sentences(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(count):
        words = rng.choice(WORDS.split(), size=int(rng.integers(4, 14)))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        if rng.random() < 0.2:
            line += f" {int(rng.integers(0, 1000))}"
        lines.append(line)
    return lines


def train_tokenizer(size: DecoderSize):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``size.vocab`` tokens (specials last)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=size.vocab - len(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_sentences(4000, size.seed), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    bos = (BOS, tokenizer.token_to_id(BOS))
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[bos]
            ),
        ]
    )
    return tokenizer


def _weight(size: DecoderSize, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0):
    rng = np.random.default_rng([size.seed, zlib.crc32(name.encode())])
    return (mean + std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


class _Graph:
    """Nodes and initializers of one graph, named in order."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, kind: str, inputs: list[str], outputs: int | list[str] = 1, **attrs) -> str:
        self._count += 1
        if isinstance(outputs, int):
            outputs = [f"{kind.lower()}_{self._count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(kind, inputs, outputs, name=f"{kind}_{self._count}",
                                           **attrs))  # fmt: skip
        return outputs[0] if len(outputs) == 1 else outputs  # type: ignore[return-value]

    def rms_norm(self, x: str, weight: str) -> str:
        square = self.op("Mul", [x, x])
        mean = self.op("ReduceMean", [square], axes=[-1], keepdims=1)
        root = self.op("Sqrt", [self.op("Add", [mean, "eps"])])
        return self.op("Mul", [self.op("Div", [x, root]), weight])

    def heads(self, x: str, count: int, dim: int) -> str:
        """[B, S, count * dim] -> [B, count, S, dim]."""
        shape = self.const(f"shape_{self._count}", np.array([0, 0, count, dim], np.int64))
        shaped = self.op("Reshape", [x, shape])
        return self.op("Transpose", [shaped], perm=[0, 2, 1, 3])

    def rotate(self, x: str) -> str:
        """Rotary embedding, rotate-half: (x1 cos - x2 sin, x2 cos + x1 sin)."""
        x1, x2 = self.op("Split", [x, "halves"], 2, axis=-1)
        first = self.op("Sub", [self.op("Mul", [x1, "cos"]), self.op("Mul", [x2, "sin"])])
        second = self.op("Add", [self.op("Mul", [x2, "cos"]), self.op("Mul", [x1, "sin"])])
        return self.op("Concat", [first, second], axis=-1)


def decoder_graph(size: DecoderSize) -> onnx.ModelProto:
    """The decoder as optimum exports it (see the module's docstring)."""
    h, d, kv = size.hidden, size.head_dim, size.kv_heads
    g = _Graph()
    _positions_and_mask(g, size)
    x = g.op(
        "Gather", [g.const("embed", _weight(size, "embed", (size.vocab, h), 1.0)), "input_ids"]
    )
    caches: list[str] = []
    for layer in range(size.layers):
        x = _layer(g, size, layer, x)
        caches += [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
    norm = g.const("norm", _weight(size, "norm", (h,), 0.2, 1.0))
    head = g.const("lm_head", _weight(size, "lm_head", (h, size.vocab), 4.0 / h**0.5))
    g.op("MatMul", [g.rms_norm(x, norm), head], ["logits"])

    def tensor(name: str, kind: int, shape: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, kind, shape)

    cache_in = ["batch", kv, "past", d]
    cache_out = ["batch", kv, "total", d]
    graph = helper.make_graph(
        g.nodes,
        "tiny_llama",
        [
            tensor("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            tensor("attention_mask", TensorProto.INT64, ["batch", "total"]),
            tensor("position_ids", TensorProto.INT64, ["batch", "sequence"]),
            *(tensor(n, TensorProto.FLOAT, cache_in) for n in caches),
        ],
        [
            tensor("logits", TensorProto.FLOAT, ["batch", "sequence", size.vocab]),
            *(
                tensor(n.replace("past_key_values", "present"), TensorProto.FLOAT, cache_out)
                for n in caches
            ),
        ],
        initializer=g.initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="plugserve-make-model"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _positions_and_mask(g: _Graph, size: DecoderSize) -> None:
    """What every layer shares: the rotary tables read at the positions (``cos``, ``sin``:
    [B, 1, S, d/2]), the attention bias (``bias``: [B, 1, S, T], key j seen by query i at cache
    index T - S + i when the attention mask has it and j <= T - S + i), and the constants."""
    d, kv, heads = size.head_dim, size.kv_heads, size.heads
    g.const("eps", np.array(1e-5, np.float32))
    g.const("halves", np.array([d // 2, d // 2], np.int64))
    inv = 1.0 / (500000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.arange(size.context, dtype=np.float64)[:, None] * inv[None, :]
    g.const("cos_table", np.cos(angles).astype(np.float32))
    g.const("sin_table", np.sin(angles).astype(np.float32))
    g.const("axis1", np.array([1], np.int64))
    g.const("axis2", np.array([2], np.int64))
    g.op("Unsqueeze", [g.op("Gather", ["cos_table", "position_ids"]), "axis1"], ["cos"])
    g.op("Unsqueeze", [g.op("Gather", ["sin_table", "position_ids"]), "axis1"], ["sin"])
    g.const("zero", np.array(0, np.int64))
    g.const("one", np.array(1, np.int64))
    total = g.op("Gather", [g.op("Shape", ["attention_mask"]), "one"])
    new = g.op("Gather", [g.op("Shape", ["input_ids"]), "one"])
    keys = g.op("Range", ["zero", total, "one"])
    queries = g.op("Range", [g.op("Sub", [total, new]), total, "one"])
    causal = g.op("LessOrEqual", [keys, g.op("Unsqueeze", [queries, "axis1"])])  # [S, T]
    g.const("axes01", np.array([0, 1], np.int64))
    padding = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", "axis1"])], to=TensorProto.BOOL)
    seen = g.op(
        "And", [g.op("Unsqueeze", [causal, "axes01"]), g.op("Unsqueeze", [padding, "axis1"])]
    )
    g.const("open", np.array(0.0, np.float32))
    g.const("shut", np.array(-1e9, np.float32))
    g.op("Where", [seen, "open", "shut"], ["bias"])
    g.const("scale", np.array(1.0 / np.sqrt(d), np.float32))
    g.const("repeat", np.array([1, 1, heads // kv, 1, 1], np.int64))
    g.const("merged_heads", np.array([0, heads, -1, d], np.int64))
    g.const("merged_width", np.array([0, 0, heads * d], np.int64))


def _layer(g: _Graph, size: DecoderSize, layer: int, x: str) -> str:
    """One decoder layer over ``x``: attention with its key/value cache (``past_key_values.N``
    in, ``present.N`` out), then the gated MLP, each behind an RMS norm and a residual."""
    h, d, kv, heads = size.hidden, size.head_dim, size.kv_heads, size.heads
    w = {
        name: g.const(f"l{layer}.{name}", _weight(size, f"l{layer}.{name}", shape, std))
        for name, shape, std in (
            ("q", (h, heads * d), 2.0 / h**0.5),
            ("k", (h, kv * d), 2.0 / h**0.5),
            ("v", (h, kv * d), 1.0 / h**0.5),
            ("o", (heads * d, h), 1.0 / (heads * d) ** 0.5),
            ("gate", (h, size.intermediate), 1.0 / h**0.5),
            ("up", (h, size.intermediate), 1.0 / h**0.5),
            ("down", (size.intermediate, h), 1.0 / size.intermediate**0.5),
        )
    }
    norm1 = g.const(f"l{layer}.norm1", _weight(size, f"l{layer}.norm1", (h,), 0.2, 1.0))
    norm2 = g.const(f"l{layer}.norm2", _weight(size, f"l{layer}.norm2", (h,), 0.2, 1.0))
    past_k, past_v = f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"
    present_k, present_v = f"present.{layer}.key", f"present.{layer}.value"
    xn = g.rms_norm(x, norm1)
    q = g.rotate(g.heads(g.op("MatMul", [xn, w["q"]]), heads, d))
    k = g.rotate(g.heads(g.op("MatMul", [xn, w["k"]]), kv, d))
    v = g.heads(g.op("MatMul", [xn, w["v"]]), kv, d)
    g.op("Concat", [past_k, k], [present_k], axis=2)
    g.op("Concat", [past_v, v], [present_v], axis=2)

    def grouped(cache: str) -> str:  # [B, kv, T, d] -> [B, heads, T, d]
        wide = g.op("Expand", [g.op("Unsqueeze", [cache, "axis2"]), "repeat"])
        return g.op("Reshape", [wide, "merged_heads"])

    scores = g.op("MatMul", [q, g.op("Transpose", [grouped(present_k)], perm=[0, 1, 3, 2])])
    scores = g.op("Add", [g.op("Mul", [scores, "scale"]), "bias"])
    attended = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), grouped(present_v)])
    merged = g.op("Reshape", [g.op("Transpose", [attended], perm=[0, 2, 1, 3]), "merged_width"])
    x = g.op("Add", [x, g.op("MatMul", [merged, w["o"]])])
    xn = g.rms_norm(x, norm2)
    gate = g.op("MatMul", [xn, w["gate"]])
    silu = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
    mlp = g.op("MatMul", [g.op("Mul", [silu, g.op("MatMul", [xn, w["up"]])]), w["down"]])
    return g.op("Add", [x, mlp])


def make_tiny_llama(folder: str | Path, size: DecoderSize = TINY) -> Path:
    """Write the folder (made if missing; files that already hold the same bytes are left as
    they are); returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(size)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIALS}
    stop = [ids[t] for t in STOP]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": size.intermediate,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": size.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": ids[BOS],
        "eos_token_id": stop,
        "pad_token_id": ids[PAD],
        "torch_dtype": "float32",
    }
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIALS}  # fmt: skip
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": size.context,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {"bos_token_id": ids[BOS], "eos_token_id": stop, "pad_token_id": ids[PAD]}
    files = {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
        "generation_config.json": generation,
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
    }
    for name, content in files.items():
        write_if_changed(folder / name, (json.dumps(content, indent=2) + "\n").encode())
    write_if_changed(folder / "tokenizer.json", tokenizer.to_str(pretty=True).encode())
    write_if_changed(folder / "chat_template.jinja", TEMPLATE.encode())
    write_if_changed(
        folder / "model.onnx", decoder_graph(size).SerializeToString(deterministic=True)
    )
    return folder
