"""Driving a :class:`Runner` (sync callers or async requests in flight) and summarizing the
latencies."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plugserve.client.bench.runners import Runner

__all__ = ["BenchResult", "measure", "percentile", "summarize"]


@dataclasses.dataclass
class BenchResult:
    latencies: list[float]  # seconds, in completion order
    starts: list[float]  # seconds since the run began, when each request was sent
    errors: int
    wall: float
    first_error: str = ""


class _Progress:
    """A bar on stderr while a run goes (when stderr is a tty); a final line either way."""

    def __init__(self, label: str, total: float, unit: str, enabled: bool) -> None:
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.stop = threading.Event()
        self.value: Callable[[], float] = lambda: 0.0
        self.count: Callable[[], int] = lambda: 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _line(self) -> str:
        fraction = min(1.0, self.value() / self.total) if self.total else 0.0
        filled = int(30 * fraction)
        return (
            f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {100 * fraction:3.0f}% "
            f"{self.count()} requests"
        )

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            sys.stderr.write(self._line())
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        if self.tty:
            self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        self.stop.set()
        if self.tty:
            self.thread.join()
        if kind is KeyboardInterrupt:  # the command's one line says it
            if self.tty:
                sys.stderr.write("\r\x1b[K")
        elif self.tty:
            sys.stderr.write(self._line() + "\n")
        elif self.enabled:
            sys.stderr.write(f"{self.label}: {self.count()} requests done\n")


def measure(
    runner: Runner,
    mode: str = "sync",
    concurrency: int = 1,
    iterations: int | None = None,
    duration: float | None = None,
    warmup: int = 1,
    progress: str = "",
) -> BenchResult:
    """Run until ``iterations`` requests completed or ``duration`` seconds passed."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode: sync or async, not {mode!r}")
    if iterations is None and duration is None:
        duration = 10.0
    concurrency = max(1, concurrency)
    for _ in range(warmup):
        runner.call()
    run = _Run(iterations, duration)
    bar = _Progress(
        progress or "bench",
        float(iterations) if iterations is not None else float(duration or 0),
        "",
        bool(progress),
    )
    bar.count = lambda: len(run.latencies) + run.errors
    bar.value = (
        (lambda: float(len(run.latencies) + run.errors))
        if iterations is not None
        else (lambda: time.perf_counter() - run.t0)
    )
    with bar:
        if mode == "sync":
            _sync(run, runner, concurrency)
        else:
            _async(run, runner, concurrency)
    wall = time.perf_counter() - run.t0
    return BenchResult(run.latencies, run.starts, run.errors, wall, run.first_error)


class _Run:
    """What the requests of one measurement share: how many may still start, and what
    finished (latencies, start times, errors), under one lock."""

    def __init__(self, iterations: int | None, duration: float | None) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.starts: list[float] = []
        self.errors = 0
        self.first_error = ""
        self.sent = 0
        self.iterations = iterations
        self.t0 = time.perf_counter()
        self.end = self.t0 + duration if duration is not None else math.inf

    def claim(self) -> bool:
        """One more request may start."""
        with self.lock:
            if self.iterations is not None and self.sent >= self.iterations:
                return False
            if time.perf_counter() >= self.end:
                return False
            self.sent += 1
            return True

    def record(self, start: float, error: BaseException | None) -> None:
        now = time.perf_counter()
        with self.lock:
            if error is None:
                self.latencies.append(now - start)
                self.starts.append(start - self.t0)
            else:
                self.errors += 1
                if not self.first_error:
                    self.first_error = _describe_error(error)


def _sync(run: _Run, runner: Runner, concurrency: int) -> None:
    """``concurrency`` threads, each sending its next request when its last is answered."""

    def worker() -> None:
        while run.claim():
            start = time.perf_counter()
            try:
                runner.call()
            except Exception as exc:  # counted, the run goes on
                run.record(start, exc)
            else:
                run.record(start, None)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _async(run: _Run, runner: Runner, concurrency: int) -> None:
    """``concurrency`` requests in flight from one thread, each completion starting the next."""
    completions: queue.SimpleQueue[int] = queue.SimpleQueue()
    in_flight = 0

    def start_one(slot: int) -> bool:
        if not run.claim():
            return False
        start = time.perf_counter()

        def done(error: BaseException | None) -> None:
            run.record(start, error)
            completions.put(slot)

        try:
            runner.submit(done)
        except Exception as exc:
            run.record(start, exc)
            completions.put(slot)
        return True

    for slot in range(concurrency):
        if start_one(slot):
            in_flight += 1
    while in_flight:
        slot = completions.get()
        in_flight -= 1
        if start_one(slot):
            in_flight += 1


def _describe_error(error: BaseException) -> str:
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        with contextlib.suppress(Exception):
            return f"{code().name}: {details()}"
    return f"{type(error).__name__}: {error}"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return float(np.percentile(np.asarray(sorted_values), q))


def summarize(result: BenchResult, batch: int = 1) -> dict[str, Any]:
    lat = sorted(result.latencies)
    ms = [1e3 * v for v in lat]
    done = len(lat)
    return {
        "requests": done,
        "errors": result.errors,
        "duration_s": result.wall,
        "throughput_rps": done / result.wall if result.wall > 0 else 0.0,
        "throughput_ips": done * batch / result.wall if result.wall > 0 else 0.0,
        "latency_ms": {
            "min": ms[0] if ms else float("nan"),
            "p50": percentile(ms, 50),
            "p90": percentile(ms, 90),
            "p99": percentile(ms, 99),
            "max": ms[-1] if ms else float("nan"),
            "mean": float(np.mean(ms)) if ms else float("nan"),
        },
    }
