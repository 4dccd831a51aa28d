"""The versions loading now, and an unload's way to stop them.

A version is listed in the table's ``loading`` while it is compiled and warmed up (an
inference for it is UNAVAILABLE "is loading", a second load of it refused), with an event an
unload sets: the warm-up stops before its next run, and a load that sees the event once its
network is made (its compile or a Python model's ``initialize``, which nothing stops, done)
closes it and fails, CANCELLED (:class:`LoadStopped`), never listing it. The unload waits for
the load to end at most --model-unload-timeout; a load still compiling then ends unlisted
when it ends. Before, an unload of a loading model was UNAVAILABLE and a warm-up of 1,000
slow runs held its load for minutes; then a load whose ``initialize`` outlasted the unload's
wait was listed READY after the unload had answered OK (a red team's).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from plugserve.plugins.api import Cancelled

__all__ = ["LoadStopped", "Loading", "check_stop"]

log = logging.getLogger(__name__)


class LoadStopped(Cancelled):
    """An unload of the model stopped its load (CANCELLED); the model has not failed: it was
    unloaded."""


def check_stop(stop: threading.Event | None, model: str, what: str) -> None:
    """LoadStopped when an unload has set ``stop`` (``what``: where the load was)."""
    if stop is not None and stop.is_set():
        raise LoadStopped(f"model {model!r} was unloaded while it {what}: its load is cancelled")


class Loading:
    """``table.loading`` (the data plane's table, under its lock) and each version's stop."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self._stops: dict[tuple[str, int], threading.Event] = {}

    def begin(self, name: str, version: int) -> threading.Event:
        """List ``version`` of ``name`` as loading (the caller holds the table's lock): the
        event an unload sets to stop its warm-up."""
        self.table.loading.add((name, version))
        stop = self._stops[(name, version)] = threading.Event()
        return stop

    def end(self, name: str, version: int) -> None:
        with self.table.lock:
            self.table.loading.discard((name, version))
            self._stops.pop((name, version), None)

    def stop(self, name: str, version: int, timeout: float) -> int:
        """Stop the loads of ``name`` under way (``version``'s; 0: every version's) at their
        warm-up's next run, and wait up to ``timeout`` for them to end (their compile, which
        nothing stops, included): how many were stopped."""
        with self.table.lock:
            keys = [k for k in self._stops if k[0] == name and version in (0, k[1])]
            for key in keys:
                self._stops[key].set()
        if keys:
            log.info("model %r: unloaded while loading; stopping its warm-up", name)
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                with self.table.lock:
                    if not any(key in self._stops for key in keys):
                        break
                time.sleep(0.02)
        return len(keys)
