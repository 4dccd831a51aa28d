"""Mistral's ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}`` after it (v3 and
later), or ``name[ARGS]{...}`` per call (the v11 tokenizers; ``[CALL_ID]id`` allowed between),
to the end of the answer. ``[TOOL_CALLS]`` is a special token: the text keeps special tokens
while these are parsed. Streamed: each call's name, then its arguments' object as written."""

from __future__ import annotations

import json
import re
from typing import Any

from plugserve.server.apps.generate.tool_parsers.base import (
    HEADER_WAIT,
    JSON_HEADER,
    JSON_TAIL,
    Family,
    JsonReader,
    Reader,
    ToolCall,
    call_of,
)

_DECODER = json.JSONDecoder()
MARKER = "[TOOL_CALLS]"
_LEAD = re.compile(r"\s*\[")
_COMMA = re.compile(r"\s*,")
_NAMED = re.compile(r"\s*(?P<name>[^\s\[\]{}\"]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*")
_NEXT = re.compile(r"\s*\[TOOL_CALLS\]")
_NOTHING = re.compile("")


class Mistral(Family):
    name = "mistral"
    starts = {MARKER: False}
    needs_special_tokens = True

    def calls(self, region: str) -> list[ToolCall] | None:
        text = region.strip()
        try:
            if text.startswith("["):
                items, at = _DECODER.raw_decode(text)
                if not isinstance(items, list) or text[at:].strip():
                    return None
                calls = [call_of(item) for item in items]
                return None if not calls or None in calls else calls  # type: ignore[return-value]
            return _named(text)
        except ValueError:
            return None

    def reader(self) -> Reader:
        return _Either()


class _Either(Reader):
    """The array form or the named form, as the region's first text says."""

    def __init__(self) -> None:
        self._buf = ""
        self._reader: JsonReader | None = None

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        if self._reader is None:
            self._buf += piece
            text = self._buf.lstrip()
            if not text:
                if len(self._buf) > HEADER_WAIT:
                    self.stopped = True
                return []
            if text.startswith("["):
                self._reader = JsonReader(JSON_HEADER, JSON_TAIL, _COMMA, _LEAD)
            else:
                self._reader = JsonReader(_NAMED, _NOTHING, _NEXT)
            piece, self._buf = self._buf, ""
        events = self._reader.feed(piece)
        self.stopped = self._reader.stopped
        return events


def _named(text: str) -> list[ToolCall] | None:
    calls = []
    for piece in text.split(MARKER):
        if not piece.strip():
            continue
        name, sep, rest = piece.partition("[ARGS]")
        if not sep:
            return None
        name = name.split("[CALL_ID]", 1)[0].strip()
        value, at = _DECODER.raw_decode(rest.strip())
        if not name or not isinstance(value, dict) or rest.strip()[at:].strip():
            return None
        calls.append(ToolCall(name, json.dumps(value, ensure_ascii=False)))
    return calls or None
