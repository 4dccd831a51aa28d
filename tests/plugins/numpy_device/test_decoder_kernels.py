"""The contrib ops of onnxruntime-genai's decoder graphs on NUMPY (kernels/decoder.py), each
against onnxruntime running the same one-node graph: GroupQueryAttention in the forms the
builder and an engine feed it (a prompt of many tokens, one-token decode steps over a past,
rows of one batch with different pasts, a chunked prompt after a past, the shared max-length
buffer and a growing one), RotaryEmbedding, GatherBlockQuantized and MatMulNBits. Whole
builder graphs are test_decoder_models.py's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ort = pytest.importorskip("onnxruntime", reason="pip install onnxruntime")

F, I64, I32, U8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.UINT8
MS = "com.microsoft"


def _model(node, inputs, outputs, initializers=()):
    graph = helper.make_graph([node], "decoder", inputs, outputs, list(initializers))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 10
    return model


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _out(name, dtype, rank):
    return helper.make_tensor_value_info(name, dtype, [f"{name}{i}" for i in range(rank)])


def _const(name, array):
    return onnx.numpy_helper.from_array(np.asarray(array), name)


def _compare(core, model, feeds, rtol=1e-4, atol=1e-5, rows=None):
    """NUMPY's outputs against onnxruntime's; ``rows`` (a [B, S] bool mask) limits the
    attention output to the rows that are not padding (onnxruntime leaves those undefined).
    Returns the largest error relative to each output's largest value."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = core.load_network(model, "NUMPY").infer(feeds)
    worst = 0.0
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype, name
        assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
        if rows is not None and name == "output":
            actual, expected = actual[rows], expected[rows]
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=name)
        scale = max(float(np.abs(expected).max()), 1e-6) if expected.size else 1.0
        worst = max(worst, float(np.abs(actual - expected).max()) / scale if actual.size else 0)
    return worst


def _rotary_caches(positions: int, half: int, base: float = 10000.0):
    inv = 1.0 / base ** (np.arange(half, dtype=np.float64) / half)
    angles = np.arange(positions)[:, None] * inv[None]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


HEADS, KV_HEADS, HEAD = 4, 2, 16


def _gqa(batch, seq, capacity, *, packed=True, rotary=True, interleaved=False, attrs=None,
         bias=False, sink=False, head=HEAD):  # fmt: skip
    """A GroupQueryAttention node model: query (packed or with key and value), past of
    ``capacity`` positions, the builder's length inputs, constant cos/sin caches."""
    attrs = dict(attrs or {})
    names = ["query", "" if packed else "key", "" if packed else "value", "past_key",
             "past_value", "seqlens_k", "total_sequence_length", "", "", "", "", ""]  # fmt: skip
    width = (HEADS + 2 * KV_HEADS) * head if packed else HEADS * head
    inputs = [_vi("query", F, [batch, seq, width])]
    if not packed:
        inputs += [_vi(n, F, [batch, seq, KV_HEADS * head]) for n in ("key", "value")]
    inputs += [
        _vi("past_key", F, [batch, KV_HEADS, capacity, head]),
        _vi("past_value", F, [batch, KV_HEADS, capacity, head]),
        _vi("seqlens_k", I32, [batch]),
        _vi("total_sequence_length", I32, []),
    ]
    consts = []
    if rotary:
        cos, sin = _rotary_caches(64, head // 2)
        names[7:9] = ["cos_cache", "sin_cache"]
        consts += [_const("cos_cache", cos), _const("sin_cache", sin)]
    if bias:
        names[10] = "attention_bias"
        inputs.append(_vi("attention_bias", F, [batch, HEADS, seq, "total"]))
    if sink:
        names[11] = "head_sink"
        consts.append(_const("head_sink", RNG.normal(size=HEADS).astype(np.float32)))
    while names[-1] == "":
        names.pop()
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["output", "present_key", "present_value"],
        domain=MS,
        num_heads=HEADS,
        kv_num_heads=KV_HEADS,
        do_rotary=int(rotary),
        rotary_interleaved=int(interleaved),
        **attrs,
    )
    outputs = [_out("output", F, 3), _out("present_key", F, 4), _out("present_value", F, 4)]
    return _model(node, inputs, outputs, consts)


