"""Text as tokens arrive (server/apps/generate/text/detokenizer.py), with a tokenizer trained
here by the
``tokenizers`` library: the pieces add up to the whole, multi-byte characters are never split,
and stop strings end the text without a character of them ever being sent."""

from __future__ import annotations

import pytest

tokenizers = pytest.importorskip("tokenizers")

from plugserve.server.apps.generate.text.tokenizer import Tokenizer  # noqa: E402
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


def _naive(text: str, stops: list[str], fed: int) -> tuple[tuple[int, str] | None, int]:
    """What the scan must find after ``text``'s last piece (which began at ``fed``): the stop
    string that begins first among those completed in that piece, and the longest end of the
    text that is a proper beginning of a stop string."""
    found = None
    for stop in stops:
        at = text.find(stop, max(0, fed - len(stop) + 1))
        if at >= 0 and at + len(stop) > fed and (found is None or at < found[0]):
            found = (at, stop)
    held = max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )
    return found, held


hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis (the test extra)")
strategies = hypothesis.strategies


@hypothesis.given(
    pieces=strategies.lists(strategies.text(alphabet="abc", max_size=5), max_size=40),
    stops=strategies.lists(
        strategies.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4
    ),
)
@hypothesis.settings(max_examples=300, deadline=None)
def test_the_stop_scan_finds_what_searching_the_whole_text_finds(pieces, stops):
    """The KMP scan (one automaton a stop string, fed each piece once) against searching the
    whole text again after every piece: the same first stop string and the same held end."""
    from plugserve.server.apps.generate.text.detokenizer import StopScan

    scan = StopScan(stops)
    text = ""
    for piece in pieces:
        fed = len(text)
        text += piece
        found = scan.feed(piece, fed)
        expected, held = _naive(text, stops, fed)
        assert found == expected, (text, stops)
        if found is not None:
            break
        assert scan.held() == held, (text, stops)
