"""Whether one instance of a Python model serves, as model readiness asks it (Triton's
``is_ready``): its process runs and, when the model has ``is_ready()``, that says True within the
check's time (``device.READY_SECONDS``, Triton's five seconds).

A model's ``is_ready()`` is asked on a socket of its own (:attr:`ModelProcess.checks`, served by a
thread of the process), so a check is answered while an execute runs. One check runs at a time:
one asked meanwhile takes its result. A process found not running is started again in the
background (one start at a time, after the execute under way), and the instance is not ready
meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time

from plugserve.plugins.api import PlugserveError
from plugserve.plugins.threads import start_daemon
from plugserve.server.apps.pipelines.python import ipc
from plugserve.server.apps.pipelines.python.kinds import Kind
from plugserve.server.apps.pipelines.python.process import ModelProcess

__all__ = ["Readiness"]

log = logging.getLogger(__name__)

_checks = itertools.count(1)


class Readiness:
    """The readiness checks of one instance's process."""

    def __init__(self, process: ModelProcess) -> None:
        self.process = process
        self._cond = threading.Condition()
        self._checking = False
        self._checked = 0  # checks done
        self._result: tuple[bool, str] = (True, "")
        self._reviving = False

    def check(self, timeout: float) -> tuple[bool, str]:
        """``(ready, why not)`` within ``timeout``."""
        if not self.process.alive():
            self.revive()
            return False, "its process is not running; it is being started again"
        sock = self.process.checks
        if sock is None:
            return True, ""
        with self._cond:
            if self._checking:
                seen = self._checked
                if not self._cond.wait_for(lambda: self._checked != seen, timeout):
                    return False, "timed out waiting for the is_ready() check under way"
                return self._result
            self._checking = True
        result = (False, "is_ready() was not asked")
        try:
            result = _ask(sock, timeout)
        finally:
            with self._cond:
                self._checking = False
                self._checked += 1
                self._result = result
                self._cond.notify_all()
        return result

    def revive(self) -> None:
        """Start a process that is not running again, in the background (one at a time)."""
        process = self.process
        with self._cond:
            if self._reviving or process.closed:
                return
            self._reviving = True

        def run() -> None:
            try:
                with process.lock:  # after a run under way
                    if not process.closed and not process.alive():
                        process.ensure()
            except PlugserveError as exc:
                log.warning("%s: its process could not be started again: %s", process.label, exc)
            finally:
                with self._cond:
                    self._reviving = False

        start_daemon(f"{process.label}-revive", run)


def _ask(sock: socket.socket, timeout: float) -> tuple[bool, str]:
    """One ``is_ready()`` asked on ``sock``: ``(ready, why not)``."""
    number = next(_checks)
    end = time.monotonic() + timeout
    try:
        ipc.send(sock, {"op": Kind.IS_READY, "id": number}, flags=socket.MSG_DONTWAIT)
        while True:  # a late answer to an earlier check that timed out is skipped
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            header, _ = ipc.receive_all(sock, 0)
            if header.get("id") == number:
                break
    except TimeoutError:
        return False, f"its is_ready() did not answer within {timeout:g} s"
    except (OSError, EOFError, ValueError) as exc:
        return False, f"its process did not answer is_ready(): {exc}"
    if header.get("error"):
        last = str(header["error"]).strip().splitlines() or [""]
        return False, f"its is_ready() failed: {last[-1]}"
    if header.get("ready"):
        return True, ""
    return False, "its is_ready() returned False"
