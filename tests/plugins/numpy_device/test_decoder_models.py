"""onnxruntime-genai's model-builder folders of the generative test models (tests/support/llm.py:
a Llama-style and a Qwen2-style decoder, seeded weights) on NUMPY, through plugserve's Core,
against onnxruntime running the same graph: a prompt, then decode steps that feed back the
greedy token and the present key/value cache, as an engine drives them. fp32 and int4
(MatMulNBits with and without zero points, an int8 head, GatherBlockQuantized embeddings
untied and tied to the head), the cache as the builder's shared max-length buffer and as a
growing one, one sequence and a batch of two prompts of different lengths. The kernels one at
a time are test_decoder_kernels.py's; optimum's exports of the same models are
test_decoder_exports.py's.

Measured here (2026-11-25), the worst error relative to the output's largest value: fp32 and
int4 with ``accuracy_level=1`` 0.7-2.5e-6 of onnxruntime; int4 with the builder's default
``accuracy_level=4`` 2.0 % (Llama) and 4.2 % (Qwen2, whose residual stream is large):
onnxruntime rounds the activations to int8 there, NUMPY computes the op's exact product.
Greedy tokens are equal in every case.
"""

from __future__ import annotations

import json

import llm
import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")

#: (model, export): fp32; int4 computed by onnxruntime in float32 (``-exact``) and with its
#: CPU default of int8 activations; for the untied model also zero points, the embedding table
#: quantized (GatherBlockQuantized of uint4) and an int8 head (``-asym``). tiny-qwen2 ties its
#: head: its int4 table is the head's MatMulNBits weight, read by GatherBlockQuantized.
FOLDERS = [
    (model, kind)
    for model in ("tiny-llama", "tiny-qwen2")
    for kind in ("genai-fp32", "genai-int4-exact", "genai-int4-asym", "genai-int4")
    if not llm.EXPORTS[kind].only or model in llm.EXPORTS[kind].only
]


def cache_shapes(path):
    """(layers, kv heads, head size, context length) from the folder's genai_config.json."""
    model = json.loads((path / "genai_config.json").read_text())["model"]
    decoder = model["decoder"]
    return (
        decoder["num_hidden_layers"],
        decoder["num_key_value_heads"],
        decoder["head_size"],
        model["context_length"],
    )


def _generate(path, device_net, batch_lengths, shared: bool, steps: int = 5):
    """Prompt + ``steps`` decode steps on NUMPY and onnxruntime; returns the worst error of
    each output kind relative to its largest value, and whether the greedy tokens agreed."""
    layers, kv, head, context = cache_shapes(path)
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


def _folder(model: str, kind: str):
    try:
        return llm.export(model, kind)
    except llm.Unavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module", params=FOLDERS, ids=["-".join(f) for f in FOLDERS])
def built(request, core):
    model, kind = request.param
    path = _folder(model, kind)
    return kind, path, core.load_network(str(path / "model.onnx"), "NUMPY")


@pytest.mark.parametrize(
    ("lengths", "shared"),
    [([9], True), ([9], False), ([9, 5], True)],
    ids=["one-shared-buffer", "one-growing-cache", "batch-of-two-padded"],
)
def test_builder_decoder_generates_as_onnxruntime(built, lengths, shared):
    name, path, net = built
    worst, agreed = _generate(path, net, lengths, shared)
    limit = 1e-1 if name == "genai-int4" else 1e-4  # int8 activations in onnxruntime
    assert max(worst.values()) <= limit, worst
    assert agreed, "greedy tokens differ from onnxruntime's"


def test_builder_graph_uses_the_contrib_ops_under_test(core):
    """The folders hold what the kernels are for, so a builder that stopped writing an op
    would not pass unnoticed."""
    import onnx

    seen = set()
    for name, kind in FOLDERS:
        graph = onnx.load(str(_folder(name, kind) / "model.onnx"), load_external_data=False).graph
        seen |= {(n.domain or "ai.onnx", n.op_type) for n in graph.node}
    ms = {op for domain, op in seen if domain == "com.microsoft"}
    assert ms == {
        "GroupQueryAttention",
        "SkipSimplifiedLayerNormalization",
        "MatMulNBits",
        "GatherBlockQuantized",
    }, ms
    assert ("ai.onnx", "SimplifiedLayerNormalization") in seen
