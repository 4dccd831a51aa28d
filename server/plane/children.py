"""Every process the server starts is stopped when the server stops, hung or not.

A Python model's processes (Triton's stubs, ``apps/pipelines/python/process.py``) register
here when they start. At shutdown, once the drain is over (``--exit-timeout``), :func:`stop_all`
asks each to end (:meth:`Child.end`: an idle model runs its ``finalize``, as Triton's unload
does; one still in ``execute``, hung or not, gets SIGTERM, sent to its whole process group, so
what the model started goes with it), waits up to :data:`STOP_SECONDS` for all of them at
once, then kills every group still there (:meth:`Child.kill`: SIGKILL, then reaped). Before
this, a model stuck in ``execute`` outlived the server: its process was never told to stop, and
four such orphans piled up in a day of this project's checks (one asleep in ``execute`` for 54
minutes).

A server killed outright (SIGKILL, the out-of-memory killer) runs none of this: each process it
starts watches its parent itself and ends with it (``sandbox.py`` for a model's process, also
asked of the kernel with ``PR_SET_PDEATHSIG``; ``protocols/http/offload.py``'s JSON helper).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Protocol

__all__ = ["STOP_SECONDS", "Child", "discard", "register", "stop_all"]

log = logging.getLogger(__name__)

#: how long the processes still running at shutdown get, all together, to end on their own
#: (a model's finalize; what a SIGTERM lets a model's own handler do) before they are killed
STOP_SECONDS = 5.0
#: how often :func:`stop_all` looks whether they have ended
_LOOK_SECONDS = 0.02


class Child(Protocol):
    """A process the server started (with whatever it started in turn)."""

    label: str

    def end(self) -> None:
        """Ask it to end, without waiting."""

    def ended(self) -> bool:
        """Whether it has ended (its group may still hold what it started)."""

    def kill(self) -> None:
        """Kill it and its group at once, and reap it."""


_lock = threading.Lock()
_children: weakref.WeakSet[Child] = weakref.WeakSet()  # one dropped leaves by itself


def register(child: Child) -> None:
    with _lock:
        _children.add(child)


def discard(child: Child) -> None:
    with _lock:
        _children.discard(child)


def stop_all(grace: float = STOP_SECONDS) -> list[str]:
    """End every registered process: asked first, killed past ``grace`` seconds (for all of
    them together); the labels of those that had to be killed."""
    with _lock:
        children = list(_children)
        _children.clear()
    for child in children:
        try:
            child.end()
        except Exception:  # one that cannot be asked is killed below
            log.exception("shutdown: asking %s to end failed", child.label)
    end = time.monotonic() + grace
    while time.monotonic() < end and not all(child.ended() for child in children):
        time.sleep(_LOOK_SECONDS)
    killed = [child.label for child in children if not child.ended()]
    for child in children:  # every group, ended or not: what a model started may linger
        try:
            child.kill()
        except Exception:
            log.exception("shutdown: killing %s failed", child.label)
    if killed:
        log.warning(
            "shutdown: %d process(es) still running %.0f s after being asked to end, killed: %s",
            len(killed), grace, ", ".join(killed),
        )  # fmt: skip
    return killed
