"""OpenAI's response bodies and stream chunks, from the engine's events.

Formats, as OpenAI's API and vLLM write them:

* chat logprobs: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}``, ``top_logprobs`` the request's count of alternatives;
* completions logprobs: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``, each dict the ``logprobs`` most likely tokens and the chosen one (so up to
  ``logprobs + 1`` entries, as OpenAI documents); with ``echo`` the prompt's tokens come first,
  the first of them without a logprob (``null``: nothing precedes it);
* ``usage``: ``prompt_tokens`` once per prompt (not per choice), ``completion_tokens`` summed
  over the choices, ``prompt_tokens_details.cached_tokens`` the prompt tokens whose cache was
  reused;
* a logprob of ``-inf`` (a token the constraint or ``logit_bias`` ruled out) is written as
  -9999.0, as OpenAI and vLLM do: JSON has no infinity.

A token's text is its bytes decoded as UTF-8 with replacement (a byte-level token may hold part
of a character; its ``bytes`` are exact): byte-level BPE tokens through the GPT-2 byte table,
SentencePiece ones with ``▁`` as a space and ``<0xNN>`` byte tokens as that byte.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orjson

from plugserve.server.apps.generate.types import TokenLogprob

__all__ = [
    "Later",
    "Slices",
    "TokenNames",
    "chat_logprobs",
    "completion_logprobs",
    "finite",
    "json_pieces",
    "token_names",
    "usage",
]


def finite(value: float) -> float:
    return value if math.isfinite(value) else -9999.0


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenNames:
    """What logprobs call a model's tokens: their bytes and text, looked up once per id (the
    cache grows with the ids met, at most the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend
        try:
            decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder else {}
        except (AttributeError, TypeError, ValueError):
            decoder = {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        self._byte_level = "ByteLevel" in kinds
        self._metaspace = "Metaspace" in kinds or any(
            d.get("type") == "Replace" and d.get("content") == " "
            for d in decoder.get("decoders", [])
        )
        self._table = _byte_table() if self._byte_level else {}
        self._cache: dict[int, tuple[bytes, str]] = {}
        self._lock = threading.Lock()

    def _compute(self, token_id: int) -> tuple[bytes, str]:
        tokenizer = self.tokenizer
        piece = tokenizer.backend.id_to_token(token_id)
        if piece is None:
            return b"", ""
        if tokenizer.is_special(token_id):
            raw = piece.encode()
        elif self._byte_level and all(c in self._table for c in piece):
            raw = bytes(self._table[c] for c in piece)
        elif self._metaspace:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    raw = bytes([int(piece[3:5], 16)])
                except ValueError:
                    raw = piece.encode()
            else:
                raw = piece.replace("\u2581", " ").encode()
        else:
            raw = tokenizer.token_text(token_id).encode()
        return raw, raw.decode("utf-8", errors="replace")

    def get(self, token_id: int) -> tuple[bytes, str]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._compute(int(token_id))
            with self._lock:
                self._cache[token_id] = found
        return found

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]


_names: weakref.WeakKeyDictionary[Any, TokenNames] = weakref.WeakKeyDictionary()
_names_lock = threading.Lock()


def token_names(tokenizer: Any) -> TokenNames:
    with _names_lock:
        found = _names.get(tokenizer)
        if found is None:
            found = _names[tokenizer] = TokenNames(tokenizer)
        return found


def chat_logprobs(
    entries: Sequence[TokenLogprob], names: TokenNames, top: int
) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for ``entries``."""
    out = []
    for entry in entries:
        raw, text = names.get(entry.token_id)
        alternatives = []
        for token_id, logprob in entry.top[:top]:
            alt_raw, alt_text = names.get(token_id)
            alternatives.append(
                {"token": alt_text, "logprob": finite(logprob), "bytes": list(alt_raw)}
            )
        out.append(
            {
                "token": text,
                "logprob": finite(entry.logprob),
                "bytes": list(raw),
                "top_logprobs": alternatives,
            }
        )
    return out


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    names: TokenNames,
    top: int,
    offset: int = 0,
) -> tuple[dict[str, Any], int]:
    """Completions' ``logprobs`` object for ``entries`` (None: a token without one, the
    prompt's first) starting at text ``offset``; and the offset after them."""
    scored = [e for e in entries if e is not None]
    return _completion_logprobs([e.token_id for e in scored], scored, names, top, offset)


