"""The most bytes of text one token stands for (server/apps/generate/text/tokenizer.py
``Tokenizer.max_token_bytes``), which times the context bounds a prompt's text before it is
tokenized (server/apps/generate/limits.py): for each kind of tokenizer, the text its longest token
stands for, counted as it decodes, encodes to that one token."""

from __future__ import annotations

import pytest

tokenizers = pytest.importorskip("tokenizers")

from tokenizers import decoders, models, pre_tokenizers  # noqa: E402

from plugserve.server.apps.generate.text.tokenizer import Tokenizer  # noqa: E402


def test_a_byte_level_bpe_counts_a_character_of_its_alphabet_as_one_byte(tmp_path):
    from tiny_decoder import write

    tokenizer = Tokenizer.from_folder(write(tmp_path / "m", context=64, long_token=40))
    assert tokenizer.max_token_bytes == 40  # its added token "<xxx...>"
    assert len(tokenizer.encode("<" + "x" * 38 + ">", add_special_tokens=False)) == 1


def test_sentencepiece_counts_its_word_boundary_as_one_space():
    vocab = {"<unk>": 0, "\u2581": 1, "h": 2, "e": 3, "l": 4, "o": 5, "\u2581hello": 6}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(backend, {})
    assert tokenizer.max_token_bytes == 6  # " hello": the text the token stands for
    assert tokenizer.encode("hello", add_special_tokens=False) == [6]


def test_wordpiece_counts_an_unknown_word_as_its_longest():
    vocab = {"[UNK]": 0, "a": 1, "##b": 2}
    backend = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = Tokenizer(backend, {})
    assert tokenizer.max_token_bytes == 400  # a word of up to 100 characters is one [UNK]
    assert tokenizer.encode("z" * 100, add_special_tokens=False) == [0]