RNG = np.random.default_rng(0)


def _feeds(batch, seq, capacity, past_lens, total, *, packed=True, head=HEAD):
    """Random queries and a past whose rows hold ``past_lens[b]`` tokens (garbage after them,
    as a reused buffer has); seqlens_k = past + new - 1 per row."""
    width = (HEADS + 2 * KV_HEADS) * head if packed else HEADS * head
    feeds = {"query": RNG.normal(size=(batch, seq, width)).astype(np.float32)}
    if not packed:
        for name in ("key", "value"):
            feeds[name] = RNG.normal(size=(batch, seq, KV_HEADS * head)).astype(np.float32)
    for name in ("past_key", "past_value"):
        feeds[name] = RNG.normal(size=(batch, KV_HEADS, capacity, head)).astype(np.float32)
    feeds["seqlens_k"] = (np.asarray(past_lens) + seq - 1).astype(np.int32)
    feeds["total_sequence_length"] = np.array(total, np.int32)
    return feeds


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gqa_prompt_into_shared_buffer(core, packed, interleaved):
    """The builder's first step: a prompt of 12 tokens, past and present of the cache's full
    length (32), nothing in the past yet."""
    model = _gqa(2, 12, 32, packed=packed, interleaved=interleaved)
    feeds = _feeds(2, 12, 32, [0, 0], 12, packed=packed)
    _compare(core, model, feeds)


def test_gqa_prompt_with_growing_cache(core):
    """No buffer: an empty past, the present as long as the prompt."""
    _compare(core, _gqa(1, 9, 0), _feeds(1, 9, 0, [0], 9))


def test_gqa_decode_one_token_after_past(core):
    _compare(core, _gqa(1, 1, 32), _feeds(1, 1, 32, [7], 8))
    _compare(core, _gqa(1, 1, 7), _feeds(1, 1, 7, [7], 8))  # growing: present 8 long


def test_gqa_batch_rows_with_different_pasts(core):
    """One decode step for three sequences of 3, 9 and 5 past tokens in one shared buffer:
    each row's new key lands at its own position, its attention sees only its own tokens."""
    model = _gqa(3, 1, 16)
    _compare(core, model, _feeds(3, 1, 16, [3, 9, 5], 10))
    model = _gqa(3, 1, 16, packed=False, interleaved=True)
    _compare(core, model, _feeds(3, 1, 16, [3, 9, 5], 10, packed=False))


def test_gqa_padded_prompt(core):
    """A batch's prompts of 5 and 3 tokens, right-padded to 5: the padding rows' outputs are
    left out (onnxruntime leaves them undefined), their cached keys are compared too."""
    feeds = _feeds(2, 5, 16, [0, 0], 5)
    feeds["seqlens_k"] = np.array([4, 2], np.int32)
    rows = np.array([[True] * 5, [True] * 3 + [False] * 2])
    _compare(core, _gqa(2, 5, 16), feeds, rows=rows)


def test_gqa_prompt_chunk_after_past(core):
    """A long prompt's second chunk: 4 tokens after 6 already cached."""
    _compare(core, _gqa(1, 4, 16), _feeds(1, 4, 16, [6], 10))


@pytest.mark.parametrize(
    "attrs",
    [
        {"local_window_size": 3},
        {"softcap": 2.0},
        {"scale": 0.5},
        {"smooth_softmax": 1},
    ],
)
def test_gqa_attention_options(core, attrs):
    for seq, past in ((6, 0), (1, 9)):
        total = past + seq
        model = _gqa(2, seq, 16, attrs=attrs)
        _compare(core, model, _feeds(2, seq, 16, [past, past], total))


