"""What the REST port answers with (``http_server.py`` writes them): a reply's type, a
streamed reply (:class:`StreamReply`, :class:`Push`), the JSON error body, the status lines
and the Date header, made once."""

from __future__ import annotations

import asyncio
import http
import time
from collections.abc import AsyncIterator, Callable
from email.utils import formatdate

import orjson

__all__ = [
    "JSON",
    "RETRY_AFTER",
    "STATUS_LINES",
    "Date",
    "Push",
    "Reply",
    "StreamReply",
    "error_reply",
]

#: what a handler returns: status, body pieces, extra headers
Reply = tuple[int, list[bytes | memoryview], list[tuple[bytes, bytes]]]
JSON = [(b"content-type", b"application/json")]
#: what a 429 or 503 tells the client: try again in a second (RFC 9110 10.2.3)
RETRY_AFTER = (b"retry-after", b"1")
STATUS_LINES = {
    s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode("latin-1") for s in http.HTTPStatus
}


class StreamReply:
    """A reply whose body is written as it is made, with chunked transfer encoding: Triton's
    generate_stream and OpenAI's streams (server-sent events, ``server/protocols/http/sse.py``).
    ``chunks``
    is an async iterator of bytes; the connection waits for the peer to read before asking it
    for more (flow control), and a peer that goes away closes it (its ``finally`` cancels the
    request that feeds it).

    ``push``, when a reply has one (:class:`Push`), is the same body written without a task
    step per event: the connection hands it a writer and it writes from the loop's callback
    that tells it events came (``ResponseStream.caller``). Whoever wraps ``chunks``
    (tracing's byte count, the Responses API's events) sets ``chunks``, which drops ``push``:
    the body is then the wrapped iterator's."""

    __slots__ = ("_chunks", "headers", "push", "status")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        chunks: AsyncIterator[bytes],
        push: Push | None = None,
    ) -> None:
        self.status, self.headers, self._chunks, self.push = status, headers, chunks, push

    @property
    def chunks(self) -> AsyncIterator[bytes]:
        return self._chunks

    @chunks.setter
    def chunks(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks, self.push = chunks, None


class Push:
    """A streamed body that writes itself (see :class:`StreamReply`): :meth:`start` gets
    ``write(data) -> bool`` (False: the peer does not read, stop until :meth:`resume`) and
    returns a future done when the body's last bytes are written (or failed with what the
    iterator would have raised); :meth:`stop` ends it early (the peer left: cancel what feeds
    it). Measured: the pulled path's task step, futures and async generators per event were
    most of the HTTP thread's per-token cost that was not the socket's write."""

    def start(self, write: Callable[[bytes], bool]) -> asyncio.Future[None]:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


def error_reply(status: int, message: str) -> Reply:
    return status, [orjson.dumps({"error": message})], JSON


class Date:
    """The Date header, formatted once a second."""

    second = -1
    value = b""

    @classmethod
    def header(cls) -> bytes:
        now = int(time.time())
        if now != cls.second:
            cls.value = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
            cls.second = now
        return cls.value
