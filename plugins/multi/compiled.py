"""MULTI's and AUTO's compiled networks.

MULTI holds one compiled network per device and a pool of infer requests for each, as many as
the device's network says it can run at once (OPTIMAL_NUMBER_OF_INFER_REQUESTS). AUTO holds the
one network of the device it chose.

A device whose run fails UNAVAILABLE (its backend or its node is gone: a RAY node lost or cut
off) is set aside for ``UNAVAILABLE_BACKOFF_S``, twice as long after each further such failure
(at most 60 times as long), while another device is up: the requests that come meanwhile go to
the others instead of each failing on it, or each waiting out a cut-off node's call timeout.
When the time is up the next request tries it again; one that succeeds takes it back. With
every device set aside, requests try them all as before (and fail with their reasons).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, InferRequest, PlugserveError, joined_precision
from plugserve.plugins.multi.config import AutoConfiguration, MultiConfiguration
from plugserve.plugins.multi.request import AutoInferRequest, MultiInferRequest
from plugserve.plugins.virtual import OneNetwork

if TYPE_CHECKING:
    from plugserve.plugins.multi.plugin import AutoPlugin, MultiPlugin

__all__ = ["AutoCompiledNetwork", "DevicePool", "MultiCompiledNetwork"]

log = logging.getLogger(__name__)


class DevicePool:
    """One device's network and its free infer requests (created on demand up to capacity)."""

    def __init__(self, device: str, network: CompiledNetwork) -> None:
        self.device = device
        self.network = network
        try:
            self.capacity = max(1, int(network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))
        except Exception:
            self.capacity = 1
        self.free: list[InferRequest] = []
        self.in_use = 0
        self.count = 0  # requests this device ran
        self.failures = 0
        #: set aside until then (``time.monotonic``) after failing UNAVAILABLE
        self.down_until = 0.0
        #: UNAVAILABLE failures in a row (each doubles the time set aside)
        self.downs = 0

    @property
    def has_room(self) -> bool:
        return self.in_use < self.capacity


