"""AUTO's choice by measurement: time each candidate on one input, keep the fastest that is right.

A device's place in a priority list says nothing about how fast it runs a given model: on a
CPU with bf16 arithmetic openvino's default precision runs ResNet-18 5x faster than f32, and
on one without it onnxruntime may beat openvino's f32. So AUTO compiles every candidate (each
device that runs every node, OPENVINO also at f32 when its default is reduced), runs each on
the same made-up input, compares each answer with the most accurate candidate's (the reference
below) within that candidate's precision's tolerance, and picks the fastest that passes.

The cost is bounded before it starts: at most :data:`MAX_CANDIDATES` compiles, and timing
runs share ``MEASURE_SECONDS`` (each candidate runs at least twice: once to check, once
timed). A model AUTO cannot make an input for (strings, unknown ranks), or whose reference
cannot run the made-up input, is not measured: the first candidate in priority order is taken.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

from plugserve.plugins.api import CompiledNetwork
from plugserve.plugins.outputcheck import compare_outputs

__all__ = ["MAX_CANDIDATES", "REFERENCE_DEVICES", "Candidate", "choose", "reference", "table"]

log = logging.getLogger(__name__)

#: the most networks AUTO compiles for one load
MAX_CANDIDATES = 6
#: timed runs per candidate, at most (a small model's median needs no more)
MAX_RUNS = 20
#: whose answer the others are checked against, most trusted first: NUMPY is the reference
#: implementation of ONNX here, ORT onnxruntime's; a reduced precision never is the reference.
#: When no candidate is one of them AUTO compiles NUMPY beside them, only to check them.
REFERENCE_DEVICES = ("NUMPY", "ORT")


@dataclasses.dataclass
class Candidate:
    """One device (and precision) AUTO may choose, and what measuring it found."""

    device: str
    config: dict[str, str]
    network: CompiledNetwork | None = None
    median_ms: float | None = None
    verdict: str = ""  # '' while untried; "ok", "reference", or why it was not chosen

    @property
    def precision(self) -> str:
        return self.network.precision if self.network is not None else "?"

    def row(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "precision": self.precision,
            "median_ms": None if self.median_ms is None else round(self.median_ms, 4),
            "verdict": self.verdict,
        }


def reference(candidates: list[Candidate]) -> Candidate | None:
    """The candidate of :data:`REFERENCE_DEVICES` that checks the others, if one is among
    them (compiled, at f32)."""
    exact = [c for c in candidates if c.network is not None and c.precision == "f32"]
    for kind in REFERENCE_DEVICES:
        for candidate in exact:
            if candidate.device.partition(".")[0].upper() == kind:
                return candidate
    return None


def _time(network: CompiledNetwork, feeds: dict[str, Any], budget_s: float) -> float:
    """The median of up to :data:`MAX_RUNS` runs of ``network`` within ``budget_s`` (one run
    at least), in milliseconds; one infer request reused, as a stream reuses its own."""
    request = network.create_infer_request()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < MAX_RUNS and (not times or time.perf_counter() < deadline):
        start = time.perf_counter()
        request.infer(feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def choose(
    candidates: list[Candidate],
    checker: Candidate | None,
    feeds: dict[str, Any] | None,
    budget_s: float,
) -> Candidate | None:
    """The fastest candidate whose answer on ``feeds`` agrees with ``checker``'s (a
    candidate or a reference compiled beside them; every candidate's ``verdict`` and
    ``median_ms`` filled in); None when nothing can be measured (then AUTO takes the first in
    priority order)."""
    loaded = [c for c in candidates if c.network is not None]
    if feeds is None or checker is None or checker.network is None:
        return None
    try:
        want = checker.network.infer(feeds)
    except Exception as exc:  # the made-up input does not suit the model
        log.info("AUTO: the reference %s cannot run a made-up input (%s)", checker.device, exc)
        return None
    checker.verdict = "reference" if checker in candidates else "reference only"
    per_candidate = budget_s / max(1, len(loaded))
    passed: list[Candidate] = []
    for candidate in loaded:
        network = candidate.network
        assert network is not None
        if candidate is not checker:
            try:
                got = network.infer(feeds)
            except Exception as exc:
                candidate.verdict = f"failed on the input the reference ran: {exc}"
                continue
            why = compare_outputs(got, want, candidate.precision, f"{checker.device}'s")
            if why:
                candidate.verdict = why
                continue
            candidate.verdict = "ok"
        try:
            candidate.median_ms = _time(network, feeds, per_candidate)
        except Exception as exc:
            candidate.verdict = f"failed while timed: {exc}"
            continue
        passed.append(candidate)
    return min(passed, key=lambda c: c.median_ms or 0.0, default=None)


def table(candidates: list[Candidate], chosen: Candidate | None) -> str:
    """The measurements as lines for the log."""
    lines = []
    for c in candidates:
        timed = "-" if c.median_ms is None else f"{c.median_ms:.3f} ms"
        mark = "  <- chosen" if c is chosen else ""
        lines.append(f"  {c.device:<10} {c.precision:<5} {timed:>12}  {c.verdict}{mark}")
    return "\n".join(lines)
