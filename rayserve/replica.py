"""One Serve replica: a plugserve server without ports of its own, behind Serve's proxies.

Each replica holds what ``plugserve serve`` holds (``server/process/app.py``'s :class:`Server`,
built from the same :class:`Settings`: the Core with its devices, the data plane and its memory
budget, model control over the repository, the metrics) and loads the repository when it
starts, so Serve counts it running only once its models are ready. It binds no port: Serve's
HTTP proxy hands it requests for the REST app (``http.py``), Serve's gRPC proxy calls its
KServe v2 methods (``kserve_grpc.py``), both the server's own code.

Health is plugserve's readiness: Serve calls :meth:`check_health` (every 10 s by default) and
replaces a replica that is not ready or is draining. Shutting down drains as the server does
on SIGTERM (admitted requests finish within ``--exit-timeout``).

Many models over few replicas (``models_per_replica`` > 0): a request naming a model in
Serve's multiplexed model id (HTTP header ``serve_multiplexed_model_id``, gRPC metadata
``multiplexed_model_id``) has it loaded from the repository on the replica first, and Serve's
router sends requests for a model to replicas that have it; at most that many models stay
loaded per replica, the least recently used unloaded (``serve.multiplexed``). The replica
then starts with nothing loaded (``--model-control-mode explicit``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from plugserve.plugins.api import PlugserveError
from plugserve.ray.http import answer, serve_http, stream_chunks
from plugserve.ray.ingress import Forwarded, ReplyHead
from plugserve.ray.kserve_grpc import METHODS, STREAMING, KServeBridge
from plugserve.server.process.app import NotServable, Server
from plugserve.server.process.rest_faces import RestFaces, build_rest
from plugserve.server.process.settings import Settings
from plugserve.server.protocols.auth import ADMIN, INFER, AuthInterceptor, load_tokens
from plugserve.server.protocols.http.http_server import StreamReply
from plugserve.server.protocols.kserve.grpc_service import KServeServicer

__all__ = ["ReplicaBase", "replica_class"]

log = logging.getLogger("plugserve.ray")


class ReplicaBase:
    """The replica's behaviour; :func:`replica_class` adds the gRPC methods Serve's proxy
    calls and, when asked for, the multiplexed model loader."""

    #: models kept per replica under multiplexing (0: off)
    models_per_replica = 0

    def __init__(self, settings: dict[str, Any], threads: int) -> None:
        s = Settings.load(argparse.Namespace(**settings))
        logging.getLogger("plugserve").setLevel(s.log_level.upper())
        self.rest: RestFaces | None = None
        self.kserve: KServeBridge | None = None
        self.server = Server(s)
        plane, control = self.server.plane, self.server.control
        try:  # what `plugserve serve` loads, ready as it is (an ensemble with all its steps)
            self.server.load_models()
        except NotServable:
            self.server.stop(0)
            raise
        auth = None
        if s.auth_tokens:
            auth = AuthInterceptor(
                load_tokens(s.auth_tokens), bool(s.open_health), bool(s.open_reflection)
            )
        local = not s.allow_remote_control
        self.rest = build_rest(plane, control, s, auth)
        self.server.openai = self.rest.openai  # closed by Server.stop
        tenant_of = auth.tenant if auth is not None else None
        self.kserve = KServeBridge(KServeServicer(plane, control, tenant_of), threads, auth, local)
        #: checks a caller's token before its multiplexed model is loaded for it
        self.auth = auth

    # --- Serve's hooks

    async def __call__(self, request: Request) -> Response:
        await self._multiplexed(list(request.headers.items()))
        return await serve_http(self.rest.router, self.server.plane.budget, request)

    async def routed(self, request: Forwarded) -> AsyncIterator[ReplyHead | bytes]:
        """A request the ingress forwards under prefix routing (``ingress.py``), answered as
        :meth:`__call__` answers Serve's proxy: its head, then its body's chunks."""
        await self._multiplexed([(k.decode("latin-1"), v.decode("latin-1")) for k, v in
                                 request.headers])  # fmt: skip
        body = request.body

        async def read() -> bytes:
            return body

        reply = await answer(
            self.rest.router,
            self.server.plane.budget,
            request.method,
            request.path,
            request.headers,
            request.peer,
            len(body),
            read,
        )
        if isinstance(reply, StreamReply):
            yield ReplyHead(reply.status, list(reply.headers), True)
            async for chunk in stream_chunks(reply):
                yield chunk
            return
        status, pieces, headers = reply
        yield ReplyHead(status, list(headers), False)
        yield b"".join(bytes(p) for p in pieces)

    def check_health(self) -> None:
        plane = self.server.plane
        if not plane.ready or plane.draining:
            raise RuntimeError("plugserve is not ready (still loading, or draining)")

    def __del__(self) -> None:
        server = getattr(self, "server", None)  # None: __init__ failed before making it
        if server is not None:
            server.stop()
        if getattr(self, "rest", None) is not None:
            self.rest.router.workers.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "kserve", None) is not None:
            self.kserve.close()

    # --- multiplexing

    async def _multiplexed(self, metadata: list[tuple[str, str]]) -> None:
        """Load the request's multiplexed model, for a caller whose token may infer: with
        tokens, a caller without one (or with a wrong one) made the replica load a model and
        unload another before its 401, so anyone could churn the tenants' models."""
        if self.models_per_replica:
            model_id = serve.get_multiplexed_model_id()
            if model_id and self._may_load(metadata):
                await self.model(model_id)

    def _may_load(self, metadata: list[tuple[str, str]]) -> bool:
        """Whether the caller's token may infer (its call's own check refuses it after)."""
        return self.auth is None or self.auth.role_of(metadata) in (INFER, ADMIN)

    async def model(self, model_id: str) -> Any:
        """Replaced by the multiplexed loader (:func:`replica_class`)."""
        return None

    async def _load(self, model_id: str) -> _Held:
        control = self.server.control
        await asyncio.to_thread(control.reload, model_id)
        return _Held(control, model_id)


