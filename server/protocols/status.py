"""The one place where plugserve's typed errors become gRPC status codes, and those codes
HTTP statuses (the REST adapter's, as Google's API design maps them; RESOURCE_EXHAUSTED is 429
Too Many Requests and CANCELLED nginx's 499, client closed request)."""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from plugserve.plugins.api import DeviceOutOfMemory, PlugserveError, QueueFull
from plugserve.server.plane.errors import FieldError, forget_frames

__all__ = [
    "HTTP_STATUS",
    "MAX_MESSAGE_CHARS",
    "grpc_code",
    "http_status_of",
    "status_of",
]

log = logging.getLogger(__name__)

#: Longest status message sent. gRPC carries it in a header, percent-encoded (up to 3 bytes per
#: byte of UTF-8), and a client refuses headers over its metadata limit (8 KiB by default) as
#: RESOURCE_EXHAUSTED "Stream removed", hiding the real error.
MAX_MESSAGE_CHARS = 1000

_CODES = {
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "UNIMPLEMENTED": grpc.StatusCode.UNIMPLEMENTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "DEADLINE_EXCEEDED": grpc.StatusCode.DEADLINE_EXCEEDED,
    "CANCELLED": grpc.StatusCode.CANCELLED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


HTTP_STATUS = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.INTERNAL: 500,
}


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, PlugserveError):
        return _CODES.get(exc.code, grpc.StatusCode.INTERNAL)
    return grpc.StatusCode.INTERNAL


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Code and message for an error; anything unexpected is INTERNAL and logged in full."""
    if isinstance(exc, PlugserveError):
        return grpc_code(exc), _bounded(str(exc))
    log.exception("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, _bounded(f"internal error: {type(exc).__name__}: {exc}")


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    cut = MAX_MESSAGE_CHARS - 40
    return f"{message[:cut]} ... ({len(message) - cut} more characters)"


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with ``exc``'s status; an unexpected error is logged with its traceback
    first, then its frames are forgotten (:func:`forget_frames`)."""
    code, message = status_of(exc)
    forget_frames(exc)
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


def http_status_of(exc: BaseException) -> tuple[int, str]:
    """HTTP status and message for an error (see :func:`status_of`); a full queue is 503, as
    Triton answers it over HTTP, and so is a device out of memory (RESOURCE_EXHAUSTED on gRPC,
    429 for every other exhaustion: the memory budget, the sequence slots)."""
    code, message = status_of(exc)
    if isinstance(exc, (QueueFull, DeviceOutOfMemory)):
        return 503, message
    if isinstance(exc, FieldError) and exc.status != 400:  # (413: a body of too many values)
        return exc.status, message
    return HTTP_STATUS.get(code, 500), message
