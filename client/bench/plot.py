"""The latency charts of ``plugserve bench --plot`` (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["plot", "plot_generation"]


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


def plot_generation(report: Mapping[str, Any], path: str) -> str:
    """``--protocol openai``: output tokens/s, and TTFT and ITL percentiles, by concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"--plot {path}: skipped, matplotlib is not installed (pip install 'plugserve[bench]')"
        )
    levels = report.get("levels") or []
    xs = [lv["concurrency"] for lv in levels]
    fig, (rate, ttft, itl) = plt.subplots(1, 3, figsize=(15, 4.5))
    rate.plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-", color="#4878a8")
    rate.set_xlabel("concurrent streams")
    rate.set_ylabel("output tokens/s")
    rate.set_title("throughput")
    for axis, key, title in (
        (ttft, "ttft_ms", "time to first token"),
        (itl, "itl_ms", "inter-token latency"),
    ):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            axis.plot(xs, [lv[key][q] for lv in levels], style, label=q)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel("ms")
        axis.set_title(title)
        axis.legend()
    for axis in (rate, ttft, itl):
        axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [str(x) for x in xs])
    fig.suptitle(
        f"{report.get('model')} at {report.get('target')}: {report.get('max_tokens')} tokens "
        "per request"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot -> {path}"
