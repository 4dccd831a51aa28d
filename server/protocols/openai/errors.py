"""OpenAI's error body and status codes for every refusal of the /v1 and /v3 routes.

OpenAI answers ``{"error": {"message", "type", "param", "code"}}``; its clients read ``message``
and raise by status (400 ``BadRequestError``, 404 ``NotFoundError``, 429 ``RateLimitError``,
...). The adapter raises :class:`OpenAIError` for what it refuses itself (naming the request
field in ``param``); plugserve's typed errors from below (the data plane, the engine, the memory
budget) keep their status from ``server/protocols/status.py`` and get the body here, so one function
answers every failure of these routes in OpenAI's shape. A refusal of the REST layer itself
(a path not served, a missing token) keeps the REST port's own body.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from plugserve.plugins.api import NotFound
from plugserve.server.plane.errors import FieldError, forget_frames
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.status import http_status_of

__all__ = ["OpenAIError", "error_reply", "guard", "rename", "reply_of", "stream_error"]

#: OpenAI's ``type`` for a status (what its API answers; a 5xx is ``server_error``)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    499: "cancelled",
    501: "not_implemented",
    503: "service_unavailable",
    504: "timeout",
}


#: what the adapter raises for a request it refuses: the request path's :class:`FieldError`
#: (the applications below raise it too), answered in OpenAI's shape by :func:`status_of`
OpenAIError = FieldError


def rename(exc: FieldError, chat_name: str, name: str, paths: bool = True) -> None:
    """A chat refusal of field ``chat_name`` made a refusal of another face's field ``name``
    (the Responses API's, Anthropic's): its ``param`` and the quoted field in its message
    (``paths``: also where the message quotes a path below the field). Before, only the param
    was renamed: a Responses request's ``max_output_tokens`` of 0 was told "'max_completion_
    tokens' must be at least 1"."""
    param = exc.param or ""
    exc.param = name + param[len(chat_name) :] if paths else name
    quoted = re.compile("'" + re.escape(chat_name) + ("(?=['\\[.])" if paths else "(?=')"))
    message = str(exc)
    renamed = quoted.sub("'" + name.replace("\\", "\\\\"), message)
    if renamed != message:
        exc.args = (renamed, *exc.args[1:])


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(
                    status, "server_error" if status >= 500 else "invalid_request_error"
                ),
                "param": param,
                "code": code,
            }
        }
    )


def error_reply(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> tuple[int, list[bytes], list[tuple[bytes, bytes]]]:
    return status, [body(status, message, param, code)], JSON


def status_of(exc: BaseException) -> tuple[int, str, str | None, str | None]:
    """Status, message, param and code for any error a route met (an unexpected one is
    logged whole by ``http_status_of`` and answered 500)."""
    if isinstance(exc, FieldError):
        return exc.status, str(exc), exc.param, exc.code_name
    status, message = http_status_of(exc)
    code = None
    if isinstance(exc, NotFound):
        code = "model_not_found"
    return status, message, None, code


def reply_of(exc: BaseException) -> tuple[int, list[bytes], list[tuple[bytes, bytes]]]:
    """The error reply for ``exc``; its frames are forgotten once answered."""
    status, message, param, code = status_of(exc)
    forget_frames(exc)
    return error_reply(status, message, param, code)


def stream_error(exc: BaseException) -> dict[str, Any]:
    """The error object a stream sends as its last event when it fails midway (the status
    line went out with its first event), as vLLM does."""
    status, message, param, code = status_of(exc)
    forget_frames(exc)
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def guard(
    handler: Callable[[Any], Any], answer: Callable[[BaseException], Any] | None = None
) -> Callable[[Any], Any]:
    """``handler`` answering every error it raises (a coroutine's too) with ``answer(exc)``:
    OpenAI's body (:func:`reply_of`) by default, Anthropic's for its face."""
    answer = answer or reply_of

    def guarded(call: Any) -> Any:
        try:
            reply = handler(call)
        except Exception as exc:
            return answer(exc)
        if asyncio.iscoroutine(reply):
            return _awaited(reply, answer)
        return reply

    guarded.__name__ = getattr(handler, "__name__", "handler")
    return guarded


async def _awaited(reply: Awaitable[Any], answer: Callable[[BaseException], Any]) -> Any:
    try:
        return await reply
    except Exception as exc:
        return answer(exc)
