"""int8 and float16 variants of the decoders and encoders, for graph shapes the ViT's (in
torch_models) leave out: quantized MatMuls beside a key/value cache that may be empty, a
statically quantized encoder with an attention mask, float16 with integer inputs and with a
Conv1d front end.

Not here because onnxconverter-common 1.16 writes models onnxruntime itself refuses ("Type
(tensor(float16)) of output arg ... does not match expected type (tensor(float))"):
keep_io_types=True on the Llama and the T5 (it leaves their float32 upcasts, RMSNorm's and
T5's LayerNorm's, as Cast(to=FLOAT) with float16 results) and on the ResNet (its
last_hidden_state output also feeds the pooler, as with the BERT).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import architectures  # noqa: F401  (registers the sources of the models below)
from .torch_models import (
    DYNAMIC_SCALE,
    HALF,
    _derived,
    _float16,
    _quantize_dynamic,
    _text_feeds,
)


def _quantize_text(source: Path, target: Path) -> None:
    """Static QDQ, calibrated on a few seeded requests of the BERT's own kind (padded)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Sentences(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(1)
            self.batches = iter([_text_feeds(rng) for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(source), str(target), Sentences(), quant_format=QuantFormat.QDQ)


# Dynamic quantization ends in float ops: the float tolerance holds.
_derived("gpt2_past_int8_dynamic", "gpt2_past_script", _quantize_dynamic)
_derived("llama_past_int8_dynamic", "llama_past_dynamo", _quantize_dynamic)
# the quantizer turns a Conv into ConvInteger, an LSTM into com.microsoft DynamicQuantizeLSTM
_derived("wav2vec2_int8_dynamic", "wav2vec2_script", _quantize_dynamic, unbatchable=DYNAMIC_SCALE)
_OPENVINO_LSTM = (
    "openvino runs DynamicQuantizeLSTM on dequantized weights without quantizing its input and "
    "state per step as onnxruntime does: 6e-4 off"
)
_derived(
    "lstm_int8_dynamic",
    "lstm_script",
    _quantize_dynamic,
    unbatchable=DYNAMIC_SCALE,
    # AUTO checks OPENVINO against ORT (NUMPY cannot run it), finds it 6e-4 off and takes ORT
    known_failures={
        "NUMPY": "no NUMPY kernel for com.microsoft DynamicQuantizeLSTM",
        "OPENVINO": _OPENVINO_LSTM,
        "HETERO:OPENVINO,NUMPY": _OPENVINO_LSTM,
        "HETERO:TORCH,NUMPY": "neither TORCH nor NUMPY runs com.microsoft DynamicQuantizeLSTM",
    },
)
# last_hidden_state is dequantized with scale 0.02572 (read from the model): one output step;
# pooler_output is tanh of a value dequantized with scale 0.00206, tanh's slope is at most 1.
# (The padding mask's -inf gets the scale inf from the calibrator: QuantizeLinear of
# -inf / inf, where NUMPY once disagreed with onnxruntime by two output steps.)
_derived("bert_int8_qdq", "bert_script", _quantize_text, atol=0.0258, rtol=0.0, fused_int8=True)
_derived("bert_fp16_io", "bert_script", _float16(False), **HALF)
_derived("whisper_encoder_fp16", "whisper_encoder_dynamo", _float16(True), **HALF)
_derived(
    "whisper_encoder_fp16_io",
    "whisper_encoder_script",
    _float16(False),
    half_inputs=True,
    **HALF,
)


# onnxruntime's own tools write com.microsoft ops into what they save (issue 38): the transformer
# optimizer (SkipLayerNormalization, BiasGelu, FastGelu), the dynamic quantizer over its
# output, and the static quantizer in QOperator format (QLinearConv, QLinearAdd,
# QLinearGlobalAveragePool); NUMPY runs each (plugins/numpy/kernels/contrib.py).


def _ort_optimized(model_type: str, heads: int, hidden: int):
    def make(source: Path, target: Path) -> None:
        from onnxruntime.transformers.optimizer import optimize_model

        optimize_model(
            str(source), model_type=model_type, num_heads=heads, hidden_size=hidden, opt_level=1
        ).save_model_to_file(str(target))

    return make


def _ort_optimized_int8(model_type: str, heads: int, hidden: int):
    def make(source: Path, target: Path) -> None:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        optimized = target.with_name("optimized.onnx")
        _ort_optimized(model_type, heads, hidden)(source, optimized)
        quantize_dynamic(
            str(optimized),
            str(target),
            weight_type=QuantType.QInt8,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},  # contrib outputs
        )
        optimized.unlink()

    return make


def _quantize_qoperator(source: Path, target: Path) -> None:
    """Static quantization in QOperator format (the quantizer's own QLinear* ops), calibrated
    on a few seeded images, after onnxruntime's pre-processing."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Images(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(1)
            self.batches = iter(
                [{"x": rng.normal(size=(1, 3, 32, 32)).astype(np.float32)} for _ in range(4)]
            )

        def get_next(self):
            return next(self.batches, None)

    prepared = target.with_name("prepared.onnx")
    quant_pre_process(str(source), str(prepared))
    import onnx

    Images.name = onnx.load(str(prepared)).graph.input[0].name
    reader = Images()
    reader.batches = iter([{Images.name: b["x"]} for b in reader.batches])
    quantize_static(
        str(prepared),
        str(target),
        reader,
        quant_format=QuantFormat.QOperator,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    prepared.unlink()


_derived("bert_ortopt", "bert_script", _ort_optimized("bert", 2, 32))
_derived("vit_ortopt", "vit_script", _ort_optimized("vit", 2, 32))
_derived(
    "gpt2_past_ortopt",
    "gpt2_past_script",
    _ort_optimized("gpt2", 0, 0),
    # TORCH takes the standard ops between the com.microsoft ones, whose outputs ONNX cannot
    # type, and NUMPY's probe of the cut values fails on the past inputs' symbolic dims
    known_failures={
        "HETERO:TORCH,NUMPY": "HETERO cannot type a Split output it cuts between NUMPY pieces "
        "(after com.microsoft ops ONNX's inference does not type)"
    },
)
_derived(
    "bert_ortopt_int8",
    "bert_script",
    _ort_optimized_int8("bert", 2, 32),
    unbatchable=DYNAMIC_SCALE,
)
# QLinear ops end in integers: within one output step of onnxruntime (its SIMD requantization)
_derived("resnet_int8_qop", "resnet_script", _quantize_qoperator, atol=0.05, rtol=0.0)
