"""The REST port's application, composed: the process (and Ray Serve's replica) builds the port's
:class:`Router`, and each face registers its routes on it: KServe v2 first (its infer route is
the one whose lookup is paid per inference), then OpenAI's, then Anthropic's Messages API on the
chat route's engine. No face constructs the router or re-exports it, so a face is decode, call,
encode, and the port (limits, authorization, workers, the refusal bodies) is the router's alone.

One function for both hosts: the Ray replica took the OpenAI routes with fewer settings than the
process (no --tool-call-parser, --reasoning-parser, --served-model-name or --max-logprobs) when
each composed the port by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugserve.server.control.model_control import ModelControl
from plugserve.server.plane.dataplane import DataPlane
from plugserve.server.process.settings import Settings
from plugserve.server.protocols.auth import AuthInterceptor
from plugserve.server.protocols.http.app import Router
from plugserve.server.protocols.kserve.rest import RestApp
from plugserve.server.protocols.openai import OpenAIRoutes
from plugserve.server.protocols.openai.anthropic import AnthropicRoutes
from plugserve.server.protocols.openai.responses_store import configured

__all__ = ["RestFaces", "build_rest"]


@dataclass
class RestFaces:
    """The port's router and the faces on it (the OpenAI routes hold the Responses store and
    are closed with the server)."""

    router: Router
    kserve: RestApp
    openai: OpenAIRoutes
    anthropic: AnthropicRoutes


def build_rest(
    plane: DataPlane,
    control: ModelControl,
    settings: Settings,
    auth: AuthInterceptor | None,
) -> RestFaces:
    """The router with KServe v2's, OpenAI's and Anthropic's routes registered on it.
    Without tokens and without --allow-remote-control, the admin routes answer this machine
    only (``auth.control_refusal``)."""
    s = settings
    router = Router(plane.budget, s.max_message_bytes, auth, not s.allow_remote_control)
    kserve = RestApp(plane, control, router)
    store = configured(plane.budget, s, auth.tokens.tenants if auth is not None else 1)
    openai = OpenAIRoutes(
        plane,
        control,
        s.max_completion_tokens,
        store,
        s.tool_call_parser,
        s.reasoning_parser,
        s.served_names(),
        s.max_logprobs,
    )
    router.add_routes(openai.routes(), openai.refusal)
    anthropic = AnthropicRoutes(openai)  # Anthropic's Messages API, on chat's path
    router.add_routes(anthropic.routes(), anthropic.refusal, auth_errors=True)
    return RestFaces(router, kserve, openai, anthropic)
