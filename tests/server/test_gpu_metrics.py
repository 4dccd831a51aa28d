"""Per-GPU metrics (server/plane/gpu_metrics.py) where there is no NVML (CI, this machine):
/metrics has no nv_gpu_* series at all (zeros would read as an idle GPU) and the server says
why once in its log; --gpu-metrics 0 says it is off. On a GPU the prepared check
(tests/gpu/gpuops_check.py, gpuops.gpu_metrics) finds the series labelled with the card's
UUID. The exposition stays valid (tests/server/test_server_metrics.py runs promtool)."""

from __future__ import annotations

import urllib.request

import pytest
from serving import RunningServer

from plugserve.server.plane.gpu_metrics import SERIES, GpuMetrics


def _nvml_here() -> bool:
    metrics = GpuMetrics(60.0)
    try:
        return bool(metrics.gpus)
    finally:
        metrics.close()


@pytest.mark.parametrize("flag", ["1", "0"])
def test_no_nv_gpu_series_without_nvml_and_the_log_says_why(flag):
    if flag == "1" and _nvml_here():
        pytest.skip("NVML sees a GPU here: the series exist (gpuops.gpu_metrics checks them)")
    with RunningServer("--gpu-metrics", flag, "--metrics-interval-ms", "100") as server:
        with urllib.request.urlopen(server.metrics_url, timeout=20) as response:
            text = response.read().decode()
        assert "plugserve_build_info" in text
        assert not [line for line in text.splitlines() if line.startswith("nv_")]
        lines = [line for line in server.log.splitlines() if "no per-GPU metrics" in line]
        assert len(lines) == 1, lines
        if flag == "0":
            assert "--gpu-metrics 0" in lines[0]
        else:
            assert "nvidia-ml-py" in lines[0] or "NVML" in lines[0], lines[0]


def test_the_series_are_tritons():
    assert set(SERIES) == {
        "nv_gpu_utilization",
        "nv_gpu_memory_total_bytes",
        "nv_gpu_memory_used_bytes",
        "nv_gpu_power_usage",
        "nv_gpu_power_limit",
        "nv_energy_consumption",
    }


def test_a_bad_interval_is_refused():
    from plugserve.server.process.settings import Settings

    problems = Settings(metrics_interval_ms=10).problems()
    assert any("metrics_interval_ms" in p for p in problems), problems
