"""Starting the server's helper threads.

Every thread plugserve starts on its own (stream workers, watchers, readers, reapers) is a
daemon: it must never keep a process alive that was asked to stop, and each is bounded by the
object that starts it (one per stream, one watcher per table). One function starts them all, so
the rule is written once and a reader finds every such thread by its name."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["LazyDaemon", "start_daemon"]


def start_daemon(name: str, target: Callable[..., Any], *args: Any) -> threading.Thread:
    """Start ``target(*args)`` on a daemon thread called ``name`` and return the thread."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


class LazyDaemon:
    """One daemon thread, started the first time it is needed (:meth:`ensure`) and never
    twice: a watcher, reaper or collector that a server with nothing to watch never starts.
    Its owner calls :meth:`ensure` under its own lock, so that two callers start one thread."""

    def __init__(self, name: str, target: Callable[..., Any], *args: Any) -> None:
        self.name, self.target, self.args = name, target, args
        self.thread: threading.Thread | None = None

    def ensure(self) -> None:
        """Start the thread unless it was started (call with the owner's lock held)."""
        if self.thread is None:
            self.thread = start_daemon(self.name, self.target, *self.args)