def test_gqa_without_rotary(core):
    _compare(core, _gqa(2, 3, 8, rotary=False), _feeds(2, 3, 8, [0, 0], 3))
    _compare(core, _gqa(2, 1, 8, rotary=False), _feeds(2, 1, 8, [2, 4], 5))


def test_gqa_head_sink(core):
    model = _gqa(1, 5, 8, sink=True)
    _compare(core, model, _feeds(1, 5, 8, [0], 5))


def test_gqa_attention_bias(core):
    feeds = _feeds(2, 4, 8, [0, 0], 4)
    feeds["attention_bias"] = RNG.normal(size=(2, HEADS, 4, 4)).astype(np.float32)
    _compare(core, _gqa(2, 4, 8, bias=True), feeds)
    feeds = _feeds(1, 3, 8, [2], 5)  # a chunk after a past: one row (onnxruntime's limit)
    feeds["attention_bias"] = RNG.normal(size=(1, HEADS, 3, 5)).astype(np.float32)
    _compare(core, _gqa(1, 3, 8, bias=True), feeds)


def test_gqa_long_prompt_in_score_blocks(core, monkeypatch):
    """A prompt whose scores exceed the block bound runs in blocks of query rows, with the
    same result."""
    from plugserve.plugins.numpy.kernels import decoder

    monkeypatch.setattr(decoder, "SCORE_BYTES", 4 * 20 * HEADS * 2 * 7)  # 7 rows a block
    _compare(core, _gqa(2, 20, 24), _feeds(2, 20, 24, [0, 0], 20))


def test_gqa_presents_as_fresh_mappings(core, monkeypatch):
    """A large present is an anonymous mapping (zero pages where no token was written): the
    same values as onnxruntime's, and a writable array of its own."""
    from plugserve.plugins.numpy.kernels import decoder

    monkeypatch.setattr(decoder, "LAZY_ZEROS_BYTES", 0)
    _compare(core, _gqa(3, 1, 16), _feeds(3, 1, 16, [3, 9, 5], 10))
    _compare(core, _gqa(1, 6, 16), _feeds(1, 6, 16, [0], 6))
    out = core.load_network(_gqa(1, 1, 16), "NUMPY").infer(_feeds(1, 1, 16, [4], 5))
    assert out["present_key"].flags.writeable and not out["present_key"][:, :, 5:].any()


def test_gqa_refuses_lengths_beyond_its_buffers(core):
    """A total length no buffer holds is refused before anything is allocated for it."""
    from plugserve.plugins.api import InferenceError

    net = core.load_network(_gqa(1, 1, 8), "NUMPY")
    feeds = _feeds(1, 1, 8, [3], 4)
    feeds["total_sequence_length"] = np.array(2_000_000_000, np.int32)
    with pytest.raises(InferenceError, match="total_sequence_length 2000000000"):
        net.infer(feeds)
    feeds = _feeds(1, 1, 8, [3], 4)
    feeds["seqlens_k"] = np.array([20], np.int32)
    with pytest.raises(InferenceError, match="seqlens_k"):
        net.infer(feeds)


def test_gqa_refuses_what_it_does_not_compute(core):
    from plugserve.plugins.api import Unsupported

    for attrs in ({"k_quant_type": "PER_TENSOR"}, {"qk_output": 1}):
        with pytest.raises(Unsupported, match=next(iter(attrs))):
            core.load_network(_gqa(1, 2, 4, attrs=attrs), "NUMPY")


# ------------------------------------------------------------------ RotaryEmbedding


