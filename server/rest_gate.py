"""Bounds on what an open HTTP connection may hold on the REST port, the twin of
``server/callgate.py`` for uvicorn.

uvicorn counts every open connection against its limit (4 x --grpc-workers) and answers 503
beyond it, and it times out a connection only between requests: one that never sends a
request, or never finishes its headers, stays open for good. So that many idle connections
used to take the REST port away from everyone. Here:

- a connection that has not finished a request's headers within --request-read-timeout of
  opening (or of its last response) is closed;
- when the limit is reached, the connections that have waited longest for a request's
  headers are closed to make room, once it has waited ``EVICT_AFTER`` seconds (a real client sends
  its headers with the connection);
- the body's arrival is bounded in the application (``RestApp``: 408 past the same timeout).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["gated_protocol"]

#: A connection waiting this long for a request's headers may be closed to make room.
EVICT_AFTER = 0.5


def gated_protocol(read_timeout: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the bounds above, for one server."""

    class GatedProtocol(HttpToolsProtocol):
        #: since when it waits for a request's headers (None: a request is under way)
        waiting_since: float | None = None
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            limit = self.limit_concurrency
            if limit is not None and len(self.connections) >= limit:
                # room for this one, with its request still under the limit when it is admitted
                _evict(self.connections, len(self.connections) - limit + 2, time.monotonic())
            super().connection_made(transport)
            self._wait_for_headers()

        def _wait_for_headers(self) -> None:
            self.waiting_since = time.monotonic()
            self.header_timer = self.loop.call_later(read_timeout, self._too_slow)

        def _too_slow(self) -> None:
            if self.waiting_since is not None and not self.transport.is_closing():
                self.transport.close()

        def on_headers_complete(self) -> None:
            self.waiting_since = None
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._wait_for_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

    return GatedProtocol


def _evict(connections: Any, count: int, now: float) -> None:
    """Close up to ``count`` of the connections waiting longest for a request's headers (those
    past EVICT_AFTER), and take them off the count at once (uvicorn's own bookkeeping drops
    them only when the close completes, after this connection's request is admitted)."""
    waiting = sorted(
        (c.waiting_since, id(c), c)
        for c in connections
        if c.waiting_since is not None and now - c.waiting_since >= EVICT_AFTER
    )
    for _, _, connection in waiting[:count]:
        connection.waiting_since = None
        connection.transport.close()
        connections.discard(connection)
