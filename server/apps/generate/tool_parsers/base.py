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

Calls stream as they are written: a family's :meth:`Family.reader` reads the open region a
piece at a time (never its end marker, whose possible beginning is held back) and the engine
sends ``("name", str)`` as soon as a call's name is known, then ``("args", str)`` fragments of
its arguments' JSON text, then ``("call", ToolCall)``, whose ``arguments`` are exactly the
fragments joined (for JSON families the arguments object as the model wrote it, cut at its
closing brace by a scanner that follows strings and nesting, :class:`JsonReader`). A call
whose name comes late, or whose arguments are not an object, comes whole at its close. One
that streamed and then does not read as a call ends ``("broken", name)`` and its region's
text is content, as the whole answer's is.
"""

from __future__ import annotations

import dataclasses
import json
import re
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

    def reader(self) -> Reader | None:
        """A reader streaming a region's calls as they are written; None: the calls come
        whole when their region closes (pythonic's Python)."""
        return None

    def raw_arguments(self, region: str) -> list[str]:
        """Each complete call's arguments as :meth:`reader` streams them (the text the
        model wrote), in order; the streamed fragments join to exactly these."""
        reader = self.reader()
        if reader is None:
            return []
        made, now = [], []
        for kind, value in reader.feed(region):
            if kind == "args":
                now.append(value)
            elif kind == "done":
                made.append("".join(now))
                now = []
        return made


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
        self._reader: Reader | None = None  # the open region's reader
        self._unfed = ""  # the region's text not yet read (may begin the end marker)
        #: the open region's calls that streamed: name, arguments' fragments, closed yet
        self._started: list[list[Any]] = []
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

    def _read(self, text: str) -> None:
        """The region's ``text`` (never the end marker) to its reader: names and arguments
        streamed as they are known."""
        if self._reader is None or not text:
            return
        for kind, value in self._reader.feed(text):
            if kind == "name":
                self._ws = ""
                self._started.append([value, [], False])
                self._events.append(("name", value))
            elif kind == "args":
                self._started[-1][1].append(value)
                self._events.append(("args", value))
            elif kind == "done":  # the arguments' object is whole: the call is made now
                name, parts, _ = self._started[-1]
                arguments = "".join(parts)
                try:
                    whole = isinstance(json.loads(arguments), dict)
                except (ValueError, RecursionError):
                    whole = False
                if not whole:  # closed with its region (the reader reads no more)
                    self._reader.stopped = True
                    return
                self._started[-1][2] = True
                self._made(ToolCall(name, arguments))

    def _made(self, call: ToolCall) -> None:
        self.made += 1
        self._events.append(("call", call))

    def _close_started(self, started: list[Any], call: ToolCall | None) -> None:
        """A streamed call closed by ``call`` (its arguments' rest sent first); when ``call``
        is None or does not continue what streamed, ``("broken", name)``: not a call after
        all. One already made is left as it is."""
        name, parts, made = started
        if made:
            return
        sent = "".join(parts)
        if call is not None and call.name == name and call.arguments.startswith(sent):
            if len(call.arguments) > len(sent):
                self._events.append(("args", call.arguments[len(sent) :]))
            self._made(call)
        else:
            self._events.append(("broken", name))

    def _unread(self, started: list[list[Any]], text: str) -> None:
        """A region that is not calls after all: its streamed calls broken, and its ``text``
        as content (unless some of its calls were made: then only those stand)."""
        for one in started:
            self._close_started(one, None)
        if not any(one[2] for one in started):
            self._ws = self._dropped
            self._content(text)

    def _raw(self, region: str, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls with their arguments as the model wrote them, where the reader's text
        is the same object (what streamed then matches the whole answer's calls)."""
        try:
            raws = self.family.raw_arguments(region)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, MemoryError):
            return calls
        made = []
        for i, call in enumerate(calls):
            if i < len(raws) and raws[i] != call.arguments:
                try:
                    if json.loads(raws[i]) == json.loads(call.arguments):
                        call = ToolCall(call.name, raws[i])
                except (ValueError, RecursionError):
                    pass
            made.append(call)
        return made

    def _resolve(self, region: str, closed: bool) -> None:
        started, self._started, self._reader = self._started, [], None
        try:
            calls = self.family.calls(region)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError, MemoryError):
            calls = None  # odd text (JSON nested past the parser's depth...): text, no 500
        if calls:
            calls = self._raw(region, calls)
            self._ws = ""
            for i, call in enumerate(calls):
                if i < len(started):
                    self._close_started(started[i], call)
                else:
                    self._made(call)
            for rest in started[len(calls) :]:
                self._close_started(rest, None)
        elif started:
            self._unread(
                started, self._opened + region + ((self.family.end or "") if closed else "")
            )
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
            unfed, self._unfed = self._unfed + piece, ""  # the region's text from the read
            if family.end is None:
                self._read(unfed)
            else:
                window = self._tail + piece
                at = window.find(family.end)
                if at >= 0:
                    whole = "".join(self._region)
                    cut = start + at
                    self._read(unfed[: max(0, len(unfed) - (self._size - cut))])
                    self._region = None
                    self._resolve(whole[:cut], closed=True)
                    self._buf = whole[cut + len(family.end) :]
                    continue
                self._tail = window[max(0, len(window) - len(family.end) + 1) :]
                hold = _held(unfed, {family.end: False}, len(family.end))
                self._read(unfed[: len(unfed) - hold])
                self._unfed = unfed[len(unfed) - hold :]
            if self._size > self.limit:  # given up: the region as text, and the rest
                self._off = True
                started, self._started, self._reader = self._started, [], None
                self._unread(started, self._opened + "".join(self._region))
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
        self._reader = self.family.reader()
        self._unfed = ""
        self._started = []
        if keep:
            self._read(marker)


# --- incremental readers: a call's name and its arguments' text as the region grows

#: how much text a reader waits on for a header (``{"name": "f", "arguments":``) before it
#: gives up streaming that region (the calls then come whole when it closes)
HEADER_WAIT = 512

_WS = " \t\r\n"


class Reader:
    """A region's text in, piece by piece (never the end marker), call events out:
    ``("name", str)`` when a call's name is known, ``("args", str)`` for each fragment of its
    arguments' JSON text, ``("done", None)`` when they are complete. Once :attr:`stopped`, it
    reads no more (the remaining calls come whole when the region closes)."""

    stopped = False
    _buf = ""  # text not yet read (a tag not yet whole)

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        if not self.stopped:
            self._buf += piece
            self._run()
        events, self._events = self._events, []
        return events

    def _run(self) -> None:
        """Read :attr:`_buf` into :attr:`_events` (subclasses)."""
        raise NotImplementedError


class JsonReader(Reader):
    """Calls written as JSON objects whose arguments are a JSON object: the text before each
    call's arguments (``header``, naming the call) is matched whole, then the arguments'
    object is scanned character by character (strings, escapes and nesting followed) and
    streamed as it arrives, ending exactly at its closing brace: the fragments join to the
    arguments' text as the model wrote it, which is what the call's ``arguments`` then are
    (:meth:`Family.raw_arguments`). ``lead`` is matched once before the first call (a list's
    ``[``), ``tail`` after each call's arguments (the object's ``}``), ``sep`` between calls."""

    def __init__(
        self,
        header: re.Pattern[str],
        tail: re.Pattern[str] | None = None,
        sep: re.Pattern[str] | None = None,
        lead: re.Pattern[str] | None = None,
    ) -> None:
        self.patterns = {"lead": lead, "header": header, "tail": tail, "sep": sep}
        self.phase = "lead" if lead is not None else "header"
        self._buf = ""
        self._depth = 0
        self._string = False
        self._escape = False
        self._events: list[tuple[str, Any]] = []

    def _stop(self) -> None:
        self.stopped = True
        self._buf = ""

    def _run(self) -> None:
        """The buffer read from a position that moves on (cutting it after each call copied
        the rest of it each time: a whole answer of many calls took its length squared)."""
        buf, at = self._buf, 0
        while not self.stopped and at < len(buf):
            if self.phase == "args":
                at = self._args(buf, at)
                continue
            pattern = self.patterns[self.phase]
            if pattern is None:  # nothing may follow (one call per region)
                self._stop()
                return
            found = pattern.match(buf, at)
            if found is None or found.end() == len(buf):  # undecided: what follows?
                if len(buf) - at > HEADER_WAIT:
                    self._stop()
                    return
                break
            if self.phase == "header":
                name = found.group("name")
                try:
                    name = json.loads(name) if name.startswith('"') else name
                except ValueError:
                    self._stop()
                    return
                self._events.append(("name", name))
            self.phase = {"lead": "header", "header": "args", "tail": "sep", "sep": "header"}[
                self.phase
            ]
            at = found.end()
        if not self.stopped:
            self._buf = buf[at:]

    def _args(self, piece: str, at: int) -> int:
        """The arguments' text from ``at``: where reading stopped (the end of ``piece``, or
        just past the arguments' closing brace)."""
        size = len(piece)
        if self._depth == 0:  # not begun: an object, or not streamed
            while at < size and piece[at] in _WS:
                at += 1
            if at == size:
                return at
            if piece[at] != "{":
                self._stop()
                return size
        start = at
        while at < size:
            if self._string and not self._escape:  # a string's plain run at once
                at = _IN_STRING.search(piece, at).start()
                if at == size:
                    break
            elif not self._string:  # and a run with no string, bracket or brace
                at = _OUTSIDE.search(piece, at).start()
                if at == size:
                    break
            ch = piece[at]
            at += 1
            if self._string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._string = False
            elif ch == '"':
                self._string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._events += [("args", piece[start:at]), ("done", None)]
                    self.phase = "tail"
                    return at
        if at > start:
            self._events.append(("args", piece[start:at]))
        return at


#: where a JSON string's plain characters end (or the text does)
_IN_STRING = re.compile(r'["\\]|\Z')
#: where the text outside strings next opens or closes something (or ends)
_OUTSIDE = re.compile(r'["{}\[\]]|\Z')
#: ``{"name": "f", "arguments": `` (or ``"parameters"``), the name first
JSON_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*(?P<name>"(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
#: the call object's own closing brace
JSON_TAIL = re.compile(r"\s*\}")


class JsonFamily(Family):
    """A family whose calls are JSON objects, ``{"name": "f", "arguments": {...}}`` (or
    ``"parameters"``), streamed by one :class:`JsonReader` (Hermes' and Llama 3's)."""

    #: what stands between two calls of a region (None: a region holds one call)
    separator: re.Pattern[str] | None = None

    def reader(self) -> JsonReader:
        return JsonReader(JSON_HEADER, JSON_TAIL, self.separator)


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
