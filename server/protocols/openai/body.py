"""An OpenAI request body: refused by its structure before it is built, charged what its
parsed form holds, and parsed where the serving process's GIL is not held.

A body is bounded by bytes first (the REST port's --max-message-bytes, charged to
--max-inflight-bytes at 3x as it arrives). Bytes are not what a body costs: a 95 MB chat
body of small JSON objects (in a field the server ignores, or as ``tools``) grew the server
by 2.9 GB (285 MB charged) and held the GIL 2-7 s while orjson built it, so REST health
waited as long. Measured here (orjson, CPython 3.11, ``tracemalloc``), what the parsed form
holds per byte of body: ``[{},{},...]`` 24x, ``[{"a":[]},...]`` 28x, ``[[],...]`` 21x,
``["a",...]`` 15x, ``{"k0":0,"k1":0,...}`` 9x, ``[1.5,...]`` 8x, a long string 1x (4x
where one astral character makes its ASCII four bytes a character). Per JSON value the
structure scan counts (each ``{``, ``[`` and ``,`` outside strings) that is at most 108
bytes (a wide object's distinct keys), so a body is charged :data:`VALUE_BYTES` a value and
:data:`TEXT_FACTOR` a byte (its strings' characters) on top of its bytes as read.

So, before anything is built:

1. :func:`scan` counts the body's values and its nesting with numpy over the raw bytes
   (strings and their escapes followed, a slice at a time; numpy's loops release the GIL):
   more than --max-json-values values is 413, nesting deeper than --max-json-depth is 400;
2. the parsed form is charged (:func:`parsed_bytes`) to --max-inflight-bytes, 429 when it
   does not fit, held until the request is prepared (its answer made, or its stream begun);
3. the body is parsed and checked field by field (the route's ``check``, ``protocol.py``),
   which also bounds ``messages`` (``protocol.MAX_MESSAGES``) and ``tools`` (``tools.py``:
   :data:`~plugserve.server.protocols.openai.tools.MAX_TOOLS` tools of at most
   :data:`~plugserve.server.protocols.openai.tools.MAX_TOOL_BYTES` each): on a worker thread
   up to ``offload.PROCESS_BYTES`` (1 MiB: at most ~30 ms of GIL), past it in the REST
   port's JSON helper process (``protocols/http/offload.py``, the one ``/infer`` uses), which
   sends back only the checked request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from plugserve.plugins.api import ResourceExhausted
from plugserve.server.protocols.http import offload
from plugserve.server.protocols.openai import json_bounds, protocol
from plugserve.server.protocols.openai.errors import OpenAIError
from plugserve.server.protocols.openai.json_bounds import Bounds

__all__ = [
    "TEXT_FACTOR",
    "VALUE_BYTES",
    "parsed_bytes",
    "read",
    "scan",
]

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


def _surely_within(data: bytes | memoryview, bounds: Bounds) -> bool:
    """Whether a body is within ``bounds`` by counts that can only overstate: every ``{``,
    ``[`` and ``,`` (strings' too) bounds its values, every ``{`` and ``[`` its depth. Three
    ``bytes.count`` calls, where :func:`scan`'s ~25 numpy calls cost ~150 us a request on the
    loop: a completion of 128 tokens streamed at 32 streams paid ~1 us a token for it on the
    HTTP thread (BENCHMARKS.md, issue 60). False only says "scan it": :func:`scan` decides."""
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)
    opens = raw.count(b"{") + raw.count(b"[")
    return opens <= bounds.depth and opens + raw.count(b",") + 1 <= bounds.values


def _check_structure(data: bytes | memoryview, bounds: Bounds) -> int:
    """The body's value count, or an OpenAIError (413 too many values, 400 too deep)."""
    values, depth = scan(data)
    if values > bounds.values:
        raise OpenAIError(
            f"the request body holds about {values:,} JSON values; this server takes at most "
            f"{bounds.values:,} (--max-json-values): send fewer or larger items",
            status=413,
            code="request_too_large",
        )
    if depth > bounds.depth:
        raise OpenAIError(
            f"the request body nests arrays and objects {depth} deep; this server takes at "
            f"most {bounds.depth} (--max-json-depth)",
        )
    return values


def _parsed(data: bytes | memoryview, check: Callable[[dict[str, Any]], Any]) -> Any:
    return check(protocol.parse_json(data))


def _in_helper(data: bytes, fn: Callable[..., Any], *args: Any) -> tuple[Any, Any]:
    """The helper process's side: ``(fn(data, *args), None)``, or ``(None, (message, param,
    status, code))`` for an OpenAIError (its class takes arguments pickle would not give
    back)."""
    try:
        return fn(data, *args), None
    except OpenAIError as exc:
        return None, (str(exc), exc.param, exc.status, exc.code_name)


async def _away(
    in_worker: Callable[..., Awaitable[Any]], fn: Callable[..., Any], data: Any, *args: Any
) -> Any:
    """``fn(data, *args)`` on a worker thread, in the JSON helper process when ``data`` is
    over ``offload.PROCESS_BYTES`` (the scan's CPU too: 1.8 s for 96 MB of small objects)."""
    if len(data) <= offload.PROCESS_BYTES:
        return await in_worker(fn, data, *args)
    value, error = await in_worker(offload.call, _in_helper, data, fn, *args)
    if error is not None:
        message, param, status, code = error
        raise OpenAIError(message, param, status, code)
    return value


async def read(
    data: bytes | memoryview,
    check: Callable[[dict[str, Any]], Any],
    budget: Any,
    in_worker: Callable[..., Awaitable[Any]],
    inline: int,
) -> tuple[Any, Any]:
    """``(ask, charge)``: the body checked by ``check`` (a module-level function: the helper
    process imports it), and the budget's charge for its parsed form, which the caller
    releases once the request is prepared. Bodies up to ``inline`` bytes are scanned and
    parsed on the loop (64 KiB: under a millisecond)."""
    bounds = json_bounds.bounds()
    if len(data) <= inline:
        if not _surely_within(data, bounds):
            _check_structure(data, bounds)
        return _parsed(data, check), budget.holder()
    values = await _away(in_worker, _check_structure, data, bounds)
    try:
        charge = budget.charge(parsed_bytes(len(data), values), "this request's parsed JSON body")
    except ResourceExhausted as exc:
        raise OpenAIError(str(exc), status=429, code="rate_limit_exceeded") from None
    try:
        return await _away(in_worker, _parsed, data, check), charge
    except BaseException:
        charge.release()
        raise
