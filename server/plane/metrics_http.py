"""The metrics port's HTTP server: prometheus_client's WSGI server, bounded.

prometheus_client's ``ThreadingWSGIServer`` starts a thread for every connection and reads it
without a timeout. The metrics port takes no token, so anyone who could reach it held a server
thread per idle connection, as long as they liked: 500 connections that sent half a request
line made 500 threads (30,000 would reach a container's thread limit, and then no part of the
server could start one). Here:

* at most :data:`CONNECTIONS` connections are served at once, at most
  :data:`PEER_CONNECTIONS` of them from one address; one past them is closed at once (a
  scraper retries on its next interval; Prometheus scrapes over one connection);
* a connection's reads wait at most :data:`READ_SECONDS` each, and a connection lives at most
  :data:`LIFE_SECONDS` in all (a client trickling a byte at a time is cut off), so a held
  slot is free again within that time.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer

from plugserve.plugins.threads import start_daemon

__all__ = ["CONNECTIONS", "LIFE_SECONDS", "PEER_CONNECTIONS", "READ_SECONDS", "serve_wsgi"]

#: connections served at once
CONNECTIONS = 16
#: connections served at once from one address
PEER_CONNECTIONS = 4
#: the longest a read of a connection waits
READ_SECONDS = 5.0
#: the longest a connection is kept, all its requests together
LIFE_SECONDS = 30.0


class _Quiet(WSGIRequestHandler):
    """No access log on stderr for every scrape; reads bounded by READ_SECONDS."""

    timeout = READ_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Bounded(ThreadingWSGIServer):
    """At most ``connections`` served at once (``per_peer`` of one address), each cut off
    after ``life`` seconds."""

    connections = CONNECTIONS
    per_peer = PEER_CONNECTIONS
    life = LIFE_SECONDS
    request_queue_size = 128  # (socketserver's 5 dropped SYNs: connects waited on retries)

    def server_bind(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Any, tuple[float, str]] = {}  # connection -> (its end, its address)
        self._peers: dict[str, int] = {}
        self._stopping = threading.Event()  # (set by server_close, which a failed bind calls)
        super().server_bind()

    def server_activate(self) -> None:
        super().server_activate()
        start_daemon("metrics-reaper", self._reap)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0]) if client_address else ""
        with self._lock:
            full = len(self._open) >= self.connections or self._peers.get(peer, 0) >= self.per_peer
            if not full:
                self._open[request] = (time.monotonic() + self.life, peer)
                self._peers[peer] = self._peers.get(peer, 0) + 1
        if full:
            self.shutdown_request(request)  # closed at once, no thread made
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            held = self._open.pop(request, None)
            if held is not None:
                left = self._peers[held[1]] - 1
                if left:
                    self._peers[held[1]] = left
                else:
                    del self._peers[held[1]]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or went away: no traceback on stderr (socketserver
        prints one for each, which a client could make as fast as it connected)."""

    def _reap(self) -> None:
        """Shut the connections past their life (a blocked read then returns)."""
        while not self._stopping.wait(1.0):
            now = time.monotonic()
            with self._lock:
                late = [r for r, (end, _) in self._open.items() if now >= end]
            for request in late:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()


def serve_wsgi(host: str, port: int, app: Callable[..., Any]) -> ThreadingWSGIServer:
    """``app`` served on ``host``:``port`` by a bounded server on a daemon thread (OSError
    when the port cannot be had)."""

    class Server(_Bounded):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, app, Server, handler_class=_Quiet)
    start_daemon("metrics", server.serve_forever)
    return server
