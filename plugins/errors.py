"""plugserve's typed errors: the ground floor every other module may import.

Each names the gRPC status the server answers with (``code``), so the server maps them in one
place (``server/protocols/status.py``) and users catch what they can act on. This module imports
nothing of plugserve's, so the modules below the Plugin API (streams, cancellation, blobs) can raise
them without importing the API itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

__all__ = [
    "BackendUnavailable",
    "Cancelled",
    "DeadlineExceeded",
    "DeviceOutOfMemory",
    "FailedPrecondition",
    "InferenceError",
    "InvalidArgument",
    "InvalidInput",
    "InvalidModel",
    "NotFound",
    "PermissionDenied",
    "PlugserveError",
    "QueueFull",
    "ResourceExhausted",
    "Unsupported",
    "listing",
]


class PlugserveError(Exception):
    """Base of every error plugserve raises on purpose; ``code`` names the gRPC status."""

    code: ClassVar[str] = "INTERNAL"


class NotFound(PlugserveError, LookupError):
    """An unknown device, network, metric or node."""

    code = "NOT_FOUND"


class InvalidArgument(PlugserveError, ValueError):
    """The caller sent something that cannot be right: a bad config value, name or key."""

    code = "INVALID_ARGUMENT"


class PermissionDenied(PlugserveError, PermissionError):
    """The call is well formed but its source may not cause it: a model that runs code when
    loaded (a PyTorch program, a Python model's ``model.py``) sent by a client rather than
    read from the operator's model repository (docs/security.md, "What runs code and who may
    cause it")."""

    code = "PERMISSION_DENIED"


class InvalidModel(InvalidArgument):
    """The model is not ONNX, does not validate, or reads files it must not."""


class InvalidInput(InvalidArgument):
    """Inference inputs do not match what the network declares."""


class Unsupported(PlugserveError, NotImplementedError):
    """The device cannot do this (an op, a data type, an attribute value, an operation)."""

    code = "UNIMPLEMENTED"


class BackendUnavailable(PlugserveError, RuntimeError):
    """A plugin's backend cannot work on this machine (raised by plugin constructors)."""

    code = "UNAVAILABLE"


class ResourceExhausted(PlugserveError, RuntimeError):
    """A queue or pool is full; the caller may retry later."""

    code = "RESOURCE_EXHAUSTED"


class QueueFull(ResourceExhausted):
    """A network's queue is full: RESOURCE_EXHAUSTED on gRPC, and on HTTP 503 Service
    Unavailable, as Triton answers it (its message, "Exceeds maximum queue size", starts ours)."""


class DeviceOutOfMemory(ResourceExhausted):
    """A device has no memory for this request (its budget, or the GPU itself ran out): that
    request fails, the device serves the next; RESOURCE_EXHAUSTED on gRPC, 503 Service
    Unavailable on HTTP as a full queue (the server's capacity, not the caller's rate)."""


class FailedPrecondition(PlugserveError, RuntimeError):
    """The call is valid but not in this state (e.g. ``wait()`` before ``start_async()``)."""

    code = "FAILED_PRECONDITION"


class DeadlineExceeded(PlugserveError, TimeoutError):
    """A request's deadline (the client's, or the server's --max-request-seconds) passed: it
    was dropped from its queue, or stopped while it ran."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(PlugserveError, RuntimeError):
    """The caller went away or cancelled: the request was removed from its queue, or stopped
    while it ran."""

    code = "CANCELLED"


class InferenceError(PlugserveError, RuntimeError):
    """A kernel failed while running; the message names the node."""

    code = "INTERNAL"


def listing(items: Iterable[Any], limit: int = 10, plain: bool = False) -> str:
    """``['a', 'b'] ... and 990 more`` (``plain``: ``a, b ... and 990 more``): names for an
    error message, however many a caller sent (a status message travels in a header)."""
    items = list(items)
    shown = ", ".join(map(str, items[:limit])) if plain else repr(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")
