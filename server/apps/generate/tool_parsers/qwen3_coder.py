"""Qwen3-Coder's XML style: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
</function></tool_call>``. A value is text; where the tool's schema gives the parameter a type
other than string it is read as JSON (a number, an object), and kept as text if it is not.
Streamed: the name at ``<function=NAME>``, then the arguments' JSON a parameter at a time as
each ``</parameter>`` closes (``{"city": "Paris"``, ``, "days": 3``, then ``}``), the same
text as the whole call's ``json.dumps``."""

from __future__ import annotations

import json
import re
from typing import Any

from plugserve.server.apps.generate.tool_parsers.base import HEADER_WAIT, Family, Reader, ToolCall

_FUNCTION = "<function="
_END_FUNCTION = "</function>"
_PARAMETER = "<parameter="
_OPEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_OPEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_CLOSE_FUNCTION = re.compile(r"\s*</function>")
_CLOSE = "</parameter>"


class Qwen3Coder(Family):
    name = "qwen3_coder"
    starts = {"<tool_call>": False}
    end = "</tool_call>"

    def calls(self, region: str) -> list[ToolCall] | None:
        text = region.strip()
        if not text.startswith(_FUNCTION) or not text.endswith(_END_FUNCTION):
            return None
        close, end = text.find(">"), len(text) - len(_END_FUNCTION)
        name = text[len(_FUNCTION) : close]
        pairs = _parameters(text[close + 1 : end]) if close < end else None
        if not name.strip() or "\n" in name or pairs is None:
            return None  # text outside the parameters: not this format
        name = name.strip()
        arguments = {key: self.value(name, key, value) for key, value in pairs}
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]

    def value(self, function: str, key: str, text: str) -> object:
        """A parameter's text read by its type in the function's schema."""
        parameters = self.tools.get(function, {}).get("parameters") or {}
        properties = parameters.get("properties") or {} if isinstance(parameters, dict) else {}
        schema = properties.get(key) if isinstance(properties, dict) else None
        return _value(
            text, (schema or {}).get("type", "string") if isinstance(schema, dict) else "string"
        )

    def reader(self) -> Reader:
        return _Reader(self)


class _Reader(Reader):
    """``<function=NAME>`` then each parameter, read as it closes; a value is held (pieces,
    the end marker searched only where it grew) until its ``</parameter>``."""

    def __init__(self, family: Qwen3Coder) -> None:
        self.family = family
        self._name = ""
        self._buf = ""  # a tag not yet whole
        self._key: str | None = None  # inside this parameter's value
        self._value: list[str] = []
        self._tail = ""  # the value's last characters, which may begin </parameter>
        self._pairs = 0
        self._events: list[tuple[str, Any]] = []

    def _run(self) -> None:
        while self._buf and not self.stopped:
            if self._key is not None:
                piece, self._buf = self._buf, ""
                window = self._tail + piece
                at = window.find(_CLOSE)
                if at < 0:
                    self._value.append(piece)
                    self._tail = window[-(len(_CLOSE) - 1) :]
                    return
                cut = len(piece) - (len(window) - at)  # where </parameter> begins in piece
                text = "".join(self._value) + piece[: max(0, cut)]
                if cut < 0:  # it began in the pieces before
                    text = text[:cut]
                self._buf = window[at + len(_CLOSE) :]
                self._pair(self._key, text)
                self._key, self._value, self._tail = None, [], ""
                continue
            patterns = (_CLOSE_FUNCTION, _OPEN_PARAMETER) if self._name else (_OPEN_FUNCTION,)
            for pattern in patterns:
                found = pattern.match(self._buf)
                if found is not None:
                    break
            if found is None:
                if len(self._buf) > HEADER_WAIT:
                    self.stopped = True
                return
            self._buf = self._buf[found.end() :]
            if pattern is _OPEN_FUNCTION:
                self._name = found.group(1).strip()
                self._events.append(("name", self._name))
            elif pattern is _OPEN_PARAMETER:
                self._key = found.group(1).strip()
            else:
                self._events += [("args", "}" if self._pairs else "{}"), ("done", None)]
                self.stopped = True

    def _pair(self, key: str, text: str) -> None:
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        value = self.family.value(self._name, key, text)
        pair = json.dumps({key: value}, ensure_ascii=False)[1:-1]
        self._events.append(("args", (", " if self._pairs else "{") + pair))
        self._pairs += 1


def _value(text: str, kind: object) -> object:
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parameters(body: str) -> list[tuple[str, str]] | None:
    """``<parameter=KEY>\\nVALUE\\n</parameter>`` after one another (whitespace between), each
    key stripped and one newline trimmed off each side of its value; None when anything else
    is there. A scan with ``str.find``: it had been two lazy regular expressions
    (``(.*?)</parameter>``), each start of which searched the rest of the call for its end, so
    a call of many unclosed ``<parameter=`` took its length squared (3.2 s at 60 KB, about a
    minute at MAX_CALL_CHARS, with the GIL held)."""
    pairs, at, size = [], 0, len(body)
    while True:
        while at < size and body[at].isspace():
            at += 1
        if at == size:
            return pairs
        if not body.startswith(_PARAMETER, at):
            return None
        close = body.find(">", at)
        key = body[at + len(_PARAMETER) : close]
        if close < 0 or not key or "\n" in key:
            return None
        start = close + 1 + body.startswith("\n", close + 1)
        end = body.find(_CLOSE, start)
        if end < 0:
            return None
        value = body[start:end]
        pairs.append((key.strip(), value[:-1] if value.endswith("\n") else value))
        at = end + len(_CLOSE)
