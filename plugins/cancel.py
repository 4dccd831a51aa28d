"""Stopping load and query work whose caller is gone.

Compiling a network runs for as long as its model asks; the caller of LoadNetwork or
QueryNetwork may cancel, or pass its deadline, long before. The server says how to tell
(``should_stop``, e.g. "the RPC is no longer active") with :func:`stop_when` around the call;
the long steps (between transformation passes, between the subgraphs of a HETERO load) ask
:func:`check`, which raises :class:`Cancelled` once it is true. The check is a context
variable, so plugins keep their signatures and nested loads (HETERO, MULTI, BATCH children on
the same thread) are covered too. Without :func:`stop_when`, :func:`check` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator

from plugserve.plugins.api import Cancelled

__all__ = ["check", "stop_when"]

log = logging.getLogger(__name__)

_should_stop: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "plugserve_should_stop", default=None
)


@contextlib.contextmanager
def stop_when(should_stop: Callable[[], bool] | None) -> Iterator[None]:
    """Within the block, :func:`check` raises once ``should_stop()`` is true (None: never)."""
    token = _should_stop.set(should_stop)
    try:
        yield
    finally:
        _should_stop.reset(token)


def check(what: str) -> None:
    """Raise :class:`Cancelled` when the caller of the work under way is gone."""
    should_stop = _should_stop.get()
    if should_stop is not None and should_stop():
        message = f"{what}: stopped, its caller is gone (cancelled or past its deadline)"
        log.info("%s", message)  # the caller cannot read the error: the log says it
        raise Cancelled(message)
