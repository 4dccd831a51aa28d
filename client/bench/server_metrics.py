"""What the server counted during a run, from its Prometheus ``/metrics`` (read with
prometheus-client's own exposition parser)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["device_figures", "scrape"]

_KEYS = {
    "plugserve_compute_seconds_sum": "compute_s",
    "plugserve_compute_seconds_count": "compute_count",
    "plugserve_queue_wait_seconds_sum": "queue_wait_s",
    "plugserve_queue_wait_seconds_count": "queue_wait_count",
}


def scrape(url: str, timeout: float = 5.0) -> dict[str, dict[str, float]]:
    """Per-device totals from plugserve's counters: requests (by status), compute and queue
    wait seconds (sum and count), read with prometheus-client's own exposition parser. Raises
    OSError when the endpoint cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    devices: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("plugserve_"):
            continue
        for sample in family.samples:
            device = sample.labels.get("device")
            if sample.name == "plugserve_inference_requests_total":
                key = f"requests_{sample.labels.get('status', '')}"
            else:
                key = _KEYS.get(sample.name)
            if device is None or key is None:
                continue
            per = devices.setdefault(device, {})
            per[key] = per.get(key, 0.0) + sample.value
    return devices


def device_figures(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall: float
) -> dict[str, dict[str, float]]:
    """What the server counted per device during the run."""
    out = {}
    for device, values in after.items():
        old = before.get(device, {})
        delta = {k: v - old.get(k, 0.0) for k, v in values.items()}
        requests = sum(v for k, v in delta.items() if k.startswith("requests_"))
        if requests <= 0:
            continue
        figures: dict[str, float] = {"requests": requests}
        for k, v in delta.items():
            if k.startswith("requests_"):
                figures[k] = v
        if delta.get("compute_count", 0) > 0:
            figures["compute_mean_ms"] = 1e3 * delta["compute_s"] / delta["compute_count"]
            figures["utilization"] = delta["compute_s"] / wall if wall > 0 else 0.0
        if delta.get("queue_wait_count", 0) > 0:
            figures["queue_wait_mean_ms"] = 1e3 * delta["queue_wait_s"] / delta["queue_wait_count"]
        out[device] = figures
    return out
