"""A chat answer as Responses output items, whole or streamed as OpenAI's events: the one seam
between the chat path's result (its whole choice, or its typed pieces: ``deltas.py``) and the
Responses API (``responses.py`` calls it).

:func:`output_items` makes the items of a whole chat answer (its ``content``, its ``tool_calls``
and its ``reasoning_content``): a ``reasoning`` item, a ``message`` with one ``output_text``
part, a ``function_call`` per call. When the chat path parses tool calls and reasoning out of
an answer, they come out as ``function_call`` and ``reasoning`` items with no change here.

:class:`EventStream` makes the same items from the answer's typed pieces, as the events the
``openai`` SDK's ``responses.stream`` accumulates, each with its ``sequence_number`` and an
``event:`` line as OpenAI writes them: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` (a message's ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``; a call's ``response.function_call_arguments.delta`` ...
``.done``; reasoning's ``response.reasoning_text.delta`` ... ``.done``),
``response.output_item.done``; then ``response.completed``, or ``response.incomplete`` when
``max_output_tokens`` or the context cut the answer (OpenAI's ``incomplete_details.reason``
``max_output_tokens``), or ``response.failed`` when it failed midway (the status line was
out). One item is open at a time: a change of kind closes it, as OpenAI orders them.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from plugserve.server.protocols.http import sse
from plugserve.server.protocols.openai.deltas import CallPiece, FaceEvents, from_chat

__all__ = [
    "EventStream",
    "assistant_messages",
    "new_id",
    "output_items",
    "response_object",
    "status_of",
    "usage",
]


def new_id(prefix: str) -> str:
    """An id as OpenAI writes them (``resp_``, ``msg_``, ...): 128 random bits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(
    content: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
    status: str = "completed",
    logprobs: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The output items of a chat answer: a ``reasoning`` item (when there is reasoning), a
    ``message`` (when there is text, or nothing else), and a ``function_call`` per tool call
    (chat's ``{"id", "function": {"name", "arguments"}}``). The only place a chat answer
    becomes items: the non-streamed path calls it, and :class:`EventStream` makes the same
    items as it streams. ``logprobs``: chat's ``logprobs.content`` (the text's tokens)."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status))
    if content or not tool_calls:
        items.append(message_item(new_id("msg"), content or "", status, logprobs))
    for call in tool_calls or ():
        function = call.get("function") or {}
        items.append(
            call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                function.get("name", ""),
                function.get("arguments", ""),
                status,
            )
        )
    return items


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[Any] | None = None
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if text is None else [_text_part(text, logprobs)],
    }


def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """An ``output_text`` part; ``logprobs`` in chat's format (``top_logprobs`` asked)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


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
    echo: dict[str, Any],
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
        **echo,
        "usage": used,
    }


def status_of(finish_reason: str | None) -> str:
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


# --- streamed: the answer's pieces in, response events out


class EventStream(FaceEvents):
    """Responses' events from the answer's typed pieces (``deltas.py``: content, reasoning,
    a tool call's head and arguments, the finish), one item open at a time: a change of kind
    closes the open item and opens the next, as OpenAI orders them."""

    def __init__(self, rid: str, created: int, model: str, echo: dict[str, Any]) -> None:
        """``echo``: what the response object repeats of its request."""
        self.rid, self.created, self.model, self.echo = rid, created, model, echo
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        #: the open item's text so far (message, reasoning) or arguments (call)
        self._text: list[str] = []
        #: chat's tool-call index -> the call item's output index
        self._calls: dict[int, int] = {}
        #: the open message's logprobs so far (chat's ``logprobs.content`` entries)
        self._logprobs: list[Any] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None  # chat's

    def _of(self, item: dict[str, Any], index: int, kind: str, **fields: Any) -> bytes:
        """An event of output item ``item`` (at ``index``): its id and index, then ``fields``."""
        return self._event(kind, item_id=item["id"], output_index=index, **fields)

    def _event(self, kind: str, **fields: Any) -> bytes:
        value = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse.event(orjson.dumps(value))

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        output = self.output if status != "in_progress" else []
        return response_object(
            self.rid, self.created, self.model, self.echo, status, output, usage(self.usage), error
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
            logprobs, self._logprobs = self._logprobs, []
            part = _text_part(text, logprobs)
            item["content"] = [part]
            events.append(
                self._of(
                    item,
                    index,
                    "response.output_text.done",
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                )
            )
            events.append(
                self._of(item, index, "response.content_part.done", content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(
                self._of(item, index, "response.reasoning_text.done", content_index=0, text=text)
            )
        else:
            item["arguments"] = text
            events.append(
                self._of(
                    item,
                    index,
                    "response.function_call_arguments.done",
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
                self._of(
                    item, index, "response.content_part.added", content_index=0, part=_text_part("")
                )
            )
        elif item["type"] == "reasoning":
            events.append(
                self._of(
                    item,
                    index,
                    "response.content_part.added",
                    content_index=0,
                    part={"type": "reasoning_text", "text": ""},
                )
            )
        return events

    def _reasoning(self, text: str) -> list[bytes]:
        return self._text_delta("reasoning", text)

    def _content(self, text: str, logprobs: list[Any] | None) -> list[bytes]:
        return self._text_delta("message", text, logprobs)

    def _text_delta(self, kind: str, text: str, logprobs: list[Any] | None = None) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                events += self._begin(message_item(new_id("msg"), None, "in_progress"))
            else:
                events += self._begin(reasoning_item(new_id("rs"), None, "in_progress"))
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
            fields["logprobs"] = logprobs or []
            self._logprobs += logprobs or []
        events.append(self._event(name, **fields))
        return events

    def _call(self, call: CallPiece) -> list[bytes]:
        events: list[bytes] = []
        index = call.index
        if index not in self._calls:
            item = call_item(
                new_id("fc"), call.id or new_id("call"), call.name or "", "", "in_progress"
            )
            events += self._begin(item)
            self._calls[index] = len(self.output) - 1
        elif self._calls[index] != len(self.output) - 1:
            return events  # a delta to a call already closed: chat's parsers never send it
        if call.arguments:
            assert self._open is not None
            self._text.append(call.arguments)
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self._open["id"],
                    output_index=self._calls[index],
                    delta=call.arguments,
                )
            )
        return events

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of a chat chunk as a client reads it (``deltas.from_chat``): a chat
        stream from elsewhere; the server's own answers come as pieces (:meth:`delta`)."""
        pieces, used = from_chat(chunk)
        if used:
            self.usage = used
        return [event for piece in pieces for event in self.delta(piece)]

    def closing(self) -> list[bytes]:
        """The open item closed and the last event: completed, or incomplete."""
        events = self._close()
        if not self.output:  # nothing generated: an empty message, as the whole answer has
            events += self._begin(message_item(new_id("msg"), None, "in_progress"))
            events += self._close()
        status = status_of(self.finish)
        events.append(self._event(f"response.{status}", response=self.response(status)))
        return events

    def failed(self, error: dict[str, Any]) -> list[bytes]:
        events = self._close()
        events.append(self._event("response.failed", response=self.response("failed", error)))
        return events