def _rotary_model(shape, ids_shape, attrs, half):
    cos, sin = _rotary_caches(64, half)
    node = helper.make_node(
        "RotaryEmbedding", ["x", "ids", "cos", "sin"], ["y"], domain=MS, **attrs
    )
    inputs = [_vi("x", F, list(shape)), _vi("ids", I64, list(ids_shape))]
    return _model(
        node, inputs, [_out("y", F, len(shape))], [_const("cos", cos), _const("sin", sin)]
    )


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(
    ("shape", "ids", "attrs", "half"),
    [
        ((2, 5, 4 * 16), "rows", {}, 8),  # [B, S, hidden], head from the caches
        ((2, 4, 5, 16), "rows", {}, 8),  # [B, N, S, head]
        ((2, 5, 4 * 16), "offset", {}, 8),  # one start position
        ((2, 5, 4 * 16), "rows", {"num_heads": 4, "rotary_embedding_dim": 8}, 4),  # partial
    ],
)
def test_rotary_embedding(core, interleaved, shape, ids, attrs, half):
    b, s = shape[0], shape[-2] if len(shape) == 4 else shape[1]
    feeds = {"x": RNG.normal(size=shape).astype(np.float32)}
    if ids == "rows":
        feeds["ids"] = RNG.integers(0, 60, (b, s)).astype(np.int64)
    else:
        feeds["ids"] = np.array([7], np.int64)
    model = _rotary_model(shape, feeds["ids"].shape, {"interleaved": interleaved, **attrs}, half)
    _compare(core, model, feeds, atol=1e-5)


