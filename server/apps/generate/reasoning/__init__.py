"""Reasoning split out of an answer: the text a reasoning model thinks in, apart from its
answer (OpenAI's ``reasoning_content``, as vLLM and DeepSeek's API name it).

The parser is chosen by the operator (``--reasoning-parser NAME``, vLLM's names) or from the
chat template: a template that writes ``<think>`` (Qwen3, QwQ, DeepSeek-R1 and its distills)
asks for :class:`Think`, one writing ``<|channel|>`` (gpt-oss) for :class:`Harmony`, whose
channels also carry tool calls. ``none`` turns it off. ``gate.py`` makes a structured-output grammar
wait until the reasoning ends.
"""

from __future__ import annotations

from typing import Any

from plugserve.server.apps.generate.reasoning.harmony import Harmony
from plugserve.server.apps.generate.reasoning.think import Splitter, Think

__all__ = ["FAMILIES", "NAMES", "Harmony", "Splitter", "Think", "detect", "family"]

FAMILIES: dict[str, Any] = {
    "think": Think,
    "qwen3": Think,
    "deepseek_r1": Think,
    "harmony": Harmony,
    "gpt_oss": Harmony,
}
#: what --reasoning-parser takes: a family, ``auto`` (from the template) or ``none``
NAMES = ("auto", "none", *FAMILIES)


def detect(template: str | None) -> str | None:
    """The reasoning family a chat template writes; None: not a reasoning model's."""
    if template and "<|channel|>" in template:
        return "harmony"
    if template and Think.start in template and Think.end in template:
        return "think"
    return None


def family(setting: str, template: str | None) -> Any:
    """The parser for a model: the operator's ``setting`` or the template's; None: off."""
    if setting == "none":
        return None
    name = detect(template) if setting in ("", "auto") else setting
    found = FAMILIES.get(name or "")
    return None if found is None else found()