def prompt_logprobs(
    prompt_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None] | None,
    names: TokenNames,
    top: int,
) -> tuple[dict[str, Any], int]:
    """Completions' ``logprobs`` for an echoed prompt: every prompt token, the first (and any
    the engine did not score) with ``null``."""
    scored = list(entries or [])
    scored += [None] * (len(prompt_ids) - len(scored))
    return _completion_logprobs(list(prompt_ids), scored, names, top, 0)


def _completion_logprobs(
    token_ids: list[int],
    entries: Sequence[TokenLogprob | None],
    names: TokenNames,
    top: int,
    offset: int,
) -> tuple[dict[str, Any], int]:
    """The ``logprobs`` object of ``token_ids`` (each with its entry, None: ``null``), text
    offsets from ``offset``; and the offset after them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        text = names.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(finite(entry.logprob))
        alternatives = {names.text(t): finite(lp) for t, lp in entry.top[:top]}
        alternatives.setdefault(text, finite(entry.logprob))
        tops.append(alternatives)
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        },
        offset,
    )


def join_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


#: list items (logprob entries, alternatives) made and written by one step at most
SLICE = 64
#: how deep :func:`json_pieces` goes into objects and lists of objects before it writes a value
#: whole (a response, its choices, a choice, its logprobs, their lists)
_DEPTH = 5


class Slices:
    """A long list made a slice at a time while it is written (:func:`json_pieces`):
    ``make(start, stop)`` gives its items ``start:stop``; ``length`` is how many there are."""

    __slots__ = ("length", "make")

    def __init__(self, length: int, make: Callable[[int, int], list[Any]]) -> None:
        self.length, self.make = length, make


class Later:
    """A value made when :func:`json_pieces` reaches it (``make()``): a choice of an answer,
    built after the ones before it are written."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def json_pieces(value: Any, pause: Callable[[], object] | None = None) -> list[bytes]:
    """``orjson.dumps(value)``'s bytes (a :class:`Slices` written as the list it stands
    for), made and written a bounded piece at a time, ``pause()`` between pieces.

    A non-streamed answer of 64 choices with logprobs, or ``n`` 16 with ``top_logprobs`` 20,
    built whole and written in one orjson call held the GIL long enough for gRPC ServerLive to
    take 0.35 s at p99 (1.13 s at worst) beside it (issue 52); made whole and written in
    pieces, the threads waiting for the GIL still got it only at the interpreter's switch
    interval (5 ms) each time they asked, and a health answer asks a dozen times: 0.5-0.6 s
    here. Walked to :data:`_DEPTH`, long lists made and written :data:`SLICE` items at a time
    (a Slices list made as it is written), each piece takes about a millisecond, and
    ``pause`` (``time.sleep(0)`` on a worker) gives the GIL away between them. The bytes are
    those of one ``dumps`` of the list made whole (keys in order, the same separators)."""
    out: list[bytes] = []
    for piece in _pieces(value, 0):
        out.append(piece)
        if pause is not None and len(piece) > 256:
            pause()
    return out


def _pieces(value: Any, depth: int) -> Iterator[bytes]:
    if isinstance(value, Later):
        value = value.make()
    if isinstance(value, Slices):
        yield b"["
        for start in range(0, value.length, SLICE):
            written = orjson.dumps(value.make(start, start + SLICE))
            yield (b"," if start else b"") + written[1:-1]
        yield b"]"
    elif isinstance(value, dict) and depth < _DEPTH:
        yield b"{"
        for n, (key, item) in enumerate(value.items()):
            yield (b"," if n else b"") + orjson.dumps(key) + b":"
            yield from _pieces(item, depth + 1)
        yield b"}"
    elif isinstance(value, list) and len(value) > SLICE:
        yield b"["
        for start in range(0, len(value), SLICE):
            written = orjson.dumps(value[start : start + SLICE])
            yield (b"," if start else b"") + written[1:-1]
        yield b"]"
    elif isinstance(value, list) and depth <= 1 and value and isinstance(value[0], dict | Later):
        # a response's choices: each written in pieces of its own
        yield b"["
        for n, item in enumerate(value):
            if n:
                yield b","
            yield from _pieces(item, depth + 1)
        yield b"]"
    else:
        yield orjson.dumps(value)
