"""A long non-streamed OpenAI answer is made and written a bounded piece at a time
(``encode.json_pieces``, issue 52): the bytes are orjson's of the whole answer, no piece holds
more than a slice of logprob entries, and the GIL is given away between pieces. The server-level
check (health within 250 ms beside such answers) is
tests/server/test_attacks_generate.py::test_large_non_streamed_answers_are_written_in_pieces_and_stall_nobody.
"""

from __future__ import annotations

import functools
import time

import orjson

from plugserve.server.apps.generate.types import TokenLogprob
from plugserve.server.protocols.openai import encode


class _Names:
    """What ``encode.chat_logprobs`` asks of a tokenizer's names: a token's bytes and text."""

    def get(self, token_id: int) -> tuple[bytes, str]:
        text = f"t{token_id}"
        return text.encode(), text


def _answer(lazy: bool, choices: int = 16, tokens: int = 512, top: int = 20):
    names = _Names()
    entries = [
        [TokenLogprob(i % 97, -0.5, [(k, -0.1 * k) for k in range(top)]) for i in range(tokens)]
        for _ in range(choices)
    ]

    def choice(i: int) -> dict:
        mine = entries[i]
        content = (
            encode.Slices(len(mine), lambda a, b: encode.chat_logprobs(mine[a:b], names, top))
            if lazy
            else encode.chat_logprobs(mine, names, top)
        )
        return {"index": i, "message": {"role": "assistant", "content": "x" * tokens},
                "logprobs": {"content": content}, "finish_reason": "length"}  # fmt: skip

    made = [encode.Later(functools.partial(choice, i)) if lazy else choice(i) for i in range(16)]
    return {"id": "cmpl-1", "object": "chat.completion", "choices": made, "usage": {"n": 1}}


def test_the_pieces_are_the_whole_answers_bytes_each_bounded():
    pauses = []
    pieces = encode.json_pieces(_answer(lazy=True), pause=lambda: pauses.append(time.monotonic()))
    assert b"".join(pieces) == orjson.dumps(_answer(lazy=False))
    # a slice of 64 entries of 20 alternatives is ~100 KB; the whole answer ~7 MB
    entry = len(orjson.dumps(encode.chat_logprobs(
        [TokenLogprob(1, -0.5, [(k, -0.1 * k) for k in range(20)])], _Names(), 20)))  # fmt: skip
    assert max(map(len, pieces)) <= (encode.SLICE + 1) * entry
    assert sum(map(len, pieces)) > 40 * max(map(len, pieces))
    assert len(pauses) >= 16 * 512 // encode.SLICE


def test_short_lists_and_plain_values_are_written_as_orjson_writes_them():
    for value in (
        {"a": [1, 2, 3], "b": {"c": None, "d": [{"e": 1.5}]}, "f": 'é\n"', "g": []},
        {"choices": [{"index": 0, "text": "", "logprobs": None}], "n": list(range(300))},
        [{"x": i} for i in range(200)],
        {"empty": encode.Slices(0, lambda a, b: [])},
    ):
        expected = orjson.dumps(
            {"empty": []} if isinstance(value, dict) and "empty" in value else value
        )
        assert b"".join(encode.json_pieces(value)) == expected
