"""Server-sent events (the HTML standard's ``text/event-stream``), as Triton's generate_stream
and OpenAI's streams frame them: each message one ``data:`` line and a blank line."""

from __future__ import annotations

__all__ = ["DONE", "HEADERS", "event"]

#: the headers of a stream of events: not cached, not buffered by a proxy
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

#: OpenAI's last event
DONE = b"data: [DONE]\n\n"


def event(data: bytes) -> bytes:
    """One event carrying ``data`` (JSON: one line, so one ``data:`` field)."""
    return b"data: " + data + b"\n\n"
