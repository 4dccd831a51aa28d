"""What Python models write (their processes' stdout and stderr, their ``pb_utils.Logger``
lines), into the server's log with each model's name, bounded so a model printing in a loop
can neither fill the log (or the disk under it) nor take the server's time:

====================================  =======================================================
a line                                at most MAX_LINE_CHARS (16384) characters; the rest is
                                      cut, marked ``[cut]``
lines logged per process              LINES_PER_SECOND (20) a second on average, at most
                                      LINE_BURST (200) at once, and LOG_BYTES_PER_SECOND
                                      (16 KiB) a second, LOG_BYTE_BURST (64 KiB) at once;
                                      lines over either are dropped, and the log says how
                                      many once they stop (at most every DROPPED_EVERY, 10 s)
bytes read per process                READ_BYTES_PER_SECOND (1 MiB) a second, READ_BURST
                                      (1 MiB) at once: past it the pump stops reading that
                                      process's pipe until its budget refills, so a model
                                      writing faster blocks in its own ``write``, and the
                                      server spends at most that much reading it
threads                               one pump thread for every process of the server (a
                                      selector), started with the first
====================================  =======================================================

Stdout and stderr share one pipe per process (their order kept); its lines are logged at INFO
(``plugserve.server.apps.pipelines.python.device.model``), Logger lines at their own level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
import time

from plugserve.plugins.threads import start_daemon

__all__ = ["PUMP", "LineBudget", "OutputPump"]

MAX_LINE_CHARS = 16384
LINES_PER_SECOND, LINE_BURST = 20.0, 200.0
LOG_BYTES_PER_SECOND, LOG_BYTE_BURST = 16384.0, 65536.0
READ_BYTES_PER_SECOND, READ_BURST = float(1 << 20), float(1 << 20)
DROPPED_EVERY = 10.0
#: bytes one read takes from a pipe
READ_CHUNK = 65536


class _Bucket:
    """A token bucket: ``rate`` a second, at most ``burst`` saved up."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level = rate, burst, burst
        self.stamp = time.monotonic()

    def refill(self, now: float) -> float:
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` is there."""
        return max(0.0, (amount - self.level) / self.rate)


class LineBudget:
    """What one model's process may put in the log: :meth:`emit` logs a line or drops it,
    counting; thread-safe (a process's pipe and its Logger calls share one)."""

    def __init__(self, label: str, logger: logging.Logger) -> None:
        self.label, self.logger = label, logger
        self._lines = _Bucket(LINES_PER_SECOND, LINE_BURST)
        self._bytes = _Bucket(LOG_BYTES_PER_SECOND, LOG_BYTE_BURST)
        self._lock = threading.Lock()
        self.dropped = 0  # since the last notice
        self.dropped_total = 0
        self._noticed = 0.0

    def emit(self, level: int, text: str) -> bool:
        """Log ``text`` (one line) at ``level`` if the budget allows; False when dropped."""
        if len(text) > MAX_LINE_CHARS:
            text = text[:MAX_LINE_CHARS] + " [cut]"
        now = time.monotonic()
        with self._lock:
            lines, size = self._lines, self._bytes
            if lines.refill(now) < 1 or size.refill(now) < len(text):
                self.dropped += 1
                self.dropped_total += 1
                notice = self._notice(now)
                keep = False
            else:
                lines.level -= 1
                size.level -= len(text)
                notice = self._notice(now) if self.dropped else 0
                keep = True
        if notice:
            self.logger.warning(
                "%s: %d lines of its output were dropped (over %g lines or %d bytes a second)",
                self.label, notice, LINES_PER_SECOND, LOG_BYTES_PER_SECOND,
            )  # fmt: skip
        if keep:
            self.logger.log(level, "%s: %s", self.label, text)
        return keep

    def _notice(self, now: float) -> int:
        """How many drops to report now (0: not yet; call with the lock held)."""
        if not self.dropped or now - self._noticed < DROPPED_EVERY:
            return 0
        count, self.dropped, self._noticed = self.dropped, 0, now
        return count


class _Pipe:
    __slots__ = ("budget", "fd", "partial", "reads")

    def __init__(self, fd: int, budget: LineBudget) -> None:
        self.fd, self.budget = fd, budget
        self.partial = b""
        self.reads = _Bucket(READ_BYTES_PER_SECOND, READ_BURST)


class OutputPump:
    """Reads every model process's output pipe on one thread (see the module's bounds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._selector: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._added: list[_Pipe] = []

    def add(self, fd: int, budget: LineBudget) -> None:
        """Read ``fd`` (a process's stdout and stderr; the pump closes it at its end) into
        ``budget``'s log."""
        os.set_blocking(fd, False)
        with self._lock:
            if self._thread is None:
                self._selector = selectors.DefaultSelector()
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                self._selector.register(self._wake_r, selectors.EVENT_READ, None)
                self._thread = start_daemon("python-output", self._run)
            self._added.append(_Pipe(fd, budget))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        selector = self._selector
        resting: dict[_Pipe, float] = {}  # pipes over their read budget: when to read again
        while True:
            now = time.monotonic()
            for pipe, when in list(resting.items()):
                if when <= now:
                    del resting[pipe]
                    selector.register(pipe.fd, selectors.EVENT_READ, pipe)
            timeout = max(0.0, min(resting.values()) - now) if resting else None
            for key, _ in selector.select(timeout):
                if key.data is None:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    with self._lock:
                        added, self._added = self._added, []
                    for pipe in added:
                        selector.register(pipe.fd, selectors.EVENT_READ, pipe)
                    continue
                pipe = key.data
                rest = self._read(pipe)
                if rest is None:  # its end: the process is gone
                    selector.unregister(pipe.fd)
                    os.close(pipe.fd)
                elif rest > 0:
                    selector.unregister(pipe.fd)
                    resting[pipe] = time.monotonic() + rest

    def _read(self, pipe: _Pipe) -> float | None:
        """Read what the budget allows; None at the pipe's end, else seconds to rest."""
        reads = pipe.reads
        if reads.refill(time.monotonic()) < 1:
            return reads.wait(READ_CHUNK)
        try:
            data = os.read(pipe.fd, int(min(READ_CHUNK, reads.level)))
        except BlockingIOError:
            return 0.0
        except OSError:
            data = b""
        if not data:
            if pipe.partial:
                self._line(pipe, pipe.partial)
            return None
        reads.level -= len(data)
        lines = (pipe.partial + data).split(b"\n")
        pipe.partial = lines.pop()
        if len(pipe.partial) > MAX_LINE_CHARS:  # a line without end: logged in pieces
            lines.append(pipe.partial)
            pipe.partial = b""
        for line in lines:
            self._line(pipe, line)
        return 0.0 if reads.level >= 1 else reads.wait(READ_CHUNK)

    @staticmethod
    def _line(pipe: _Pipe, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r")
        if text:
            pipe.budget.emit(logging.INFO, text)


#: the server's one pump
PUMP = OutputPump()
