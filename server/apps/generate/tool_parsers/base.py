"""What every tool-call parser shares: the call, the family's description, and one streaming
engine that turns an answer's text into content and calls.

A family (one small class per model family in this package) says only what is its own: the
markers that open a call region (``starts``: each marker -> whether it belongs to the region's
text, as the ``{`` of Llama 3's bare JSON does), the marker that closes one (``end``; None: the
region runs to the end of the answer, as Mistral's ``[TOOL_CALLS]`` and pythonic lists do),
whether a marker counts only as the answer's first text (``at_start``), and :meth:`Family.calls`,
the region's text read into calls (None: malformed).

:class:`Streamer` is the one engine, for streamed and whole answers alike: :func:`parse` is
``feed(text)`` then ``finish()``, so a whole answer and the same answer fed token by token give
the same content and calls by construction (tests/generate/test_tool_parsers.py checks each
family's transcripts token by token through a tokenizer). Text that may still become a marker
is held back (at most the longest marker), so no markup reaches content; whitespace is held
until more content follows, and dropped once a call is made (the newlines between calls). A
call region is held until it closes, at most :data:`MAX_CALL_CHARS` characters: past that, or
when the region does not read as calls, its text (markers included) is returned as content,
never an error.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_CALL_CHARS", "Family", "Streamer", "ToolCall", "parse"]

#: the most characters one call region may hold before it is given up as text: a model's
#: calls are a few KiB; a bound keeps an endless call from growing the request's memory
MAX_CALL_CHARS = 256 << 10


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's form)."""

    name: str
    arguments: str


def arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON text: an object as is, a string holding an object's JSON
    parsed first; None when it is neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class Family:
    """A model family's call markup (subclasses set the markers and read the regions)."""

    #: the name operators give (--tool-call-parser)
    name = ""
    #: markers opening a call region -> whether the marker is part of the region's text
    starts: Mapping[str, bool] = {}
    #: the marker closing a region; None: the region runs to the end of the answer
    end: str | None = None
    #: the markers count only as the answer's first text (after whitespace)
    at_start = False
    #: the markers are special tokens, which the detokenizer must keep in the text
    needs_special_tokens = False

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = {}
        for tool in tools or ():
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                self.tools[function["name"]] = function

    def calls(self, region: str) -> list[ToolCall] | None:
        """The calls ``region`` holds; None when it does not read as calls."""
        raise NotImplementedError


def call_of(item: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """``{"name": ..., "arguments" (or "parameters"): {...}}`` as a call; None otherwise."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    value = item.get(arguments_key, item.get("parameters", item.get("arguments", {})))
    text = arguments_text(value)
    return None if text is None else ToolCall(item["name"], text)


class Streamer:
    """One answer's text in, content pieces and calls out (``("content", str)`` and
    ``("call", ToolCall)`` events), as it streams; see the module's docstring."""

    def __init__(self, family: Family, limit: int = MAX_CALL_CHARS) -> None:
        self.family = family
        self.limit = limit
        self._longest = max((len(m) for m in family.starts), default=0)
        self._buf = ""  # text not yet resolved (a marker's possible beginning)
        self._region: list[str] | None = None  # inside a call region: its text so far
        self._size = 0  # its characters
        self._tail = ""  # its last characters that may begin the end marker
        self._opened = ""  # the marker that opened it
        self._ws = ""  # whitespace held until more content follows
        self._dropped = ""  # the whitespace held when a region opened
        self._content_seen = False  # for at_start families: the answer began as text
        self._off = False  # a region passed its bound: the rest is text
        self.made = 0  # calls made
        self._events: list[tuple[str, Any]] = []

    # --- input

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._buf += text
        self._drain(final=False)
        return self._take()

    def finish(self) -> list[tuple[str, Any]]:
        self._drain(final=True)
        if self._ws and not self.made:
            self._events.append(("content", self._ws))
        self._ws = ""
        return self._take()

    # --- output

    def _take(self) -> list[tuple[str, Any]]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        joined = self._ws + text
        body = joined.rstrip()
        self._ws = joined[len(body) :]
        if body:
            self._content_seen = True
            self._events.append(("content", body))

    def _resolve(self, region: str, closed: bool) -> None:
        try:
            calls = self.family.calls(region)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, MemoryError):
            calls = None  # odd text (JSON nested past the parser's depth...): text, no 500
        if calls:
            self._ws = ""
            self.made += len(calls)
            self._events.extend(("call", c) for c in calls)
        else:  # not calls after all: the text as the model wrote it
            self._ws = self._dropped
            self._content(self._opened + region + ((self.family.end or "") if closed else ""))

    # --- the engine

    def _drain(self, final: bool) -> None:
        family = self.family
        while True:
            if self._off:
                self._content(self._buf)
                self._buf = ""
                return
            if self._region is None:
                if not self._find_start(final):
                    return
                continue
            # the region grows by pieces and only the new piece (and the end marker's
            # possible start before it) is searched: a long call costs its length, not its
            # length squared
            piece, self._buf = self._buf, ""
            start = self._size - len(self._tail)  # where the searched window begins
            self._region.append(piece)
            self._size += len(piece)
            if family.end is not None:
                window = self._tail + piece
                at = window.find(family.end)
                if at >= 0:
                    whole = "".join(self._region)
                    cut = start + at
                    self._region = None
                    self._resolve(whole[:cut], closed=True)
                    self._buf = whole[cut + len(family.end) :]
                    continue
                self._tail = window[max(0, len(window) - len(family.end) + 1) :]
            if self._size > self.limit:  # given up: the region as text, and the rest
                self._off = True
                self._ws = self._dropped
                self._content(self._opened + "".join(self._region))
                self._region = None
                continue
            if final:
                region, self._region = "".join(self._region), None
                self._resolve(region, closed=False)
            return

    def _find_start(self, final: bool) -> bool:
        """Content up to the next start marker (True: a region opened); holds back what may
        still become one."""
        family, buf = self.family, self._buf
        if family.at_start:
            if self._content_seen or self.made:
                self._content(buf)
                self._buf = ""
                return False
            stripped = buf.lstrip()
            for marker, keep in family.starts.items():
                if stripped.startswith(marker):
                    self._open(marker, keep, stripped[len(marker) :])
                    return True
            if not final and (not stripped or any(m.startswith(stripped) for m in family.starts)):
                return False  # still undecided
            self._content(buf)
            self._buf = ""
            return False
        best = -1
        found = ""
        for marker in family.starts:
            at = buf.find(marker)
            if at >= 0 and (best < 0 or at < best):
                best, found = at, marker
        if best >= 0:
            self._content(buf[:best])
            self._open(found, family.starts[found], buf[best + len(found) :])
            return True
        hold = 0 if final else _held(buf, family.starts, self._longest)
        self._content(buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold :]
        return False

    def _open(self, marker: str, keep: bool, rest: str) -> None:
        self._dropped, self._ws = self._ws, ""  # back if the region is not calls
        self._opened = "" if keep else marker
        self._region = [marker] if keep else []
        self._size = len(marker) if keep else 0
        self._tail = ""
        self._buf = rest


def _held(text: str, markers: Mapping[str, bool], longest: int) -> int:
    """How many of ``text``'s last characters may still begin a marker."""
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


def parse(family: Family, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer: its content and its calls (the streamed events joined)."""
    streamer = Streamer(family)
    events = streamer.feed(text) + streamer.finish()
    content = "".join(v for k, v in events if k == "content")
    return content, [v for k, v in events if k == "call"]
