"""One engine's numbers for Prometheus: histograms of time to first token, inter-token latency
and end-to-end latency, token counters, and the present's gauges.

The engine's loop thread updates plain lists and numbers under one lock as tokens come out
(no prometheus_client objects on the hot path, as ``server/plane/metrics.py`` does for requests);
``server/plane/metrics.py`` turns a :meth:`GenerationStats.snapshot` into families when /metrics is
scraped.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import threading
from typing import Any

__all__ = ["BUCKETS", "VLLM_BUCKETS", "GenerationStats", "Histogram", "Numbers", "Snapshot"]

#: seconds: from a fast inter-token latency (ms) to a long queued request (minutes)
BUCKETS = {
    "time_to_first_token": (
        0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0,
    ),
    "inter_token_latency": (
        0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
        0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    ),
    "e2e_request_latency": (
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0,
    ),
}  # fmt: skip
#: vLLM's buckets for the same histograms (``vllm/v1/metrics/loggers.py``): its
#: ``vllm:*_seconds`` families have them, and dashboards made for vLLM expect them
#: (``server/plane/vllm_metrics.py``)
VLLM_BUCKETS = {
    "time_to_first_token": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ),
    "inter_token_latency": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0,
    ),
    "e2e_request_latency": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0,
    ),
}  # fmt: skip


class Histogram:
    """Per-bucket counts (not cumulative; the last is +Inf) and the sum, in our bounds and in
    vLLM's (one observe counts both: a second bisect, no second object on the hot path)."""

    __slots__ = ("bounds", "counts", "total", "vllm_bounds", "vllm_counts")

    def __init__(self, bounds: tuple[float, ...], vllm_bounds: tuple[float, ...] = ()) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.vllm_bounds = vllm_bounds
        self.vllm_counts = [0] * (len(vllm_bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.vllm_counts[bisect.bisect_left(self.vllm_bounds, value)] += 1
        self.total += value


@dataclasses.dataclass
class Numbers:
    """The engine's counters and gauges besides its histograms: what the engine's loop
    updates (:class:`GenerationStats`) and a scrape reads (:class:`Snapshot`), declared once."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    finished: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0}
    )
    #: sequences holding a slot, and requests waiting for one
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_cache_bytes: int = 0
    #: tokens per block of the prefix cache, and the blocks the cache holds in all
    #: (slots x context / block size): what vLLM's ``cache_config_info`` says (set once by
    #: the engine, with kv_cache_bytes)
    block_size: int = 0
    kv_cache_blocks: int = 0
    #: decode steps launched behind the one in flight (:mod:`.overlap`)
    pipelined_steps: int = 0
    #: warm-up requests run (:mod:`.warmup`: at load and at each wake), and the seconds
    #: the last warm-up took
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    #: prompt tokens looked up in the prefix cache at admission, and those found (vLLM's
    #: ``prefix_cache_queries`` and ``prefix_cache_hits``: the slot table's, added by the
    #: engine with the gauges)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: bytes the KV host tier keeps, and prompt tokens restored from it (:mod:`.kv_host_tier`)
    kv_offload_bytes: int = 0
    kv_offload_restored_tokens: int = 0
    #: bytes of the KV disk tier's files, and prompt tokens restored from them
    #: (:mod:`.kv_disk_tier`)
    kv_disk_bytes: int = 0
    kv_disk_restored_tokens: int = 0


@dataclasses.dataclass
class Snapshot(Numbers):
    """What one scrape reads: the numbers, and each histogram as ``(bounds, per-bucket
    counts, sum)``."""

    histograms: dict[str, tuple[tuple[float, ...], list[int], float]] = dataclasses.field(
        default_factory=dict
    )
    #: the histograms in vLLM's buckets (``VLLM_BUCKETS``), as :attr:`histograms`
    vllm_histograms: dict[str, tuple[tuple[float, ...], list[int], float]] = dataclasses.field(
        default_factory=dict
    )


@dataclasses.dataclass(eq=False)
class GenerationStats(Numbers):
    """Updated by the engine's loop; read by scrapes (both under :attr:`lock`)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    histograms: dict[str, Histogram] = dataclasses.field(
        default_factory=lambda: {
            name: Histogram(bounds, VLLM_BUCKETS[name]) for name, bounds in BUCKETS.items()
        }
    )

    #: what requests count (a warm-up's are put back: :meth:`counters`, :meth:`restore`)
    _COUNTED = (
        "histograms", "prompt_tokens", "generation_tokens", "cached_prompt_tokens", "finished",
        "pipelined_steps", "prefix_cache_queries", "prefix_cache_hits",
    )  # fmt: skip

    def counters(self) -> dict[str, Any]:
        """The request counters and histograms as they are (:meth:`restore` puts them back)."""
        with self.lock:
            return {name: copy.deepcopy(getattr(self, name)) for name in self._COUNTED}

    def restore(self, saved: dict[str, Any]) -> None:
        """The counters as :meth:`counters` read them: a warm-up's requests counted nowhere
        (it runs while no request is served: at load, before the model is listed, and at
        wake, before requests are taken again)."""
        with self.lock:
            for name, value in saved.items():
                setattr(self, name, value)

    def snapshot(self) -> Snapshot:
        with self.lock:
            numbers = {
                f.name: copy.copy(getattr(self, f.name)) for f in dataclasses.fields(Numbers)
            }
            return Snapshot(
                **numbers,
                histograms={
                    n: (h.bounds, list(h.counts), h.total) for n, h in self.histograms.items()
                },
                vllm_histograms={
                    n: (h.vllm_bounds, list(h.vllm_counts), h.total)
                    for n, h in self.histograms.items()
                },
            )
