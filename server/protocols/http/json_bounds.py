"""The server's bounds on the structure of a request's JSON (--max-json-values, --max-json-depth),
and the scan that counts a body's values and nesting from its bytes, before anything is built.

The faces' plumbing: the OpenAI routes' bodies (``protocols/openai/body.py``, which says what a
parsed body costs and why) and KServe's generate bodies (``protocols/kserve/rest.py``: a 45 MB
generate body of empty objects grew the server 1.3 GB and held REST health 0.86 s where the
same body to a chat route was a 413 in 0.3 s).

JSON also comes inside a body's strings: a tool call's ``arguments`` in the history is JSON
text the request carries as one string value, which the OpenAI adapter parses
(``tools.history``). Its values are counted against the same bound before it is parsed: an
assistant message whose arguments held 50M numbers (a 100 MB body of one string) took 25.7 s
and grew the server 0.9 GB, two at once kept a chat waiting 21 s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from plugserve.server.plane.errors import FieldError

__all__ = [
    "MAX_DEPTH",
    "MAX_VALUES",
    "TEXT_FACTOR",
    "VALUE_BYTES",
    "Bounds",
    "bounds",
    "check_structure",
    "configure",
    "decode_bounded",
    "parsed_bytes",
    "scan",
    "surely_within",
    "values_at_most",
]

#: most JSON values in one body (--max-json-values): a completion's 64 prompts of 16k token
#: ids is 1M; 1M small objects hold ~100 MB parsed and take orjson ~0.1 s
MAX_VALUES = 1 << 20
#: deepest nesting of arrays and objects (--max-json-depth): tool schemas nest a few levels;
#: orjson itself stops at 1024
MAX_DEPTH = 64


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The server's bounds on a body's structure (settings.py: --max-json-values,
    --max-json-depth)."""

    values: int = MAX_VALUES
    depth: int = MAX_DEPTH


_bounds = Bounds()


def configure(values: int = MAX_VALUES, depth: int = MAX_DEPTH) -> None:
    """The server's settings (process/app.py)."""
    global _bounds
    _bounds = Bounds(values, depth)


def bounds() -> Bounds:
    return _bounds


def values_at_most(text: str) -> int:
    """The most JSON values ``text`` can hold: one, and one more for each ``{``, ``[`` and
    ``,`` (in strings too: it can only overstate)."""
    return text.count(",") + text.count("{") + text.count("[") + 1


#: what the parsed form holds per counted value, at most (108 measured: see the docstring)
VALUE_BYTES = 128
#: what it holds per byte of text, at most (a str of UCS-4 characters from ASCII bytes)
TEXT_FACTOR = 4
#: bytes the scan reads at a time (its temporaries are ~10x this)
_SCAN_SLICE = 1 << 20

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPENS, _CLOSES, _COMMA = (ord("{"), ord("[")), (ord("}"), ord("]")), ord(",")


def scan(data: bytes | memoryview) -> tuple[int, int]:
    """``(values, depth)`` of a JSON text without building it: values counted as the ``{``,
    ``[`` and ``,`` outside strings (plus one), depth as the deepest nesting. Strings are
    followed through their escapes (a quote after an odd run of backslashes is in the
    string). Exact for valid JSON; for invalid text an estimate orjson then refuses."""
    raw = np.frombuffer(data, np.uint8)
    values, depth, deepest = 1, 0, 0
    inside = 0  # 1: the slice begins inside a string
    run = 0  # backslashes ending the slice before
    for start in range(0, raw.size, _SCAN_SLICE):
        chunk = raw[start : start + _SCAN_SLICE]
        index = np.arange(chunk.size)
        plain = np.where(chunk != _BACKSLASH, index, -1)
        np.maximum.accumulate(plain, out=plain)
        quotes = np.flatnonzero(chunk == _QUOTE)
        before = quotes - 1 - np.where(quotes > 0, plain[quotes - 1], -1)  # backslashes
        before = np.where(plain[quotes] == quotes, before, 0)
        before[before == quotes] += run  # a run from the slice before
        real = quotes[before % 2 == 0]
        toggles = np.zeros(chunk.size, np.int8)
        toggles[real] = 1
        string = (np.cumsum(toggles, dtype=np.int64) + inside) % 2 == 1
        string[real] = True  # the quotes themselves are no structure
        outside = ~string
        opens = outside & ((chunk == _OPENS[0]) | (chunk == _OPENS[1]))
        closes = outside & ((chunk == _CLOSES[0]) | (chunk == _CLOSES[1]))
        values += int(np.count_nonzero(opens)) + int(np.count_nonzero(outside & (chunk == 44)))
        if opens.any() or closes.any():
            level = np.cumsum(opens.astype(np.int64) - closes, dtype=np.int64) + depth
            deepest = max(deepest, int(level.max()))
            depth = int(level[-1])
        inside = (inside + real.size) % 2
        last = int(plain[-1])
        run = chunk.size - 1 - last if last >= 0 else run + chunk.size
    return values, deepest


def parsed_bytes(size: int, values: int) -> int:
    """What the parsed form of a ``size``-byte body of ``values`` values holds, at most."""
    return values * VALUE_BYTES + size * TEXT_FACTOR


def surely_within(data: bytes | memoryview, bounds: Bounds) -> bool:
    """Whether a body is within ``bounds`` by counts that can only overstate: every ``{``,
    ``[`` and ``,`` (strings' too) bounds its values, every ``{`` and ``[`` its depth. Three
    ``bytes.count`` calls, where :func:`scan`'s ~25 numpy calls cost ~150 us a request on the
    loop: a completion of 128 tokens streamed at 32 streams paid ~1 us a token for it on the
    HTTP thread (BENCHMARKS.md, issue 60). False only says "scan it": :func:`scan` decides."""
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    opens = raw.count(b"{") + raw.count(b"[")
    return opens <= bounds.depth and opens + raw.count(b",") + 1 <= bounds.values


def check_structure(data: bytes | memoryview, bounds: Bounds) -> int:
    """The body's value count, or a FieldError (413 too many values, 400 too deep)."""
    values, depth = scan(data)
    if values > bounds.values:
        raise FieldError(
            f"the request body holds about {values:,} JSON values; this server takes at most "
            f"{bounds.values:,} (--max-json-values): send fewer or larger items",
            status=413,
            code="request_too_large",
        )
    if depth > bounds.depth:
        raise FieldError(
            f"the request body nests arrays and objects {depth} deep; this server takes at "
            f"most {bounds.depth} (--max-json-depth)",
        )
    return values


def decode_bounded(data: bytes | memoryview, bounds: Bounds) -> tuple[Any, Any]:
    """``(value, None)``: ``data`` parsed once :func:`check_structure` passes it, or ``(None,
    (message, param, status, code))`` for its refusal: what a face runs in the REST port's
    JSON helper process (``offload.call``) for a large body, so neither the scan nor the parse
    holds the serving process's GIL (a FieldError's status would not survive pickling)."""
    import orjson

    try:
        check_structure(data, bounds)
        return orjson.loads(data), None
    except FieldError as exc:
        return None, (str(exc), exc.param, exc.status, exc.code_name)
    except (ValueError, RecursionError) as exc:  # orjson.JSONDecodeError is a ValueError
        return None, (f"the request body is not valid JSON: {exc}", None, 400, None)
