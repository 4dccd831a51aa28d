"""Llama 3.1-3.3's JSON calls: the answer is ``{"name": "f", "parameters": {...}}`` (several
separated by ``;``), possibly after ``<|python_tag|>``. Only an answer that begins so is a call,
as Meta's template asks and vLLM reads it."""

from __future__ import annotations

import json
import re

from plugserve.server.apps.generate.tool_parsers.base import JsonFamily, ToolCall, call_of

_DECODER = json.JSONDecoder()


class Llama3Json(JsonFamily):
    name = "llama3_json"
    starts = {"<|python_tag|>": False, "{": True}
    at_start = True
    needs_special_tokens = True
    separator = re.compile(r"\s*;")

    def calls(self, region: str) -> list[ToolCall] | None:
        calls = []
        at = 0
        text = region.strip()
        try:
            while at < len(text):
                item, at = _DECODER.raw_decode(text, at)
                call = call_of(item, "parameters")
                if call is None:
                    return None
                calls.append(call)
                while at < len(text) and text[at] in " \t\r\n;":
                    at += 1
        except ValueError:
            return None
        return calls or None
