"""A sequence that ends inside a character (server/apps/generate/text/detokenizer.py
``_flush``) gets the
text decoding the whole sequence gives (U+FFFD for the cut character), decoded from its last
tokens only, whatever the length of what came before."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from plugserve.server.apps.generate.text.tokenizer import Tokenizer
from plugserve.server.apps.generate.types import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from tiny_decoder import write

    # a byte-level BPE without merges: each byte of text is a token
    return Tokenizer.from_folder(write(tmp_path_factory.mktemp("tok") / "m", context=64))


@pytest.mark.parametrize("before", [0, 3, 5000])
@pytest.mark.parametrize("cut", [1, 2, 4, 5])
def test_a_character_cut_by_the_end_is_what_the_whole_decode_gives(tokenizer, before, cut):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    text = "ab " * before + "日本語"
    ids = tokenizer.encode(text, add_special_tokens=False)[: 3 * before + cut]
    detok = tokenizer.detokenizer(prompt, SamplingParams(stop=["never"]))
    pieces = []
    for token in ids:
        assert not detok.add(token)
        pieces.append(detok.take())
    pieces.append(detok.take(final=True))
    whole = tokenizer.decode([*prompt, *ids])[len(tokenizer.decode(prompt)) :]
    assert "".join(pieces) == whole
    assert whole.endswith("\ufffd") == (cut % 3 != 0)
