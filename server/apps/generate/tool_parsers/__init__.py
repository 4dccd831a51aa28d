"""Tool calls read out of a model's answer, one small class per model family.

A family's parser is chosen by the operator (``--tool-call-parser NAME``, as vLLM's) or, by
default, from the model folder's chat template, as OpenVINO Model Server chooses it: each
family's template writes the markup it asks the model for (:data:`SIGNS`, tried in order, the
most specific first). ``none`` turns parsing off. See ``base.py`` for the one streaming engine
and its bounds; docs/openai.md for what the API answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plugserve.server.apps.generate.tool_parsers.base import (
    MAX_CALL_CHARS,
    Family,
    Streamer,
    ToolCall,
    parse,
)
from plugserve.server.apps.generate.tool_parsers.hermes import Hermes
from plugserve.server.apps.generate.tool_parsers.llama3_json import Llama3Json
from plugserve.server.apps.generate.tool_parsers.mistral import Mistral
from plugserve.server.apps.generate.tool_parsers.pythonic import Pythonic
from plugserve.server.apps.generate.tool_parsers.qwen3_coder import Qwen3Coder

__all__ = [
    "FAMILIES",
    "MAX_CALL_CHARS",
    "NAMES",
    "Family",
    "Streamer",
    "ToolCall",
    "detect",
    "family",
    "parse",
]

#: the families by the names operators give them (vLLM's names, with its aliases)
FAMILIES: dict[str, type[Family]] = {
    "hermes": Hermes,
    "qwen2_5": Hermes,
    "qwen3": Hermes,
    "qwen3_coder": Qwen3Coder,
    "qwen3_xml": Qwen3Coder,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "pythonic": Pythonic,
    "llama4_pythonic": Pythonic,
}
#: what --tool-call-parser takes: a family, ``auto`` (from the template) or ``none``
NAMES = ("auto", "none", *FAMILIES)

#: what a family's chat template writes, each sign all of its strings, the first match wins
SIGNS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<function=", "<parameter="), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_start|>",), "pythonic"),
    (("[func_name1(",), "pythonic"),
    (("<|python_tag|>",), "llama3_json"),
    (('"parameters"',), "llama3_json"),
)


def detect(template: str | None) -> str | None:
    """The family a chat template asks its model to write calls in; None: not known."""
    if not template:
        return None
    for strings, name in SIGNS:
        if all(s in template for s in strings):
            return name
    return None


def family(
    setting: str, template: str | None, tools: Sequence[Mapping[str, Any]] | None
) -> Family | None:
    """The parser for a request: the operator's ``setting`` (a family, ``auto`` or ``none``)
    or the template's family; None when calls are not parsed."""
    if setting == "none":
        return None
    name = detect(template) if setting in ("", "auto") else setting
    found = FAMILIES.get(name or "")
    return None if found is None else found(tools)
