"""Mistral's ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}`` after it (v3 and
later), or ``name[ARGS]{...}`` per call (the v11 tokenizers; ``[CALL_ID]id`` allowed between),
to the end of the answer. ``[TOOL_CALLS]`` is a special token: the text keeps special tokens
while these are parsed."""

from __future__ import annotations

import json

from plugserve.server.apps.generate.tool_parsers.base import Family, ToolCall, call_of

_DECODER = json.JSONDecoder()
MARKER = "[TOOL_CALLS]"


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
