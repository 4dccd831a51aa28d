"""Kernel choices decided by timing them on this machine, when the network is compiled.

Several kernels can compute one node (a 3x3 conv as a direct GEMM over the NCHW image, as an
im2col GEMM over a channel-last image, or as Winograd F(2,3) / F(4,3) in either layout), and
which is fastest depends on the CPU, the BLAS kernel numpy runs and the node's real shapes:
rules tuned on an AVX-512 machine did not transfer to an AVX2 one (issue 15). So, as oneDNN's
and TVM's autotuners do, a kernel with several candidates asks its :class:`Site` to pick: the
first time the site sees an input key (shape and memory layout) every candidate runs on the
real input, the fastest is kept, and from then on the key costs one dict lookup.

The load runs one warm-up inference (plugin.py) so the network's static shapes are decided
before it serves. A shape first seen later (a new batch size) is explored over the requests
that bring it, one candidate each, so no request pays for timing the others (timing them all
at once made the first batch-8 ResNet-18 request take seconds); at most
:data:`MAX_KEYS_PER_SITE` keys per site, after which the site's first choice serves. While a
key is explored, two requests with the same input may run different kernels, so their results
may differ in float32 rounding (Winograd F(4, 3) within 1e-4 of the largest output). Choices are
exported with the network and restored on import (``CACHE_DIR``) when the machine key (CPU
model, BLAS library and kernel, BLAS threads) matches, so a second load does not time again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from plugserve.plugins.api import cpu_name
from plugserve.plugins.numpy import blas

log = logging.getLogger(__name__)

__all__ = ["MAX_KEYS_PER_SITE", "Releasable", "Site", "Tuner", "input_key", "machine_key"]

#: Distinct input keys one site times; more (a client cycling batch sizes) take the first choice.
MAX_KEYS_PER_SITE = 16
#: Timed runs per candidate after its first (warm-up) run; the best of them counts.
TIMED_RUNS = 2
#: The two ways a network's GEMMs can be split over its threads.
THREADINGS = ("split", "openblas")
#: Whole runs each way before a shape's threading is chosen: the first THREADING_SKIP of each
#: are not counted (right after a load both ways run slower than they will, the split more,
#: its helper thread still faulting in memory: four loads in a row chose OpenBLAS's threads
#: on ResNet-18 that then ran no faster than the split), the next THREADING_RUNS are.
THREADING_SKIP = 2
THREADING_RUNS = 3
#: Runs per candidate when a new key is explored on requests (the first pays for plans and
#: transformed weights; the best counts).
EXPLORE_RUNS = 2

Candidate = Callable[..., Any]


def machine_key(threads: int) -> str:
    """What a stored choice is only valid for: the CPU, numpy's BLAS and its kernel, threads."""
    return f"{cpu_name()} | {blas.library_name()} {blas.core_name()} | threads {threads}"


