"""An Anthropic Messages body checked and made into the chat request the OpenAI chat path runs.

What becomes what (docs/anthropic.md):

* ``system`` (a string or text blocks) is the first message, a ``system`` one;
* a ``user`` message's ``text`` blocks are one user message (joined by a newline); its
  ``tool_result`` blocks come before it as ``tool`` messages with their ``tool_call_id`` (the
  ``tool_use_id``, which must be one of the assistant message before), their content a
  string or text blocks;
* a last message of the ``assistant`` is a prefill: the answer continues it (chat's
  ``continue_final_message``; the answer holds the continuation only, as Anthropic's);
* an ``assistant`` message's text is its content, its ``tool_use`` blocks its ``tool_calls``
  (``input`` as the arguments' JSON), its ``thinking`` blocks its ``reasoning_content`` (what
  Qwen3-style templates read); ``redacted_thinking`` is opaque and left out;
* ``tools`` (``name``, ``description``, ``input_schema``) are function tools; ``tool_choice``
  ``auto``, ``any`` (chat's ``required``), ``tool`` (a named function) and ``none``;
  ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``;
* ``max_tokens`` (required), ``stop_sequences`` (chat's ``stop``, the matched one kept in the
  text so the answer can name it: ``answer.py`` cuts it), ``temperature`` (0 to 1, Anthropic's
  range), ``top_p``, ``top_k``, ``stream``;
* ``thinking`` ``enabled`` (or ``adaptive``) / ``disabled`` is the template's
  ``enable_thinking`` (Qwen3's switch); the reasoning the model's parser splits out is the
  answer's ``thinking`` blocks. ``budget_tokens`` is checked, not enforced: ``max_tokens``
  bounds thinking and text together;
* ``output_config``: ``format`` (a JSON schema, what the SDK's ``messages.parse`` sends) is
  chat's ``response_format`` (constrained decoding); ``effort`` the template's
  ``reasoning_effort`` (``xhigh`` and ``max`` as ``high``, the most templates know);
* ``metadata`` (``user_id``) is accepted and only checked; ``service_tier`` is accepted;
  ``cache_control`` (on blocks or the request) is accepted and needs nothing: the prefix cache
  reuses every prompt's cached blocks by itself; ``tool_result``'s ``is_error`` is accepted,
  and the template sees the result's content only (chat's tool messages have no such field).

Refused with a 400 naming the field, never dropped: image and document blocks (this server
serves text models), server tools (a ``tools[]`` entry with a ``type`` other than ``custom``),
``mcp_servers``, ``container``. Other fields are ignored, as chat ignores them. Everything
chat checks (ranges, counts, the tools' schemas, a forced choice's grammar) it checks here too,
the refusal naming the Anthropic field (``stop_sequences`` where chat says ``stop``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

from plugserve.server.protocols.openai import protocol
from plugserve.server.protocols.openai.errors import OpenAIError, rename

__all__ = ["MAX_BLOCKS", "MessagesAsk", "count_request", "messages_request", "renamed"]

#: content blocks in one request, at most (chat's bound on messages, four blocks each)
MAX_BLOCKS = 4 * protocol.MAX_MESSAGES
#: chat's field -> the Anthropic field a refusal names
_FIELDS = {
    "stop": "stop_sequences",
    "max_tokens": "max_tokens",
    "chat_template_kwargs": "thinking",
    "response_format": "output_config.format",
    "reasoning_effort": "output_config.effort",
}
#: the longest ``metadata.user_id`` (Anthropic's API takes at most 256 characters)
MAX_USER_ID = 256
#: how the chat route's prompt bound begins its refusal of a chat's messages (serving.py)
_PROMPT_TOO_LONG = "'messages' is at least"
#: ``output_config.effort`` -> chat's ``reasoning_effort``
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


@dataclasses.dataclass
class MessagesAsk:
    """A checked ``POST /v1/messages`` (or ``count_tokens``) body: the chat request it is, and
    what the answer needs of it."""

    model: str
    chat: protocol.ChatRequest
    stop_sequences: list[str] = dataclasses.field(default_factory=list)
    stream: bool = False
    #: the caller's tenant, set by the route from its token (``auth.py``), never from the body
    tenant: str = ""


def _kind(value: Any) -> str:
    return protocol._kind(value)


def _fail(message: str, field: str) -> OpenAIError:
    return OpenAIError(f"{field}: {message}", field)


#: Anthropic's text (``system``, a ``tool_result``'s content): text blocks, joined by a newline
_TEXT = protocol.TextParts(
    {"text": "text"},
    "\n",
    "{where}.{i}",
    "{where}: must be a string or an array of text blocks, not {what}",
    '{item}: must be a text block ({{"type": "text", "text": ...}}), not {kind!r}: this '
    "server serves text models",
)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _fail("must be a string or an array of content blocks", where)
    return content


def _user(content: Any, where: str, asked: set[str]) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results, then its text. ``asked``: the ids of
    the tool_use blocks of the assistant message before it, which its tool results answer (as
    Anthropic's API: a result answering no call reached the template as a tool message of a
    call never made)."""
    out: list[dict[str, Any]] = []
    texts = []
    for i, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}.{i}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            call = block.get("tool_use_id")
            if not isinstance(call, str) or not call:
                raise _fail("must be the id of the tool_use it answers", f"{at}.tool_use_id")
            if call not in asked:
                raise _fail(
                    "answers no tool_use block of the assistant message before it: each "
                    "tool_result's tool_use_id is the id of one",
                    f"{at}.tool_use_id",
                )
            result = block.get("content", "")
            text = protocol.text_of(result, f"{at}.content", _TEXT)
            out.append({"role": "tool", "tool_call_id": call, "content": text})
        else:
            raise _fail(
                f"a user message takes text and tool_result blocks, not {kind!r} (this server "
                "serves text models)",
                f"{at}.type",
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(content: Any, where: str) -> dict[str, Any]:
    """An assistant turn as one chat message: text, calls, reasoning."""
    message: dict[str, Any] = {"role": "assistant"}
    texts, calls, thinking = [], [], []
    for i, block in enumerate(_blocks(content, where)):
        kind, at = block.get("type"), f"{where}.{i}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            name, call, given = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(call, str) or not call:
                raise _fail("a tool_use block needs its 'id' and 'name'", at)
            if not isinstance(given, dict):
                raise _fail(f"must be an object, not {_kind(given)}", f"{at}.input")
            arguments = orjson.dumps(given).decode()
            function = {"name": name, "arguments": arguments}
            calls.append({"id": call, "type": "function", "function": function})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind != "redacted_thinking":  # opaque: nothing a template could read
            raise _fail(
                f"an assistant message takes text, tool_use and thinking blocks, not {kind!r}",
                f"{at}.type",
            )
    message["content"] = "".join(texts) if texts or not calls else None
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("must be a non-empty array of messages", "messages")
    blocks = sum(
        len(m["content"])
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if len(messages) > protocol.MAX_MESSAGES or blocks > MAX_BLOCKS:
        raise _fail(
            f"holds {len(messages)} messages and {blocks} blocks; at most "
            f"{protocol.MAX_MESSAGES} and {MAX_BLOCKS}",
            "messages",
        )
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = protocol.text_of(system, "system", _TEXT)
        if text:
            out.append({"role": "system", "content": text})
    asked: set[str] = set()  # the tool calls of the assistant message before
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            out += _user(message.get("content"), f"{where}.content", asked)
            asked = set()
        elif role == "assistant":
            out.append(_assistant(message.get("content"), f"{where}.content"))
            asked = {call["id"] for call in out[-1].get("tool_calls", ())}
        else:
            raise _fail(f"is {role!r}; a message's role is 'user' or 'assistant'", f"{where}.role")
    return out


def _tools(body: dict[str, Any], chat: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _fail("must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _fail("must be an object", where)
        if tool.get("type", "custom") not in ("custom", None):
            raise _fail(
                f"{tool.get('type')!r} is a server tool; this server runs none: declare tools "
                "with 'name', 'description' and 'input_schema', which the client runs",
                f"{where}.type",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _fail("must be a string", f"{where}.name")
        if not isinstance(schema, dict):
            raise _fail("must be a JSON schema (an object)", f"{where}.input_schema")
        function = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    if out:
        chat["tools"] = out


def _tool_choice(body: dict[str, Any], chat: dict[str, Any]) -> None:
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _fail(
            'must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or '
            '{"type": "none"}',
            "tool_choice",
        )
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _fail("a 'tool' choice names its tool", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise _fail("must be true or false", "tool_choice.disable_parallel_tool_use")
        chat["parallel_tool_calls"] = not parallel


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _fail(
            'must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}',
            "thinking",
        )
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (
        not isinstance(budget, int) or isinstance(budget, bool) or budget < 1
    ):
        raise _fail("must be a positive integer", "thinking.budget_tokens")
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}


def _output_config(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """``output_config``: ``format`` (a JSON schema: chat's ``response_format``, the same
    constrained decoding) and ``effort`` (the template's ``reasoning_effort``; ``xhigh`` and
    ``max`` are the most a template knows, ``high``)."""
    config = body.get("output_config")
    if config is None:
        return
    if not isinstance(config, dict):
        raise _fail("must be an object", "output_config")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise _fail('must be {"type": "json_schema", "schema": {...}}', "output_config.format")
        schema = {"name": "output", "schema": fmt.get("schema")}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in _EFFORTS:  # (a list is unhashable)
            raise _fail(f"must be one of {', '.join(_EFFORTS)}", "output_config.effort")
        chat["reasoning_effort"] = _EFFORTS[effort]


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> list[str]:
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise _fail(f"must be a number, not {_kind(temperature)}", "temperature")
        if not 0 <= temperature <= 1:
            raise _fail(f"is {temperature}; Anthropic's range is 0 to 1", "temperature")
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _fail("must be an array of strings", "stop_sequences")
    if stops:  # kept in the text so the answer names the one matched (answer.py cuts it)
        chat["stop"] = stops
        chat["include_stop_str_in_output"] = True
    return [s for s in stops if s]


def _metadata(body: dict[str, Any]) -> None:
    for key in ("mcp_servers", "container"):
        if body.get(key):
            raise _fail("is not supported: this server runs no server-side tools", key)
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not isinstance(metadata.get("user_id", ""), (str, type(None)))
    ):
        raise _fail("must be an object with an optional 'user_id' string", "metadata")
    user = metadata.get("user_id") if metadata is not None else None
    if user is not None and len(user) > MAX_USER_ID:  # (Anthropic's own bound)
        raise _fail(f"is {len(user):,} characters; at most {MAX_USER_ID}", "metadata.user_id")


def renamed(exc: OpenAIError) -> OpenAIError:
    """A chat refusal naming the Anthropic field it came from. The chat's ``messages`` are
    Anthropic's ``system`` and ``messages`` together: a prompt too long says so (a long
    ``system`` was refused naming ``messages`` alone)."""
    param = exc.param or ""
    head = param.split("[", 1)[0].split(".", 1)[0]
    if head in _FIELDS:
        rename(exc, head, _FIELDS[head])
    elif param == "messages" and str(exc).startswith(_PROMPT_TOO_LONG):
        prompt = "the prompt ('system' and 'messages' together)"
        exc.args = (prompt + str(exc)[len("'messages'") :], *exc.args[1:])
    return exc


def _decode(body: dict[str, Any], counting: bool) -> MessagesAsk:
    model = protocol._model(body)
    _metadata(body)
    chat: dict[str, Any] = {"model": model, "messages": _messages(body)}
    if chat["messages"][-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    stops = _sampling(body, chat)
    if not counting:
        if body.get("max_tokens") is None:
            raise _fail("Field required", "max_tokens")
        chat["max_tokens"] = body["max_tokens"]
    _tools(body, chat)
    _tool_choice(body, chat)
    _thinking(body, chat)
    _output_config(body, chat)
    stream = protocol._boolean(body, "stream") and not counting
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    try:
        request = protocol.chat_request(chat)
    except OpenAIError as exc:
        raise renamed(exc) from None
    return MessagesAsk(model=model, chat=request, stop_sequences=stops, stream=stream)


def messages_request(body: dict[str, Any]) -> MessagesAsk:
    """POST /v1/messages: the body checked, its chat request made."""
    return _decode(body, False)


def count_request(body: dict[str, Any]) -> MessagesAsk:
    """POST /v1/messages/count_tokens: the same body without ``max_tokens`` and ``stream``."""
    return _decode(body, True)
