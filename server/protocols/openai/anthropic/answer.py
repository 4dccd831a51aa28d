"""A chat answer as Anthropic's message, whole or streamed as its events: the one seam between
the chat path's result (its whole choice, or its typed pieces: ``deltas.py``) and the Messages
API (``routes.py`` calls it).

Blocks, in the order a model writes them: ``thinking`` (the reasoning the model's parser split
out; ``signature`` is empty: nothing here signs it, and a client sends it back as it came),
``text``, then a ``tool_use`` per call (``input`` the arguments as an object; ``{}`` when
``max_tokens`` cut them short). ``stop_reason``: ``max_tokens`` when the answer was cut,
``tool_use`` when it holds calls (forced ones too, as Anthropic answers ``any`` and ``tool``),
``stop_sequence`` when one of ``stop_sequences`` ended it (``stop_sequence`` names it; the chat
request kept it in the text, :class:`StopTail` cuts it), ``end_turn`` otherwise. ``usage``:
``input_tokens`` are the prompt's tokens not read from the prefix cache, ``cache_read_input_tokens``
those that were (Anthropic's split: their sum is what ``count_tokens`` says),
``output_tokens`` the answer's.

:class:`EventStream` makes the same blocks from the answer's typed pieces as the events the
``anthropic`` SDK's ``messages.stream`` accumulates, each with its ``event:`` line:
``message_start``, per block ``content_block_start``, its deltas (``thinking_delta``,
``text_delta``, ``input_json_delta``: a call's arguments in the fragments the model wrote)
and ``content_block_stop``; one ``ping`` after the first block starts; then ``message_delta``
(the stop reason and the final usage) and ``message_stop``. A failure once the status line is
out is an ``error`` event, as Anthropic sends an overloaded stream's.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from plugserve.server.apps.generate.text.detokenizer import StopScan
from plugserve.server.protocols.http import sse
from plugserve.server.protocols.openai.anthropic import errors
from plugserve.server.protocols.openai.deltas import CallPiece, FaceEvents

__all__ = ["EventStream", "StopTail", "message", "new_id", "tool_input", "usage"]


def new_id(prefix: str = "msg") -> str:
    """An id as Anthropic writes them (``msg_``, ``toolu_``): 128 random bits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _tool_id(call_id: str | None) -> str:
    if not call_id:
        return new_id("toolu")
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str | None) -> Any:
    """A call's arguments (JSON text) as ``tool_use.input``: the object, or ``{}`` when they do
    not read as one (cut short by ``max_tokens``)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, calls: bool, matched: str | None) -> str:
    if finish == "length":
        return "max_tokens"
    if calls or finish == "tool_calls":
        return "tool_use"
    return "stop_sequence" if matched is not None else "end_turn"


def usage(chat: dict[str, Any] | None, output: bool = True) -> dict[str, Any]:
    """Chat's ``usage`` in Anthropic's names (the prompt's cached tokens apart)."""
    chat = chat or {}
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    made = {
        "input_tokens": chat.get("prompt_tokens", 0) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
    if output:
        made["output_tokens"] = chat.get("completion_tokens", 0)
    return made


class StopTail:
    """A text's end held back while it could still be one of ``stops`` (the chat request keeps
    the matched stop sequence in the text), and the stop sequence cut once it is complete:
    the detokenizer's own scan (``StopScan``: a character costs each stop sequence O(1),
    amortized)."""

    def __init__(self, stops: list[str]) -> None:
        self.scan = StopScan(stops) if stops else None
        self.length = 0  # characters fed since the last flush
        self.unsent = ""
        #: the stop sequence that ended the text, once found
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """What of ``text`` may be sent now."""
        if self.scan is None:
            return text
        if self.matched is not None:
            return ""
        start = self.length - len(self.unsent)
        found = self.scan.feed(text, self.length)
        self.length += len(text)
        self.unsent += text
        if found is not None:
            out, self.unsent = self.unsent[: found[0] - start], ""
            self.matched = found[1]
            return out
        keep = self.scan.held()
        out = self.unsent[: len(self.unsent) - keep]
        self.unsent = self.unsent[len(out) :]
        return out

    def flush(self) -> str:
        """What is held, sent after all (the text went on with something else)."""
        out, self.unsent = self.unsent, ""
        if self.scan is not None:
            self.scan.states = [0] * len(self.scan.stops)
            self.length = 0
        return out


def message(
    rid: str,
    model: str,
    choice: dict[str, Any],
    used: dict[str, Any] | None,
    stops: list[str],
) -> dict[str, Any]:
    """The message of a whole answer: ``choice``, chat's choice of it (``Answer.choice``:
    its message through the parsers, its finish), ``used`` chat's usage."""
    chat = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = chat.get("reasoning_content") or chat.get("reasoning")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    tail = StopTail(stops)
    text = tail.feed(chat.get("content") or "")
    text += tail.flush()
    if text:
        content.append({"type": "text", "text": text})
    calls = chat.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": _tool_id(call.get("id")),
                "name": function.get("name", ""),
                "input": tool_input(function.get("arguments")),
            }
        )
    finish = choice.get("finish_reason")
    matched = tail.matched if finish == "stop" else None
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish, bool(calls), matched),
        "stop_sequence": matched,
        "usage": usage(used),
    }


