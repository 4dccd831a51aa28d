"""OPENVINO loading OpenVINO IR (an .xml and its .bin) and, with PAGED_ATTENTION=YES, an LLM's
IR in openvino's paged-attention form, run by hand through the plugin API: the block tables,
past lengths and the cache bound with infer_into (written in place by the op) give the logits
the stateful IR gives for the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
from models import mlp

ov = pytest.importorskip("openvino")

from plugserve.plugins.api import InvalidArgument, InvalidModel, Unsupported  # noqa: E402

DEVICE = "OPENVINO"
F32 = {"EXECUTION_MODE_HINT": "ACCURACY"}


@pytest.fixture
def ir_of_mlp(tmp_path):
    """A small MLP converted by openvino to IR (model.xml + model.bin), and its ONNX."""
    proto = mlp()
    onnx_path = tmp_path / "mlp.onnx"
    onnx_path.write_bytes(proto.SerializeToString())
    xml = tmp_path / "model.xml"
    ov.save_model(ov.convert_model(str(onnx_path)), str(xml), compress_to_fp16=False)
    return xml, proto


def test_an_ir_loads_and_computes_what_its_onnx_computes(core, ir_of_mlp):
    xml, proto = ir_of_mlp
    ir_net = core.load_network(str(xml), DEVICE, F32)
    onnx_net = core.load_network(proto, DEVICE, F32)
    assert [s.name for s in ir_net.inputs] == [s.name for s in onnx_net.inputs]
    assert ir_net.inputs[0].dtype == np.float32
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    name = ir_net.inputs[0].name
    ir_out = ir_net.infer({name: x})
    onnx_out = onnx_net.infer({name: x})
    assert ir_out.keys() == onnx_out.keys()
    for key in ir_out:
        np.testing.assert_allclose(ir_out[key], onnx_out[key], rtol=1e-5, atol=1e-6)


def test_an_ir_without_its_weights_is_refused_naming_the_file(core, ir_of_mlp):
    xml, _proto = ir_of_mlp
    xml.with_suffix(".bin").unlink()
    with pytest.raises(InvalidModel, match=r"model\.bin"):
        core.load_network(str(xml), DEVICE)


def test_a_broken_ir_is_refused(core, tmp_path):
    xml = tmp_path / "model.xml"
    xml.write_text("<net name='x'><layers><layer id='0' type='Nope'/></layers></net>")
    xml.with_suffix(".bin").write_bytes(b"")
    with pytest.raises(InvalidModel, match="not an OpenVINO IR openvino can read"):
        core.load_network(str(xml), DEVICE)


def test_paged_attention_needs_an_llm_ir(core, ir_of_mlp):
    xml, proto = ir_of_mlp
    with pytest.raises(InvalidModel, match="ScaledDotProductAttention"):
        core.load_network(str(xml), DEVICE, {"PAGED_ATTENTION": "YES"})
    with pytest.raises(InvalidArgument, match="applies to an OpenVINO IR"):
        core.load_network(proto, DEVICE, {"PAGED_ATTENTION": "YES"})


def test_an_ir_is_not_queried_for_hetero(core, ir_of_mlp):
    xml, _proto = ir_of_mlp
    with pytest.raises(Unsupported, match="loaded whole"):
        core.query_network(str(xml), DEVICE)


# --------------------------------------------------------------------------- the paged form


@pytest.fixture(scope="module")
def llm_ir():
    """tiny-llama's IR as optimum-intel exports it (tests/support/llm.py)."""
    llm = pytest.importorskip("llm", reason="tests/support/llm.py makes the generative models")
    try:
        return llm.export("tiny-llama", "openvino") / "openvino_model.xml"
    except llm.Unavailable as exc:
        pytest.skip(str(exc))


def stateful_logits(core, xml, ids: list[int]) -> np.ndarray:
    """The stateful IR's own logits for ``ids`` (a prompt, then one token a run)."""
    net = core.load_network(str(xml), DEVICE, F32)
    request = net.create_infer_request()
    rows = []
    prompt, rest = ids[:4], ids[4:]
    feeds = {
        "input_ids": np.array([prompt]),
        "attention_mask": np.ones((1, len(prompt)), np.int64),
        "position_ids": np.arange(len(prompt))[None],
        "beam_idx": np.zeros(1, np.int32),
    }
    rows.append(request.infer(feeds)["logits"][0, -1])
    for i, token in enumerate(rest, start=len(prompt)):
        feeds = {
            "input_ids": np.array([[token]]),
            "attention_mask": np.ones((1, i + 1), np.int64),
            "position_ids": np.array([[i]]),
            "beam_idx": np.zeros(1, np.int32),
        }
        rows.append(request.infer(feeds)["logits"][0, -1])
    net.close()
    return np.stack(rows)


