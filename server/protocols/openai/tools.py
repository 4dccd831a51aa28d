"""Chat's tools and reasoning on the OpenAI face: the request's tool fields checked, the
history made as templates expect it, forced tool choice as a grammar, and each choice's answer
split into reasoning, content and tool calls.

* ``tool_choice``: ``none`` (calls are not parsed), ``auto`` (the default with tools: the
  model's calls are parsed by its family's parser, ``server/apps/generate/tool_parsers``),
  ``required`` or ``{"type": "function", "function": {"name": ...}}``: constrained decoding
  (``grammar.py``), as vLLM forces them: ``required`` is a JSON array of at least one
  ``{"name", "parameters"}`` object over the tools' schemas (exactly one with
  ``parallel_tool_calls`` false), a named function is its ``parameters`` schema, each
  object of it closed unless it says otherwise (``grammar.closed_schema``: the declared
  properties only, so a weak model's forced call ends), and the answer is read back as the
  calls.
* ``parallel_tool_calls`` false: at most one call per choice (``auto``: the first is kept).
* The history: an assistant message's ``tool_calls[].function.arguments`` is JSON text in
  OpenAI's API, and templates iterate it as an object (Qwen3-Coder's ``arguments|items``, or
  ``tojson`` that would encode the string a second time): it is parsed before rendering, as
  vLLM and llama.cpp do; a text that is not a JSON object is a 400 naming it.
* ``reasoning_effort`` is given to the template as a variable (gpt-oss's reads it), unless
  ``chat_template_kwargs`` sets it.

:class:`ChatOutput` is one choice's answer, streamed or whole: reasoning split out first
(``reasoning/think.py``), then content and calls; a call streams as OpenAI streams it, a delta
with its ``index``, ``id``, ``type`` and ``function.name`` (arguments ``""``) as soon as the
parser knows the name, then its arguments in fragments as the model writes them (the
parsers' readers, ``tool_parsers/base.py``), which join to exactly the call's ``arguments``.
A call that streamed and then does not read as one (cut short by its end marker, or past the
parsers' bound) cannot be taken back: it is left out of the message and the finish reason, and
its text comes as content, as the whole answer's does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from plugserve.server.apps.generate.text.grammar import MAX_SCHEMA_BYTES, closed_schema
from plugserve.server.apps.generate.tool_parsers import MAX_CALL_CHARS, Streamer, ToolCall
from plugserve.server.protocols.http import json_bounds
from plugserve.server.protocols.openai.deltas import CallPiece, Delta
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = [
    "EFFORTS",
    "MAX_TOOLS",
    "MAX_TOOL_BYTES",
    "ChatOutput",
    "Plan",
    "check_tools",
    "forced_schema",
    "history",
    "plan",
]

#: reasoning_effort's values (OpenAI's, with gpt-oss's)
EFFORTS = ("none", "minimal", "low", "medium", "high")
#: most tools a request may define (OpenAI's own bound): each is rendered into the prompt and
#: may become a grammar, so thousands of them were work and memory no answer needs
MAX_TOOLS = 128
#: most bytes of one tool as JSON (its schema is at most a grammar's: MAX_SCHEMA_BYTES)
MAX_TOOL_BYTES = MAX_SCHEMA_BYTES


def check_tools(body: dict[str, Any], ask: Any) -> None:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``reasoning_effort`` read into
    ``ask`` (a ChatRequest); the forced choices become its schema."""
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise OpenAIError("'tools' must be an array of tool objects", "tools")
    if tools is not None and len(tools) > MAX_TOOLS:
        raise OpenAIError(f"'tools' holds {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    names = []
    for i, tool in enumerate(tools or ()):
        if len(json.dumps(tool)) > MAX_TOOL_BYTES:
            raise OpenAIError(
                f"'tools[{i}]' is over {MAX_TOOL_BYTES} bytes of JSON; send a smaller schema",
                f"tools[{i}]",
                413,
            )
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise OpenAIError(
                f'\'tools[{i}]\' must be {{"type": "function", "function": {{...}}}}; this '
                "server serves function tools",
                f"tools[{i}]",
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise OpenAIError(f"'tools[{i}].function.name' must be a string", f"tools[{i}]")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise OpenAIError(
                f"'tools[{i}].function.parameters' must be a JSON schema (an object)",
                f"tools[{i}]",
            )
        names.append(function["name"])
    ask.tools = tools or None
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise OpenAIError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    ask.parallel_tool_calls = parallel is not False
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise OpenAIError(
                '\'tool_choice\' naming a function must be {"type": "function", '
                '"function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise OpenAIError(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                "tool_choice",
            )
        choice = {"name": name}
    elif choice not in ("none", "auto", "required"):
        raise OpenAIError(
            f"'tool_choice' must be 'none', 'auto', 'required' or name a function, not {choice!r}",
            "tool_choice",
        )
    elif choice == "required" and not names:
        raise OpenAIError("'tool_choice' is 'required' but 'tools' is empty", "tool_choice")
    ask.tool_choice = choice
    if choice not in ("none", "auto"):
        if ask.schema is not None and ask.grammar_field != "response_format":
            raise OpenAIError(
                f"'{ask.grammar_field}' cannot be used with a forced 'tool_choice' (the answer "
                "is the tool call's arguments)",
                ask.grammar_field,
            )
        # a response_format shapes an answer's text; a forced call's answer has none, so the
        # call's schema decodes this turn (OpenAI's API, and the OpenAI Agents SDK sends both)
        ask.grammar_kind, ask.grammar_field = "json", "tool_choice"
        ask.schema = json.dumps(forced_schema(tools or [], choice, ask.parallel_tool_calls))
        if len(ask.schema) > MAX_SCHEMA_BYTES:  # a grammar over thousands of tools
            raise OpenAIError(
                f"'tool_choice' {choice if isinstance(choice, str) else 'naming a function'} "
                f"makes a grammar of the tools' schemas, here {len(ask.schema)} bytes; at most "
                f"{MAX_SCHEMA_BYTES}: send fewer tools or smaller schemas",
                "tools",
            )
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise OpenAIError(
                f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, not {effort!r}",
                "reasoning_effort",
            )
        ask.template_kwargs.setdefault("reasoning_effort", effort)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A forced call's arguments schema: the declared properties only (``grammar.closed_schema``,
    unless the schema says what other keys it takes)."""
    parameters = function.get("parameters")
    return closed_schema(
        parameters if isinstance(parameters, dict) and parameters else {"type": "object"}
    )


def forced_schema(tools: Sequence[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced ``tool_choice`` decodes by (vLLM's shapes)."""
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        return next(_parameters(f) for f in functions if f["name"] == choice["name"])
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [f["name"]]}, "parameters": _parameters(f)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def history(messages: list[dict[str, Any]]) -> None:
    """Each assistant message's call arguments (JSON text) as objects, in place (the messages
    are the request's own copies; their ``tool_calls`` lists are copied before changing).
    Their values together are counted against --max-json-values before any is parsed: each
    is one string value in the body, and its text may hold millions."""
    limit, counted = json_bounds.bounds().values, 0
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not calls:
            continue
        if not isinstance(calls, list):
            raise OpenAIError(
                f"'messages[{i}].tool_calls' must be an array", f"messages[{i}].tool_calls"
            )
        made = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise OpenAIError(f"'{where}' must hold a function with a name", where)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                counted += json_bounds.values_at_most(arguments)
                if counted > limit:
                    raise OpenAIError(
                        f"'{where}.function.arguments': the history's call arguments hold up "
                        f"to {counted:,} JSON values; this server takes at most {limit:,} "
                        "(--max-json-values)",
                        f"{where}.function.arguments",
                        status=413,
                        code="request_too_large",
                    )
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except (ValueError, RecursionError):
                    arguments = None
                if not isinstance(arguments, dict):
                    raise OpenAIError(
                        f"'{where}.function.arguments' must be a JSON object's text",
                        f"{where}.function.arguments",
                    )
            made.append({**call, "function": {**function, "arguments": arguments or {}}})
        message["tool_calls"] = made


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    """One choice's answer, as typed deltas while it streams (``deltas.py``: :meth:`feed`,
    :meth:`finish`) and as its message (:meth:`message`); see the module's docstring."""

    def __init__(
        self,
        splitter: Any = None,
        family: Any = None,
        forced: Any = None,
        parallel: bool = True,
    ) -> None:
        self.splitter = splitter
        self.streamer = Streamer(family) if family is not None and forced is None else None
        #: "required", a function's name, or None
        self.forced = forced["name"] if isinstance(forced, dict) else forced
        self.parallel = parallel
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._held: list[str] = []  # a forced answer's text
        self._streaming: dict[str, Any] | None = None  # the call whose arguments stream
        self._skipping = False  # a streamed call past parallel_tool_calls false: dropped
        self._message: dict[str, Any] | None = None

    def feed(self, text: str) -> list[Delta]:
        """The typed pieces (``deltas.py``) of the answer's next ``text``."""
        return self._step(text, False)

    def finish(self) -> list[Delta]:
        return self._step("", True)

    def _step(self, text: str, final: bool) -> list[Delta]:
        deltas: list[Delta] = []
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text)
            if final:
                more, rest = self.splitter.finish()
                reasoning, text = reasoning + more, text + rest
            if reasoning:
                self.reasoning.append(reasoning)
                deltas.append(Delta(reasoning=reasoning))
            for kind, value in getattr(self.splitter, "take_events", list)():
                deltas += self._event(kind, value)  # harmony's calls come with its channels
        if self.forced is not None:
            deltas += self._forced(text, final)
        elif self.streamer is not None:
            events = self.streamer.feed(text) if text else []
            if final:
                events += self.streamer.finish()
            for kind, value in events:
                deltas += self._event(kind, value)
        elif text:
            deltas.append(self._text(text))
        return deltas

    def _event(self, kind: str, value: Any) -> list[Delta]:
        """A parser's event as deltas: content, a call's name, its arguments' fragment, or
        the call closed (whole, when it did not stream)."""
        if kind == "content":
            return [self._text(value)]
        if kind == "name":
            if self.calls and not self.parallel:
                self._skipping = True
                return []
            head = self._call(ToolCall(value, ""))[:1]
            self._streaming = self.calls[-1]
            return head
        if kind == "args":
            if self._streaming is None:
                return []
            self._streaming["function"]["arguments"] += value
            index = len(self.calls) - 1
            return [Delta(call=CallPiece(index, value))]
        if self._skipping:
            self._skipping = False
            return []
        if kind == "broken":  # streamed, then not a call: its text comes as content
            if self._streaming is not None:
                self.calls.remove(self._streaming)
                self._streaming = None
            return []
        if self._streaming is not None:  # its fragments are its arguments
            self._streaming["function"]["arguments"] = value.arguments
            self._streaming = None
            return []
        return self._call(value)

    def _text(self, text: str) -> Delta:
        self.content.append(text)
        return Delta(content=text)

    def _call(self, call: ToolCall) -> list[Delta]:
        if self.calls and not self.parallel:
            return []
        index = len(self.calls)
        entry = {
            "id": _call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        self.calls.append(entry)
        head = CallPiece(index, "", entry["id"], call.name)
        return [Delta(call=head), Delta(call=CallPiece(index, call.arguments))]

    def _forced(self, text: str, final: bool) -> list[Delta]:
        if self.forced != "required":  # a named function: the text is its arguments
            deltas: list[Delta] = []
            if not self.calls and (text or final):
                deltas += self._call(ToolCall(self.forced, ""))[:1]
            if text:
                self.calls[0]["function"]["arguments"] += text
                deltas.append(Delta(call=CallPiece(0, text)))
            return deltas
        self._held.append(text)
        if not final:
            return []
        answer = "".join(self._held)
        try:
            items = json.loads(answer)
        except (ValueError, RecursionError):
            items = None
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
        ):
            return [self._text(answer)] if answer else []  # cut short: the text as it is
        deltas = []
        for item in items:
            arguments = json.dumps(item.get("parameters") or {}, ensure_ascii=False)
            deltas += self._call(ToolCall(item["name"], arguments))
        return deltas

    def whole(self, text: str) -> dict[str, Any]:
        """The message of a whole answer ``text`` (read once, however often asked)."""
        if self._message is None:
            self.feed(text)
            self.finish()
            self._message = self.message()
        return self._message

    def message(self) -> dict[str, Any]:
        """The choice's ``message``."""
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self.calls else None,
        }
        if self.splitter is not None:
            message["reasoning_content"] = "".join(self.reasoning) or None
        if self.calls:
            message["tool_calls"] = self.calls
        return message


