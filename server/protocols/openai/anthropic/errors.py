"""Anthropic's error body for every refusal of ``/v1/messages`` and ``/v1/messages/count_tokens``.

Anthropic answers ``{"type": "error", "error": {"type", "message"}}``, the type naming the
status (400 ``invalid_request_error``, 401 ``authentication_error``, 403 ``permission_error``,
404 ``not_found_error``, 413 ``request_too_large``, 429 ``rate_limit_error``, 500
``api_error``, 529 ``overloaded_error``); its SDK raises by status (``BadRequestError``,
``NotFoundError``, ...) and reads the type from the body. The refusals come from the chat path
below this face (:class:`~plugserve.server.protocols.openai.errors.OpenAIError`, plugserve's
typed errors), so their status and message are the OpenAI face's (``openai/errors.py``
``status_of``), and only the body is Anthropic's. A 503 (busy, not ready) is
``overloaded_error`` with its 503 kept: Anthropic's 529 is its own, and retrying clients
(the SDK retries 503 and 529 alike) read both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from plugserve.plugins.api import PlugserveError, ResourceExhausted
from plugserve.server.plane.errors import forget_frames
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.openai.errors import guard, status_of

__all__ = ["error_body", "error_reply", "from_chat", "guarded", "refusal", "reply_of"]

#: Anthropic's error type for a status
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

Reply = tuple[int, list[bytes], list[tuple[bytes, bytes]]]


def error_type(status: int) -> str:
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def error_reply(status: int, message: str) -> Reply:
    return status, [orjson.dumps(error_body(status, message))], JSON


def refusal(status: int, message: str, error: PlugserveError | None) -> Reply:
    """A request to these routes refused before its handler runs (``Router.add_routes``):
    a token missing or not allowed (401, 403), a body over --max-message-bytes (413) or the
    memory budget (429), or too slow (408)."""
    if isinstance(error, ResourceExhausted):
        status = 429
    return error_reply(status, message)


def reply_of(exc: BaseException) -> Reply:
    """The error reply for ``exc`` (the OpenAI face's status and message, Anthropic's body)."""
    status, message, param, _code = status_of(exc)
    forget_frames(exc)
    if param and param not in message:
        message = f"{param}: {message}"
    return error_reply(status, message)


def from_chat(error: dict[str, Any]) -> dict[str, Any]:
    """The ``error`` event's body of a stream that fails once its status line is out, from
    chat's error object (``openai/errors.stream_error``: the chat path's failure, as the chat
    stream would write it; a code that is not a status is a 500)."""
    code = error.get("code")
    status = code if isinstance(code, int) else 500
    return error_body(status, str(error.get("message", "")))


def guarded(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``handler`` answering every error it raises in Anthropic's body (a coroutine's too)."""
    return guard(handler, reply_of)
