"""vLLM's metric names beside ours, for generative models: what the Gateway API Inference
Extension's model-server protocol (``docs/proposals/003-model-server-protocol``), KEDA recipes
and the dashboards made for vLLM read, so they read plugserve unchanged.

The same numbers as the ``plugserve_generate_*`` families (``metrics.py``), read at scrape time
from each engine's statistics, under vLLM's names, types, labels and buckets
(``vllm/v1/metrics/loggers.py``): labels ``model_name`` and ``engine`` (vLLM's engine index:
here ``0``, or ``1``, ``2``... when one model name is loaded more than once, on several devices
or versions, so that no two series share their labels), counters written with ``_total``, the
latency histograms in vLLM's bounds (``stats.VLLM_BUCKETS``, counted with ours by the same
observe):

==========================================  ==============================================
``vllm:num_requests_running``               gauge: sequences holding a cache slot
``vllm:num_requests_waiting``               gauge: requests waiting for one
``vllm:kv_cache_usage_perc``                gauge: share of the cache's slots held, 0 to 1
``vllm:prefix_cache_queries_total``         counter: prompt tokens looked up at admission
``vllm:prefix_cache_hits_total``            counter: of those, tokens found in the cache
``vllm:prompt_tokens_total``                counter: prompt tokens of requests started
``vllm:generation_tokens_total``            counter: tokens generated
``vllm:request_success_total``              counter by ``finished_reason`` (stop, length,
                                            abort): sequences ended
``vllm:time_to_first_token_seconds``        histogram
``vllm:inter_token_latency_seconds``        histogram
``vllm:e2e_request_latency_seconds``        histogram
``vllm:cache_config_info``                  gauge 1, labels ``block_size``, ``num_gpu_blocks``
==========================================  ==============================================

vLLM's older ``vllm:gpu_cache_usage_perc`` and ``vllm:time_per_output_token_seconds`` are left
out: vLLM itself no longer exports them and the protocol names ``kv_cache_usage_perc``. These
families are per model, as vLLM's (one model per server); a router in front of a server of
several models reads the server-wide sums (``plugserve_num_requests_*``, ``metrics.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

__all__ = ["VllmCollector", "cumulative"]

_LABELS = ["model_name", "engine"]
_HISTOGRAMS = (
    ("time_to_first_token", "Histogram of time to first token in seconds."),
    ("inter_token_latency", "Histogram of inter-token latency in seconds."),
    ("e2e_request_latency", "Histogram of e2e request latency in seconds."),
)


def cumulative(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """A histogram's buckets as Prometheus writes them (``le``, cumulative count) from its
    bounds and per-bucket counts (the last one +Inf's)."""
    total, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts):
        total += count
        buckets.append((floatToGoString(bound), total))
    return buckets


class VllmCollector:
    """The ``vllm:*`` families, from ``read()``: ``(device, model, version, stats snapshot)``
    of each generative model."""

    def __init__(self, read: Callable[[], list[tuple[str, str, str, Any]]]) -> None:
        self._read = read

    def collect(self):
        gauges = {
            name: GaugeMetricFamily(f"vllm:{name}", text, labels=_LABELS)
            for name, text in (
                ("num_requests_running", "Number of requests in model execution batches."),
                ("num_requests_waiting", "Number of requests waiting to be processed."),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            )
        }
        counters = {
            name: CounterMetricFamily(f"vllm:{name}", text, labels=_LABELS)
            for name, text in (
                ("prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens."),
                ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                ("prompt_tokens", "Number of prefill tokens processed."),
                ("generation_tokens", "Number of generation tokens processed."),
            )
        }  # fmt: skip
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )  # fmt: skip
        histograms = {
            name: HistogramMetricFamily(f"vllm:{name}_seconds", text, labels=_LABELS)
            for name, text in _HISTOGRAMS
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=[*_LABELS, "block_size", "num_gpu_blocks"],
        )  # fmt: skip
        engines: dict[str, int] = {}
        for _device, model, _version, snap in self._read():
            engine = engines[model] = engines.get(model, -1) + 1
            key = [model, str(engine)]
            gauges["num_requests_running"].add_metric(key, snap.running)
            gauges["num_requests_waiting"].add_metric(key, snap.waiting)
            gauges["kv_cache_usage_perc"].add_metric(key, snap.kv_cache_usage)
            counters["prefix_cache_queries"].add_metric(key, snap.prefix_cache_queries)
            counters["prefix_cache_hits"].add_metric(key, snap.prefix_cache_hits)
            counters["prompt_tokens"].add_metric(key, snap.prompt_tokens)
            counters["generation_tokens"].add_metric(key, snap.generation_tokens)
            for reason, count in sorted(snap.finished.items()):
                success.add_metric([*key, reason], count)
            for name, family in histograms.items():
                bounds, counts, total = snap.vllm_histograms[name]
                family.add_metric(key, cumulative(bounds, counts), total)
            if snap.block_size > 0:
                info.add_metric([*key, str(snap.block_size), str(snap.kv_cache_blocks)], 1)
        yield from gauges.values()
        yield from counters.values()
        yield success
        yield from histograms.values()
        yield info
