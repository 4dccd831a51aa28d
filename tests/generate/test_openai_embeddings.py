"""``/v1/embeddings`` against a real server: sentence-transformers folders (optimum's ONNX export
under ``onnx/``, mean pooling with Normalize and CLS pooling without) served on NUMPY and ORT
give sentence-transformers' own embeddings within 1e-4 (cosine), as floats or base64, from text
or token ids; ``dimensions`` shortens; an input over the model's length is refused naming it."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from attack import cpu_seconds

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402

ENTRIES = [
    ("mean-numpy", "tiny-bert-mean", "NUMPY"),
    ("mean-ort", "tiny-bert-mean", "ORT"),
    ("cls-numpy", "tiny-bert-cls", "NUMPY"),
    ("cls-ort", "tiny-bert-cls", "ORT"),
]


@pytest.fixture(scope="module")
def server(encoder_folder):
    entries = {name: (encoder_folder(recipe), device) for name, recipe, device in ENTRIES}
    with serving(entries) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return client(server)


def _cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize(("model", "recipe"), [(e[0], e[1]) for e in ENTRIES])
def test_embeddings_are_sentence_transformers(api, encoder_embeddings, model, recipe):
    reference = encoder_embeddings(recipe)
    answer = api.embeddings.create(model=model, input=reference["sentences"])
    assert [d.index for d in answer.data] == list(range(len(reference["sentences"])))
    for got, want in zip(answer.data, reference["embeddings"]):
        assert len(got.embedding) == len(want)
        assert _cosine(got.embedding, want) >= 1 - 1e-4
        if reference["normalize"]:
            assert np.linalg.norm(got.embedding) == pytest.approx(1.0, abs=1e-5)
        else:
            np.testing.assert_allclose(got.embedding, want, rtol=1e-3, atol=1e-4)
    tokens = sum(len(ids) for ids in reference["input_ids"])
    assert answer.usage.prompt_tokens == tokens == answer.usage.total_tokens
    # token ids in, the same vectors out
    by_ids = api.embeddings.create(model=model, input=reference["input_ids"])
    for a, b in zip(answer.data, by_ids.data):
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-5, atol=1e-6)


def test_base64_and_dimensions(api, encoder_embeddings):
    reference = encoder_embeddings("tiny-bert-mean")
    sentence = reference["sentences"][1]
    floats = api.embeddings.create(model="mean-numpy", input=sentence).data[0].embedding
    raw = api.embeddings.with_raw_response.create(
        model="mean-numpy", input=sentence, encoding_format="base64"
    )
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats, dtype=np.float32))
    short = api.embeddings.create(model="mean-numpy", input=sentence, dimensions=8)
    vector = np.asarray(short.data[0].embedding)
    assert vector.shape == (8,)
    first = np.asarray(floats[:8])
    np.testing.assert_allclose(vector, first / np.linalg.norm(first), rtol=1e-5, atol=1e-6)


def test_refusals_name_the_field(api, server):
    with pytest.raises(openai.BadRequestError) as caught:
        api.embeddings.create(model="mean-numpy", input="apples " * 5000)
    assert caught.value.body["param"] == "input"
    assert "at most" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        api.embeddings.create(model="mean-numpy", input="hi", dimensions=100_000)
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as caught:
        api.embeddings.create(model="mean-numpy", input=[])
    assert caught.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(model="no-such-encoder", input="hi")
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="mean-numpy", prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model"
    ids = sorted(m.id for m in api.models.list().data)
    assert ids == sorted(e[0] for e in ENTRIES)


def test_inputs_over_the_length_are_refused_before_the_rest_is_tokenized(api, server):
    """A red team's request: 2,048 inputs of 10 KB, each far over the model's 128 tokens but
    under its text bound (a WordPiece token may stand for 400 bytes), were all tokenized
    before the first was refused: 8-56 s of CPU on every core. Now the texts are tokenized a
    slice at a time and the first over-long one ends the work (0.3 s of CPU here)."""
    inputs = ["word " * 2000] * 2048
    before = cpu_seconds(server.process.pid)
    with pytest.raises(openai.BadRequestError) as caught:
        api.embeddings.create(model="mean-numpy", input=inputs)
    used = cpu_seconds(server.process.pid) - before
    print(f"{used:.2f} s CPU")
    assert caught.value.body["param"] == "input"
    assert "'input[0]' is" in caught.value.body["message"]
    assert used < 2.5, f"{used:.1f} s of CPU to refuse it"  # all of them: 8-56 s
