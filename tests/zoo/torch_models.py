"""Deep learning as users export it: transformers models built from configs with seeded random
weights (no hub downloads), torch recurrent and scripted-loop modules, through both of torch's
ONNX exporters (TorchScript ``dynamo=False`` and ``dynamo=True``, which writes external data),
and derived int8 (onnxruntime.quantization) and float16 (onnxconverter-common) models.

Configs are tiny (hidden 32, two layers) so a build takes seconds per exporter and a run
milliseconds; what is exercised is the exporters' graphs, not the size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import ZooModel, entry

TORCH = ("torch", "transformers")
DYNAMO_OPSET, SCRIPT_OPSET = 18, 17


def _export(
    module,
    args: tuple,
    folder: Path,
    names: list[str],
    outputs: list[str],
    dynamic: dict[str, dict[int, str]],
    dynamo: bool,
    opset: int | None = None,
) -> None:
    import torch

    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if dynamo:
            # positional, in input order: the wrappers take their tensors as *args
            shapes = tuple(
                {
                    axis: torch.export.Dim(label, min=0 if label == "past" else 1)
                    for axis, label in dynamic.get(name, {}).items()
                }
                or None
                for name in names
            )
            torch.onnx.export(
                module,
                args,
                str(folder / "model.onnx"),
                input_names=names,
                output_names=outputs,
                dynamic_shapes=shapes,
                dynamo=True,
                opset_version=opset or DYNAMO_OPSET,
                verbose=False,
            )
        else:
            torch.onnx.export(
                module,
                args,
                str(folder / "model.onnx"),
                input_names=names,
                output_names=outputs,
                dynamic_axes=dynamic,
                dynamo=False,
                opset_version=opset or SCRIPT_OPSET,
            )


def _both(
    name: str,
    make: Callable,
    args: Callable,
    names: list[str],
    outputs: list[str],
    dynamic: dict[str, dict[int, str]],
    feeds: Callable,
    **options,
) -> None:
    """Register the model once per exporter."""
    for dynamo in (False, True):

        def build(folder: Path, dynamo: bool = dynamo) -> None:
            import torch

            torch.manual_seed(0)
            _export(make().eval(), args(), folder, names, outputs, dynamic, dynamo)

        suffix = "dynamo" if dynamo else "script"
        entry(ZooModel(f"{name}_{suffix}", "torch", build, feeds, requires=TORCH, **options))


def _wrap(model, keys: list[str], take: Callable):
    """transformers' forward takes keyword arguments and returns a ModelOutput: a module the
    exporters can trace, taking its tensors positionally (no *args: torch.export's dynamic
    shapes follow the signature's structure) and returning plain ones."""
    import torch

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, a):
            return take(self.model(**{keys[0]: a}, return_dict=False))

    class Two(One):
        def forward(self, a, b):
            return take(self.model(**{keys[0]: a, keys[1]: b}, return_dict=False))

    return One() if len(keys) == 1 else Two()


# --------------------------------------------------------------------------- transformers


def _bert():
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return _wrap(BertModel(config), ["input_ids", "attention_mask"], lambda out: (out[0], out[1]))


def _text_args():
    import torch

    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.int64)
    mask[1, 5:] = 0
    return ids, mask


def _text_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    seq = int(rng.integers(3, 12))
    mask = np.ones((1, seq), np.int64)
    mask[0, int(rng.integers(1, seq)) :] = 0  # padding the mask hides
    return {"input_ids": rng.integers(0, 100, (1, seq)).astype(np.int64), "attention_mask": mask}


_both(
    "bert",
    _bert,
    _text_args,
    ["input_ids", "attention_mask"],
    ["last_hidden_state", "pooler_output"],
    {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
    _text_feeds,
)

GPT_LAYERS, GPT_HEADS, GPT_HIDDEN = 2, 2, 32


def _with_cache(model, layers: int):
    """A causal LM with its key/value cache as explicit inputs and outputs, as decoders are
    served: ``(input_ids, attention_mask, past.0.key, past.0.value, ...)`` to
    ``(logits, present.0.key, ...)``."""
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache()
            for layer in range(layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
            )
            flat = []
            for layer in out.past_key_values.layers:
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)

    if layers == 2:  # torch.export's dynamic shapes follow the signature: no *args there

        class Two(Decoder):
            def forward(self, input_ids, attention_mask, key0, value0, key1, value1):
                return super().forward(input_ids, attention_mask, key0, value0, key1, value1)

        return Two()
    raise ValueError(f"a decoder with {layers} layers has no wrapper here")


def _gpt2():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=100,
        n_positions=64,
        n_embd=GPT_HIDDEN,
        n_layer=GPT_LAYERS,
        n_head=GPT_HEADS,
    )
    return _with_cache(GPT2LMHeadModel(config), GPT_LAYERS)


