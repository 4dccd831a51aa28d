"""The latency charts of ``plugserve bench --plot`` (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["histogram", "plot", "plot_generation"]

#: latencies whose largest is over this many times their median are drawn on log axes
LOG_SPREAD = 10.0
#: the histogram's axis ends at this many times p99 (the slower requests are counted)
CLIP_OVER_P99 = 2.0


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
    histogram(hist, report)
    line.plot(starts, lat, ".", markersize=3, color="#4878a8")
    if _logarithmic(lat):
        line.set_yscale("log")
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


def _logarithmic(latencies: Sequence[float]) -> bool:
    """Whether latencies spread over more than :data:`LOG_SPREAD` times their median."""
    positive = np.asarray([v for v in latencies if v > 0])
    if len(positive) < 2:
        return False
    return bool(positive.max() > LOG_SPREAD * np.median(positive))


def histogram(axis: Any, report: Mapping[str, Any]) -> None:
    """The latency histogram with the p50, p90 and p99 lines, drawn so they stand apart: its
    axis ends at :data:`CLIP_OVER_P99` times p99 (one 2 s request beside a thousand of 1 ms
    would otherwise put p50 and p90 in one bin), the requests past it counted in the title;
    what is still spread over :data:`LOG_SPREAD` times the median is drawn on a log axis
    with log-spaced bins."""
    lat = [v for v in report.get("latencies_ms") or [] if v == v]
    p99 = report["latency_ms"]["p99"]
    beyond = 0
    if lat and p99 == p99 and max(lat) > CLIP_OVER_P99 * p99:
        drawn = [v for v in lat if v <= CLIP_OVER_P99 * p99]
        beyond = len(lat) - len(drawn)
        lat = drawn
    bins: Any = min(60, max(5, len(lat) // 4))
    if _logarithmic(lat):
        lat = [v for v in lat if v > 0]
        bins = np.geomspace(min(lat), max(lat), bins + 1)
        axis.set_xscale("log")
    axis.hist(lat, bins=bins, color="#4878a8")
    for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        value = report["latency_ms"][q]
        if value == value:
            axis.axvline(value, color="black", linestyle=style, label=f"{q} {value:.2f} ms")
    axis.set_xlabel("latency (ms)" + (", log scale" if axis.get_xscale() == "log" else ""))
    axis.set_ylabel("requests")
    title = "latency histogram"
    if beyond:
        title += f" ({beyond} slower than {CLIP_OVER_P99:g} x p99 left out)"
    axis.set_title(title)
    axis.legend()


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
