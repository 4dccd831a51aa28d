"""What runs on the node: one Ray actor per network, holding the network compiled by a
device plugin of the plugserve installed there.

The actor builds its device itself from the ``plugserve.plugins`` entry points (as the Core
discovers them), so nothing of the server travels and the node needs only plugserve and its
backend. It compiles the model (or imports a blob exported elsewhere, fetched through the
object store) and runs checked inputs on a pool of infer requests, one per stream of the
network (``OPTIMAL_NUMBER_OF_INFER_REQUESTS``); the actor runs that many calls at once, plus
one for control calls (cancel, counts). Each run comes with its run context as plain values
(``run_context.to_wire``) and runs under the context rebuilt from it, with a
:class:`cancel.Token` of its own registered under the caller's cancellation id, so a cancel
from the caller stops it at its device's next checkpoint.

Runs are counted per network in Ray's own metrics (``plugserve_ray_device_runs``, tagged with
the node's name, the network's and the run's outcome: ok, cancelled or failed), which each
node's metrics agent exports: where requests ran, and that a cancelled one stopped there, is
read from the nodes themselves.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from importlib.metadata import entry_points
from typing import Any

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Cancelled,
    CompiledNetwork,
    InferRequest,
    InvalidArgument,
    NotFound,
    Plugin,
    PlugserveError,
)
from plugserve.plugins.run_context import from_wire

__all__ = ["NetworkActor", "device_id", "device_plugin"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "plugserve.plugins"
#: devices made of others: they need a Core's devices, which an actor has not
_VIRTUAL = ("HETERO", "MULTI", "AUTO", "BATCH", "RAY")


def device_plugin(name: str) -> Plugin:
    """The plugin of device ``name``, made from its entry point (as the Core makes it)."""
    if name in _VIRTUAL:
        raise InvalidArgument(
            f"RAY_DEVICE={name}: a virtual device cannot run inside the RAY device's actor; "
            "name a real one (NUMPY, ORT, OPENVINO) and compose RAY devices with MULTI or HETERO"
        )
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name.upper() == name]
    if not found:
        raise NotFound(f"RAY_DEVICE={name}: no such device plugin is installed on this node")
    return found[0].load()()


_NOT_ID = re.compile(r"[^A-Za-z0-9_]")


def device_id(node_name: str) -> str:
    """A node's device id: its Ray name with every other character than letters, digits and
    ``_`` made ``_`` (device ids are ``[A-Za-z0-9_]+``)."""
    return _NOT_ID.sub("_", node_name) or "node"


def _this_node() -> str:
    """The device id of the node this actor runs on."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == here:
            return device_id(node["NodeName"])
    return here[:8]


class NetworkActor:
    """One compiled network on a node (the plugin wraps this class with ``ray.remote``)."""

    def __init__(self, device: str, config: dict[str, str], node: str) -> None:
        self.device = device
        self.config = config
        self.node = node
        self.plugin: Plugin | None = None
        self.network: CompiledNetwork | None = None
        self.requests: queue.SimpleQueue[InferRequest] = queue.SimpleQueue()
        self.running: dict[str, cancel.Token] = {}
        self.lock = threading.Lock()
        self.runs = 0
        self.counter: Any = None

    # --- loading

    def load(self, model: bytes, export: bool) -> tuple[dict[str, Any], bytes | None]:
        """Compile ``model``; its description, and its export when asked and the device can
        (returned as a second object, which stays in this node's object store until read)."""
        self.plugin = device_plugin(self.device)
        self.network = self.plugin.load_network(model, self.config)
        return self._info(), self._export() if export else None

    def import_network(self, blob: bytes) -> dict[str, Any]:
        self.plugin = device_plugin(self.device)
        self.network = self.plugin.import_network(blob, self.config)
        return self._info()

    def _export(self) -> bytes | None:
        assert self.plugin is not None and self.network is not None
        try:
            if not self.plugin.get_metric("IMPORT_EXPORT_SUPPORT"):
                return None
            return self.network.export()
        except PlugserveError as exc:  # the network still serves; only shipping it is lost
            log.warning("network %s: not exported (%s)", self.network.name, exc)
            return None

    def _info(self) -> dict[str, Any]:
        network = self.network
        assert network is not None
        if not self.node:  # placed by Ray: the node it landed on names it
            self.node = _this_node()
        streams = max(1, int(network.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))
        self._count_runs(network.name)
        return {
            "name": network.name,
            "inputs": list(network.inputs),
            "outputs": list(network.outputs),
            "precision": network.precision,
            "streams": streams,
            "open_ended": network.open_ended,
            "node": self.node,
            "full_name": str(network.plugin.get_metric("FULL_DEVICE_NAME")),
        }

    def _count_runs(self, network: str) -> None:
        try:
            from ray.util.metrics import Counter

            self.counter = Counter(
                "plugserve_ray_device_runs",
                description="runs of networks loaded on the RAY device, on this node",
                tag_keys=("node", "network", "outcome"),
            )
            self.counter.set_default_tags({"node": self.node, "network": network})
        except Exception as exc:  # metrics are a courtesy: the network serves without them
            log.warning("RAY device: no run counter on node %s (%s)", self.node, exc)

    # --- running

    def infer(self, arrays: list[Any], wire: dict[str, Any]) -> dict[str, Any]:
        """Run checked inputs (the caller's device checked them against the same specs) under
        the run context the caller sent (``run_context.to_wire``), rebuilt here with a token
        of this node's, registered under the run's cancellation id."""
        network = self.network
        assert network is not None
        token = cancel.Token()
        run = wire["cancel"]
        told = from_wire(wire, token)
        with self.lock:
            self.running[run] = token
        try:
            request = self.requests.get_nowait()
        except queue.Empty:
            request = network.create_infer_request()
        outcome = "failed"
        try:
            outputs = request.infer_checked(arrays, told)
            outcome = "ok"
        except Cancelled:
            outcome = "cancelled"
            raise
        finally:
            token.finish()
            if told.trace is not None:
                told.trace.end()
            self.requests.put(request)
            with self.lock:
                self.running.pop(run, None)
                self.runs += 1
            if self.counter is not None:
                self.counter.inc(tags={"outcome": outcome})
        return outputs

    def cancel(self, run: str, why: str) -> None:
        with self.lock:
            token = self.running.get(run)
        if token is not None:
            token.cancel(Cancelled(why))

    def runs_made(self) -> int:
        return self.runs

    def close(self) -> None:
        if self.network is not None:
            self.network.close()