class EventStream(FaceEvents):
    """Anthropic's events from the answer's typed pieces (``deltas.py``: content, reasoning,
    a tool call's head and arguments, the finish; :attr:`usage`, chat's, set once it ends),
    one block open at a time: a change of kind closes the open block and starts the next."""

    def __init__(self, rid: str, model: str, stops: list[str], input_tokens: int) -> None:
        self.rid, self.model, self.input_tokens = rid, model, input_tokens
        self.tail = StopTail(stops)
        self.blocks = 0  # blocks started
        self.open: str | None = None  # the open block's kind
        self.calls: dict[int, int] = {}  # chat's call index -> its block's index
        self.pinged = False
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, **fields})
        return b"event: " + kind.encode() + b"\n" + sse.event(data)

    def opening(self) -> list[bytes]:
        start = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [self._event("message_start", message=start)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [self._event("content_block_stop", index=self.blocks - 1)]

    def _held(self) -> list[bytes]:
        """The text held back as a possible stop sequence, sent after all: the answer went
        on with another block, or ended without one."""
        text = self.tail.flush()
        if not text:
            return []
        events = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self._held() if kind != "text" else []
        events += self._close()
        self.open = kind
        events.append(self._event("content_block_start", index=self.blocks, content_block=block))
        self.blocks += 1
        if not self.pinged:
            self.pinged = True
            events.append(self._event("ping"))
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._event("content_block_delta", index=self.blocks - 1, delta=delta)

    def _reasoning(self, text: str) -> list[bytes]:
        return self._text("thinking", text)

    def _content(self, text: str, logprobs: list[Any] | None) -> list[bytes]:
        return self._text("text", text)  # (Anthropic's events carry no logprobs)

    def _text(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if kind == "text":
            text = self.tail.feed(text)
            if not text:
                return events
        if self.open != kind:
            empty = {"type": "text", "text": ""}
            if kind == "thinking":
                empty = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._start(kind, empty)
        field = "text" if kind == "text" else "thinking"
        events.append(self._delta({"type": f"{kind}_delta", field: text}))
        return events

    def _call(self, call: CallPiece) -> list[bytes]:
        events: list[bytes] = []
        index = call.index
        if index not in self.calls:
            block = {
                "type": "tool_use",
                "id": _tool_id(call.id),
                "name": call.name or "",
                "input": {},
            }
            events += self._start("tool_use", block)
            self.calls[index] = self.blocks - 1
        elif self.calls[index] != self.blocks - 1:
            return events  # a delta to a call already closed: chat's parsers never send it
        if call.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append(self._delta(delta))
        return events

    def closing(self) -> list[bytes]:
        """The open block closed, the stop reason and usage, the end."""
        events = self._held()
        events += self._close()
        if not self.pinged:
            events.append(self._event("ping"))
        matched = self.tail.matched if self.finish == "stop" else None
        reason = stop_reason(self.finish, bool(self.calls), matched)
        delta = {"stop_reason": reason, "stop_sequence": matched}
        used = usage(self.usage) if self.usage else {"output_tokens": 0}
        events.append(self._event("message_delta", delta=delta, usage=used))
        events.append(self._event("message_stop"))
        return events

    def failed(self, error: dict[str, Any]) -> list[bytes]:
        """The stream's last event when it failed midway: chat's ``error`` as Anthropic's."""
        return [self._event("error", error=errors.from_chat(error)["error"])]