# ------------------------------------------------------------------ GatherBlockQuantized


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-bit values along the last axis, 8 / bits a byte, low bits first."""
    per = 8 // bits
    v = values.reshape(*values.shape[:-1], -1, per).astype(np.uint8)
    out = np.zeros(v.shape[:-1], np.uint8)
    for i in range(per):
        out |= v[..., i] << np.uint8(i * bits)
    return out


@pytest.mark.parametrize(
    ("form", "zero_points"),
    [("uint8", False), ("uint8", True), ("uint4", True), ("uint4", False), ("int4", False)],
)
def test_gather_block_quantized(core, form, zero_points):
    """A [vocab, hidden] table of 4-bit blocks of 32 along the hidden axis: packed in bytes
    (the builder's tied form), or as ONNX int4/uint4 tensors (its untied form)."""
    import ml_dtypes

    vocab, hidden, block = 20, 64, 32
    blocks = hidden // block
    scales = RNG.uniform(0.01, 0.1, (vocab, blocks)).astype(np.float32)
    attrs = {"gather_axis": 0, "quantize_axis": 1, "block_size": block}
    if form == "uint8":
        raw = RNG.integers(0, 16, (vocab, hidden))
        data = _pack(raw, 4)
        attrs["bits"] = 4
        zps = _pack(RNG.integers(0, 16, (vocab, blocks)), 4) if zero_points else None
    else:
        low, high = (0, 16) if form == "uint4" else (-8, 8)
        dtype = ml_dtypes.uint4 if form == "uint4" else ml_dtypes.int4
        data = RNG.integers(low, high, (vocab, hidden)).astype(dtype)
        zps = RNG.integers(low, high, (vocab, blocks)).astype(dtype) if zero_points else None
    consts = [_const("data", data), _const("scales", scales)]
    names = ["data", "ids", "scales"]
    if zps is not None:
        consts.append(_const("zps", zps))
        names.append("zps")
    node = helper.make_node("GatherBlockQuantized", names, ["y"], domain=MS, **attrs)
    model = _model(node, [_vi("ids", I64, [2, 3])], [_out("y", F, 3)], consts)
    ids = RNG.integers(-vocab, vocab, (2, 3)).astype(np.int64)
    _compare(core, model, {"ids": ids}, atol=1e-6)


# ------------------------------------------------------------------ MatMulNBits


@pytest.mark.parametrize(
    ("bits", "zero_points", "g_idx", "bias", "k"),
    [
        (4, None, False, False, 64),
        (4, "packed", False, True, 64),
        (4, "float", False, False, 64),
        (4, None, True, False, 64),  # g_idx: act-order blocks
        (4, "float", True, True, 64),
        (8, "packed", False, False, 64),
        (4, None, False, False, 80),  # K not a whole number of blocks
    ],
)
def test_matmul_nbits(core, bits, zero_points, g_idx, bias, k):
    """B's blocks made here byte by byte, in every form onnxruntime's MatMulNBits takes, with
    accuracy_level 1 (onnxruntime computes in float32 as NUMPY does)."""
    n, block = 24, 32
    blocks = -(-k // block)
    q = RNG.integers(0, 1 << bits, (n, blocks * block))
    b = _pack(q, bits).reshape(n, blocks, block * bits // 8)
    scales = RNG.uniform(0.01, 0.1, (n * blocks,)).astype(np.float32)
    names, consts = ["a", "b", "scales"], [_const("b", b), _const("scales", scales)]
    if zero_points == "packed":
        zp = RNG.integers(0, 1 << bits, (n, blocks))
        per = 8 // bits
        padded = np.zeros((n, -(-blocks // per) * per), np.int64)
        padded[:, :blocks] = zp
        consts.append(_const("zp", _pack(padded, bits)))
        names.append("zp")
    elif zero_points == "float":
        consts.append(_const("zp", RNG.uniform(5, 10, (n * blocks,)).astype(np.float32)))
        names.append("zp")
    if g_idx:
        while len(names) < 4:
            names.append("")
        consts.append(_const("g_idx", RNG.integers(0, blocks, k).astype(np.int32)))
        names.append("g_idx")
    if bias:
        while len(names) < 5:
            names.append("")
        consts.append(_const("bias", RNG.normal(size=n).astype(np.float32)))
        names.append("bias")
    node = helper.make_node(
        "MatMulNBits", names, ["y"], domain=MS, K=k, N=n, bits=bits, block_size=block,
        accuracy_level=1,
    )  # fmt: skip
    model = _model(node, [_vi("a", F, [2, 3, k])], [_out("y", F, 3)], consts)
    _compare(core, model, {"a": RNG.normal(size=(2, 3, k)).astype(np.float32)}, atol=1e-4)


def test_matmul_nbits_refuses_packed_zero_points_with_g_idx(core):
    """onnxruntime ignores packed zero points when g_idx is given (it takes 8): the model's
    numbers are undefined, so NUMPY refuses it at load, saying what to change."""
    from plugserve.plugins.api import Unsupported

    k, n = 64, 8
    consts = [
        _const("b", RNG.integers(0, 255, (n, 2, 16)).astype(np.uint8)),
        _const("scales", np.ones(n * 2, np.float32)),
        _const("zp", np.full((n, 1), 0x88, np.uint8)),
        _const("g_idx", (np.arange(k) // 32).astype(np.int32)),
    ]
    node = helper.make_node(
        "MatMulNBits", ["a", "b", "scales", "zp", "g_idx"], ["y"], domain=MS, K=k, N=n, bits=4,
        block_size=32,
    )  # fmt: skip
    model = _model(node, [_vi("a", F, [1, k])], [_out("y", F, 2)], consts)
    with pytest.raises(Unsupported, match="store them as floats"):
        core.load_network(model, "NUMPY")


def test_matmul_nbits_blocked_when_memory_is_short(core, monkeypatch):
    """Without the memory to dequantize at load, each run dequantizes slabs of columns: the
    same numbers (slabs of 16 columns here, so several)."""
    from plugserve.plugins.numpy.kernels import decoder

    monkeypatch.setattr(decoder, "_free_memory", lambda: 0)
    monkeypatch.setattr(decoder, "BLOCKED_SLAB_BYTES", 16 * 4 * 64)
    test_matmul_nbits(core, 4, "packed", False, True, 64)
    test_matmul_nbits(core, 4, "float", True, False, 64)
    test_matmul_nbits(core, 8, None, False, False, 80)
