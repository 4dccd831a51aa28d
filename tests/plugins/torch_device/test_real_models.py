"""Real exporters' models (tests/zoo) on TORCH: QueryNetwork claims every node of the
transformer, CNN, RNN and int8 (QDQ and dynamic) exports, so HETERO:TORCH,NUMPY (whose
results tests/zoo/test_zoo.py compares with onnxruntime) runs them wholly on TORCH; and at f16
and bf16 they stay within those precisions' tolerance of onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from reference import ort_outputs as reference
from zoo import load_all

from plugserve.plugins.ir import load_model

pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)
pytestmark = pytest.mark.slow

ZOO = load_all()

#: claimed whole: both exporters, transformers and RNNs, QDQ and dynamic int8, float16
WHOLE = [
    "bert_script", "bert_dynamo", "bert_int8_qdq", "bert_int8_dynamic", "bert_fp16_io",
    "vit_dynamo", "vit_int8_qdq", "vit_fp16", "resnet_script", "resnet_dynamo",
    "whisper_encoder_script", "t5_encoder_script", "wav2vec2_script", "wav2vec2_int8_dynamic",
    "gpt2_past_script", "llama_past_dynamo", "lstm_script", "lstm_state_dynamo", "gru_script",
    "gru_state_script", "minilm_int8",
]  # fmt: skip


@pytest.mark.parametrize("name", WHOLE)
def test_torch_claims_every_node(core, name):
    path = str(ZOO[name].path())
    nodes = {n.name for n in load_model(path).nodes}
    claimed = core.query_network(path, "TORCH")
    refused = core.plugin("TORCH").unsupported_nodes(path)
    assert set(claimed) == nodes, refused


@pytest.mark.parametrize(("name", "hint", "tolerance"), [
    ("vit_dynamo", "f16", 2e-2), ("vit_dynamo", "bf16", 8e-2), ("bert_script", "bf16", 8e-2),
])  # fmt: skip
def test_reduced_precision_stays_within_its_tolerance(core, name, hint, tolerance):
    model = ZOO[name]
    feeds = model.feeds(np.random.default_rng(0))
    want = reference(model, feeds)
    network = core.load_network(str(model.path()), "TORCH", {"INFERENCE_PRECISION_HINT": hint})
    assert network.get_metric("INFERENCE_PRECISION") == hint
    got = network.infer(feeds)
    for key, value in want.items():
        scale = float(np.max(np.abs(value))) or 1.0
        error = float(np.max(np.abs(got[key].astype(np.float64) - value))) / scale
        assert got[key].dtype == value.dtype
        assert error <= tolerance, f"{name} {key} at {hint}: {error:.3g} of its largest value"
