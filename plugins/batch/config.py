"""BATCH's configuration: the device, the batch size and how long a batch waits to fill."""

from __future__ import annotations

from typing import Any

from plugserve.plugins.api import ConfigKey, Configuration

__all__ = ["BatchConfiguration"]


def _device(value: str) -> str:
    text = str(value).strip()
    if "," in text:
        raise ValueError("BATCH runs on one device, e.g. BATCH:ORT(8)")
    return text


def _positive(value: str) -> int:
    number = int(str(value).strip())
    if number < 1:
        raise ValueError("expected an integer >= 1")
    return number


def _timeout(value: str) -> float:
    number = float(str(value).strip())
    if not number >= 0:
        raise ValueError("expected a number of milliseconds >= 0")
    return number


def _format_timeout(value: float) -> str:
    return f"{value:g}"


class BatchConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey("DEVICE_PRIORITIES", "", _device, doc="the device (BATCH:D(n) sets it)"),
        ConfigKey("BATCH_SIZE", 8, _positive, doc="most rows in one batch (BATCH:D(n) sets it)"),
        ConfigKey(
            "BATCH_TIMEOUT_MS",
            2.0,
            _timeout,
            _format_timeout,
            doc="how long a batch waits for more requests after its first one",
        ),
    )

    devices: Any = None

    def device(self) -> str:
        return self.get("DEVICE_PRIORITIES")

    def child_settings(self) -> dict[str, str]:
        """Common keys set away from their defaults, handed to the device."""
        strings = self.to_strings()
        return {
            k.name: strings[k.name]
            for k in Configuration.KEYS
            if k.name not in ("DEVICE_ID", "CACHE_DIR") and self.get(k.name) != k.default
        }

    def streams(self, cores: int | None = None) -> int:
        """Callers that may wait at once: twice the batch size, so one batch fills while the
        previous one runs (and at least what the device itself runs)."""
        child = 1
        device = self.device()
        if self.devices is not None and device:
            try:
                plugin = self.devices.plugin(device)
                known = plugin.config_class.keys()
                config = {k: v for k, v in self.child_settings().items() if k in known}
                child = int(plugin.merged_config(config, strict=False).streams())
            except Exception:
                child = 1
        return max(2 * int(self.get("BATCH_SIZE")), child)
