"""How long another thread waited for the GIL while some work ran: a thread that sleeps a few
milliseconds at a time and records the gaps between its wake-ups. A C call that keeps the GIL
shows as one gap as long as the call; work that lets go of it, or Python that shares it every
switch interval, as gaps near the sleep."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def longest_gap(work: Callable[[], object], every: float = 0.005) -> float:
    """The longest a neighbour thread ticking every ``every`` seconds waited while ``work()``
    ran (its errors propagate)."""
    gaps, stop = [0.0], threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(every)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        work()
    finally:
        stop.set()
        ticker.join()
    return max(gaps)