def test_the_paged_form_batches_rows_of_different_lengths(core, llm_ir):
    net = core.load_network(str(llm_ir), DEVICE, {**F32, "PAGED_ATTENTION": "YES"})
    specs = {s.name: s for s in net.inputs}
    assert {"past_lens", "block_indices", "sampled_tokens_indices"} <= set(specs)
    block = specs["key_cache.0"].shape[2]
    caches = {
        name: np.zeros((8, *spec.shape[1:]), spec.dtype)
        for name, spec in specs.items()
        if name.startswith(("key_cache.", "value_cache."))
    }
    request = net.create_infer_request()

    def forward(sequences):
        """``(first block, past, tokens)`` each; the logits of each one's last token."""
        counts = [len(t) for _b, _p, t in sequences]
        begins = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        tables = [list(range(b, b + -(-(p + len(t)) // block))) for b, p, t in sequences]
        values = {
            "input_ids": np.concatenate([t for _b, _p, t in sequences]).astype(np.int64),
            "position_ids": np.concatenate([np.arange(p, p + len(t)) for _b, p, t in sequences]),
            "past_lens": np.array([p for _b, p, _t in sequences], np.int32),
            "subsequence_begins": begins,
            "block_indices": np.array([i for table in tables for i in table], np.int32),
            "block_indices_begins": np.concatenate(
                [[0], np.cumsum([len(t) for t in tables])]
            ).astype(np.int32),
            "max_context_len": np.array(max(p + len(t) for _b, p, t in sequences), np.int32),
            "sampled_tokens_indices": (begins[1:] - 1).astype(np.int64),
            **caches,
        }
        out = request.infer_into([values[s.name] for s in net.inputs], {})
        return out["logits"][:, 0]

    long = list(np.random.default_rng(1).integers(3, 2000, 40))  # two blocks
    short = [5, 6, 7, 8, 9, 10]
    # both prompts' first 4 tokens in one forward (blocks 0.. and 4..), then the rest of the
    # long one beside the short one's tokens one at a time
    rows = forward([(0, 0, long[:4]), (4, 0, short[:4])])
    long_rows, short_rows = [rows[0]], [rows[1]]
    rows = forward([(0, 4, long[4:]), (4, 4, short[4:5])])
    long_rows.append(rows[0])
    short_rows.append(rows[1])
    rows = forward([(4, 5, short[5:6])])
    short_rows.append(rows[0])
    assert np.abs(caches["key_cache.0"][4]).sum() > 0  # written in place, through the binding
    assert not caches["key_cache.0"][2:4].any()  # the blocks nobody was given stay untouched
    np.testing.assert_allclose(
        np.stack(short_rows), stateful_logits(core, llm_ir, short), rtol=1e-4, atol=1e-4
    )
    expected_long = stateful_logits(core, llm_ir, long)
    np.testing.assert_allclose(long_rows[0], expected_long[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(long_rows[1], expected_long[-1], rtol=1e-4, atol=1e-4)
    net.close()


def test_a_cached_ir_is_compiled_again_when_its_weights_change(core, ir_of_mlp, tmp_path):
    """CACHE_DIR's key covers the IR's .bin beside its .xml: new weights are never served
    from an entry compiled with the old ones."""
    xml, _proto = ir_of_mlp
    config = {**F32, "CACHE_DIR": str(tmp_path / "cache")}
    core.load_network(str(xml), DEVICE, config).close()
    again = core.load_network(str(xml), DEVICE, config)
    assert again.loaded_from_cache
    again.close()
    weights = xml.with_suffix(".bin")
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(4)  # one weight of the last layer changed, the size kept
    weights.write_bytes(bytes(data))
    changed = core.load_network(str(xml), DEVICE, config)
    assert not changed.loaded_from_cache
    changed.close()


def test_a_paged_network_is_compiled_each_time_rather_than_cached(core, llm_ir, tmp_path):
    """openvino 2026.4 cannot import a compiled paged-attention model it exported: nothing is
    written to CACHE_DIR for one (it was a useless blob of the model's size), and loads
    compile it."""
    cache = tmp_path / "cache"
    config = {**F32, "PAGED_ATTENTION": "YES", "CACHE_DIR": str(cache)}
    for _ in range(2):
        net = core.load_network(str(llm_ir), DEVICE, config)
        assert not net.loaded_from_cache
        net.close()
    assert not list(cache.glob("*.blob"))