class Site:
    """One node's choice among equivalent kernels, per input key."""

    __slots__ = ("_lock", "_pending", "_tuner", "choices", "name")

    def __init__(self, tuner: Tuner, name: str) -> None:
        self._tuner = tuner
        self.name = name
        #: input key (see :func:`input_key`) -> the candidate's name
        self.choices: dict[tuple, str] = dict(tuner.stored.get(name, {}))
        #: keys being explored on requests: key -> {candidate: [seconds per run]}
        self._pending: dict[tuple, dict[str, list[float]]] = {}
        self._lock = threading.Lock()

    def snapshot(self) -> dict[tuple, str]:
        """The choices made so far, copied under the site's lock."""
        with self._lock:
            return dict(self.choices)

    @property
    def channel_last(self) -> bool:
        """Whether the network's 4-D activations are to be kept channel-last (see Tuner)."""
        return self._tuner.channel_last

    def run(self, key: tuple, candidates: Mapping[str, Candidate], *args: Any) -> Any:
        """``candidates[choice](*args)``, the choice timed on this machine if the key is new.

        ``candidates`` is ordered: the first is the default where timing is off or the site
        has seen enough keys. At load (the tuner's ``eager`` warm-up) a new key times every
        candidate at once; later, a request with a new key runs just one candidate, the one
        with the fewest timings so far, so no request pays for the others, and the choice is
        made once each has :data:`EXPLORE_RUNS` timings. A candidate that raises is dropped
        (a path that cannot take this shape); if all raise, the error propagates.
        """
        name = self.choices.get(key)
        if name is not None and name in candidates:
            return candidates[name](*args)
        if len(candidates) == 1 or not self._tuner.enabled:
            return next(iter(candidates.values()))(*args)
        if not self._tuner.eager:
            return self._explore(key, candidates, args)
        with self._lock:
            name = self.choices.get(key)
            if name is not None and name in candidates:
                return candidates[name](*args)
            if len(self.choices) + len(self._pending) >= MAX_KEYS_PER_SITE:
                return self._default(candidates)(*args)
            name, result = self._time(candidates, args)
            self._decide(key, name, candidates)
            return result

    def _default(self, candidates: Mapping[str, Candidate]) -> Candidate:
        """What serves a key past the bound: the site's first choice, else the first candidate."""
        first = next(iter(self.choices.values()), None)
        return candidates.get(first or "") or next(iter(candidates.values()))

    def _decide(self, key: tuple, name: str, candidates: Mapping[str, Candidate]) -> None:
        self.choices[key] = name
        self._tuner.timed += 1
        if self._pending:  # another key still runs every candidate
            return
        kept = set(self.choices.values())
        for other, fn in candidates.items():
            if other not in kept and isinstance(fn, Releasable):
                fn.release()

    def _explore(self, key: tuple, candidates: Mapping[str, Candidate], args: tuple) -> Any:
        while True:
            with self._lock:
                name = self.choices.get(key)
                samples = self._pending.get(key)
                if name is None and samples is None:
                    if len(self.choices) + len(self._pending) >= MAX_KEYS_PER_SITE:
                        name = ""
                    else:
                        samples = self._pending[key] = {n: [] for n in candidates}
                if samples is not None and name is None:
                    name = min(samples, key=lambda n: len(samples[n]))
            if not name:
                return self._default(candidates)(*args)
            if samples is None:  # decided by another thread meanwhile
                return candidates[name](*args)
            start = time.perf_counter()
            try:
                result = candidates[name](*args)
            except Exception:
                # the request is served by another candidate; a kernel bug must still show
                log.warning(
                    "%s: kernel %s failed on %s, dropped", self.name, name, key, exc_info=True
                )
                with self._lock:
                    samples.pop(name, None)
                    if not samples:
                        self._pending.pop(key, None)
                        raise
                continue
            elapsed = time.perf_counter() - start
            with self._lock:
                if name in samples:
                    samples[name].append(elapsed)
                if self._pending.get(key) is samples and all(
                    len(v) >= EXPLORE_RUNS for v in samples.values()
                ):
                    best = {n: min(v) for n, v in samples.items()}
                    del self._pending[key]
                    self._tuner.log.append(
                        (self.name, {k: round(v * 1e3, 4) for k, v in best.items()})
                    )
                    self._decide(key, min(best, key=best.__getitem__), candidates)
            return result

    def _time(self, candidates: Mapping[str, Candidate], args: tuple) -> tuple[str, Any]:
        clock = time.perf_counter
        alive: dict[str, Candidate] = {}
        results: dict[str, Any] = {}
        first_error: Exception | None = None
        for name, fn in candidates.items():  # warm-up: plans, buffers, and whether it runs
            try:
                results[name] = fn(*args)
                alive[name] = fn
            except Exception as exc:
                log.warning("%s: kernel %s failed, dropped", self.name, name, exc_info=True)
                first_error = first_error or exc
        if not alive:
            assert first_error is not None
            raise first_error
        best = {name: float("inf") for name in alive}
        for _ in range(TIMED_RUNS):  # interleaved, so a noisy moment hits every candidate
            for name, fn in alive.items():
                start = clock()
                results[name] = fn(*args)
                best[name] = min(best[name], clock() - start)
        winner = min(best, key=best.__getitem__)
        self._tuner.log.append((self.name, {k: round(v * 1e3, 4) for k, v in best.items()}))
        return winner, results[winner]


