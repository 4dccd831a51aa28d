"""What a ``plugserve`` verb shows while it works: an elapsed-time ticker on stderr.

A verb that can take more than a second or two (loading, querying, exporting a network, the
conformance run, making a model folder) wraps its work in :func:`progress`, so a person at a
terminal sees it is alive: every 0.25 s the line ``LABEL ... 3.2 s`` (and a count, when the
verb gives one) is redrawn in place, and a last line says how it ended (none after Ctrl-C: the
command's own line says so). When stderr is not a
terminal (CI, a pipe) only that last line is written, so logs hold no carriage returns.

One thread per ticker (a daemon, joined when the work ends); nothing is written to stdout,
which stays the verb's answer.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["progress"]

#: seconds between two redraws of the line
TICK_SECONDS = 0.25


@contextlib.contextmanager
def progress(label: str, count: Callable[[], str] | None = None) -> Iterator[None]:
    """The ticker around a block; ``count`` gives text shown after the time (``"812 cases"``)."""
    stop = threading.Event()
    start = time.monotonic()
    tty = sys.stderr.isatty()

    def line() -> str:
        extra = f", {count()}" if count is not None else ""
        return f"{time.monotonic() - start:.1f} s{extra}"

    def tick() -> None:
        while not stop.wait(TICK_SECONDS):
            sys.stderr.write(f"\r{label} ... {line()}\x1b[K")
            sys.stderr.flush()

    thread = threading.Thread(target=tick, name="progress", daemon=True)
    if tty:
        thread.start()
    outcome = "stopped after"
    try:
        yield
        outcome = "done in"
    except KeyboardInterrupt:
        outcome = ""  # the command's one line says it (plugserve VERB: interrupted)
        raise
    except BaseException:
        outcome = "failed after"
        raise
    finally:
        stop.set()
        if tty:
            thread.join()
            sys.stderr.write("\r\x1b[K")
        if outcome:
            sys.stderr.write(f"{label}: {outcome} {line()}\n")
