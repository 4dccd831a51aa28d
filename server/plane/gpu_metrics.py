"""Per-GPU metrics as Triton exports them: ``nv_gpu_utilization``, ``nv_gpu_memory_total_bytes``,
``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage``, ``nv_gpu_power_limit`` and
``nv_energy_consumption``, each labelled ``gpu_uuid``, read from NVIDIA's management library
(NVML, through ``nvidia-ml-py``'s ``pynvml``: ``pip install plugserve[gpu]``).

NVML is sampled on a thread every ``--metrics-interval-ms`` (Triton's flag, default 2,000 ms),
not at scrape time: one reading of utilization, memory and power is six NVML calls per card
(~0.1-1 ms each, the driver's), and a scrape answers from the last sample. Energy is the card's
counter since this server started (Triton's: joules since it started).

Without NVML (no ``nvidia-ml-py``, no driver, no GPU, or ``--gpu-metrics 0``) there are no
``nv_gpu_*`` series at all, and the server says why once in its log: a series of zeros would
read as an idle GPU. A card whose reading fails (a counter it does not have: power on some
boards) leaves that series out for the card and logs it once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from plugserve.plugins.threads import start_daemon

__all__ = ["SERIES", "GpuMetrics"]

log = logging.getLogger(__name__)

#: name -> help, as Triton's docs/metrics.md names them. All are exposed as gauges: the
#: exposition format would rename a counter ``nv_energy_consumption_total``, and dashboards
#: written for Triton read ``nv_energy_consumption``
SERIES = {
    "nv_gpu_utilization": "GPU utilization rate [0.0 - 1.0)",
    "nv_gpu_memory_total_bytes": "GPU total memory, in bytes",
    "nv_gpu_memory_used_bytes": "GPU used memory, in bytes",
    "nv_gpu_power_usage": "GPU power usage in watts",
    "nv_gpu_power_limit": "GPU power management limit in watts",
    "nv_energy_consumption": "GPU energy consumption in joules since the server started",
}


def _nvml() -> tuple[Any, str]:
    """``(pynvml, "")`` with NVML initialised, or ``(None, why not)``."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install plugserve[gpu])"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded...
        return None, f"NVML does not start here ({type(exc).__name__}: {exc}): no NVIDIA driver"
    return pynvml, ""


class GpuMetrics:
    """The per-GPU series of one server (see the module's docstring); register it on the
    metrics registry, :meth:`close` it at shutdown."""

    def __init__(self, interval_s: float = 2.0, enabled: bool = True) -> None:
        self.interval_s = max(0.05, float(interval_s))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: uuid -> {series name: value}, the last sample
        self._sample: dict[str, dict[str, float]] = {}
        self._energy_start: dict[str, float] = {}
        self._failed: set[tuple[str, str]] = set()
        self._nvml: Any = None
        self._handles: list[tuple[str, Any]] = []
        if not enabled:
            self.reason = "off (--gpu-metrics 0)"
        else:
            self._nvml, self.reason = _nvml()
        if self._nvml is not None:
            try:
                count = self._nvml.nvmlDeviceGetCount()
                for index in range(count):
                    handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = self._nvml.nvmlDeviceGetUUID(handle)
                    self._handles.append(
                        (uuid.decode() if isinstance(uuid, bytes) else uuid, handle)
                    )
            except Exception as exc:
                self.reason = f"NVML lists no GPU ({type(exc).__name__}: {exc})"
                self._handles = []
            if not self._handles:
                self.reason = self.reason or "NVML sees no GPU"
                self._shutdown()
        if self._handles:
            log.info("per-GPU metrics (nv_gpu_*) for %d GPU(s), sampled every %.0f ms",
                     len(self._handles), self.interval_s * 1e3)  # fmt: skip
            self.sample()
            start_daemon("gpu-metrics", self._loop)
        else:
            log.info("no per-GPU metrics (nv_gpu_*): %s", self.reason)

    @property
    def gpus(self) -> list[str]:
        return [uuid for uuid, _ in self._handles]

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        """One reading of every card (a reading that fails is left out and logged once)."""
        nvml, found = self._nvml, {}
        if nvml is None:
            return
        for uuid, handle in self._handles:
            values: dict[str, float] = {}
            readers = {
                "nv_gpu_utilization": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100,
                "nv_gpu_memory_total_bytes": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total,
                "nv_gpu_memory_used_bytes": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used,
                "nv_gpu_power_usage": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000,
                "nv_gpu_power_limit": lambda h: nvml.nvmlDeviceGetPowerManagementLimit(h) / 1000,
                "nv_energy_consumption": lambda h: (
                    nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000
                ),
            }
            for name, read in readers.items():
                try:
                    values[name] = float(read(handle))
                except Exception as exc:  # a counter this card does not have
                    if (uuid, name) not in self._failed:
                        self._failed.add((uuid, name))
                        log.info("%s: %s is not read (%s: %s)", uuid, name,
                                 type(exc).__name__, exc)  # fmt: skip
            if "nv_energy_consumption" in values:
                start = self._energy_start.setdefault(uuid, values["nv_energy_consumption"])
                values["nv_energy_consumption"] -= start
            found[uuid] = values
        with self._lock:
            self._sample = found

    def collect(self) -> Iterable[Any]:
        with self._lock:
            sample = dict(self._sample)
        if not sample:
            return
        for name, text in SERIES.items():
            family = GaugeMetricFamily(name, text, labels=["gpu_uuid"])
            for uuid, values in sample.items():
                if name in values:
                    family.add_metric([uuid], values[name])
            yield family

    def close(self) -> None:
        self._stop.set()
        self._shutdown()

    def _shutdown(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            with contextlib.suppress(Exception):  # a driver gone at exit: nothing to release
                nvml.nvmlShutdown()
