"""A ``POST /v1/responses`` body checked, and its ``input`` items as the chat messages the chat
path renders (``responses.py`` runs them; docs/openai.md, "The Responses API").

``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
``function_call``, ``function_call_output``, ``reasoning``) becomes chat messages
(:func:`input_messages`): a ``function_call`` an assistant message's ``tool_calls`` (calls in a
row are one message, as a model makes them), a ``function_call_output`` a ``tool`` message with
its ``tool_call_id``, a ``reasoning`` item the next assistant message's ``reasoning_content``
(what Qwen3-style templates read). ``tools`` (``function`` tools only), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (chat's ``response_format``), ``max_output_tokens``
(chat's ``max_completion_tokens``), ``temperature``, ``top_p`` and ``reasoning.effort`` (given
to the template as ``reasoning_effort``) become a chat body (:attr:`ResponsesAsk.chat`), which
chat's own checks read once the conversation is known, so what chat honours or refuses,
responses does too.

``top_logprobs`` (or ``include: ["message.output_text.logprobs"]``) is chat's ``logprobs``, its
entries in the ``output_text`` part (and each delta) in chat's format, as OpenAI's.

Refused with a 400 naming the field, never dropped: ``background``, ``conversation``,
``prompt`` (stored prompts), other ``include`` values, tools other than functions,
``truncation`` ``auto`` (nothing is truncated: a conversation too long for the context is a
400), image, file and audio parts, ``item_reference`` items, ``max_tool_calls``,
``text.verbosity`` other than ``medium``. Fields that only describe the request (``metadata``,
``user``) are kept in the response; others unknown are ignored, as chat ignores them.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import orjson

from plugserve.server.protocols.openai import protocol
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = ["MAX_ITEMS", "ResponsesAsk", "input_items", "input_messages", "responses_request"]

#: items in ``input``, at most (chat's messages bound)
MAX_ITEMS = protocol.MAX_MESSAGES
#: ``metadata``: OpenAI's bounds (16 keys, 64-character keys, 512-character values)
MAX_METADATA = 16

#: what ``include`` may ask for: the output text's logprobs (chat's, with ``top_logprobs``)
_INCLUDE = ("message.output_text.logprobs",)
#: request fields this server knows and refuses when set (the value that is allowed, if any)
_REFUSED: dict[str, tuple[Any, str]] = {
    "background": (False, "runs in the background are not supported; leave it out"),
    "conversation": (None, "conversations are not kept by this server; use "
                     "'previous_response_id'"),
    "prompt": (None, "stored prompt templates are not supported; send 'input'"),
    "max_tool_calls": (None, "a bound on built-in tool calls is not supported (this server "
                       "runs no built-in tools)"),
}  # fmt: skip


def _kind(value: Any) -> str:
    return protocol._kind(value)


@dataclasses.dataclass
class ResponsesAsk:
    """A checked ``POST /v1/responses`` body: the chat fields it maps to (``chat``, a chat
    request body without ``messages``), the new turn's messages, and what the response echoes."""

    model: str
    messages: list[dict[str, Any]]
    chat: dict[str, Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    #: what the response object repeats of the request
    echo: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the request's ``input`` as the items GET /v1/responses/{id}/input_items lists
    items: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the caller's tenant (``auth.py``; "" without tokens), set by the route, never from the
    #: body: the store keeps its responses apart, and its chat its part of the prefix cache
    tenant: str = ""


#: Responses' message content: text parts (Responses' types and chat's) and refusals
_TEXT = protocol.TextParts(
    {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"},
    "",
    "{where}[{i}]",
    "'{where}' must be a string or an array of content parts",
    '\'{item}\' must be a text part ({{"type": "input_text", "text": ...}}); this server '
    "serves text models, not {kind!r} parts",
)


def _named(item: dict[str, Any], key: str, where: str) -> str:
    """``item[key]``, an id or a name: a non-empty string (refused, naming ``where.key``,
    otherwise)."""
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return orjson.dumps(value).decode()
    raise OpenAIError(f"'{where}' must be a JSON string, not {_kind(value)}", where)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages (the module's docstring); a 400 naming the first item that
    cannot be one."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise OpenAIError("'input' must be a string or a non-empty array of input items", "input")
    if len(value) > MAX_ITEMS:
        raise OpenAIError(f"'input' holds {len(value)} items; at most {MAX_ITEMS}", "input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"'{where}' must be an input item (an object)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(
                    f"'{where}.role' is {role!r}; a message's role is user, system, developer "
                    "or assistant",
                    f"{where}.role",
                )
            message: dict[str, Any] = {
                "role": role,
                "content": protocol.text_of(item.get("content"), f"{where}.content", _TEXT),
            }
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _named(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _named(item, "name", where),
                    "arguments": _arguments(item.get("arguments", "{}"), f"{where}.arguments"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"] = "".join(reasoning)
                    reasoning = []
                messages.append(message)
        elif kind == "function_call_output":
            call_id = _named(item, "call_id", where)
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": protocol.text_of(output, f"{where}.output", _TEXT)
                    if not isinstance(output, (dict, int, float))
                    else orjson.dumps(output).decode(),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise OpenAIError(f"'{where}.content' must be an array", f"{where}.content")
            for part in parts:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        else:
            raise OpenAIError(
                f"'{where}.type' is {kind!r}; this server takes message, function_call, "
                "function_call_output and reasoning items",
                f"{where}.type",
            )
    return messages


#: an input item's id prefix, by its type (OpenAI's)
_ITEM_IDS = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def input_items(value: Any) -> list[dict[str, Any]]:
    """``input`` (checked by :func:`input_messages` first) as the items OpenAI lists for it:
    a string a user message, each item with an ``id`` (its own, or one made) and a
    ``status``; a message's text content as one ``input_text`` part (``output_text`` for
    the assistant's)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        made = {"id": f"{_ITEM_IDS.get(kind, 'item')}_{uuid.uuid4().hex}", **item, "type": kind}
        if kind == "message" and isinstance(made.get("content"), str):
            part = "output_text" if made.get("role") == "assistant" else "input_text"
            made["content"] = [{"type": part, "text": made["content"]}]
        if kind != "reasoning":
            made.setdefault("status", "completed")
        items.append(made)
    return items


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise OpenAIError(
                f"'tools[{i}].type' is {kind!r}; this server runs no built-in tools, only "
                "'function' tools the client runs",
                f"tools[{i}].type",
            )
        function = {"name": _named(tool, "name", f"tools[{i}]")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(value: Any) -> Any:
    """Responses' ``tool_choice`` as chat's."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise OpenAIError(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        '"name": ...}',
        "tool_choice",
    )


def _text_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise OpenAIError("'text' must be an object", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise OpenAIError("'text.verbosity' other than 'medium' is not supported", "text.verbosity")
    fmt = text.get("format")
    kind = protocol._format_kind(fmt, "text.format")
    if kind is None:
        return None
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema", {})}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": kind}


def responses_request(body: dict[str, Any]) -> ResponsesAsk:
    """POST /v1/responses: the body checked (the chat fields are checked again, as chat's,
    once the conversation is known: :meth:`ResponsesRoutes._chat_ask`)."""
    model = protocol._model(body)
    for key, (allowed, why) in _REFUSED.items():
        if body.get(key) is not None and body.get(key) != allowed:
            raise OpenAIError(f"'{key}': {why}", key)
    include = body.get("include") or []
    if not isinstance(include, list) or any(v not in _INCLUDE for v in include):
        raise OpenAIError(
            f"'include' asks for {include!r}; this server adds only {list(_INCLUDE)}",
            "include",
        )
    if body.get("truncation") not in (None, "disabled"):
        raise OpenAIError(
            "'truncation' may only be 'disabled': this server never drops input (a "
            "conversation too long for the model's context is a 400)",
            "truncation",
        )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise OpenAIError("'instructions' must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise OpenAIError("'previous_response_id' must be a response id", "previous_response_id")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA
        or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise OpenAIError(
            f"'metadata' must map at most {MAX_METADATA} keys (64 characters) to strings (512 "
            "characters)",
            "metadata",
        )
    chat: dict[str, Any] = {"model": model}
    for key in ("temperature", "top_p", "parallel_tool_calls", "stream", "user", "cache_salt"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("top_logprobs") is not None or "message.output_text.logprobs" in include:
        chat["logprobs"] = True  # chat checks top_logprobs' range, named the same
        chat["top_logprobs"] = body.get("top_logprobs") or 0
    tools = _tools(body)
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _text_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise OpenAIError("'reasoning' must be an object", "reasoning")
        if reasoning.get("effort") is not None:
            chat["chat_template_kwargs"] = {"reasoning_effort": reasoning["effort"]}
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    ask = ResponsesAsk(
        model=model,
        messages=input_messages(body.get("input")),
        chat=chat,
        instructions=instructions,
        previous_response_id=previous,
        store=protocol._boolean(body, "store", True),
        stream=protocol._boolean(body, "stream"),
    )
    ask.items = input_items(body.get("input"))
    ask.echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous,
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
        "store": ask.store,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ask
