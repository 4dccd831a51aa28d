"""Qwen3-Coder's XML style: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
</function></tool_call>``. A value is text; where the tool's schema gives the parameter a type
other than string it is read as JSON (a number, an object), and kept as text if it is not."""

from __future__ import annotations

import json
import re

from plugserve.server.apps.generate.tool_parsers.base import Family, ToolCall

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Qwen3Coder(Family):
    name = "qwen3_coder"
    starts = {"<tool_call>": False}
    end = "</tool_call>"

    def calls(self, region: str) -> list[ToolCall] | None:
        found = _FUNCTION.fullmatch(region)
        if found is None:
            return None
        name, body = found.group(1).strip(), found.group(2)
        if _PARAMETER.sub("", body).strip():
            return None  # text outside the parameters: not this format
        properties = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        arguments = {}
        for key, value in _PARAMETER.findall(body):
            kind = (properties.get(key.strip()) or {}).get("type", "string")
            arguments[key.strip()] = _value(value, kind)
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]


def _value(text: str, kind: object) -> object:
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
