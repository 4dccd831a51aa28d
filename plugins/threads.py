"""Starting the server's helper threads.

Every thread plugserve starts on its own (stream workers, watchers, readers, reapers) is a
daemon: it must never keep a process alive that was asked to stop, and each is bounded by the
object that starts it (one per stream, one watcher per table). One function starts them all, so
the rule is written once and a reader finds every such thread by its name."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, MutableSet
from typing import Any, Generic, TypeVar

__all__ = ["LazyDaemon", "Watchlist", "start_daemon"]

_T = TypeVar("_T")


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


class Watchlist(Generic[_T]):
    """The objects one watcher thread looks at in turn (a reaper's sequence batchers, the
    hang watch's model processes): the thread starts when the first is added, and looks at
    :meth:`items`, a copy taken under the list's lock, so that adding and removing never wait
    for a look. ``weak``: an object no one else holds leaves the list by itself."""

    def __init__(self, name: str, look: Callable[[], Any], weak: bool = False) -> None:
        self._lock = threading.Lock()
        self._items: MutableSet[_T] = weakref.WeakSet() if weak else set()
        self._thread = LazyDaemon(name, look)

    def add(self, item: _T) -> None:
        with self._lock:
            self._items.add(item)
            self._thread.ensure()

    def discard(self, item: _T) -> None:
        with self._lock:
            self._items.discard(item)

    def items(self) -> list[_T]:
        with self._lock:
            return list(self._items)
