"""A chat answer's pieces, typed: what every face that answers a chat encodes.

The chat path reads each engine event through the answer (``answer.py``: the counts, the
finish reason, the logprobs) and its parsers (``tools.ChatOutput``: reasoning split out, tool
calls read) into :class:`Delta` values: a piece of content, of reasoning, or of a tool call
(:class:`CallPiece`: its head, then fragments of its arguments), with the event's logprobs,
token ids and finish reason. The chat route writes them as chat chunks (:meth:`Delta.chat`);
the Responses API (``responses_output.py``) and the Anthropic face (``anthropic/answer.py``)
write them as their own events, from the same objects: no face parses another's bytes back;
both are a :class:`FaceEvents`, which ``answer.events_of`` drives.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

__all__ = ["CallPiece", "Delta", "FaceEvents", "from_chat"]


@dataclasses.dataclass(slots=True)
class CallPiece:
    """A piece of a tool call: its head (``id`` and ``name`` set, ``arguments`` empty) as
    soon as the parser knows the name, then fragments of its arguments (``id`` None), which
    join to exactly the call's arguments. ``index``: the call's number in its choice."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def chat(self) -> dict[str, Any]:
        """As chat's ``delta.tool_calls[0]`` (the key order OpenAI's chunks have)."""
        if self.id is not None:
            return {
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
                "index": self.index,
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclasses.dataclass(slots=True)
class Delta:
    """One piece of choice ``choice``'s answer: ``content``, ``reasoning`` or ``call`` (at
    most one of them set; none: a piece that carries only logprobs, token ids or the finish).
    ``logprobs``: chat's ``logprobs.content`` entries of the event's tokens (None: not asked,
    or on another piece of the event); ``token_ids``: vLLM's ``return_token_ids`` (None: not
    asked); ``finish``: the choice's finish reason on its last piece, as chat says it
    (``tool_calls`` when it ended with calls it chose)."""

    choice: int = 0
    content: str | None = None
    reasoning: str | None = None
    call: CallPiece | None = None
    logprobs: list[Any] | None = None
    token_ids: list[int] | None = None
    finish: str | None = None

    def chat(self) -> dict[str, Any]:
        """As chat's ``delta`` object."""
        if self.content is not None:
            return {"content": self.content}
        if self.reasoning is not None:
            return {"reasoning_content": self.reasoning}
        if self.call is not None:
            return {"tool_calls": [self.call.chat()]}
        return {}


class FaceEvents(abc.ABC):
    """A face's stream of events from a chat answer's pieces: its opening, each piece's
    events (:meth:`delta`: the reasoning, the content, a call, in that order, as chat's
    chunks have them; the finish kept), its closing, or its last event when it fails midway.
    ``usage``: chat's, set once the answer ended."""

    finish: str | None = None
    usage: dict[str, Any] | None = None

    def delta(self, delta: Delta) -> list[bytes]:
        """The events of one piece of the answer."""
        events: list[bytes] = []
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.content:
            events += self._content(delta.content, delta.logprobs)
        if delta.call is not None:
            events += self._call(delta.call)
        if delta.finish is not None:
            self.finish = delta.finish
        return events

    @abc.abstractmethod
    def opening(self) -> list[bytes]: ...

    @abc.abstractmethod
    def _reasoning(self, text: str) -> list[bytes]: ...

    @abc.abstractmethod
    def _content(self, text: str, logprobs: list[Any] | None) -> list[bytes]: ...

    @abc.abstractmethod
    def _call(self, call: CallPiece) -> list[bytes]: ...

    @abc.abstractmethod
    def closing(self) -> list[bytes]: ...

    @abc.abstractmethod
    def failed(self, error: dict[str, Any]) -> list[bytes]:
        """The last event of a stream that failed midway (``error``: chat's error object,
        ``errors.stream_error``'s)."""


def from_chat(chunk: dict[str, Any]) -> tuple[list[Delta], dict[str, Any] | None]:
    """A chat chunk as a client reads it (``choices[].delta``: ``reasoning_content`` or
    ``reasoning``, ``content`` with its ``logprobs.content``, ``tool_calls``; the finish; the
    chunk's ``usage``) as pieces, and its usage: for a chat stream that comes from elsewhere
    (the server's own answers are pieces from the start: ``Answer.deltas``)."""
    pieces = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        index = choice.get("index", 0)
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            pieces.append(Delta(index, reasoning=reasoning))
        if delta.get("content"):
            logprobs = (choice.get("logprobs") or {}).get("content")
            pieces.append(Delta(index, delta["content"], logprobs=logprobs))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            piece = CallPiece(
                call.get("index", 0),
                function.get("arguments") or "",
                call.get("id"),
                function.get("name"),
            )
            pieces.append(Delta(index, call=piece))
        if choice.get("finish_reason") is not None:
            pieces.append(Delta(index, finish=choice["finish_reason"]))
    return pieces, chunk.get("usage") or None
