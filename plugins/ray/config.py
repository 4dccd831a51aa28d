"""RAY's configuration: the common keys (passed on to the device that runs the network on its
node) plus which device that is and how long a remote call may take."""

from __future__ import annotations

from collections.abc import Callable

from plugserve.plugins.api import ConfigKey, Configuration

__all__ = ["INNER_KEYS", "RayConfiguration"]

#: the keys the device on the node is loaded with (DEVICE_ID names the node here, and
#: CACHE_DIR is a folder of this machine's)
INNER_KEYS = (
    "PERF_COUNT",
    "PERFORMANCE_HINT",
    "EXECUTION_MODE_HINT",
    "NUM_STREAMS",
    "INFERENCE_NUM_THREADS",
)


def _device(value: str) -> str:
    text = str(value).strip().upper()
    if not text or not text.replace("_", "").isalnum() or ":" in text or "." in text:
        raise ValueError("expected a device plugin's name (NUMPY, ORT, OPENVINO)")
    return text


def _seconds(least: float, most: float) -> Callable[[str], float]:
    def parse(value: str) -> float:
        number = float(str(value).strip())
        if not least <= number <= most:
            raise ValueError(f"expected seconds from {least:g} to {most:g}")
        return number

    return parse


class RayConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "RAY_DEVICE",
            "NUMPY",
            _device,
            doc="the device that compiles and runs the network in its actor on the node "
            "(a real device of plugserve's there: NUMPY, ORT, OPENVINO)",
        ),
        ConfigKey(
            "RAY_CALL_TIMEOUT_S",
            30.0,
            _seconds(0.1, 3600),
            doc="the longest one run on the node may take before it fails UNAVAILABLE (a "
            "node cut off answers nothing); a request's own deadline ends it sooner",
        ),
        ConfigKey(
            "RAY_LOAD_TIMEOUT_S",
            300.0,
            _seconds(1, 3600),
            doc="the longest the actor's start and the network's compilation on the node "
            "may take before the load fails UNAVAILABLE",
        ),
    )
