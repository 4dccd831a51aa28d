"""onnxruntime-genai's model-builder folders (Llama- and Qwen2-style, seeded random weights)
on NUMPY, through plugserve's Core, against onnxruntime running the same graph: a prompt,
then decode steps that feed back the greedy token and the present key/value cache, as an
engine drives them. fp32 and int4 (MatMulNBits, with and without zero points, an int8 head,
GatherBlockQuantized embeddings untied and tied to the head), the cache as the builder's
shared max-length buffer and as a growing one, one sequence and a batch of two prompts of
different lengths. The kernels one at a time are test_decoder_kernels.py's.

Measured here (2026-11-25): fp32 and int4 with ``accuracy_level=1`` within 1e-6 of
onnxruntime (relative to the largest logit); int4 with the builder's default
``accuracy_level=4`` within 3 % (onnxruntime rounds the activations to int8 there, NUMPY
computes the op's exact product), greedy tokens still equal.
"""

from __future__ import annotations

import genai_builder
import numpy as np
import pytest
from genai_builder import TINY_LLAMA, TINY_QWEN2, TINY_QWEN2_TIED

ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")
_why = genai_builder.missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

EXACT = "accuracy_level=1"  # onnxruntime computes MatMulNBits in float32, as NUMPY does

FOLDERS = {
    "llama-fp32": (TINY_LLAMA, "fp32", ()),
    "qwen2-fp32": (TINY_QWEN2, "fp32", ()),
    "llama-int4": (TINY_LLAMA, "int4", (EXACT,)),
    "llama-int4-zp-gather-int8head": (
        TINY_LLAMA,
        "int4",
        (
            EXACT,
            "is_symmetric=false",
            "op_types_to_quantize=MatMul/Gather",
            "matmul_mixed_precision=last_matmul:int8",
        ),
    ),
    "qwen2-int4-tied": (TINY_QWEN2_TIED, "int4", (EXACT, "shared_embeddings=true")),
    "llama-int4-int8-activations": (TINY_LLAMA, "int4", ()),
}


def _generate(path, device_net, batch_lengths, shared: bool, steps: int = 5):
    """Prompt + ``steps`` decode steps on NUMPY and onnxruntime; returns the worst error of
    each output kind relative to its largest value, and whether the greedy tokens agreed."""
    layers, kv, head, context = genai_builder.cache_shapes(path)
    session = ort.InferenceSession(str(path / "model.onnx"), providers=["CPUExecutionProvider"])
    request = device_net.create_infer_request()
    rng = np.random.default_rng(len(batch_lengths))
    batch, prompt = len(batch_lengths), max(batch_lengths)
    ids = rng.integers(2, 300, (batch, prompt)).astype(np.int64)
    mask = (np.arange(prompt)[None] < np.array(batch_lengths)[:, None]).astype(np.int64)
    capacity = context if shared else 0
    cache = {
        f"past_key_values.{i}.{kind}": np.zeros((batch, kv, capacity, head), np.float32)
        for i in range(layers)
        for kind in ("key", "value")
    }
    worst: dict[str, float] = {}
    agreed = True
    for step in range(steps + 1):
        feeds = {"input_ids": ids, "attention_mask": mask, **cache}
        want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        got = request.infer(feeds)
        for name, expected in want.items():
            actual = got[name]
            assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
            if step == 0 and name == "logits":  # a padded prompt's padding rows are undefined
                keep = mask.astype(bool)[:, :, None]
                actual, expected = actual * keep, expected * keep
            if step == 0 and name.startswith("present"):
                keep = np.zeros(expected.shape, bool)
                for row, length in enumerate(batch_lengths):
                    keep[row, :, :length] = True
                actual, expected = actual * keep, expected * keep
            kind = name.split(".")[0]
            error = float(np.abs(actual - expected).max() / np.abs(expected).max())
            worst[kind] = max(worst.get(kind, 0.0), error)
        last = [
            (length - 1 if step == 0 else -1) for length in batch_lengths
        ]  # each row's last real token
        want_next = np.array([want["logits"][r, last[r]].argmax() for r in range(batch)])
        got_next = np.array([got["logits"][r, last[r]].argmax() for r in range(batch)])
        agreed &= bool((want_next == got_next).all())
        ids = want_next[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        cache = {n.replace("present", "past_key_values"): want[n] for n in want if "present" in n}
    return worst, agreed


@pytest.fixture(scope="module", params=list(FOLDERS))
def built(request, core):
    recipe, precision, options = FOLDERS[request.param]
    path = genai_builder.folder(recipe, precision, *options)
    return request.param, path, core.load_network(str(path / "model.onnx"), "NUMPY")


@pytest.mark.parametrize(
    ("lengths", "shared"),
    [([9], True), ([9], False), ([9, 5], True)],
    ids=["one-shared-buffer", "one-growing-cache", "batch-of-two-padded"],
)
def test_builder_decoder_generates_as_onnxruntime(built, lengths, shared):
    name, path, net = built
    worst, agreed = _generate(path, net, lengths, shared)
    limit = 3e-2 if name == "llama-int4-int8-activations" else 1e-4
    assert max(worst.values()) <= limit, worst
    assert agreed, "greedy tokens differ from onnxruntime's"


def test_builder_graph_uses_the_contrib_ops_under_test(core):
    """The folders hold what the kernels are for, so a builder that stopped writing an op
    would not pass unnoticed."""
    import onnx

    seen = set()
    for recipe, precision, options in FOLDERS.values():
        path = genai_builder.folder(recipe, precision, *options)
        model = onnx.load(str(path / "model.onnx"), load_external_data=False)
        seen |= {(n.domain or "ai.onnx", n.op_type) for n in model.graph.node}
    ms = {op for domain, op in seen if domain == "com.microsoft"}
    assert ms == {
        "GroupQueryAttention",
        "SkipSimplifiedLayerNormalization",
        "MatMulNBits",
        "GatherBlockQuantized",
    }, ms
    assert ("ai.onnx", "SimplifiedLayerNormalization") in seen
