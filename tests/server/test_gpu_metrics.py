"""Per-GPU metrics (server/plane/gpu_metrics.py) where there is no NVML (CI, this machine):
/metrics has no nv_gpu_* series at all (zeros would read as an idle GPU) and the server says
why once in its log; --gpu-metrics 0 says it is off. On a GPU the prepared check
(tests/gpu/gpuops_check.py, gpuops.gpu_metrics) finds the series labelled with the card's
UUID. The exposition stays valid (tests/server/test_server_metrics.py runs promtool)."""

from __future__ import annotations

import logging
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


class _FakeNvml:
    """NVIDIA's library as nvidia-ml-py exposes it, for one card whose power limit cannot be
    read (the calls GpuMetrics makes; NVML itself needs a driver, which CI has not)."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.energy_mj = 5_000.0
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("card", index)

    def nvmlDeviceGetUUID(self, handle):
        return "GPU-5a2c0e1f-0000-1111-2222-333344445555"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Rates", (), {"gpu": 37, "memory": 5})()

    def nvmlDeviceGetMemoryInfo(self, handle):
        return type("Memory", (), {"total": 80 * 2**30, "used": 3 * 2**30, "free": 77 * 2**30})()

    def nvmlDeviceGetPowerUsage(self, handle):
        return 150_000  # mW

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        raise self.NVMLError("Not Supported")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.energy_mj += 2_000.0
        return self.energy_mj


def test_the_series_from_nvml_readings(monkeypatch, caplog):
    """What the sampler makes of NVML's readings: Triton's units (utilization 0-1, watts,
    joules since the start), the card's UUID as gpu_uuid, a counter the card lacks left out
    and logged once, NVML shut down at close."""
    import sys

    from prometheus_client import CollectorRegistry, generate_latest

    caplog.set_level(logging.INFO, logger="plugserve.server.plane.gpu_metrics")
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    metrics = GpuMetrics(3600.0)
    try:
        metrics.sample()  # a second reading: energy since the first
        registry = CollectorRegistry()
        registry.register(metrics)
        text = generate_latest(registry).decode()
    finally:
        metrics.close()
    from prometheus_client.parser import text_string_to_metric_families

    found = {
        sample.name: (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    uuid = {"gpu_uuid": "GPU-5a2c0e1f-0000-1111-2222-333344445555"}
    assert found["nv_gpu_utilization"] == (uuid, 0.37)
    assert found["nv_gpu_memory_total_bytes"] == (uuid, 80 * 2**30)
    assert found["nv_gpu_memory_used_bytes"] == (uuid, 3 * 2**30)
    assert found["nv_gpu_power_usage"] == (uuid, 150.0)
    assert found["nv_energy_consumption"] == (uuid, 2.0)  # joules since the first reading
    assert "nv_gpu_power_limit{" not in text  # not read on this card: no series, one log line
    assert sum("nv_gpu_power_limit is not read" in r.message for r in caplog.records) == 1
    assert fake.shut