class MultiCompiledNetwork(CompiledNetwork):
    plugin: MultiPlugin
    config: MultiConfiguration

    def __init__(
        self,
        plugin: MultiPlugin,
        config: MultiConfiguration,
        networks: list[tuple[str, CompiledNetwork]],
    ) -> None:
        first = networks[0][1]
        super().__init__(plugin, first.name, config)
        self.pools = [DevicePool(device, network) for device, network in networks]
        self.open_ended = any(network.open_ended for _, network in networks)
        self.fallback = bool(config.get("RUNTIME_FALLBACK"))
        self.backoff = float(config.get("UNAVAILABLE_BACKOFF_S"))
        #: devices failing UNAVAILABLE (set aside now or last time they were tried)
        self._troubled = 0
        self._inputs = list(first.inputs)
        self._outputs = list(first.outputs)
        self._cond = threading.Condition()
        self._next = 0  # round robin when every device is busy

    @property
    def devices(self) -> list[str]:
        return [p.device for p in self.pools]

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self.pools)

    # --- scheduling

    def acquire(self, exclude: set[str] | None = None) -> tuple[DevicePool, InferRequest]:
        """A request on the first device (priority order) with room; when all are busy, the
        next device in round robin, waiting for its room."""
        exclude = exclude or set()
        with self._cond:
            pools = self.up([p for p in self.pools if p.device not in exclude])
            pool = next((p for p in pools if p.has_room), None)
            if pool is None:
                pool = pools[self._next % len(pools)]
                self._next += 1
                while not pool.has_room:
                    self._cond.wait()
            request = self._claim(pool)
        return self._ready(pool, request)

    def acquire_on(self, device: str) -> tuple[DevicePool, InferRequest]:
        pool = next(p for p in self.pools if p.device == device)
        with self._cond:
            while not pool.has_room:
                self._cond.wait()
            request = self._claim(pool)
        return self._ready(pool, request)

    @staticmethod
    def _claim(pool: DevicePool) -> InferRequest | None:
        """Take a slot of ``pool`` (the lock held, room seen) and its free request if any."""
        pool.in_use += 1
        pool.count += 1
        return pool.free.pop() if pool.free else None

    def _ready(
        self, pool: DevicePool, request: InferRequest | None
    ) -> tuple[DevicePool, InferRequest]:
        """The claimed slot's request: a new one is made outside the lock (it can be slow);
        if that fails the slot is given back."""
        if request is None:
            try:
                request = pool.network.create_infer_request()
            except BaseException:
                self.release(pool, None)
                raise
        return pool, request

    def up(self, pools: list[DevicePool]) -> list[DevicePool]:
        """Those of ``pools`` not set aside (all of them when every one is)."""
        if not self._troubled:  # (every request asks: nothing more while all is well)
            return pools
        now = time.monotonic()
        with self._cond:
            return [p for p in pools if p.down_until <= now] or pools

    def release(
        self, pool: DevicePool, request: InferRequest | None, failed: BaseException | None = None
    ) -> None:
        with self._cond:
            pool.in_use -= 1
            if failed is not None:
                pool.failures += 1
                if isinstance(failed, PlugserveError) and failed.code == "UNAVAILABLE":
                    self._set_aside(pool, failed)
            elif pool.downs:
                log.warning("network %s: %s answers again", self.name, pool.device)
                pool.downs, pool.down_until = 0, 0.0
                self._troubled -= 1
            if request is not None:
                pool.free.append(request)
            self._cond.notify_all()

    def _set_aside(self, pool: DevicePool, error: PlugserveError) -> None:
        """(The lock held.) ``pool``'s device failed UNAVAILABLE: skipped for a while."""
        if not self.backoff:
            return
        seconds = self.backoff * min(2**pool.downs, 60)
        self._troubled += pool.downs == 0
        pool.downs += 1
        pool.down_until = time.monotonic() + seconds
        log.warning(
            "network %s: %s is unavailable (%s); its requests go to the other devices for "
            "%g s (UNAVAILABLE_BACKOFF_S)",
            self.name,
            pool.device,
            error,
            seconds,
        )

    # --- the CompiledNetwork API

    def each_stream(self, fn: Any) -> list[Any]:
        """Every device's requests (its pool's, made now up to its capacity): MULTI's own
        streams take a device's request per run, so they would not reach every device."""
        results = []
        for pool in self.pools:
            with self._cond:
                requests = list(pool.free)
                pool.free.clear()
                missing = max(0, pool.capacity - pool.in_use - len(requests))
            try:
                requests += [pool.network.create_infer_request() for _ in range(missing)]
                results += [fn(request) for request in requests]
            finally:
                with self._cond:
                    pool.free.extend(requests)
                    self._cond.notify_all()
        return results

    def create_infer_request(self) -> MultiInferRequest:
        return MultiInferRequest(self)

    def export(self) -> bytes:
        """Every device's own export, bundled; import rebuilds each on its device."""
        payload = json.dumps(
            {p.device: base64.b64encode(p.network.export()).decode() for p in self.pools}
        ).encode()
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            payload,
            {"network_name": self.name, "devices": self.devices},
        )

    @property
    def precision(self) -> str:
        return joined_precision(pool.network for pool in self.pools)

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "EXECUTION_DEVICES", "DEVICE_REQUEST_COUNTS"]

    def _metric(self, name: str) -> Any:
        if name == "EXECUTION_DEVICES":
            return self.devices
        if name == "DEVICE_REQUEST_COUNTS":
            with self._cond:
                return {p.device: p.count for p in self.pools}
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.capacity
        return super()._metric(name)

    def close(self) -> None:
        super().close()
        for pool in self.pools:
            close_quietly(pool.network)


class AutoCompiledNetwork(OneNetwork, CompiledNetwork):
    """The chosen device's network, reporting the choice through EXECUTION_DEVICES."""

    plugin: AutoPlugin
    config: AutoConfiguration

    def __init__(
        self,
        plugin: AutoPlugin,
        config: AutoConfiguration,
        device: str,
        network: CompiledNetwork,
        measured: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(plugin, network.name, config)
        self.chosen = device
        self.network = network
        #: what AUTO measured to choose (AUTO_MEASUREMENTS; kept in the export, so a network
        #: from the cache still says why it runs where it does)
        self.measured = list(measured or [])

    def keep_states(self, pairs: Mapping[str, str]) -> None:
        """The chosen device's network keeps them: its requests are the ones that run."""
        self.network.keep_states(pairs)
        self.state_pairs = dict(pairs)

    def create_infer_request(self) -> AutoInferRequest:
        return AutoInferRequest(self, self.network.create_infer_request())

    def export(self) -> bytes:
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            self.network.export(),
            {"network_name": self.name, "device": self.chosen, "measured": self.measured},
        )

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "EXECUTION_DEVICES", "AUTO_MEASUREMENTS"]

    def _metric(self, name: str) -> Any:
        if name == "EXECUTION_DEVICES":
            return [self.chosen]
        if name == "AUTO_MEASUREMENTS":
            return self.measured
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.network.get_metric(name)
        return super()._metric(name)

    def get_config(self, key: str) -> Any:
        if key in self.config:
            return self.config.get(key)
        return self.network.get_config(key)

    def close(self) -> None:
        close_quietly(self.network)


def close_quietly(network: CompiledNetwork) -> None:
    """Close a device's network that MULTI or AUTO is letting go of; a failure to close it
    is not the caller's failure (the load or close under way goes on)."""
    with contextlib.suppress(Exception):
        network.close()
