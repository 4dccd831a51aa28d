"""The RAY device: a network compiled and run on a node of a Ray cluster, by a device of the
plugserve installed there, as any device runs one here.

``RAY`` lists the cluster's alive nodes as its device ids (``AVAILABLE_DEVICES``): a node's
Ray name (``ray start --node-name``; Ray's default is its IP address) with every character
other than letters, digits and ``_`` made ``_`` (``10.0.0.2`` is ``RAY.10_0_0_2``); the first
8 or more hex digits of its node id name it too. A network loaded on ``RAY.<id>`` runs in an
actor pinned to that node (``NodeAffinitySchedulingStrategy``, not soft); on ``RAY`` alone, Ray
places it. The actor (``actor.py``) builds ``RAY_DEVICE`` (default NUMPY) from its own
plugins and compiles the model there; the network's export, when that device can make one,
stays in that node's object store under a reference this process owns, and a load of the same
model, device and config on another node imports it from there instead of compiling again
(at most :data:`KEPT_EXPORTS` are kept). So ``MULTI:RAY.a,RAY.b`` spreads requests over two
machines, and ``HETERO:RAY.a,NUMPY`` splits a graph between a node and this process.

Everything below is Ray's: membership (``ray.nodes()``), placement, transport, the object
store; nothing here routes, schedules or distributes.

The backend is checked when the plugin is made (the seed's rule): ``ray`` must import, and
this process must be in a Ray cluster already (a Serve replica, a Ray job) or join the one
``RAY_ADDRESS`` names; else the device is unavailable with the reason, and nothing changes
where Ray is not installed. QueryNetwork asks ``RAY_DEVICE`` of this process (the same
plugserve, so the same answer as on the node).

Every remote call is bounded: a load by ``RAY_LOAD_TIMEOUT_S``, a run by
``RAY_CALL_TIMEOUT_S`` and by its own deadline (``request.py``). An actor whose node died or
was declared dead fails its calls at once; all of these are UNAVAILABLE, so MULTI sets the
node aside for the requests that follow (``UNAVAILABLE_BACKOFF_S``), and with
``RUNTIME_FALLBACK=YES`` runs the failed request again on its next device.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    BackendUnavailable,
    InferenceError,
    Model,
    NotFound,
    Plugin,
    PlugserveError,
    Unsupported,
)
from plugserve.plugins.ir import read_model
from plugserve.plugins.model_copies import serialized
from plugserve.plugins.ray.actor import NetworkActor, device_id
from plugserve.plugins.ray.compiled import RayCompiledNetwork
from plugserve.plugins.ray.config import INNER_KEYS, RayConfiguration

__all__ = ["KEPT_EXPORTS", "RayPlugin"]

log = logging.getLogger(__name__)

#: Exports kept in the object store for loads of the same model elsewhere (each holds its
#: bytes in the memory of the node that made it, until dropped here, least recently used
#: first).
KEPT_EXPORTS = 8
#: An actor runs this many calls at once beyond its network's streams (cancel, counts).
_CONTROL_CALLS = 2
#: Most calls one actor runs at once (its threads).
_MOST_CONCURRENCY = 64
#: How often a load under way looks whether its caller is gone.
_LOAD_POLL_S = 0.5


class RayPlugin(Plugin):
    name = "RAY"
    config_class = RayConfiguration
    architecture = "ray"
    cancellation = (
        "as RAY_DEVICE on the node, which the caller tells at once; a node that does not "
        "answer fails the run UNAVAILABLE after RAY_CALL_TIMEOUT_S"
    )
    CAPABILITIES = ("EXPORT_IMPORT",)

    def __init__(self) -> None:
        super().__init__()
        try:
            import ray
        except ImportError as exc:
            raise BackendUnavailable(
                f"ray cannot be imported ({exc}): pip install 'plugserve[ray]'"
            ) from None
        if not hasattr(ray, "remote"):  # a folder named ray on sys.path, not Ray
            raise BackendUnavailable(
                f"the module 'ray' at {list(ray.__path__)} is not Ray: pip install 'plugserve[ray]'"
            )
        import ray.exceptions
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "")
            if not address:
                raise BackendUnavailable(
                    "this process is in no Ray cluster: set RAY_ADDRESS=HEAD:6379 to join "
                    "one, or run plugserve as a Ray job or in a Serve replica"
                )
            try:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            except Exception as exc:  # ConnectionError, RuntimeError, ...: not usable here
                raise BackendUnavailable(
                    f"cannot join the Ray cluster at {address}: {exc}"
                ) from None
        self.ray = ray
        self.errors = ray.exceptions
        self.affinity = NodeAffinitySchedulingStrategy
        self.version = ray.__version__
        self.remote_class = ray.remote(NetworkActor)
        self._exports: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._exports_lock = threading.Lock()

    # --- the cluster's nodes

    def nodes(self) -> dict[str, dict[str, Any]]:
        """The alive nodes by device id, as Ray's GCS lists them."""
        return {device_id(n["NodeName"]): n for n in self.ray.nodes() if n.get("Alive")}

    def _place(self, ident: str) -> tuple[str | None, str, float]:
        """``(node id or None, device id, the node's CPUs)`` for a device id ('': anywhere)."""
        nodes = self.nodes()
        if not ident:
            return None, "", 0.0
        node = nodes.get(ident)
        if node is None and len(ident) >= 8:
            matches = [n for n in nodes.values() if n["NodeID"].startswith(ident.lower())]
            node = matches[0] if len(matches) == 1 else None
        if node is None:
            raise NotFound(
                f"device RAY.{ident}: no alive node of that name in the Ray cluster; "
                f"nodes: {', '.join(sorted(nodes)) or 'none'}"
            )
        name = device_id(node["NodeName"])
        return node["NodeID"], name, float(node.get("Resources", {}).get("CPU", 0))

    # --- networks

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> RayCompiledNetwork:
        cfg = self.merged_config(config)
        proto, _ = read_model(model)  # external data inlined here: the node has no files
        return self._compile(cfg, proto.graph.name or "model", data=serialized(proto))

    def import_network(
        self, blob: bytes, config: Mapping[str, Any] | None = None
    ) -> RayCompiledNetwork:
        header, payload, cfg = self._unpack(blob, config)
        if header.get("device") not in (None, cfg.get("RAY_DEVICE")):
            raise Unsupported(
                f"exported network was made by RAY_DEVICE={header['device']}: import it with "
                "that RAY_DEVICE"
            )
        name = str(header.get("network_name") or "model")
        return self._compile(cfg, name, exported=self.ray.put(payload))

    def _compile(
        self, cfg: RayConfiguration, name: str, data: bytes | None = None, exported: Any = None
    ) -> RayCompiledNetwork:
        started = self.start(cfg, name, data, exported, float(cfg.get("RAY_LOAD_TIMEOUT_S")))
        return RayCompiledNetwork(self, cfg, *started, data)

    def start(
        self,
        cfg: RayConfiguration,
        name: str,
        data: bytes | None,
        exported: Any,
        timeout: float,
        reuse: bool = True,
    ) -> tuple[Any, dict[str, Any], Any, str | None]:
        """A network's actor on its node, the model compiled there from ``data`` (or imported
        from ``exported``, or from an export kept of the same model when ``reuse``) within
        ``timeout``: ``(actor, its info, the export or None, the node's id)``."""
        node_id, node, cpus = self._place(str(cfg.get("DEVICE_ID")))
        inner = str(cfg.get("RAY_DEVICE"))
        inner_config = {k: cfg.get_string(k) for k in INNER_KEYS}
        where = f"network {name} on RAY.{node or '(placed by Ray)'} ({inner})"
        streams = int(cfg.get("NUM_STREAMS")) or (
            max(1, int(cpus)) if cfg.get("PERFORMANCE_HINT") == "THROUGHPUT" else 1
        )
        options: dict[str, Any] = {
            "num_cpus": 0,  # the node's device uses its cores; the actor reserves none
            "max_restarts": 0,  # a lost node's network is lost: its calls fail UNAVAILABLE
            "max_concurrency": min(_MOST_CONCURRENCY, streams + _CONTROL_CALLS),
        }
        if node_id is not None:
            options["scheduling_strategy"] = self.affinity(node_id, soft=False)
        actor = self.remote_class.options(**options).remote(inner, inner_config, node)
        key = ""
        how = "imported"
        try:
            if exported is None and data is not None:
                key = hashlib.sha256(
                    data + json.dumps([inner, inner_config], sort_keys=True).encode()
                ).hexdigest()
                exported = self._kept(key) if reuse else None
            if exported is not None:
                info = self._wait(actor.import_network.remote(exported), where, timeout)
            else:
                how = "compiled"
                info_ref, exported = actor.load.options(num_returns=2).remote(
                    self.ray.put(data), True
                )
                info = self._wait(info_ref, where, timeout)
                if key:
                    self._keep(key, exported)
        except BaseException:
            self.release(actor)
            raise
        log.info("%s: %s on node %s", where, how, info["node"])
        return actor, info, exported, node_id

    def _kept(self, key: str) -> Any:
        with self._exports_lock:
            ref = self._exports.get(key)
            if ref is not None:
                self._exports.move_to_end(key)
            return ref

    def _keep(self, key: str, ref: Any) -> None:
        with self._exports_lock:
            self._exports[key] = ref
            while len(self._exports) > KEPT_EXPORTS:
                self._exports.popitem(last=False)

    def _wait(self, ref: Any, where: str, timeout: float) -> Any:
        """``ray.get(ref)`` within ``timeout``, giving up when the load's caller is gone."""
        end = time.monotonic() + timeout
        while True:
            step = min(_LOAD_POLL_S, max(0.0, end - time.monotonic()))
            ready, _ = self.ray.wait([ref], timeout=step)
            if ready:
                return self.fetch(ref, where, timeout)
            cancel.check(f"load of {where}")
            if time.monotonic() >= end:
                raise BackendUnavailable(
                    f"{where}: not loaded within {timeout:g} s (RAY_LOAD_TIMEOUT_S): the node "
                    "is unreachable or has no room for the actor"
                )

    def fetch(self, ref: Any, where: str, timeout: float) -> Any:
        try:
            return self.ray.get(ref, timeout=timeout)
        except Exception as exc:
            raise self.failure(exc, where) from None

    def failure(self, exc: BaseException, where: str) -> PlugserveError:
        """A remote call's error as plugserve's: the node device's own typed error as it was
        raised there; a lost or unreachable actor UNAVAILABLE."""
        errors = self.errors
        if isinstance(exc, errors.RayTaskError):
            cause = exc.cause
            if isinstance(cause, PlugserveError):
                return type(cause)(str(cause))
            return InferenceError(f"{where}: {type(cause).__name__}: {cause}")
        if isinstance(exc, PlugserveError):
            return exc
        if isinstance(
            exc,
            errors.RayActorError
            | errors.ObjectLostError
            | errors.GetTimeoutError
            | errors.RaySystemError
            | errors.NodeDiedError,
        ):
            return BackendUnavailable(
                f"{where}: the node is lost or unreachable ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            )
        return InferenceError(f"{where}: {type(exc).__name__}: {exc}")

    @staticmethod
    def unreachable(where: str, timeout: float) -> BackendUnavailable:
        return BackendUnavailable(
            f"{where}: no answer within {timeout:g} s (RAY_CALL_TIMEOUT_S): the node is cut "
            "off or the run takes longer"
        )

    def release(self, actor: Any) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone with its node: nothing left to free
            log.debug("RAY: killing an actor: %s", exc)

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        cfg = self.merged_config(config, strict=False)
        inner = str(cfg.get("RAY_DEVICE"))
        devices = self.devices
        if devices is None or inner not in devices.available_devices:
            raise Unsupported(
                f"device RAY asks RAY_DEVICE={inner} of this process which nodes it runs, and "
                f"{inner} is not available here"
            )
        answer = devices.query_network(model, inner, {k: cfg.get_string(k) for k in INNER_KEYS})
        return {node: self.name for node in answer}

    # --- metrics

    def device_name(self) -> str:
        return f"Ray {self.version} cluster ({len(self.nodes())} nodes alive)"

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        if name == "AVAILABLE_DEVICES":
            return sorted(self.nodes())
        return super()._metric(name, options)