def _cache_names(layers: int) -> list[str]:
    return [f"past.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def _cache_args(layers: int, heads: int, head_dim: int) -> Callable[[], tuple]:
    def args() -> tuple:
        import torch

        past_len, new = 3, 2
        shape = (1, heads, past_len, head_dim)
        return (
            torch.randint(0, 100, (1, new)),
            torch.ones(1, past_len + new, dtype=torch.int64),
            *[torch.randn(*shape) for _ in _cache_names(layers)],
        )

    return args


def _cache_feeds(layers: int, heads: int, head_dim: int) -> Callable:
    def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Half of the requests are the prefill: an empty past (length 0)."""
        past_len = int(rng.choice([0, 4]))
        new = int(rng.integers(1, 5))
        shape = (1, heads, past_len, head_dim)
        made = {
            "input_ids": rng.integers(0, 100, (1, new)).astype(np.int64),
            "attention_mask": np.ones((1, past_len + new), np.int64),
        }
        made.update({n: rng.normal(size=shape).astype(np.float32) for n in _cache_names(layers)})
        return made

    return feeds


def _cache_io(layers: int) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
    """A cached decoder's input names, output names and dynamic axes."""
    names = _cache_names(layers)
    return (
        ["input_ids", "attention_mask", *names],
        ["logits", *[n.replace("past", "present") for n in names]],
        {
            "input_ids": {0: "batch", 1: "seq"},
            "attention_mask": {0: "batch", 1: "total"},
            **{n: {0: "batch", 2: "past"} for n in names},
        },
    )


def _decoder(name: str, make: Callable, layers: int, heads: int, head_dim: int) -> None:
    """Register a cached decoder from both exporters."""
    _both(
        name,
        make,
        _cache_args(layers, heads, head_dim),
        *_cache_io(layers),
        _cache_feeds(layers, heads, head_dim),
        batch_axis=None,  # the cache's lengths differ per request: nothing to batch along
    )


_decoder("gpt2_past", _gpt2, GPT_LAYERS, GPT_HEADS, GPT_HIDDEN // GPT_HEADS)


def _vit():
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    return _wrap(ViTModel(config), ["pixel_values"], lambda out: (out[0],))


def _image_args():
    import torch

    return (torch.randn(2, 3, 32, 32),)


_both(
    "vit",
    _vit,
    _image_args,
    ["pixel_values"],
    ["last_hidden_state"],
    {"pixel_values": {0: "batch"}},
    lambda rng: {"pixel_values": rng.normal(size=(1, 3, 32, 32)).astype(np.float32)},
)


def _wav2vec2():
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    return _wrap(Wav2Vec2Model(config), ["input_values"], lambda out: (out[0],))


_both(
    "wav2vec2",
    _wav2vec2,
    lambda: (__import__("torch").randn(2, 1600),),
    ["input_values"],
    ["last_hidden_state"],
    {"input_values": {0: "batch", 1: "samples"}},
    lambda rng: {"input_values": rng.normal(size=(1, 1600)).astype(np.float32)},
)


# --------------------------------------------------------------------------- torch modules


def _rnn(kind: str):
    import torch

    class Recurrent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            cell = torch.nn.GRU if kind == "gru" else torch.nn.LSTM
            self.rnn = cell(8, 16, num_layers=2, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(32, 4)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y)

    return Recurrent()


def _sequence_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.normal(size=(1, int(rng.integers(2, 9)), 8)).astype(np.float32)}


for _kind in ("gru", "lstm"):
    _both(
        _kind,
        lambda kind=_kind: _rnn(kind),
        lambda: (__import__("torch").randn(2, 5, 8),),
        ["x"],
        ["y"],
        {"x": {0: "batch", 1: "steps"}},
        _sequence_feeds,
    )


def _rnn_with_state(kind: str):
    """A streaming recurrent model as it is served with its state carried between requests:
    the hidden state (and an LSTM's cell state) in and out, batch first (``[batch, layers,
    hidden]``, as a server's implicit state has its batch dimension first)."""
    import torch

    class Streaming(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            cell = torch.nn.GRU if kind == "gru" else torch.nn.LSTM
            self.rnn = cell(8, 16, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x, h, *c):
            h = h.transpose(0, 1).contiguous()
            if kind == "gru":
                y, h = self.rnn(x, h)
                return self.head(y), h.transpose(0, 1)
            y, (h, c) = self.rnn(x, (h, c[0].transpose(0, 1).contiguous()))
            return self.head(y), h.transpose(0, 1), c.transpose(0, 1)

    if kind == "gru":
        return Streaming()

    class WithCell(Streaming):  # torch.export's dynamic shapes follow the signature
        def forward(self, x, h, c):
            return super().forward(x, h, c)

    return WithCell()


def _state_feeds(kind: str) -> Callable:
    def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
        made = {
            "x": rng.normal(size=(1, 5, 8)).astype(np.float32),  # a chunk of 5 frames
            "h": (rng.normal(size=(1, 2, 16)) * 0.5).astype(np.float32),
        }
        if kind == "lstm":
            made["c"] = (rng.normal(size=(1, 2, 16)) * 0.5).astype(np.float32)
        return made

    return feeds


for _kind in ("gru", "lstm"):
    _states = ["h", "c"] if _kind == "lstm" else ["h"]
    _both(
        f"{_kind}_state",
        lambda kind=_kind: _rnn_with_state(kind),
        lambda states=_states: tuple(
            __import__("torch").randn(*shape) for shape in [(2, 5, 8)] + [(2, 2, 16)] * len(states)
        ),
        ["x", *_states],
        ["y", *[f"{s}_out" for s in _states]],
        {"x": {0: "batch", 1: "steps"}, **{s: {0: "batch"} for s in _states}},
        _state_feeds(_kind),
    )


def _scripted_loop():
    """A data-dependent loop: TorchScript turns it into ONNX Loop."""
    import torch

    class Halve(torch.nn.Module):
        def forward(self, x, steps):
            for _ in range(int(steps)):
                x = x * 0.5 + 1.0
            return x

    return torch.jit.script(Halve())


def _build_loop(folder: Path) -> None:
    import torch

    _export(
        _scripted_loop(),
        (torch.randn(2, 3), torch.tensor(3)),
        folder,
        ["x", "steps"],
        ["y"],
        {"x": {0: "batch"}},
        dynamo=False,
    )


def _loop_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The trip count is drawn first: the seeded requests then run the loop 5 and 2 times
    (drawn after the data, both were 0, and the Loop's body never ran)."""
    steps = np.array(int(rng.choice([0, 2, 5])), np.int64)
    return {"x": rng.normal(size=(1, 3)).astype(np.float32), "steps": steps}


entry(
    ZooModel(
        "scripted_loop",
        "torch",
        _build_loop,
        _loop_feeds,
        requires=TORCH,
        batch_axis=None,  # a scalar input has no batch dimension
    )
)


# --------------------------------------------------------------------------- derived models


def _derived(name: str, source: str, make: Callable[[Path, Path], None], **options) -> None:
    base = next(m for m in _registered() if m.name == source)

    def build(folder: Path) -> None:
        make(base.path(), folder / "model.onnx")

    requires = (*base.requires, *options.pop("requires", ()))
    options.setdefault("batch_axis", base.batch_axis)  # a conversion keeps the model's inputs
    feeds = base.feeds
    if options.pop("half_inputs", False):

        def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
            return {k: v.astype(np.float16) for k, v in base.feeds(rng).items()}

    entry(ZooModel(name, "derived", build, feeds, requires=requires, **options))


def _registered():
    from . import ZOO

    return list(ZOO.values())


# BATCH refuses dynamically quantized models: DynamicQuantizeLinear's one scale per tensor
# would make a request's result depend on the requests batched with it.
DYNAMIC_SCALE = "DynamicQuantizeLinear computes one scale over the whole batch"


def _quantize_dynamic(source: Path, target: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


def _quantize_static(source: Path, target: Path) -> None:
    """QDQ format, calibrated on a few seeded images."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Images(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(1)
            self.batches = iter(
                [
                    {"pixel_values": rng.normal(size=(1, 3, 32, 32)).astype(np.float32)}
                    for _ in range(4)
                ]
            )

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(source), str(target), Images(), quant_format=QuantFormat.QDQ)


def _float16(keep_io_types: bool) -> Callable[[Path, Path], None]:
    def make(source: Path, target: Path) -> None:
        import onnx
        from onnxconverter_common.float16 import convert_float_to_float16

        model = onnx.load(str(source))
        onnx.save(convert_float_to_float16(model, keep_io_types=keep_io_types), str(target))

    return make


# int8: the QDQ model's output is dequantized from int8 with scale 0.02278 (read from the
# model): "one output quantization step" is that. Dynamic quantization ends in float ops, so
# the float tolerance holds there (measured 6e-7).
_derived("bert_int8_dynamic", "bert_script", _quantize_dynamic, unbatchable=DYNAMIC_SCALE)
_derived("vit_int8_qdq", "vit_script", _quantize_static, atol=0.0228, rtol=0.0, fused_int8=True)
# float16 inside: NUMPY computes in float32 and rounds once, onnxruntime rounds at every op;
# they agree to two float16 steps (0.002 at 1.0, measured 0.00195 at most), looser than the
# float32 tolerance. (keep_io_types=True on the BERT is not here: onnxconverter-common leaves
# its pooler reading a float output as float16, a model onnx's shape inference refuses.)
HALF = {"requires": ("onnxconverter-common",), "rtol": 2e-3, "atol": 2e-3}
_derived("vit_fp16", "vit_script", _float16(True), **HALF)
_derived("vit_fp16_io", "vit_script", _float16(False), half_inputs=True, **HALF)
