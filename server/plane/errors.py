"""What the request path does with a request's error once it has been answered or logged."""

from __future__ import annotations

from plugserve.plugins.api import InvalidArgument, PlugserveError

__all__ = ["FieldError", "Unloaded", "forget_frames"]


class Unloaded(PlugserveError):
    """A request whose model was unloaded (or replaced, or the server is stopping) before it
    could be answered: UNAVAILABLE (REST 503 with Retry-After), which a client retries; never
    INTERNAL, which says the server failed. An unload waits for the requests its model
    admitted first (--model-unload-timeout: ``server/control/retire.py``)."""

    code = "UNAVAILABLE"


class FieldError(InvalidArgument):
    """A request refused for one of its fields, named in ``param`` as a dotted path
    (``messages[2].role``) so each protocol can point at it (OpenAI's ``param``); raised by the
    applications (a grammar, an encoder) as much as by the adapters. ``status``: the HTTP status
    when it is not 400 (413 for a field too large, 501 for a feature not installed), ``code``
    a protocol's machine-readable code."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code_name = code


def forget_frames(exc: BaseException) -> None:
    """Forget the frames a request's error (and the errors it came from) holds, once it has
    been answered or logged.

    Each frame in a traceback keeps its callers too, and on the request path those held the
    request's future (or an asyncio task), which held the error: a reference cycle that kept
    the request's arrays (inputs, outputs, the run's locals) until Python's cycle collector
    ran, which counts objects, not bytes: three refused 2 GB answers held 6 GB. A device's own
    failure is logged with its traceback where it is caught (``DataPlane._admit``)."""
    pending = [exc]
    for _ in range(16):  # a chain is short; the bound keeps a cyclic one from looping
        if not pending:
            return
        error = pending.pop()
        error.__traceback__ = None
        pending += [e for e in (error.__cause__, error.__context__) if e is not None]