class Tuner:
    """A network's sites and the choices they made, exportable with the network."""

    def __init__(
        self, threads: int, enabled: bool = True, stored: Mapping[str, Any] | None = None
    ) -> None:
        self.enabled = enabled
        self.machine = machine_key(threads)
        self.stored: dict[str, dict[tuple, str]] = {}
        #: Who splits the network's GEMMs, per input shapes: "split" (parallel.py) or
        #: "openblas" (OpenBLAS's own threads), timed by whole runs (:meth:`threading_for`).
        self.threading: dict[tuple, str] = {}
        #: Whether ``stored`` was made on this machine and read back whole: then nothing the
        #: load decides is timed again.
        self.restored = False
        if stored and stored.get("machine") == self.machine:
            try:
                self.stored = {
                    str(site): {_parse_key(k): str(v) for k, v in choices.items()}
                    for site, choices in stored.get("sites", {}).items()
                }
                self.threading = {
                    _parse_shapes(k): str(v)
                    for k, v in stored.get("threading", {}).items()
                    if v in THREADINGS
                }
                self.restored = isinstance(stored.get("threading"), dict)
            except (AttributeError, TypeError, ValueError):
                self.stored = {}  # not what export() writes: time again rather than fail
                self.threading = {}
        self.sites: dict[str, Site] = {}
        #: True during the load's warm-up: a new key times every candidate at once.
        self.eager = False
        #: The network's activation layout: channel-last once most timed convs chose a
        #: channel-last kernel. Decided for the whole network, not per conv, because mixing
        #: layouts costs more than either (an Add of an NCHW and a channel-last map runs 8x
        #: slower than of two alike, and its result is NCHW, so the next conv converts again).
        self.channel_last = bool(self.restored and stored and stored.get("channel_last"))
        self._samples: dict[tuple, dict[str, list[float]]] = {}
        self._lock = threading.Lock()
        #: keys timed since this network was compiled or imported (0 after a cached load)
        self.timed = 0
        #: (site, {candidate: best ms}) per timing, for `plugserve` diagnostics and tests
        self.log: list[tuple[str, dict[str, float]]] = []

    def site(self, name: str) -> Site:
        site = self.sites.get(name)
        if site is None:
            site = self.sites[name] = Site(self, name)
        return site

    def export(self) -> dict[str, Any]:
        sites = {}
        for name, site in self.sites.items():
            choices = site.snapshot()  # requests may be adding choices meanwhile
            if choices:
                sites[name] = {_key_text(k): v for k, v in choices.items()}
        with self._lock:
            threading_ = {_shapes_text(k): v for k, v in self.threading.items()}
        return {
            "machine": self.machine,
            "sites": sites,
            "channel_last": self.channel_last,
            "threading": threading_,
        }

    def threading_for(self, shapes: tuple) -> tuple[str, bool]:
        """Who splits the GEMMs of a run on inputs of these shapes, and whether the run is to
        be timed (:meth:`record`): a new shape alternates the two over its first runs, as a
        site explores its candidates; past :data:`MAX_KEYS_PER_SITE` shapes, NUMPY's split.

        Neither wins everywhere (measured on these machines): with a core busy, OpenBLAS's
        static split stalled ResNet-18 (71 ms median against 43 split), while the encoder's
        many 0.2-0.5 ms GEMMs ran faster on OpenBLAS's spinning threads at batch 1 (8.8 ms
        against 12-14 split) and slower at batch 8 (92 against 81)."""
        mode = self.threading.get(shapes)
        if mode is not None or not self.enabled:
            return mode or "split", False
        with self._lock:
            samples = self._samples.get(shapes)
            if samples is None:
                if len(self.threading) + len(self._samples) >= MAX_KEYS_PER_SITE:
                    return "split", False
                samples = self._samples[shapes] = {m: [] for m in THREADINGS}
            return min(samples, key=lambda m: len(samples[m])), True

    def record(self, shapes: tuple, mode: str, seconds: float) -> None:
        """A timed run's duration; the choice is made once each way has THREADING_RUNS
        timings after its first THREADING_SKIP (the sum counts: a stall is what is measured)."""
        with self._lock:
            samples = self._samples.get(shapes)
            if samples is None:
                return
            samples[mode].append(seconds)
            if all(len(v) >= THREADING_SKIP + THREADING_RUNS for v in samples.values()):
                total = {m: sum(v[THREADING_SKIP:]) for m, v in samples.items()}
                del self._samples[shapes]
                self.threading[shapes] = min(total, key=total.__getitem__)
                self.log.append(("threading", {k: round(v * 1e3, 3) for k, v in total.items()}))

    def prefers_channel_last(self) -> bool:
        """Whether most timed choices were channel-last kernels (``nhwc-...``)."""
        chosen = [c for site in self.sites.values() for c in site.choices.values()]
        return sum(c.startswith("nhwc") for c in chosen) * 2 > len(chosen)


@runtime_checkable
class Releasable(Protocol):
    """A candidate holding memory (transformed weights) it can drop when it loses, and make
    again if a later key needs it."""

    def release(self) -> None: ...


def input_key(x: np.ndarray, layout: str) -> tuple:
    """A site key: the input's shape, dtype and memory layout (a tuple: one dict lookup)."""
    return (x.shape, x.dtype.str, layout)


def _shapes_text(shapes: tuple) -> str:
    return ";".join("x".join(map(str, s)) for s in shapes)


def _parse_shapes(text: str) -> tuple:
    return tuple(tuple(int(d) for d in s.split("x") if d) for s in str(text).split(";"))


def _key_text(key: tuple) -> str:
    shape, dtype, layout = key
    return f"{'x'.join(map(str, shape))} {dtype} {layout}"


def _parse_key(text: str) -> tuple:
    shape, dtype, layout = str(text).split(" ")
    return (tuple(int(d) for d in shape.split("x") if d), dtype, layout)
