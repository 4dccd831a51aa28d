"""gpt-oss's harmony format: an answer is messages, each a header naming its channel (and a
recipient) then ``<|message|>`` and a body ended by ``<|end|>`` (or ``<|call|>`` /
``<|return|>``, which end the sequence):

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

The ``analysis`` channel is reasoning; ``final`` (and ``commentary`` without a recipient, a
preamble) is content; a ``commentary`` message to ``functions.NAME`` is a call of ``NAME``
whose body is its arguments (when the request parses calls; otherwise its body is content).
The markers are special tokens: the text keeps them while this parses. Streams as the think
splitter does: a header is held until its ``<|message|>`` (at most :data:`MAX_HEADER`
characters, past which the answer is taken as plain text), a body's possible terminator held
back. A call streams (:meth:`HarmonySplitter.take_events`) as the channel's text arrives: its
name once the body begins with ``{``, then the body's text as written (whitespace at its ends
held back), which is the call's ``arguments`` when the message ends and it reads as a JSON
object; a body that does not begin so is held (at most the tool parsers' bound) and comes
back as text if it is not an object.
"""

from __future__ import annotations

import re

from plugserve.server.apps.generate.tool_parsers.base import (
    MAX_CALL_CHARS,
    ToolCall,
    arguments_text,
)

__all__ = ["MAX_HEADER", "Harmony", "HarmonySplitter"]

#: the longest header (``<|start|>assistant<|channel|>commentary to=functions.x ...``)
MAX_HEADER = 512
_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class Harmony:
    """The harmony family: reasoning always comes first, and the structured-output grammar
    binds from the final channel's message."""

    name = "harmony"
    start = "<|channel|>analysis"
    end = "<|channel|>final<|message|>"
    needs_special_tokens = True

    def opened(self, prompt_tail: str) -> bool:
        return True  # the analysis channel comes first: a grammar waits for the final one

    def splitter(self, opened: bool) -> HarmonySplitter:
        return HarmonySplitter()


class HarmonySplitter:
    """One answer's text in, ``(reasoning, content)`` out, and the calls it made
    (:meth:`take_calls`) when :attr:`parse_calls` is set."""

    def __init__(self) -> None:
        self.parse_calls = False
        self.state = "header"  # "header", "body", "text" (not harmony: all content)
        self._buf = ""
        self._dest = "content"  # "reasoning", "content" or the called function's name
        self._args: list[str] = []
        self._size = 0
        self._calls: list[ToolCall] = []
        self._events: list[tuple[str, object]] = []  # ("name" | "args" | "call", ...)
        self._streaming = False  # the open call's name went out: its arguments stream
        self._plain = False  # the open call's body does not begin as an object
        self._ws = ""  # the streamed arguments' trailing whitespace, held

    @property
    def reasoning(self) -> bool:
        return self.state == "header" or self._dest == "reasoning"

    def take_calls(self) -> list[ToolCall]:
        calls, self._calls = self._calls, []
        return calls

    def take_events(self) -> list[tuple[str, object]]:
        """The calls as they stream: ``("name", str)``, ``("args", str)`` fragments, then
        ``("call", ToolCall)`` whose arguments are the fragments joined."""
        events, self._events = self._events, []
        return events

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._drain(False)

    def finish(self) -> tuple[str, str]:
        return self._drain(True)

    def _drain(self, final: bool) -> tuple[str, str]:
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while self._buf or (final and self.state == "body"):
            buf = self._buf
            if self.state == "text":
                out["content"].append(buf)
                self._buf = ""
            elif self.state == "header":
                at = buf.find(_MESSAGE)
                if at < 0:
                    if len(buf) > MAX_HEADER or (final and not buf.lstrip().startswith("<|")):
                        self.state = "text"
                        continue
                    if final:
                        self._buf = ""  # a header with no message (the last <|start|>)
                    break
                self._open(buf[:at])
                self._buf = buf[at + len(_MESSAGE) :]
            else:
                ends = [(buf.find(e), e) for e in _ENDS if e in buf]
                if ends:
                    at, end = min(ends)
                    self._route(buf[:at], out)
                    self._close(out)
                    self._buf = buf[at + len(end) :]
                    self.state = "header"
                    continue
                hold = 0 if final else _held(buf)
                self._route(buf[: len(buf) - hold], out)
                self._buf = buf[len(buf) - hold :]
                if final:
                    self._close(out)
                    self.state = "header"
                break
        return "".join(out["reasoning"]), "".join(out["content"])

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.state = "body"
        self._args, self._size = [], 0
        self._streaming, self._plain, self._ws = False, False, ""
        if recipient and recipient.group(1).startswith("functions.") and self.parse_calls:
            self._dest = recipient.group(1)[len("functions.") :]
        elif channel and channel.group(1) == "analysis":
            self._dest = "reasoning"
        else:
            self._dest = "content"

    def _route(self, piece: str, out: dict[str, list[str]]) -> None:
        if not piece:
            return
        if self._dest in out:
            out[self._dest].append(piece)
            return
        self._size += len(piece)
        if not self._streaming:
            self._args.append(piece)
            if not self._plain:
                text = "".join(self._args).lstrip()
                if text.startswith("{"):  # an object begins: the call streams
                    self._streaming = True
                    self._args, self._ws = [], ""
                    self._events.append(("name", self._dest))
                    piece = text
                elif text:
                    self._plain = True  # not an object: held, read when the message ends
        if self._streaming:
            body = (self._ws + piece).rstrip()
            self._ws = (self._ws + piece)[len(body) :]
            if body:
                self._events.append(("args", body))
                self._args.append(body)
        if self._size > MAX_CALL_CHARS:  # given up: the arguments as text
            if self._streaming:
                self._end_call(None, out)
            else:
                out["content"].append("".join(self._args))
            self._args, self._dest = [], "content"

    def _close(self, out: dict[str, list[str]]) -> None:
        if self._dest in out:
            return
        text = "".join(self._args)
        if self._streaming:
            self._end_call(text if arguments_text(text) is not None else None, out)
        elif (arguments := arguments_text(text)) is None:
            out["content"].append(text)  # not a JSON object: the text as it is
        else:
            self._calls.append(ToolCall(self._dest, arguments))
            self._events.append(("call", self._calls[-1]))
        self._args, self._dest = [], "content"

    def _end_call(self, arguments: str | None, out: dict[str, list[str]]) -> None:
        """The streamed call closed: its arguments are the text that streamed; when that is
        not a JSON object (None), ``("broken", name)`` and the text is content."""
        if arguments is None:
            self._events.append(("broken", self._dest))
            out["content"].append("".join(self._args) + self._ws)
        else:
            call = ToolCall(self._dest, arguments)
            self._calls.append(call)
            self._events.append(("call", call))
        self._streaming, self._ws = False, ""


def _held(text: str) -> int:
    for size in range(min(len(text), max(len(e) for e in _ENDS) - 1), 0, -1):
        if any(e.startswith(text[-size:]) for e in _ENDS):
            return size
    return 0
