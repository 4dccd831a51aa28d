"""Text as tokens arrive (server/apps/generate/detokenizer.py), with a tokenizer trained here by the
``tokenizers`` library: the pieces add up to the whole, multi-byte characters are never split,
and stop strings end the text without a character of them ever being sent."""

from __future__ import annotations

import pytest

tokenizers = pytest.importorskip("tokenizers")

from plugserve.server.apps.generate.tokenizer import Tokenizer  # noqa: E402
from plugserve.server.apps.generate.types import SamplingParams  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. Ünïcödé 日本語のテキスト and emoji 🙂🚀 "
    "mixed with code: def f(x): return x ** 2 # done. Hello there, hello world!"
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator([TEXT] * 20, trainer)
    return Tokenizer(backend, {"eos_token": "<|end|>"})


def stream(tokenizer, prompt, ids, **params):
    detok = tokenizer.detokenizer(prompt, SamplingParams(**params))
    pieces, stopped = [], False
    for token in ids:
        stopped = detok.add(token)
        pieces.append(detok.take(final=stopped))
        if stopped:
            break
    if not stopped:
        pieces.append(detok.take(final=True))
    return pieces, detok


def test_pieces_add_up_to_the_continuation_of_the_prompt(tokenizer):
    ids = tokenizer.encode(TEXT)
    for cut in (1, 7, 20):
        prompt, generated = ids[:cut], ids[cut:]
        pieces, _ = stream(tokenizer, prompt, generated)
        whole = tokenizer.decode(ids)
        assert "".join(pieces) == whole[len(tokenizer.decode(prompt)) :]
        assert all("\ufffd" not in p for p in pieces)  # no character sent in halves


def test_a_stop_string_ends_the_text_and_no_part_of_it_is_sent(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces, detok = stream(tokenizer, ids[:3], ids[3:], stop=["lazy dog", "never"])
    text = "".join(pieces)
    whole = tokenizer.decode(ids)[len(tokenizer.decode(ids[:3])) :]
    assert text == whole[: whole.index("lazy dog")]
    assert detok.stop_reason == "lazy dog"
    # a piece is never a beginning of the stop string that a later piece completes
    sent = ""
    for piece in pieces:
        sent += piece
        assert not sent.endswith("lazy")


def test_include_stop_str_in_output_keeps_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces, _ = stream(tokenizer, ids[:3], ids[3:], stop=["brown"], include_stop_str_in_output=True)
    assert "".join(pieces).endswith("brown")


def test_held_back_text_is_released_when_it_is_not_a_stop_string(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces, detok = stream(tokenizer, ids[:1], ids[1:], stop=["Hello there!"])
    assert detok.stop_reason is None
    assert "".join(pieces).endswith("hello world!")
