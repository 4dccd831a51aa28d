"""HTTP/1.1 for the REST port: an asyncio protocol on httptools' parser, and its bounds.

httptools (llhttp) parses; this module only keeps the connection's state and writes replies.
It replaced uvicorn's ASGI server, measured to be the difference on small requests
(BENCHMARKS.md, "REST without ASGI"): no task, receive/send messages or scope per request, a
request whose handler finishes at once (an inline inference) answered within the parser's
callback. Each request's body is read whole before its handler runs, so handlers see bytes
(or a bytearray or memoryview of them).

The bounds, the twin of ``server/protocols/grpc/callgate.py`` for HTTP (docs/security.md, "The
REST front door"; tests/server/test_attacks_front.py drives each):

- nothing is read or charged before the caller is known: a request is routed and its token
  checked on its headers (``admit``); a refusal (401, 403, 404, 405, 415) is answered then,
  and a body coming with it is not read (the connection closed after the drain below);
- the memory budget is charged as a body's bytes arrive (in _CHARGE_STEP steps), never from
  the Content-Length a header promises: ~66 sockets that declared bodies and sent none held
  the whole default budget (12 GiB) for 30 s, and authorized infers failed 144/159; one
  client address holds at most --max-inflight-bytes-per-peer of it;
- a body must come at --http-min-body-rate on average once --http-body-grace has passed
  since its headers (and whole within --request-read-timeout), else 408: 264 sockets
  dribbling a byte every 2 s held every slot until the read timeout, and health was 503;
- a connection that has not finished a request's headers within --request-read-timeout of
  opening (or of its last response) is closed; that is the keep-alive timeout too. Deadlines
  are checked by one sweep per port (each second, or each quarter of a shorter timeout), not a
  timer per request: two timers made and cancelled per request were 3 % of a batch-1 request;
- headers (request line included) over ``MAX_HEADER_BYTES`` are 431; a body over
  --max-message-bytes is 413, declared or as it arrives; a body that has not arrived within
  --request-read-timeout of its headers is 408; the connection is closed after each of these
  (but 408) once the peer has stopped sending, for at most --request-read-timeout: what it
  still sends is read and dropped, so that a client that sends its whole body before it reads
  (Python's ``requests``, curl) gets the answer rather than a reset (nginx's lingering close);
- a body sent with ``Transfer-Encoding: chunked`` is read as HTTP/1.1 requires, bounded as one
  with a Content-Length (--max-message-bytes counted as it arrives, the memory budget charged
  as it arrives); one that also carries a Content-Length (Python's ``requests`` adds it to a
  body given as bytes, which Triton's own HTTP tests do) is read by its chunks, the length
  ignored, and its connection closed once it is answered, nothing after it read (RFC 9112
  6.1: the pair is how requests are smuggled past a proxy that reads the other header);
- at most ``limit`` connections (4 x --grpc-workers = 256, as gRPC's
  maximum_concurrent_rpcs): a new connection past it first closes those that hold a slot
  without using it: refused ones draining, then those that have waited longest for a
  request's headers, then bodies coming under the minimum rate (408), once they have waited
  ``EVICT_AFTER`` seconds (a real client sends its headers with the connection; one whose
  request is in its socket, unread because the loop was busy, is not idle: ``unread``); a
  request on a connection still past the limit is answered 503 on its headers, but for the
  health routes (a liveness probe stays 200 while the infer routes are refused). Each request
  holds its connection, so this is also the port's requests in flight;
- bounds that stop attackers, not users (issue 58): --http-peer-connections (half the limit,
  128) counts only the connections of an address that serve none of its requests (waiting for
  headers, idle keep-alive, a body coming without a token, refused): a connection whose
  request came whole, or whose headers carried a valid token, is the address's user, not a
  slot held without use. A new connection of an address past it closes that address's idle,
  refused or slow ones as above; a request is never refused for it. On main the bound counted
  every connection: 130-175 requests in flight from one address (vLLM's own cancellation
  test, and every client behind an ingress, a gateway or Ray's proxy, which is one address)
  were 503 past 128. Now 200 slow requests from one address are all served, and 168 idle
  sockets opened beside them are closed down to the bound (tests/server/test_busy_clients.py).
  A request with a valid token is bounded by its token's own quota instead,
  --http-token-requests (its share of the limit, ``plane/shares.py``: 224 alone, less as
  more tokens have requests in flight, so that another always finds room), counted from its
  headers to its answer: past it 429. Without tokens, idle
  and slow connections stay bounded per address, and a burst of connections opened at once
  (their requests a moment later) is served whole;
- every 429 and 503 carries ``Retry-After: 1``;
- a body in pieces is joined in one growing buffer (an object per piece: 12 MB of 1-byte
  chunks took +1 GB), and a read is parsed _SLICE bytes at a time, the loop's turn given up
  after _PIECES_PER_TURN chunks (a request read whole counts _MESSAGE_PIECES); at most
  _REQUESTS_PER_TURN pipelined requests of a connection are served in one turn;
- one request per connection at a time: pipelined requests wait (reading paused), and so does
  the next request while the peer does not read its replies (transport flow control);
- a peer that reads nothing of its replies for --request-read-timeout (the transport's buffer
  stays above its high-water mark) is cut off, its buffered reply dropped: otherwise each such
  connection would hold its slot and a reply's memory for as long as it liked;
- a streamed reply (:class:`StreamReply`: server-sent events of a generation) gets a socket
  send buffer of ``STREAM_SEND_BUFFER`` (the kernel doubles it: 128 KiB, where Linux would
  grow it to 4 MiB for a peer that does not read: a never-reading client of a generation
  stream had taken 2.9 MB of events into the kernel in 25 s and was still generating), so a
  peer that stops reading is seen after its own receive window, 128 KiB of the kernel's and
  the transport's 64 KiB high-water mark; the stream's producer is then stopped by its own
  bounds (a generation's: ``server/apps/generate/limits.py``) and the connection by the rule above;
- a streamed reply's chunk is one ``transport.write`` (its framing and data joined), and a
  reply with a :class:`Push` (an OpenAI stream of one prompt) is written from the loop's
  wake-up with no task step per event: it stops taking events while the transport is paused
  and goes on from ``resume_writing``, so the bounds above hold the same way.

A client that disconnects cancels the request it waits for: queued, it leaves its queue;
running, it stops at its device's next checkpoint (``plugins/cancel.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import sys
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, unquote

import httptools
import numpy as np

from plugserve.plugins.api import PlugserveError, ResourceExhausted
from plugserve.server.plane import shares
from plugserve.server.plane.budget import Charge, MemoryBudget, body_factor, size_text
from plugserve.server.plane.errors import forget_frames
from plugserve.server.protocols.http.bounds import Bounds, Share
from plugserve.server.protocols.http.replies import (
    RETRY_AFTER,
    STATUS_LINES,
    Date,
    Push,
    Reply,
    StreamReply,
    error_reply,
)
from plugserve.server.protocols.status import http_status_of

__all__ = [
    "EVICT_AFTER",
    "MAX_HEADER_BYTES",
    "STREAM_SEND_BUFFER",
    "Bounds",
    "HttpServer",
    "Push",
    "Reply",
    "StreamReply",
    "error_reply",
]

#: A connection waiting this long for a request's headers may be closed to make room.
EVICT_AFTER = 0.5
#: The socket send buffer of a streamed reply (SO_SNDBUF; Linux doubles it). Token events are
#: small: 64 KiB a round trip is 1.3 MB/s at 50 ms, thousands of events a second.
STREAM_SEND_BUFFER = 64 << 10
#: The request line and headers of one request, at most (as Node's default, about).
MAX_HEADER_BYTES = 64 * 1024

#: the request's URL, the status, the message and the typed error behind it -> the reply
Refusal = Callable[[bytes, int, str, "PlugserveError | None"], Reply]
#: method, path, headers (lower-case names), peer -> a refusal (a Reply, answered before the
#: body is read) or what ``Handle`` takes (an object whose ``probe`` says whether it is a
#: health route, exempt from the connection limits)
Admit = Callable[[str, str, list[tuple[bytes, bytes]], str], Any]
#: (what Admit returned, body) -> a reply, an awaitable of one, or a StreamReply
Handle = Callable[[Any, Any], "Reply | Awaitable[Reply] | StreamReply"]

_NEVER = float("inf")


#: A body with a Content-Length of at least this is read into one buffer made for it.
_PREALLOCATE = 1 << 20
#: Body pieces (chunks) parsed in one turn of the loop before the connection waits for the
#: next: 1,024 1-byte chunks take about 1-3 ms to parse here. A chunked body is parsed
#: _SLICE bytes at a time to count them.
_PIECES_PER_TURN = 1024
#: pipelined requests of one connection served in one turn of the loop (see Connection._next)
_REQUESTS_PER_TURN = 32
#: what a request read whole counts among a turn's _PIECES_PER_TURN (its routing, its charge)
_MESSAGE_PIECES = 8
_SLICE = 16 << 10
#: The memory budget is charged as a body arrives, in steps of this many body bytes (times
#: the body's factor): a body of 1-byte chunks takes a lock per 64 KiB, not per byte.
_CHARGE_STEP = 64 << 10


class _Refused(Exception):
    """Raised in a parser callback: answer ``status`` and close the connection."""

    def __init__(
        self,
        status: int,
        message: str,
        error: PlugserveError | None = None,
        reply: Reply | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error = error  # the typed error behind it (the memory budget's), if any
        self.reply = reply  # the answer made already (the router's: 401, 403, 404...)


class _Discard(Exception):
    """Raised in a parser callback: what the peer sends from here on is not read."""


class HttpServer:
    """What the connections of one port share: the handler and the bounds."""

    def __init__(
        self,
        admit: Admit,
        handle: Handle,
        max_body: int,
        read_timeout: float,
        limit: int,
        too_large: Callable[[int], str],
        budget: MemoryBudget | None = None,
        refusal: Refusal | None = None,
        bounds: Bounds | None = None,
    ) -> None:
        """``admit(method, path, headers, peer)``: route and authorize a request on its
        headers (a Reply refuses it before its body is read); ``handle(admitted, body)``:
        serve it once its body is in. ``too_large(size)``: the 413 message for a body of
        ``size`` bytes; ``budget``: --max-inflight-bytes, which each request's body is charged
        against as it arrives (see server/plane/budget.py); ``refusal(url, status, message,
        error)``: the reply refusing a request before it reaches its handler (a route family
        with an error body of its own, OpenAI's, answers in it; None: ``error_reply``)."""
        self.admit = admit
        self.handle = handle
        self.refusal = refusal
        self.budget = budget
        self.max_body = max_body
        self.read_timeout = read_timeout
        self.limit = limit
        self.too_large = too_large
        self.bounds = bounds or Bounds()
        self.connections: set[Connection] = set()
        #: what each client address holds (connections, bytes of the budget)
        self.peers: dict[str, Share] = {}
        #: requests in flight per token (what ``admit`` named as the request's ``tenant``)
        self.tenants: dict[Any, int] = {}
        self.sweep_every = max(0.05, min(1.0, read_timeout / 4))
        self._sweep: asyncio.TimerHandle | None = None

    def share(self, peer: str) -> Share:
        share = self.peers.get(peer)
        if share is None:
            share = self.peers[peer] = Share()
        return share

    def protocol(self) -> Connection:
        return Connection(self)

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sweep the connections' deadlines while there are connections."""
        if self._sweep is None:
            self._sweep = loop.call_later(self.sweep_every, self._sweep_deadlines, loop)

    def _sweep_deadlines(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep = None
        now = time.monotonic()
        for connection in [c for c in self.connections if c.deadline <= now]:
            connection.expire()
        for connection in [c for c in self.connections if c.stalled_until <= now]:
            connection.abort()
        rate = self.bounds.min_rate
        if rate:
            since = now - self.bounds.grace
            for connection in [
                c
                for c in self.connections
                if c.body_since <= since and c._size < rate * (now - c.body_since)
            ]:
                connection.too_slow(now)
        if self.connections:
            self.watch(loop)

    def evict(self, count: int, now: float, share: Share | None = None) -> None:
        """Close up to ``count`` connections (of ``share``'s address only, if given) that
        hold a slot without using it, worst first: a refused one draining what its peer
        still sends, then those waiting longest for a request's headers (past EVICT_AFTER),
        then bodies coming slower than --http-min-body-rate (past EVICT_AFTER)."""
        rate = self.bounds.min_rate
        ranked = []
        for c in self.connections:
            if share is not None and c.share is not share:
                continue
            if c.lingering:
                ranked.append((0, 0.0, id(c), c))
            elif c.waiting_since is not None and now - c.waiting_since >= EVICT_AFTER:
                ranked.append((1, c.waiting_since, id(c), c))
            elif (
                rate and now - c.body_since >= EVICT_AFTER and c._size < rate * (now - c.body_since)
            ):
                ranked.append((2, c.body_since, id(c), c))
        ranked.sort()
        for rank, _, _, connection in ranked:
            if count <= 0:
                break
            if rank == 1 and connection.unread():
                continue  # its request came: the loop has not read it yet (a busy turn)
            count -= 1
            if rank == 2:
                connection.too_slow(now, evicted=True)
            else:
                connection.close()

    def close_idle(self) -> None:
        """Close every connection not serving a request (shutdown)."""
        for connection in list(self.connections):
            if not connection.busy:
                connection.close()

    @property
    def busy(self) -> int:
        return sum(c.busy for c in self.connections)

    def counts(self) -> tuple[int, int]:
        """(connections open, serving a request): from any thread (a scrape), while the
        loop changes the set (``list`` copies it without letting another thread in)."""
        connections = list(self.connections)
        return len(connections), sum(c.busy for c in connections)


class Connection(asyncio.Protocol):
    """One client connection: parse, bound, dispatch, reply, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.peer = ""  # the client's address
        self.parser = httptools.HttpRequestParser(self)
        # both Transfer-Encoding and Content-Length: read by the chunks (see the docstring;
        # on_headers_complete makes it the connection's last request)
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        #: the rest of what the peer sends is dropped unread (after such a request)
        self.discard = False
        #: since when it waits for a request's headers (None: a request is under way)
        self.waiting_since: float | None = None
        #: when the headers or body being waited for are late (inf: nothing is awaited)
        self.deadline = _NEVER
        #: when a peer that stopped reading its replies is cut off (inf: it reads)
        self.stalled_until = _NEVER
        self.busy = False  # a request is being served
        self.task: asyncio.Task | None = None  # what a request being served awaits, if any
        self.paused = False  # the peer is not reading: no further request until it does
        self._drained: asyncio.Event | None = None  # a streamed reply waits for the peer
        self._push: Push | None = None  # a streamed reply that writes itself
        self.closed = False
        self.last = False  # the parser reads no further request: close after those taken
        self.lingering = False  # refused: what the peer still sends is dropped, then closed
        self.reading = False  # a request's first bytes came, not yet all of it
        #: it serves a request of its address's (read whole, or with a valid token): not
        #: counted by --http-peer-connections (``Share.serving``)
        self.exempt = False
        #: the token whose request it serves (counted in ``HttpServer.tenants``), if any
        self.tenant: Any = None
        #: requests read whole, to serve in order: (method, what admit gave, body,
        #: keep-alive, their charge)
        self.pending: deque[tuple[str, Any, Any, bool, Charge | None]] = deque()
        self._deferred = False  # the next pending requests are served on the loop's next turn
        #: what this connection's address holds (set once connected)
        self.share = Share()
        #: since when the body being read has come (inf: no body is being read)
        self.body_since = _NEVER
        #: what the request being read holds of the memory budget, and at what factor
        self._charge: Charge | None = None
        self._factor = 0
        self._held = 0  # bytes of the budget it holds
        self._most = 0  # the most it will hold (its declared length x factor; 0: unknown)
        self._method = ""
        self._routed: Any = None  # what admit gave for the request being read
        self._pieces = 0  # body pieces parsed of the slice being fed
        self._chunked = False  # the body being read is chunked
        self._sized = 0  # the length of the body being read, when it is known (0: it is not)
        self._stash: memoryview | None = None  # read, left for the loop's next turn
        #: what the request being served holds (released once its reply is handed over)
        self.serving: Charge | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._size = 0  # header bytes, then body bytes, of the request being read
        #: the body as it comes: its one piece, or the bytearray the pieces are joined in
        self._body: bytes | bytearray = b""
        self._buffer: memoryview | None = None  # a large body with a Content-Length, read here

    # --- asyncio

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "unix:"
        server = self.server
        self.share = share = server.share(self.peer)
        share.connections += 1
        if len(server.connections) >= server.limit:
            # room for this one, with its request still under the limit when it comes
            server.evict(len(server.connections) - server.limit + 2, time.monotonic())
        most = server.bounds.peer_connections
        if most and share.unserved > most:  # room within its address's share
            server.evict(share.unserved - most, time.monotonic(), share)
        server.connections.add(self)
        server.watch(self.loop)
        self._wait_for_headers()

    def data_received(self, data: bytes) -> None:
        if self.discard:
            return
        if self._stash is not None:  # (what came before is still to be parsed)
            self._stash = memoryview(bytes(self._stash) + data)
        elif len(data) > _SLICE:  # (a chunked body's pieces, or pipelined requests)
            self._feed_slices(memoryview(data))
        else:
            self._feed(data)

    def _feed_slices(self, view: memoryview) -> None:
        """Parse a read a slice at a time (the rest of a body of a known length whole: its
        bytes are one piece), and leave the rest for the loop's next turn once a turn has
        parsed _PIECES_PER_TURN pieces (a request counts _MESSAGE_PIECES): libuv reads up to
        32 times in one turn, and 8 MB of 1-byte chunks held the loop 4.6 s; 35,000 pipelined
        requests in one send were each routed in one turn."""
        pieces = self._pieces = 0
        start = 0
        while start < len(view):
            if self.discard or self.closed:
                return
            left = self._sized - self._size if self._sized else 0
            end = start + (left if left > 0 else _SLICE)
            self._feed(view[start:end])
            start = end
            pieces += self._pieces
            self._pieces = 0
            if pieces > _PIECES_PER_TURN and start < len(view):
                self._stash = view[start:]
                self.transport.pause_reading()
                self.loop.call_soon(self._go_on)
                return

    def _go_on(self) -> None:
        view, self._stash = self._stash, None
        if view is None or self.closed:
            return
        self._feed_slices(view)
        if self._stash is None and not self.closed and not self.pending and not self.paused:
            self.transport.resume_reading()

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Discard):
                self.discard = True
                return
            if not isinstance(refused, _Refused):
                raise
            self._fail(refused)
        except httptools.HttpParserUpgrade:
            # The request asking for the upgrade was read whole and is answered as a plain one
            # (a server may ignore Upgrade); the parser reads nothing after it, so the
            # connection closes once it is answered (a second, 400 reply followed it before).
            self.last = True
            if not self.busy and not self.pending:
                self.close()
        except httptools.HttpParserError as exc:
            self._fail(_Refused(400, f"malformed HTTP request: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if self.task is not None and not self.task.done():
            # the client is gone: cancelling what its request awaits stops the run too
            # (asyncio cancels the request's future, whose cancel() cancels its token)
            self.task.cancel()

    def pause_writing(self) -> None:
        self.paused = True
        self.stalled_until = time.monotonic() + self.server.read_timeout

    def resume_writing(self) -> None:
        self.paused = False
        self.stalled_until = _NEVER
        if self._drained is not None:
            self._drained.set()
        if self._push is not None:
            self._push.resume()
        if not self.busy:
            self._next()

    # --- httptools' callbacks

    def on_message_begin(self) -> None:
        if self.last:  # a request after one that closes the connection: not read
            raise _Discard
        self.reading = True
        self._url = b""
        self._headers = []
        self._size = 0
        self._body = b""
        self._buffer = None
        self._charge = None
        self._held = self._most = 0
        self._chunked = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._count_header(len(name) + len(value))

    def _count_header(self, size: int) -> None:
        self._size += size
        if self._size > MAX_HEADER_BYTES:
            raise _Refused(
                431, f"the request's headers are over this server's {MAX_HEADER_BYTES} bytes"
            )

    def on_headers_complete(self) -> None:
        self.waiting_since = None
        self._size = 0
        server = self.server
        length = None
        expect = False
        binary = False
        chunked = False
        for name, value in self._headers:
            if name == b"content-length":
                length = value
            elif name == b"expect":
                expect = value.strip().lower() == b"100-continue"
            elif name == b"inference-header-content-length":
                binary = True
            elif name == b"transfer-encoding":
                codings = [c.strip() for c in value.lower().split(b",") if c.strip()]
                if codings != [b"chunked"]:  # RFC 9112 6.1: an unknown coding is 501
                    raise _Refused(
                        501,
                        f"Transfer-Encoding {value.decode('latin-1')!r} is not supported: send "
                        "the body plain or chunked, and compress it with Content-Encoding "
                        "(gzip or deflate) instead",
                    )
                chunked = True
        self._chunked = chunked
        # a body of a known length: its bytes are parsed whole (see _feed_slices)
        self._sized = 0 if chunked else int(length or 0)
        if chunked and length is not None:  # the chunks decide; the connection ends with it
            length = None
            self.last = True
        method = self.parser.get_method()
        if method == b"CONNECT":
            raise _Refused(501, "CONNECT is not served: this is an inference server, not a proxy")
        self._method = method = method.decode("latin-1")
        url = self._url
        if b"%" in url or b"?" in url or not url.startswith(b"/"):
            path = unquote(httptools.parse_url(url).path.decode("latin-1"))
        else:
            path = url.decode("latin-1")
        # the caller is known before anything is read or charged: a refusal (no such route,
        # no token, a wrong one) is answered now, and a body coming with it is not read
        routed = server.admit(method, path, self._headers, self.peer)
        if b"?" in url and type(routed) is not tuple:
            query = httptools.parse_url(url).query
            routed.query = parse_qs(query.decode("latin-1")) if query else {}
        if type(routed) is not tuple and not routed.probe:
            # (health and readiness probes are answered whatever the count)
            if len(server.connections) > server.limit:
                routed = self._crowded(routed)
            # (never refused for its address's bound: that closes the address's connections
            # that hold a slot without a request as its new ones come; a burst of connections
            # opened at once sends its requests a moment later)
            tenant = getattr(routed, "quota_key", None)
            if tenant is not None and type(routed) is not tuple:
                routed = self._quota(routed, tenant)
        self._routed = routed
        coming = chunked or (length is not None and length != b"0")
        if type(routed) is tuple and coming:
            raise _Refused(routed[0], "", reply=routed)
        if length is not None and length.isdigit() and int(length) > server.max_body:
            raise _Refused(413, server.too_large(int(length)))
        if server.budget is not None and server.budget.limit:
            self._factor = body_factor(url, binary)
            if length is not None and length.isdigit():
                self._most = int(length) * self._factor
        if length is not None and length.isdigit() and int(length) >= _PREALLOCATE:
            # read straight into place: joining 200 MB of chunks at the end would hold the
            # loop (and the GIL) for tens of milliseconds, and so would bytearray(n), which
            # zeroes its memory (120 ms for 200 MB); numpy's empty buffer is mapped lazily
            self._buffer = memoryview(np.empty(int(length), np.uint8))
        if expect and not self.busy:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        now = time.monotonic()
        self.deadline = now + server.read_timeout  # for the body
        if coming:
            self.body_since = now

    def _crowded(self, routed: Any) -> Any:
        """A request on a connection past the port's limit: room is made by closing
        connections that hold a slot without using it (refused ones draining, idle ones, slow
        bodies); if none, it is refused (503)."""
        server = self.server
        server.evict(len(server.connections) - server.limit, time.monotonic())
        if len(server.connections) > server.limit:
            return self._refusal(503, "the server has too many connections open; retry later")
        return routed

    def _quota(self, routed: Any, tenant: Any) -> Any:
        """A request with a valid token: counted in its token's requests in flight, or
        refused (429) past --http-token-requests; it is not counted by its address's bound
        from here on (a gateway is one address for all of its clients)."""
        if self.tenant != tenant:
            self._settle()  # (a pipelined request of another token: that one's is over)
            server = self.server
            held = server.tenants.get(tenant, 0)
            most = server.bounds.token_requests
            if (
                not shares.may_take(server.tenants, tenant, server.limit)
                if most < 0
                else most and held >= most
            ):
                return self._refusal(
                    429,
                    f"this token has {held} requests in flight, the most one token may have "
                    "(--http-token-requests / PLUGSERVE_HTTP_TOKEN_REQUESTS); retry later",
                )
            server.tenants[tenant] = held + 1
            self.tenant = tenant
        self._exempt()
        return routed

    def _exempt(self) -> None:
        """The connection serves a request of its address's: it leaves the address's bound."""
        if not self.exempt:
            self.exempt = True
            self.share.serving += 1

    def _settle(self) -> None:
        """Its requests are over (answered, refused, or the connection gone): it counts in
        its address's bound again, and no longer in its token's requests in flight."""
        if self.exempt:
            self.exempt = False
            self.share.serving -= 1
        tenant = self.tenant
        if tenant is not None:
            self.tenant = None
            tenants = self.server.tenants
            held = tenants.get(tenant, 1) - 1
            if held > 0:
                tenants[tenant] = held
            else:
                tenants.pop(tenant, None)

    def _refusal(self, status: int, message: str) -> Reply:
        refusal = self.server.refusal
        if refusal is not None:
            return refusal(self._url, status, message, None)
        return error_reply(status, message)

    def on_body(self, body: bytes) -> None:
        self._pieces += 1
        size = self._size = self._size + len(body)
        if size > self.server.max_body:
            raise _Refused(413, self.server.too_large(size))
        if self._factor and size * self._factor > self._held:  # charged as it comes
            self._charge_for(size)
        buffer = self._buffer
        if buffer is not None and size <= len(buffer):
            buffer[size - len(body) : size] = body
        elif not self._body:
            self._body = body  # one piece (a small request's whole body): kept as it is
        else:  # more: joined in one growing buffer, never an object per piece
            kept = self._body
            if type(kept) is bytes:
                kept = self._body = bytearray(kept)
            kept += body

    def _charge_for(self, size: int) -> None:
        """Charge what ``size`` bytes of body hold, in steps of _CHARGE_STEP bytes (never
        past the declared length's charge)."""
        factor = self._factor
        step = _CHARGE_STEP * factor
        want = -(-size * factor // step) * step
        if self._most:
            want = min(want, self._most)
        want = max(want, size * factor)
        self._charge = self._take(want - self._held, self._charge)
        self._held = want

    def _take(self, nbytes: int, onto: Charge | None = None) -> Charge:
        """``nbytes`` more of the memory budget for the request being read, or a 503 now:
        within the budget, and within this address's share of it."""
        share = self.share
        most = self.server.bounds.peer_bytes
        if most and share.nbytes + nbytes > most:
            error = ResourceExhausted(
                f"this request would hold about {size_text(nbytes)} more while in flight, and "
                f"requests from {self.peer} already hold {size_text(share.nbytes)} of the "
                f"{size_text(most)} one client address may hold (--max-inflight-bytes-per-peer / "
                "PLUGSERVE_MAX_INFLIGHT_BYTES_PER_PEER); retry later, or send large tensors "
                "as binary data (JSON costs 20x its size to decode)"
            )
            raise _Refused(503, str(error), error)
        try:
            charge = self.server.budget.charge(nbytes, "this request", onto)  # type: ignore[union-attr]
        except PlugserveError as exc:
            raise _Refused(503, str(exc), exc) from None
        share.nbytes += nbytes
        return charge

    def on_message_complete(self) -> None:
        self._pieces += _MESSAGE_PIECES
        self._sized = 0
        self.reading = False
        self.deadline = self.body_since = _NEVER
        body: bytes | bytearray | memoryview
        if self._buffer is not None and not self._body:
            body = self._buffer
        else:
            body = self._body
        self._body = b""
        self._buffer = None
        charge, self._charge = self._charge, None
        routed, self._routed = self._routed, None
        if type(routed) is not tuple:  # read whole: it serves its address now
            self._exempt()
        self.pending.append((self._method, routed, body, self.parser.should_keep_alive(), charge))
        if self.busy or self.paused or self._deferred:
            self.transport.pause_reading()
        else:
            self._next()

    # --- serving

    def _next(self) -> None:
        """Serve the oldest pending request, if any, else wait for the next one's headers.
        At most _REQUESTS_PER_TURN are served before the loop's next turn (reading paused
        meanwhile): one read of pipelined requests was served back to back, and 35,000
        ``GET /v2`` in one 1 MB send held the loop 7.8 s."""
        self._deferred = False
        served = 0
        while self.pending and not self.paused and not self.closed:
            if served == _REQUESTS_PER_TURN:
                self._deferred = True
                self.transport.pause_reading()
                self.loop.call_soon(self._next)
                return
            served += 1
            method, routed, body, keep_alive, self.serving = self.pending.popleft()
            if type(routed) is tuple:  # refused on its headers (it had no body)
                reply = routed
                keep_alive = keep_alive and routed[0] != 503  # (a slot it should not hold)
            else:
                try:
                    reply = self.server.handle(routed, body)
                except Exception as exc:
                    reply = error_reply(*http_status_of(exc))
                    forget_frames(exc)  # answered: its frames would only keep its data
            if not isinstance(reply, tuple):  # it awaits, or streams: finish on the loop
                self.busy = True
                self.task = self.loop.create_task(self._later(method, reply, keep_alive))
                return
            if not self._reply(method, reply, keep_alive):
                return
        if not self.closed and not self.pending:
            self.transport.resume_reading()
            if not self.reading:  # (else its headers are in, its body is timed)
                self._wait_for_headers()
            elif getattr(self._routed, "quota_key", None) is None:
                self._settle()  # a body coming without a token counts as its address's

    async def _later(
        self, method: str, reply: Awaitable[Reply] | StreamReply, keep_alive: bool
    ) -> None:
        try:
            done = reply if isinstance(reply, StreamReply) else await reply
        except Exception as exc:
            done = error_reply(*http_status_of(exc))
            forget_frames(exc)  # answered: its frames would only keep the request's data
        if isinstance(done, StreamReply):
            open_ = await self._stream(method, done, keep_alive)
        else:
            open_ = self._reply(method, done, keep_alive)
        self.busy = False
        if open_ and not self.paused:
            self._next()

    async def _stream(self, method: str, reply: StreamReply, keep_alive: bool) -> bool:
        """Write a :class:`StreamReply` chunk by chunk; whether the connection stays open.
        The request's memory charge ends when its head is written (its body was read)."""
        self._release(self.serving)
        self.serving = None
        chunks = reply.chunks
        try:
            if self.closed:
                return False
            self._bound_send_buffer()
            keep_alive = keep_alive and not (self.last and not self.pending)
            head = [
                STATUS_LINES.get(reply.status) or f"HTTP/1.1 {reply.status} \r\n".encode(),
                Date.header(),
            ]
            for name, value in reply.headers:
                head += (name, b": ", value, b"\r\n")
            head.append(b"transfer-encoding: chunked\r\n")
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            self.transport.write(b"".join(head))
            if method != "HEAD" and reply.push is not None:
                self._push = reply.push
                await self._push.start(self._write_chunk)
                if self.closed:
                    return False
            elif method != "HEAD":
                async for chunk in chunks:
                    if self.closed:
                        return False
                    size = len(chunk)
                    if 0 < size < 65536:  # one write, one send(2) (an event's is small)
                        self.transport.write(b"%x\r\n%b\r\n" % (size, chunk))
                    elif size:
                        self.transport.writelines([b"%x\r\n" % len(chunk), chunk, b"\r\n"])
                    while self.paused and not self.closed:  # the peer reads: then more
                        self._drained = asyncio.Event()
                        await self._drained.wait()
                    if self.closed:
                        return False
            self.transport.write(b"0\r\n\r\n")
        finally:
            self._drained = None
            self._push = None
            if reply.push is not None:
                reply.push.stop()
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        if not keep_alive:
            self.close()
            return False
        return True

    def _write_chunk(self, chunk: bytes) -> bool:
        """A :class:`Push`'s writer: ``chunk`` as one chunk of the body; whether to go on (the
        peer reads: the transport is under its high-water mark, the connection open)."""
        if self.closed:
            return False
        if chunk:
            self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return not self.paused and not self.closed

    def _bound_send_buffer(self) -> None:
        """A small kernel send buffer for a streamed reply (see STREAM_SEND_BUFFER)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a socket that refuses: the kernel's default
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)

    def _reply(self, method: str, reply: Reply, keep_alive: bool, linger: bool = False) -> bool:
        """Write ``reply``; whether the connection stays open. The request's memory charge
        ends here: its reply is the transport's now (bounded by the peer's reading).
        ``linger``: a connection closed after it first drops what the peer still sends."""
        self._release(self.serving)
        self.serving = None
        if self.closed:  # the client left: its answer is dropped
            return False
        status, pieces, headers = reply
        if status in (429, 503) and not any(n == b"retry-after" for n, _ in headers):
            headers = [*headers, RETRY_AFTER]  # every refusal to retry says when
        keep_alive = keep_alive and not (self.last and not self.pending)
        length = 0
        for piece in pieces:
            length += memoryview(piece).nbytes
        head = [STATUS_LINES.get(status) or f"HTTP/1.1 {status} \r\n".encode(), Date.header()]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-length: %d\r\n" % length)
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        if method == "HEAD" or not length:
            self.transport.write(b"".join(head))
        elif length < 65536:
            self.transport.write(b"".join([*head, *pieces]))
        else:
            self.transport.writelines([b"".join(head), *pieces])
        if not keep_alive and linger and self.transport.can_write_eof():
            self._linger()
            return False
        if not keep_alive:
            self.close()
            return False
        return True

    def _linger(self) -> None:
        """Close once the peer has sent what it was sending, or --request-read-timeout from
        now: the reply is sent with the write side shut (the peer reads it, then closes, and
        ``eof_received`` closes this side); what comes meanwhile is dropped unread."""
        self._release(self._charge)  # nothing it sends is kept
        self._charge = None
        self._settle()
        self.discard = self.lingering = True
        self.reading = False
        self.waiting_since = None
        self.body_since = _NEVER
        self.deadline = time.monotonic() + self.server.read_timeout
        self.transport.write_eof()

    def _fail(self, refused: _Refused) -> None:
        """Answer a request that cannot be read further, and close (without an answer when
        earlier pipelined requests are still to be answered: replies go out in order).
        ``refused.reply``: the answer, made already (else the refusal of its status)."""
        self.deadline = self.body_since = _NEVER
        if self.busy or self.pending:
            self.close()
        elif not self.closed:
            status, message, reply = refused.status, refused.message, refused.reply
            if reply is None:
                refusal = self.server.refusal
                reply = (
                    refusal(self._url, status, message, refused.error)
                    if refusal is not None
                    else error_reply(status, message)
                )
            self._reply("", reply, False, linger=status != 408)

    def unread(self) -> int:
        """Bytes the peer sent that the loop has not read yet (FIONREAD; 0 where unknown): a
        connection "waiting for headers" past EVICT_AFTER whose request is in its socket is
        not idle, the loop was busy. A burst of 250 requests on connections opened at once
        had 50 of them reset so while the loop answered the first (issue 58)."""
        sock = self.transport.get_extra_info("socket")
        try:
            found = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (AttributeError, OSError, ValueError):
            return 0
        return int.from_bytes(found, sys.byteorder, signed=True)

    def close(self) -> None:
        """Close now, and take it off the count at once (the close completes later)."""
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection off, dropping what it has not sent (a peer that does not read
        would keep a closing transport open as long as its buffer is not written out)."""
        self._forget()
        self.transport.abort()

    def _release(self, charge: Charge | None) -> None:
        if charge is not None:
            self.share.nbytes -= charge.release()

    def _forget(self) -> None:
        for *_, charge in self.pending:
            self._release(charge)
        self.pending.clear()
        self._release(self._charge)
        self._release(self.serving)
        self._charge = self.serving = None
        if not self.closed:
            self._settle()
            share = self.share
            share.connections -= 1
            if share.connections <= 0 and share.nbytes <= 0:
                peers = self.server.peers
                if peers.get(self.peer) is share:
                    del peers[self.peer]
        self.closed = True
        self.waiting_since = None
        self.deadline = self.stalled_until = self.body_since = _NEVER
        self.server.connections.discard(self)

    # --- deadlines

    def _wait_for_headers(self) -> None:
        self._settle()
        self.waiting_since = time.monotonic()
        self.deadline = self.waiting_since + self.server.read_timeout

    def expire(self) -> None:
        """Past the deadline: a connection waiting for headers is closed, a request whose body
        is late answered 408."""
        self.deadline = _NEVER
        if self.waiting_since is not None or self.lingering:
            self.close()
        elif self.reading:
            timeout = self.server.read_timeout
            self._fail(
                _Refused(
                    408,
                    f"the request body did not arrive within {timeout:g} s "
                    "(--request-read-timeout)",
                )
            )

    def too_slow(self, now: float, evicted: bool = False) -> None:
        """A body coming slower than --http-min-body-rate: 408, and closed (``evicted``: the
        port is full and wants its slot, before its --http-body-grace is over)."""
        bounds = self.server.bounds
        rate = self._size / max(now - self.body_since, 1e-6)
        message = (
            f"the request body came at {rate:,.0f} bytes/s, under this server's minimum of "
            f"{bounds.min_rate:g} (--http-min-body-rate, after --http-body-grace "
            f"{bounds.grace:g} s)" + ("; the server needed its connection" if evicted else "")
        )
        self._fail(_Refused(408, message))
