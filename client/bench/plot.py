"""The latency charts of ``plugserve bench --plot`` (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(report: Mapping[str, Any], path: str) -> str:
    """A latency histogram and a latency-over-time chart; returns a message for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"--plot {path}: skipped, matplotlib is not installed (pip install 'plugserve[bench]')"
        )
    lat = report.get("latencies_ms") or []
    starts = report.get("starts_s") or []
    fig, (hist, line) = plt.subplots(1, 2, figsize=(12, 4.5))
    hist.hist(lat, bins=min(60, max(5, len(lat) // 4)), color="#4878a8")
    for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        value = report["latency_ms"][q]
        if value == value:
            hist.axvline(value, color="black", linestyle=style, label=f"{q} {value:.2f} ms")
    hist.set_xlabel("latency (ms)")
    hist.set_ylabel("requests")
    hist.set_title("latency histogram")
    hist.legend()
    line.plot(starts, lat, ".", markersize=3, color="#4878a8")
    line.set_xlabel("time since start (s)")
    line.set_ylabel("latency (ms)")
    line.set_title("latency over time")
    fig.suptitle(
        f"{report.get('model')} on {report.get('device') or report.get('target')}: "
        f"{report['throughput_ips']:.1f} inferences/s, {report['mode']} x{report['concurrency']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot -> {path}"
