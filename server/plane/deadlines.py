"""Cancelling requests whose time is up, while they wait and while they run.

Each admitted request has a cancellation token (``plugins/cancel.py``) and a time by which it
must be done: its client's deadline or the server's ``--max-request-seconds``, whichever comes
first. One thread per server watches them all and cancels a token once its time passes, with
the :class:`DeadlineExceeded` the client gets; the run stops at its next checkpoint, and a
request still queued leaves its queue. Checking only when a stream picks a request up (as
before) let a run that never ends hold its stream, and its CPU, forever.

Watching costs a request one dict insert under a lock and one delete without (a pop is one
step under the GIL, and the thread only pops); the error is made only for a request that
expires. The thread sleeps until the earliest time, woken only by a request due earlier than
that, so the usual case (every request due ``--max-request-seconds`` from now) adds no
wake-ups.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from plugserve.plugins.cancel import Token
from plugserve.plugins.errors import PlugserveError
from plugserve.plugins.threads import start_daemon

__all__ = ["DeadlineWatch"]

log = logging.getLogger(__name__)

#: Longest sleep between looks (a wake-up also comes with each request due earlier).
_LONGEST_SLEEP = 1.0


class DeadlineWatch:
    def __init__(self, name: str = "deadline-watch") -> None:
        self._name = name
        #: token -> (when, error, its arguments)
        self._due: dict[Token, tuple[float, Callable[..., PlugserveError], tuple]] = {}
        self._lock = threading.Lock()  # the thread's start, its wake-up time, closing
        self._cond = threading.Condition(self._lock)
        self._wake_at = float("inf")  # when the thread looks next
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(
        self, token: Token, when: float, error: Callable[..., PlugserveError], *args: object
    ) -> None:
        """Cancel ``token`` with ``error(*args)`` once ``time.monotonic()`` passes ``when``."""
        with self._lock:  # the thread sets its wake-up time from what it found under it
            self._due[token] = (when, error, args)
            if self._thread is None and not self._closed:
                self._thread = start_daemon(self._name, self._run)
            if when < self._wake_at:
                self._wake_at = when
                self._cond.notify()

    def forget(self, token: Token) -> None:
        """The request is done: no more watching."""
        self._due.pop(token, None)

    def cancel_all(self, error: Callable[[], PlugserveError]) -> int:
        """Cancel every watched token now with ``error()``; returns how many."""
        tokens = []
        for token in list(self._due):
            if self._due.pop(token, None) is not None:
                tokens.append(token)
        for token in tokens:
            token.cancel(error())
        return len(tokens)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            expired: list[tuple[Token, Callable[..., PlugserveError], tuple]] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                earliest = now + _LONGEST_SLEEP
                for token, (when, error, args) in list(self._due.items()):
                    if when <= now:
                        if self._due.pop(token, None) is not None:  # not done meanwhile
                            expired.append((token, error, args))
                    elif when < earliest:
                        earliest = when
                if not expired:
                    self._wake_at = earliest
                    self._cond.wait(earliest - now)
                    continue
            for token, error, args in expired:
                try:
                    token.cancel(error(*args))
                except Exception:  # one bad message must not stop the watch
                    log.exception("cancelling a request past its deadline failed")
