"""Request counts and latency histograms kept as plain numbers (``metrics._Series``) expose what
prometheus_client's own Counter and Histogram exposed for the same requests."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from plugserve.server.plane.metrics import _LATENCY_BUCKETS, Metrics

# on a bucket's bound, either side of it, zero, past the last bound
TIMES = [0.0, 0.0005, 0.00050001, 0.001, 0.0024, 0.3, 30.0, 31.0, 1e-9, 2.5]


def _exposed(registry: CollectorRegistry, *names: str) -> list[str]:
    """The samples of ``names`` (their _created times left out), sorted."""
    text = generate_latest(registry).decode()
    return sorted(
        line
        for line in text.splitlines()
        if line.split("{")[0].startswith(names) and "_created" not in line
    )


def _sorted_labels(line: str) -> str:
    head, _, value = line.rpartition(" ")
    name, _, labels = head.partition("{")
    pairs = sorted(re.findall(r'(\w+)="([^"]*)"', labels))
    return f"{name}{{{','.join(f'{k}={v!r}' for k, v in pairs)}}} {value}"


def test_counts_and_buckets_are_prometheus_own():
    metrics = Metrics("test")
    recorder = metrics.recorder("NUMPY", "net", 2, "f32")
    reference = CollectorRegistry()
    labels = ["device", "model", "version"]
    counter = Counter("plugserve_inference_requests", "", [*labels, "status"], registry=reference)
    queue = Histogram(
        "plugserve_queue_wait_seconds", "", labels, buckets=_LATENCY_BUCKETS, registry=reference
    )
    compute = Histogram(
        "plugserve_compute_seconds", "", labels, buckets=_LATENCY_BUCKETS, registry=reference
    )
    key = ("NUMPY", "net", "2")
    for wait, run in zip(TIMES, reversed(TIMES)):
        recorder.success(wait, run)
        counter.labels(*key, "success").inc()
        queue.labels(*key).observe(wait)
        compute.labels(*key).observe(run)
    for status in ("deadline", "invalid", "deadline"):
        recorder.failure(status)
        counter.labels(*key, status).inc()
    recorder.refused("overloaded")
    recorder.refused("")  # KServe's statistics only
    counter.labels(*key, "overloaded").inc()
    names = ("plugserve_inference_requests", "plugserve_queue_wait", "plugserve_compute")
    ours = [_sorted_labels(line) for line in _exposed(metrics.registry, *names)]
    theirs = [_sorted_labels(line) for line in _exposed(reference, *names)]
    assert sorted(ours) == sorted(theirs)
    assert recorder.stats().success == len(TIMES) and recorder.stats().failure == 5


def test_a_reload_on_the_same_device_goes_on_counting_and_forget_drops_the_series():
    metrics = Metrics("test")
    metrics.recorder("ORT", "net", 1, "f32").success(0.001, 0.002)
    again = metrics.recorder("ORT", "net", 1, "f32")
    again.success(0.001, 0.002)
    text = generate_latest(metrics.registry).decode()
    assert 'plugserve_compute_seconds_count{device="ORT",model="net",version="1"} 2.0' in text
    assert again.stats().success == 1  # KServe's statistics are the loaded network's own
    metrics.forget("ORT", "net", 1)
    again.success(0.001, 0.002)  # a request that finishes after its network was unloaded
    assert 'model="net"' not in generate_latest(metrics.registry).decode()
