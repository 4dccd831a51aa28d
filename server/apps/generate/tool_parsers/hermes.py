"""Hermes, Qwen2.5 and Qwen3: each call a JSON object between ``<tool_call>`` and
``</tool_call>`` (``{"name": "f", "arguments": {...}}``), content before the first kept.
Streamed: the name, then the arguments' object as it is written."""

from __future__ import annotations

import json

from plugserve.server.apps.generate.tool_parsers.base import JsonFamily, ToolCall, call_of


class Hermes(JsonFamily):
    name = "hermes"
    starts = {"<tool_call>": False}
    end = "</tool_call>"

    def calls(self, region: str) -> list[ToolCall] | None:
        try:
            call = call_of(json.loads(region))
        except ValueError:
            return None
        return None if call is None else [call]