class _Held:
    """A model loaded for multiplexing; Serve calls ``__del__`` when it evicts it."""

    def __init__(self, control: Any, name: str) -> None:
        self.control = control
        self.name = name
        self.loaded = True

    def __del__(self) -> None:
        if self.loaded:
            self.loaded = False
            try:
                self.control.unload(self.name, 0, remove=False)
            except PlugserveError as exc:
                log.warning("multiplexing: unloading %s: %s", self.name, exc)


def _metadata(grpc_context: Any) -> list[tuple[str, str]]:
    """A gRPC call's metadata as Serve's context gives it (its auth check reads it)."""
    return list(grpc_context.invocation_metadata() or [])


def _unary(name: str) -> Any:
    async def method(self: ReplicaBase, request: Any, grpc_context: Any) -> Any:
        await self._multiplexed(_metadata(grpc_context))
        return await self.kserve.unary(name, request, grpc_context)

    method.__name__ = name
    return method


def _streaming(name: str) -> Any:
    async def method(
        self: ReplicaBase, requests: AsyncIterator[Any], grpc_context: Any
    ) -> AsyncIterator[Any]:
        await self._multiplexed(_metadata(grpc_context))
        async for response in self.kserve.stream(name, requests, grpc_context):
            yield response

    method.__name__ = name
    return method


def replica_class(models_per_replica: int = 0) -> type[ReplicaBase]:
    """The deployment's class: :class:`ReplicaBase` with a method per KServe v2 gRPC method
    (Serve's proxy calls the replica's method named as the RPC) and, when
    ``models_per_replica`` > 0, ``model`` as Serve's multiplexed loader."""
    namespace: dict[str, Any] = {
        name: _streaming(name) if name in STREAMING else _unary(name) for name in METHODS
    }
    if models_per_replica:

        @serve.multiplexed(max_num_models_per_replica=models_per_replica)
        async def model(self: ReplicaBase, model_id: str) -> Any:
            return await self._load(model_id)

        namespace["model"] = model
        namespace["models_per_replica"] = models_per_replica
    return type("PlugserveReplica", (ReplicaBase,), namespace)
