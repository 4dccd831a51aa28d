"""Pythonic calls (Llama 4, Llama 3.2's pythonic template): the answer is a Python list of
calls, ``[f(a=1), g(b="x")]``, possibly between ``<|python_start|>`` and ``<|python_end|>``.
Read with Python's own parser; each argument must be a literal (read with ``literal_eval``:
no name, call or attribute is ever evaluated)."""

from __future__ import annotations

import ast
import json

from plugserve.server.apps.generate.tool_parsers.base import Family, ToolCall


class Pythonic(Family):
    name = "pythonic"
    starts = {"<|python_start|>": False, "[": True}
    at_start = True
    needs_special_tokens = True

    def calls(self, region: str) -> list[ToolCall] | None:
        text = region.strip()
        if text.endswith("<|python_end|>"):
            text = text[: -len("<|python_end|>")].strip()
        try:
            tree = ast.parse(text, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or node.args:
                    return None
                if not isinstance(node.func, ast.Name):
                    return None
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                if None in arguments:
                    return None  # **kwargs
                calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            return calls
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None
