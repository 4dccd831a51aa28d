"""BATCH's configuration: the device, the batch size and how long a batch waits to fill."""

from __future__ import annotations

from plugserve.plugins.api import ConfigKey, Configuration, PlugserveError
from plugserve.plugins.virtual import VirtualConfiguration

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


#: the most requests BATCH_WAITING lets wait in a batcher: each waits on a thread of its own
MAX_WAITING = 1024


def _waiting(value: str) -> int:
    number = int(str(value).strip())
    if not 0 <= number <= MAX_WAITING:
        raise ValueError(f"expected an integer from 0 (twice BATCH_SIZE) to {MAX_WAITING}")
    return number


#: the longest a batch may wait for more requests (10 minutes, as MULTI's timeouts): past
#: ``threading``'s own bound a wait raised OverflowError in the collector, which then no longer
#: ran, and every later request of the network waited out its deadline
MAX_TIMEOUT_MS = 600_000


def _timeout(value: str) -> float:
    number = float(str(value).strip())
    if not 0 <= number <= MAX_TIMEOUT_MS:
        raise ValueError(f"expected milliseconds from 0 to {MAX_TIMEOUT_MS:,}")
    return number


def _format_timeout(value: float) -> str:
    return f"{value:g}"


class BatchConfiguration(VirtualConfiguration):
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
        ConfigKey(
            "BATCH_WAITING",
            0,
            _waiting,
            doc="requests that may wait in the batcher at once (0: twice BATCH_SIZE)",
        ),
    )

    OWN_KEYS = frozenset(
        {
            "DEVICE_PRIORITIES",
            "BATCH_SIZE",
            "BATCH_TIMEOUT_MS",
            "BATCH_WAITING",
            "DEVICE_ID",
            "CACHE_DIR",
        }
    )

    def device(self) -> str:
        return self.get("DEVICE_PRIORITIES")

    def streams(self, cores: int | None = None) -> int:
        """Callers that may wait at once: ``BATCH_WAITING``, else twice the batch size, so one
        batch fills while the previous one runs (and at least what the device itself runs,
        from its configuration for this load: :meth:`child`, parsed once). Those past it wait
        on this network's streams, in priority order but out of the batcher's sight: a model
        with priority levels waits on more (the server sets ``BATCH_WAITING``), so a higher
        priority reaches the batcher while lower ones wait there, as Triton's batcher sees its
        whole queue."""
        child = 1
        device = self.device()
        if self.devices is not None and device:
            try:
                child = int(self.child(device).streams())
            except PlugserveError:  # an unknown device or a bad value: the load says which
                child = 1
        return max(2 * int(self.get("BATCH_SIZE")), int(self.get("BATCH_WAITING")), child)
