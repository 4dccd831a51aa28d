"""plugserve's REST routes as an ASGI application, served by uvicorn or granian (issue 52).

The question it answers: does our own HTTP/1.1 server (``server/protocols/http/http_server.py``)
earn its keep against a well-kept HTTP server for Python? To compare servers rather than
applications, both serve the *same* application: :meth:`RestApp.dispatch` (every KServe route,
the OpenAI routes mounted on it, the same DataPlane and models), called with the request read
whole, exactly as ``HttpServer`` calls it. Only the HTTP layer differs.

What ``HttpServer`` does around ``dispatch`` that a switch would have to do in the ASGI app is
done here as a switch would do it, so the attacks meet a fair opponent:

- the body is read whole, bounded by --max-message-bytes (413) and by one deadline of
  --request-read-timeout from its headers (408), and charged to the memory budget **as its
  bytes arrive** (issue 52's ask; ``HttpServer`` charged a declared Content-Length up front);
- a body with a Content-Length of 1 MiB or more is read into one buffer made for it, others
  into one ``bytearray`` (never one object per chunk);
- a reply is written as ``HttpServer`` writes it (Content-Length, or chunks for a
  :class:`StreamReply`), the request's charge released once it is handed over;
- a refusal closes the connection (``connection: close``).

Not done (a switch would need them too): the auth interceptor is not passed (the benchmark
runs without tokens); a client that disconnects does not cancel the inference it waits for
(uvicorn does not cancel the application's task; a watcher on ``receive()`` would); HTTP-level
bounds (header size, keep-alive, connection count) are the ASGI server's own, at its defaults.

Run as a server (the flags after ``--`` are ``plugserve serve``'s; its own REST port is off)::

    python tests/benchmarks/asgi_shim.py --server uvicorn --port 0 -- --grpc-port 0 ...

It prints ``listening: asgi http://HOST:PORT`` once the models are loaded and the port is up.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvloop

from plugserve.plugins.api import PlugserveError
from plugserve.server.plane.budget import Charge, MemoryBudget, body_factor
from plugserve.server.protocols.http.http_server import Reply, StreamReply, error_reply
from plugserve.server.protocols.status import http_status_of

#: a body with a Content-Length of at least this is read into one buffer made for it
_PREALLOCATE = 1 << 20
_CLOSE = (b"connection", b"close")

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KserveAsgi:
    """An ASGI application calling ``dispatch(method, path, headers, body, peer)``."""

    def __init__(
        self,
        dispatch: Callable[..., Any],
        max_body: int,
        read_timeout: float,
        too_large: Callable[[int], str],
        budget: MemoryBudget | None = None,
        copy_views: bool = False,
    ) -> None:
        """``copy_views``: hand the server ``bytes`` only (granian refuses memoryviews)."""
        self.dispatch = dispatch
        self.max_body = max_body
        self.read_timeout = read_timeout
        self.too_large = too_large
        self.budget = budget if budget is not None and budget.limit else None
        self.copy_views = copy_views

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rsplit(".", 1)[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        headers: list[tuple[bytes, bytes]] = [(k.lower(), v) for k, v in scope["headers"]]
        charge: Charge | None = None
        try:
            try:
                body, charge = await self._body(scope["path"], headers, receive)
            except _Refused as exc:
                await self._send(send, (*error_reply(exc.status, str(exc))[:2], [_CLOSE]))
                return
            client = scope.get("client")
            peer = str(client[0]) if client else "unix:"
            try:
                reply = self.dispatch(scope["method"], scope["path"], headers, body, peer)
                if not isinstance(reply, (tuple, StreamReply)):
                    reply = await reply
            except Exception as exc:
                reply = error_reply(*http_status_of(exc))
            if isinstance(reply, StreamReply):
                if charge is not None:  # the body was read: a stream holds no charge
                    charge.release()
                    charge = None
                await self._stream(send, reply)
            else:
                await self._send(send, reply, charge)
                charge = None
        finally:
            if charge is not None:
                charge.release()

    async def _body(
        self, path: str, headers: list[tuple[bytes, bytes]], receive: Receive
    ) -> tuple[bytes | memoryview, Charge | None]:
        """The request's body, read whole within the bounds (see the module's docstring)."""
        length = -1
        binary = False
        for name, value in headers:
            if name == b"content-length" and value.isdigit():
                length = int(value)
            elif name == b"inference-header-content-length":
                binary = True
        if length > self.max_body:
            raise _Refused(413, self.too_large(length))
        factor = body_factor(path.encode("latin-1"), binary) if self.budget is not None else 0
        charge = self.budget.holder() if self.budget is not None else None
        buffer: Any = (
            memoryview(np.empty(length, np.uint8)) if length >= _PREALLOCATE else bytearray()
        )
        size = 0
        # one deadline for the whole body: a timer that cancels this task (wait_for on each
        # receive() would make a task and a timer per message)
        task = asyncio.current_task()
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            task.cancel()  # type: ignore[union-attr]

        timer = asyncio.get_running_loop().call_later(self.read_timeout, expire)
        try:
            while True:
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    if not expired:
                        raise
                    getattr(task, "uncancel", lambda: 0)()  # Python 3.11+
                    raise _Refused(
                        408,
                        f"the request body did not arrive within {self.read_timeout:g} s "
                        "(--request-read-timeout)",
                    ) from None
                if message["type"] == "http.disconnect":
                    raise _Refused(400, "the client went away")
                chunk = message.get("body", b"")
                if chunk:
                    if size + len(chunk) > self.max_body:
                        raise _Refused(413, self.too_large(size + len(chunk)))
                    if factor:
                        try:
                            self.budget.charge(len(chunk) * factor, "this request", charge)  # type: ignore[union-attr]
                        except PlugserveError as exc:
                            raise _Refused(503, str(exc)) from None
                    if isinstance(buffer, memoryview) and size + len(chunk) <= len(buffer):
                        buffer[size : size + len(chunk)] = chunk
                    else:
                        if isinstance(buffer, memoryview):  # more than it said
                            buffer = bytearray(buffer[:size])
                        buffer += chunk
                    size += len(chunk)
                if not message.get("more_body", False):
                    break
        except BaseException:
            if charge is not None:
                charge.release()
            raise
        finally:
            timer.cancel()
        if isinstance(buffer, memoryview):
            return buffer[:size], charge
        return bytes(buffer), charge

    async def _send(self, send: Send, reply: Reply, charge: Charge | None = None) -> None:
        status, pieces, headers = reply
        views = [memoryview(p).cast("B") if not isinstance(p, bytes) else p for p in pieces]
        length = sum(len(v) for v in views)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [*headers, (b"content-length", b"%d" % length)],
                }
            )
            if length < 65536 or self.copy_views:
                await send({"type": "http.response.body", "body": b"".join(views)})
            else:
                for i, view in enumerate(views):
                    more = i < len(views) - 1
                    await send({"type": "http.response.body", "body": view, "more_body": more})
        finally:
            if charge is not None:
                charge.release()

    async def _stream(self, send: Send, reply: StreamReply) -> None:
        chunks = reply.chunks
        try:
            await send(
                {"type": "http.response.start", "status": reply.status, "headers": reply.headers}
            )
            async for chunk in chunks:
                if chunk:
                    await send(
                        {"type": "http.response.body", "body": bytes(chunk), "more_body": True}
                    )
            await send({"type": "http.response.body", "body": b""})
        finally:
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()


def build(serve_argv: list[str], copy_views: bool = False) -> tuple[Any, KserveAsgi]:
    """A started plugserve :class:`Server` without its REST port, and the ASGI application
    over its routes (as ``Server._start_rest`` mounts them: KServe, then OpenAI's)."""
    from plugserve.server.process.app import Server, configure_logging
    from plugserve.server.process.rest_faces import build_rest
    from plugserve.server.process.settings import Settings

    settings = Settings.from_argv([*serve_argv, "--http-port", "-1"])
    configure_logging(settings)
    server = Server(settings)
    server.start()
    faces = build_rest(server.plane, server.control, settings, None)
    server.openai = faces.openai
    app = KserveAsgi(
        faces.router.dispatch,
        settings.max_message_bytes,
        settings.request_read_timeout,
        faces.router.too_large,
        server.plane.budget,
        copy_views,
    )
    return server, app


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["uvicorn", "granian"], default="uvicorn")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(own)
    port = args.port or _free_port(args.host)
    server, app = build(serve, copy_views=args.server == "granian")
    stopping = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
        loop.add_signal_handler(signal.SIGINT, stopping.set)
        if args.server == "uvicorn":
            import uvicorn

            config = uvicorn.Config(
                app, host=args.host, port=port, loop="none", http="httptools",
                lifespan="off", log_level="warning", access_log=False,
            )  # fmt: skip
            config.load()
            asgi = uvicorn.Server(config)
            asgi.lifespan = config.lifespan_class(config)  # as Server._serve makes it
            await asgi.startup()
            print(f"listening: asgi http://{args.host}:{port}", flush=True)
            await stopping.wait()
            asgi.should_exit = True
            await asgi.shutdown()
            return
        # granian's embedded server: it runs on this loop, in this process, beside the gRPC
        # server (as our REST server does); its worker-process mode could not share the
        # DataPlane with the gRPC port
        from granian.constants import Interfaces
        from granian.server.embed import Server as Granian

        granian = Granian(
            app, address=args.host, port=port, interface=Interfaces.ASGI, log_enabled=False
        )
        serving = asyncio.ensure_future(granian.serve())
        await asyncio.sleep(0.5)
        print(f"listening: asgi http://{args.host}:{port}", flush=True)
        await stopping.wait()
        granian.stop()
        await asyncio.wait_for(serving, 10)

    try:
        uvloop.run(run())
    finally:
        server.stop(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
