"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``),
served by the chat path it stands on.

A request is turned into a chat request and run through the chat route's own code
(``OpenAIRoutes._chat``: the same checks, template, tokenizing, engine, budget, trace), never an
HTTP hop; its answer, the chat completion (or its stream of chunks), is turned into a response:

* ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
  ``function_call``, ``function_call_output``, ``reasoning``) becomes chat messages
  (:func:`input_messages`): a ``function_call`` an assistant message's ``tool_calls`` (calls in a
  row are one message, as a model makes them), a ``function_call_output`` a ``tool`` message
  with its ``tool_call_id``, a ``reasoning`` item the next assistant message's
  ``reasoning_content`` (what Qwen3-style templates read); ``instructions`` the first, system,
  message (not carried over by ``previous_response_id``, as OpenAI);
* ``tools`` (``function`` tools only), ``tool_choice``, ``parallel_tool_calls``,
  ``text.format`` (``json_schema``, ``json_object``: chat's ``response_format``),
  ``max_output_tokens`` (chat's ``max_completion_tokens``), ``temperature``, ``top_p``,
  ``reasoning.effort`` (given to the template as ``reasoning_effort``) map onto chat's fields,
  so what chat honours or refuses, responses does too (the refusal naming the responses field);
* the chat's answer (content, tool calls, reasoning) becomes output items in ONE place,
  :func:`output_items`: a ``reasoning`` item, a ``message`` with one ``output_text`` part, a
  ``function_call`` per call. When the chat answer carries parsed ``tool_calls`` (and
  ``reasoning_content``), they come out as ``function_call`` (and ``reasoning``) items with no
  change here; streamed, :class:`EventStream` turns chat's tool-call and reasoning deltas into
  ``response.function_call_arguments.delta`` and ``response.reasoning_text.delta`` events.

Streamed (``stream: true``): the events the ``openai`` SDK's ``responses.stream`` accumulates,
each with its ``sequence_number`` and ``event:`` line as OpenAI writes them:
``response.created``, ``response.in_progress``, per item ``response.output_item.added`` (a
message's ``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``; a call's
``response.function_call_arguments.delta`` ... ``.done``), ``response.output_item.done``; then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` or the context
cut the answer, or ``response.failed`` when it failed midway (the status line was out).

Kept responses (``store``, true unless said false) live in :mod:`.responses_store`, bounded in
entries, bytes (charged to the memory budget) and age; ``previous_response_id`` continues the
conversation a kept response ended (404 when it is not kept: evicted, expired, deleted, or
made with ``store: false``).

Refused with a 400 naming the field, never dropped: ``background``, ``conversation``,
``prompt`` (stored prompts), ``include`` values, tools other than functions, ``truncation``
``auto`` (nothing is truncated: a conversation too long for the context is a 400), image, file
and audio parts, ``item_reference`` items, ``top_logprobs``, ``max_tool_calls``. Fields that
only describe the request (``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``) are kept in the response or ignored as chat ignores them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from plugserve.server.protocols.http import sse
from plugserve.server.protocols.http.http_server import StreamReply
from plugserve.server.protocols.openai import protocol
from plugserve.server.protocols.openai.errors import OpenAIError
from plugserve.server.protocols.openai.responses_store import ResponseStore

__all__ = [
    "EventStream",
    "ResponsesAsk",
    "ResponsesRoutes",
    "input_messages",
    "output_items",
    "responses_request",
]

_JSON = [(b"content-type", b"application/json")]
#: items in ``input``, at most (chat's messages bound)
MAX_ITEMS = protocol.MAX_MESSAGES
#: ``metadata``: OpenAI's bounds (16 keys, 64-character keys, 512-character values)
MAX_METADATA = 16

#: chat's field -> the responses field a refusal names
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}
#: request fields this server knows and refuses when set (the value that is allowed, if any)
_REFUSED: dict[str, tuple[Any, str]] = {
    "background": (False, "runs in the background are not supported; leave it out"),
    "conversation": (None, "conversations are not kept by this server; use "
                     "'previous_response_id'"),
    "prompt": (None, "stored prompt templates are not supported; send 'input'"),
    "max_tool_calls": (None, "a bound on built-in tool calls is not supported (this server "
                       "runs no built-in tools)"),
    "top_logprobs": (None, "logprobs are not served on /v1/responses yet; use "
                     "/v1/chat/completions with 'logprobs'"),
}  # fmt: skip


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
    #: the input items as given (for the conversation kept with the response)
    size: int = 0


# --- the request


def _text(value: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise OpenAIError(f"'{where}' must be a string or an array of content parts", where)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        raise OpenAIError(
            f'\'{where}[{i}]\' must be a text part ({{"type": "input_text", "text": ...}}); '
            f"this server serves text models, not {kind!r} parts",
            f"{where}[{i}]",
        )
    return "".join(texts)


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
                "content": _text(item.get("content"), f"{where}.content"),
            }
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(message)
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise OpenAIError(f"'{where}.{key}' must be a string", f"{where}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {
                    "name": item["name"],
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
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise OpenAIError(f"'{where}.call_id' must be a string", f"{where}.call_id")
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text(output, f"{where}.output")
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
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise OpenAIError(f"'tools[{i}].name' must be a string", f"tools[{i}].name")
        function = {"name": tool["name"]}
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
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("'text.format' must be an object with a 'type'", "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "response"),
                "schema": fmt.get("schema", {}),
            },
        }
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise OpenAIError(
        f"'text.format.type' must be 'text', 'json_object' or 'json_schema', not {kind!r}",
        "text.format.type",
    )


def responses_request(body: dict[str, Any]) -> ResponsesAsk:
    """POST /v1/responses: the body checked (the chat fields are checked again, as chat's,
    once the conversation is known: :meth:`ResponsesRoutes._chat_ask`)."""
    model = protocol._model(body)
    for key, (allowed, why) in _REFUSED.items():
        if body.get(key) is not None and body.get(key) != allowed:
            raise OpenAIError(f"'{key}': {why}", key)
    include = body.get("include")
    if include:
        raise OpenAIError(
            f"'include' asks for {include!r}; this server adds nothing to the output on request "
            "(leave it out)",
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
    for key in ("temperature", "top_p", "parallel_tool_calls", "stream", "user"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
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


# --- the answer: one seam from the chat's result to output items


def output_items(
    content: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    status: str = "completed",
) -> list[dict[str, Any]]:
    """The output items of a chat answer: a ``reasoning`` item (when there is reasoning), a
    ``message`` (when there is text, or nothing else), and a ``function_call`` per tool call
    (chat's ``{"id", "function": {"name", "arguments"}}``). The only place a chat answer
    becomes items: the non-streamed path calls it, and :class:`EventStream` makes the same
    items as it streams."""
    items = []
    if reasoning:
        items.append(reasoning_item(_new_id("rs"), reasoning, status))
    if content or not tool_calls:
        items.append(message_item(_new_id("msg"), content or "", status))
    for call in tool_calls or ():
        function = call.get("function") or {}
        items.append(
            call_item(
                _new_id("fc"),
                call.get("id") or _new_id("call"),
                function.get("name", ""),
                function.get("arguments", ""),
                status,
            )
        )
    return items


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text)],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [] if text is None else [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's ``usage`` in responses' names."""
    if not chat:
        return None
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat.get("total_tokens", 0),
    }


def response_object(
    rid: str,
    created: int,
    model: str,
    ask: ResponsesAsk,
    status: str,
    output: list[dict[str, Any]],
    used: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        **ask.echo,
        "usage": used,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the chat messages a next turn renders (``previous_response_id``)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "message":
            text = "".join(p.get("text", "") for p in item["content"])
            message["content"] = (message["content"] or "") + text
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        elif item["type"] == "reasoning":
            text = "".join(p.get("text", "") for p in item["content"])
            message["reasoning_content"] = text
    if message["content"] is None and "tool_calls" not in message:
        message["content"] = ""
    return [message]


# --- streaming: chat chunks in, response events out


class EventStream:
    """Responses' events from chat's streamed deltas (``choices[0].delta``: ``content``,
    ``tool_calls``, ``reasoning_content`` / ``reasoning``), one item open at a time: a change
    of kind closes the open item and opens the next, as OpenAI orders them."""

    def __init__(self, rid: str, created: int, model: str, ask: ResponsesAsk) -> None:
        self.rid, self.created, self.model, self.ask = rid, created, model, ask
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        #: the open item's text so far (message, reasoning) or arguments (call)
        self._text: list[str] = []
        #: chat's tool-call index -> the call item's output index
        self._calls: dict[int, int] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        value = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse.event(orjson.dumps(value))

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        output = self.output if status != "in_progress" else []
        return response_object(
            self.rid, self.created, self.model, self.ask, status, output, self.usage, error
        )

    def opening(self) -> list[bytes]:
        start = self.response("in_progress")
        return [
            self._event("response.created", response=start),
            self._event("response.in_progress", response=start),
        ]

    # --- items

    def _close(self) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        text = "".join(self._text)
        self._text = []
        events = []
        item["status"] = "completed"
        if item["type"] == "message":
            part = _text_part(text)
            item["content"] = [part]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
        else:
            item["arguments"] = text
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _begin(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        elif item["type"] == "reasoning":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part={"type": "reasoning_text", "text": ""},
                )
            )
        return events

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                events += self._begin(message_item(_new_id("msg"), None, "in_progress"))
            else:
                events += self._begin(reasoning_item(_new_id("rs"), None, "in_progress"))
        assert self._open is not None
        self._text.append(text)
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        fields: dict[str, Any] = {
            "item_id": self._open["id"],
            "output_index": len(self.output) - 1,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            fields["logprobs"] = []
        events.append(self._event(name, **fields))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        if index not in self._calls:
            item = call_item(
                _new_id("fc"),
                call.get("id") or _new_id("call"),
                function.get("name") or "",
                "",
                "in_progress",
            )
            events += self._begin(item)
            self._calls[index] = len(self.output) - 1
        elif self._calls[index] != len(self.output) - 1:
            return events  # a delta to a call already closed: chat's parsers never send it
        arguments = function.get("arguments") or ""
        if arguments:
            assert self._open is not None
            self._text.append(arguments)
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=self._calls[index],
                    delta=arguments,
                )
            )
        return events

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk."""
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        events: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                events += self._text_delta("reasoning", reasoning)
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def closing(self) -> list[bytes]:
        """The open item closed and the last event: completed, or incomplete."""
        events = self._close()
        if not self.output:  # nothing generated: an empty message, as the whole answer has
            events += self._begin(message_item(_new_id("msg"), None, "in_progress"))
            events += self._close()
        status = _status(self.finish_reason)
        events.append(self._event(f"response.{status}", response=self.response(status)))
        return events

    def failed(self, error: dict[str, Any]) -> list[bytes]:
        events = self._close()
        events.append(self._event("response.failed", response=self.response("failed", error)))
        return events


def _sse_values(piece: bytes) -> list[Any]:
    """The JSON values of the ``data:`` events in a chat stream's piece (``[DONE]`` left out)."""
    values = []
    for block in piece.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: ") and line[6:] != b"[DONE]":
                values.append(orjson.loads(line[6:]))
    return values


# --- the routes


class ResponsesRoutes:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` over the chat
    routes (``openai``: their :class:`~.serving.OpenAIRoutes`) and a bounded store."""

    def __init__(self, openai: Any, store: ResponseStore) -> None:
        self.openai = openai
        self.store = store

    def routes(self, prefix: str, infer: str, guarded: Callable[[Any], Any]) -> list[Any]:
        return [
            (prefix + "/responses", {"POST": (infer, guarded(self.create))}),
            (
                prefix + r"/responses/(?P<response>[^/]+)",
                {"GET": (infer, guarded(self.retrieve)), "DELETE": (infer, guarded(self.delete))},
            ),
        ]

    # --- GET and DELETE

    def _kept(self, rid: str) -> Any:
        entry = self.store.get(rid)
        if entry is None:
            raise OpenAIError(
                f"Response with id '{rid}' not found (never made with 'store', deleted, or "
                f"evicted from this server's bounded store: {self._bounds()})",
                "response_id",
                404,
            )
        return entry

    def _bounds(self) -> str:
        s = self.store
        if not s.on:
            return "the store is off (--responses-store-bytes 0)"
        return (
            f"{s.max_entries} responses, {s.max_bytes >> 20} MiB, {s.max_age_s:g} s "
            "(--responses-store-entries, --responses-store-bytes, --responses-store-seconds)"
        )

    def retrieve(self, call: Any) -> Any:
        entry = self._kept(call.path["response"])
        return 200, [entry.response], _JSON

    def delete(self, call: Any) -> Any:
        rid = call.path["response"]
        if not self.store.delete(rid):
            self._kept(rid)
        body = {"id": rid, "object": "response.deleted", "deleted": True}
        return 200, [orjson.dumps(body)], _JSON

    # --- POST

    async def create(self, call: Any) -> Any:
        return await self.openai._answer(call, responses_request, "responses", self._create)

    def _history(self, ask: ResponsesAsk) -> list[dict[str, Any]]:
        if ask.previous_response_id is None:
            return []
        entry = self.store.get(ask.previous_response_id)
        if entry is None:
            raise OpenAIError(
                f"Previous response with id '{ask.previous_response_id}' not found (never made "
                f"with 'store', deleted, or evicted from this server's bounded store: "
                f"{self._bounds()})",
                "previous_response_id",
                404,
            )
        return entry.messages()

    def _chat_ask(
        self, ask: ResponsesAsk, history: list[dict[str, Any]]
    ) -> tuple[protocol.ChatRequest, list[dict[str, Any]]]:
        """The chat request of ``ask`` after ``history`` (checked as chat checks it, a
        refusal naming the responses field) and the conversation it continues."""
        conversation = [*history, *ask.messages]
        system = [{"role": "system", "content": ask.instructions}] if ask.instructions else []
        body = {**ask.chat, "messages": [*system, *conversation]}
        try:
            chat = protocol.chat_request(body)
        except OpenAIError as exc:
            raise _renamed(exc) from None
        chat.max_tokens_field = "max_output_tokens"
        return chat, conversation

    async def _create(self, ask: ResponsesAsk, trace: Any) -> Any:
        history = self._history(ask)
        if history or len(ask.messages) > 64:
            chat, conversation = await self.openai._in_worker(self._chat_ask, ask, history)
        else:
            chat, conversation = self._chat_ask(ask, history)
        rid = _new_id("resp")
        created = int(time.time())
        try:
            reply = await self.openai._chat(chat, trace)
        except OpenAIError as exc:
            raise _renamed(exc) from None
        if isinstance(reply, StreamReply):
            events = EventStream(rid, created, chat.model, ask)
            reply.chunks = self._streamed(events, reply.chunks, conversation)
            return reply
        status, pieces, _headers = reply
        if status != 200:
            return reply
        answer = orjson.loads(b"".join(pieces))
        choice = answer["choices"][0]
        message = choice.get("message") or {}
        state = _status(choice.get("finish_reason"))
        output = output_items(
            message.get("content"),
            message.get("tool_calls"),
            message.get("reasoning_content") or message.get("reasoning"),
        )
        body = response_object(
            rid, created, chat.model, ask, state, output, usage(answer.get("usage"))
        )
        if ask.store:
            self._keep(body, conversation)
        return 200, [orjson.dumps(body)], _JSON

    def _keep(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self.store.put(body["id"], body, [*conversation, *assistant_messages(body["output"])])

    async def _streamed(
        self, events: EventStream, chunks: AsyncIterator[bytes], conversation: list[dict[str, Any]]
    ) -> AsyncIterator[bytes]:
        try:
            for piece in events.opening():
                yield piece
            async for piece in chunks:
                for value in _sse_values(piece):
                    if "error" in value and "choices" not in value:
                        for event in events.failed(value["error"]):
                            yield event
                        return
                    for event in events.chunk(value):
                        yield event
            finished = events.closing()
            if events.ask.store:
                self._keep(events.response(_status(events.finish_reason)), conversation)
            for event in finished:
                yield event
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]  # its own finally cancels


def _renamed(exc: OpenAIError) -> OpenAIError:
    """A chat refusal naming the responses field it came from."""
    param = exc.param or ""
    for chat_name, name in _PARAMS.items():
        if (
            param == chat_name
            or param.startswith(chat_name + "[")
            or param.startswith(chat_name + ".")
        ):
            exc.param = name + param[len(chat_name) :] if chat_name != "messages" else "input"
            break
    return exc
