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

from plugserve.plugins.api import ResourceExhausted
from plugserve.server.protocols.http import json_bounds, offload
from plugserve.server.protocols.http.json_bounds import (
    TEXT_FACTOR,
    VALUE_BYTES,
    parsed_bytes,
    scan,
)
from plugserve.server.protocols.openai import protocol
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = ["TEXT_FACTOR", "VALUE_BYTES", "parsed_bytes", "read", "scan"]


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
        if not json_bounds.surely_within(data, bounds):
            json_bounds.check_structure(data, bounds)
        return _parsed(data, check), budget.holder()
    values = await _away(in_worker, json_bounds.check_structure, data, bounds)
    try:
        charge = budget.charge(parsed_bytes(len(data), values), "this request's parsed JSON body")
    except ResourceExhausted as exc:
        raise OpenAIError(str(exc), status=429, code="rate_limit_exceeded") from None
    try:
        return await _away(in_worker, _parsed, data, check), charge
    except BaseException:
        charge.release()
        raise
