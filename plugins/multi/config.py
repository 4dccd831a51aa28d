"""MULTI's and AUTO's configuration: device lists, exclusions and runtime fallback."""

from __future__ import annotations

from plugserve.plugins.api import BOOL, ConfigKey, Configuration, PlugserveError
from plugserve.plugins.virtual import VirtualConfiguration, check_device_list, device_list

__all__ = ["AutoConfiguration", "MultiConfiguration"]

#: AUTO's default preference when no DEVICE_PRIORITIES is given.
DEFAULT_AUTO_PRIORITIES = "OPENVINO,ORT,NUMPY"


def _seconds(value: str) -> float:
    seconds = float(value)
    if not 0 <= seconds <= 600:
        raise ValueError("expected seconds from 0 to 600")
    return seconds


def _names(value: str) -> str:
    text = check_device_list(value)
    return ",".join(p.upper() for p in text.split(",")) if text else ""


class _Devices(VirtualConfiguration):
    """What MULTI's and AUTO's configurations share: a device list, and streams sized from
    the children's configurations for this load."""

    OWN_KEYS = frozenset(
        {
            "DEVICE_PRIORITIES",
            "EXCLUDED_DEVICES",
            "RUNTIME_FALLBACK",
            "DEVICE_ID",
            "MEASURE_SECONDS",
            "CACHE_DIR",
        }
    )

    def priorities(self) -> list[str]:
        return device_list(self.get("DEVICE_PRIORITIES"))

    def child_streams(self, device: str) -> int:
        """The streams a child device would run for a load through this virtual device."""
        if self.devices is None:
            return 1
        try:
            return max(1, int(self.child(device).streams()))
        except PlugserveError:  # an unknown device is reported by load, not here
            return 1


class MultiConfiguration(_Devices):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "DEVICE_PRIORITIES",
            "",
            check_device_list,
            doc="devices in priority order (MULTI:A,B sets it)",
        ),
        ConfigKey(
            "RUNTIME_FALLBACK",
            False,
            **BOOL,
            doc="YES: a request that fails on one device is retried on the next one",
        ),
        ConfigKey(
            "UNAVAILABLE_BACKOFF_S",
            5.0,
            _seconds,
            doc="a device whose run fails UNAVAILABLE (its backend or node gone) gets no "
            "requests for this long while another is up, doubled after each further failure "
            "up to 60x; 0: never set aside",
        ),
    )

    def streams(self, cores: int | None = None) -> int:
        """The sum of the children's streams: every device can run its share at once."""
        return max(1, sum(self.child_streams(d) for d in self.priorities()))


class AutoConfiguration(_Devices):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "DEVICE_PRIORITIES",
            "",
            check_device_list,
            doc=f"candidate devices in preference order (default {DEFAULT_AUTO_PRIORITIES})",
        ),
        ConfigKey(
            "EXCLUDED_DEVICES",
            "",
            _names,
            doc="devices AUTO must not choose (AUTO:-X sets it)",
        ),
        ConfigKey(
            "MEASURE_SECONDS",
            2.0,
            _seconds,
            doc=(
                "time AUTO may spend timing its candidates at load, shared among them (each "
                "runs twice at least); 0: no timing, the first candidate in priority order"
            ),
        ),
    )

    def candidates(self) -> list[str]:
        listed = self.priorities() or DEFAULT_AUTO_PRIORITIES.split(",")
        excluded = set(self.excluded())
        return [d for d in listed if d.upper().partition(".")[0] not in excluded]

    def excluded(self) -> list[str]:
        text = self.get("EXCLUDED_DEVICES")
        return [p for p in text.split(",") if p] if text else []

    def streams(self, cores: int | None = None) -> int:
        """The most streams any candidate would run (the choice is made at load)."""
        available = set(self.devices.available_devices) if self.devices is not None else set()
        counts = [
            self.child_streams(d) for d in self.candidates() if d.partition(".")[0] in available
        ]
        return max(counts, default=1)