class Plan:
    """What a chat request's answers are read with: the reasoning parser (and whether the
    prompt opened the reasoning), the tool family, the forced choice; made once per request
    (:func:`plan`), a :class:`ChatOutput` per choice."""

    def __init__(self, think: Any, opened: bool, family: Any, ask: Any) -> None:
        self.think = think
        self.opened = opened
        self.family = family
        self.forced = ask.tool_choice if ask.tool_choice not in ("none", "auto") else None
        self.parallel = ask.parallel_tool_calls
        #: the reasoning format carries the calls itself (gpt-oss's harmony channels)
        self.calls_in_channels = bool(ask.tools) and ask.tool_choice == "auto"

    @property
    def keeps_special_tokens(self) -> bool:
        """The family's markers are special tokens, which the text must keep."""
        if getattr(self.think, "needs_special_tokens", False):
            return True
        return self.family is not None and self.forced is None and self.family.needs_special_tokens

    def holds(self, choices: int, stream: bool) -> int:
        """What a stream's parsers may hold: a call region per choice, at most
        ``MAX_CALL_CHARS`` (a whole answer is charged as the answer already)."""
        return choices * MAX_CALL_CHARS if stream else 0

    def output(self) -> ChatOutput:
        splitter = self.think.splitter(self.opened) if self.think is not None else None
        if hasattr(splitter, "parse_calls"):
            splitter.parse_calls = self.calls_in_channels
        return ChatOutput(splitter, self.family, self.forced, self.parallel)

    def gated(self, constraints: list[Any], tokenizer: Any) -> list[Any]:
        """Each grammar made to wait for the reasoning's end (no reasoning parser: as is)."""
        if self.think is None or not constraints:
            return constraints
        from plugserve.server.apps.generate.reasoning.gate import ReasoningGate
        from plugserve.server.protocols.openai.encode import token_names

        names = token_names(tokenizer)
        start = tokenizer.backend.token_to_id(self.think.start)
        eos = tuple(tokenizer.eos_token_ids)
        return [
            ReasoningGate(c, names, start, self.think.end, eos, self.opened) for c in constraints
        ]


def plan(
    ask: Any, tokenizer: Any, prompt_ids: Sequence[int], tool_setting: str, reasoning_setting: str
) -> Plan | None:
    """The request's :class:`Plan`; None when its answers are plain content (no reasoning
    parser, no tools to parse, nothing forced). Whether the prompt opened the reasoning is
    read from its last 16 tokens' text (DeepSeek-R1's template ends it so)."""
    from plugserve.server.apps.generate import reasoning, tool_parsers

    template = tokenizer.chat_template
    think = reasoning.family(reasoning_setting, template)
    family = None
    if ask.tool_choice == "auto" and ask.tools:
        family = tool_parsers.family(tool_setting, template, ask.tools)
    if think is None and family is None and ask.tool_choice in ("none", "auto"):
        return None
    opened = think is not None and think.opened(
        tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)
    )
    return Plan(think, opened, family, ask)
