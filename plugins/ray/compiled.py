"""RAY's compiled network: a handle on the actor that holds the network on its node.

Its streams are the node's network's (``OPTIMAL_NUMBER_OF_INFER_REQUESTS`` there), so the
server's executor keeps as many runs in flight as the node runs at once, each a thread here
waiting on its remote call. The export is the node device's own blob, kept in the object
store of the node that made it (the caller owns the reference) and fetched only when asked
for, wrapped in RAY's header so it imports on RAY again (on any node).

A network whose node was lost is compiled again when a node of the same name is alive again
(Ray gives it a new id: a machine restarted, a pod rescheduled under its name): the first
request that finds the actor dead looks (at most once a second), and when the node is back
compiles the model there in the background from the bytes this network keeps (the model as
it was loaded; an imported network re-imports its blob, kept in this process's object store),
then swaps the new actor in. Until then its requests fail UNAVAILABLE at once, and MULTI sets
the node aside meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, Unsupported
from plugserve.plugins.ray.config import RayConfiguration
from plugserve.plugins.ray.request import RayInferRequest
from plugserve.plugins.threads import start_daemon

if TYPE_CHECKING:
    from plugserve.plugins.ray.plugin import RayPlugin

__all__ = ["RayCompiledNetwork"]

log = logging.getLogger(__name__)

#: a lost actor's node is looked for at most this often (a GCS call)
_LOOK_S = 1.0


class RayCompiledNetwork(CompiledNetwork):
    plugin: RayPlugin

    def __init__(
        self,
        plugin: RayPlugin,
        config: RayConfiguration,
        actor: Any,
        info: dict[str, Any],
        exported: Any,
        node_id: str | None,
        data: bytes | None,
    ) -> None:
        super().__init__(plugin, info["name"], config)
        self.actor = actor
        self._inputs = list(info["inputs"])
        self._outputs = list(info["outputs"])
        self.streams = int(info["streams"])
        self.open_ended = bool(info["open_ended"])
        self._precision = str(info["precision"])
        #: the node it runs on, by name (its device id)
        self.node = str(info["node"])
        self.where = f"network {self.name} on node {self.node}"
        self.inner = str(config.get("RAY_DEVICE"))
        self.inner_name = str(info["full_name"])
        self.call_timeout = float(config.get("RAY_CALL_TIMEOUT_S"))
        #: the node device's export in the object store (None: it cannot export)
        self.exported = exported
        #: the node's Ray id (None: placed by Ray), which changes when a node comes back
        self.node_id = node_id
        #: the model as loaded (None: imported), to compile it again on a node come back
        self.data = data
        self._revive = threading.Lock()
        self._looked = 0.0
        self._closed = False

    @property
    def precision(self) -> str:
        return self._precision

    def create_infer_request(self) -> RayInferRequest:
        return RayInferRequest(self)

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "EXECUTION_DEVICES", "NODE"]

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.streams
        if name == "EXECUTION_DEVICES":
            return [f"{self.inner} on {self.node}"]
        if name == "NODE":
            return self.node
        return super()._metric(name)

    def export(self) -> bytes:
        if self.exported is None:
            raise Unsupported(f"{self.where}: device {self.inner} cannot export it")
        payload = self.plugin.fetch(self.exported, self.where, self.call_timeout)
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            payload,
            {"network_name": self.name, "device": self.inner},
        )

    def revive(self) -> None:
        """The actor was found dead: when its node is alive again (a new id under the same
        name; for a network Ray placed, any node), the network is compiled there again in
        the background (bounded by RAY_LOAD_TIMEOUT_S) and its actor replaced. Requests never
        wait for it: they fail UNAVAILABLE until the new actor is in place. One compile at a
        time, one look a second."""
        now = time.monotonic()
        if now - self._looked < _LOOK_S or not self._revive.acquire(blocking=False):
            return
        self._looked = now
        if self._node_back() and not self._closed:
            start_daemon(f"RAY/{self.name}-revive", self._recompile)
        else:
            self._revive.release()

    def _node_back(self) -> bool:
        """Whether the lost actor's node is alive again: a node of its name under a new id
        (a network Ray placed may go anywhere)."""
        if not self.config.get("DEVICE_ID"):
            return True
        try:
            node = self.plugin.nodes().get(self.node)
        except Exception:  # the GCS unreachable too: look again later
            return False
        return node is not None and node["NodeID"] != self.node_id

    def _recompile(self) -> None:
        """(:meth:`revive`'s thread, holding its lock.)"""
        try:
            exported = None if self.data is not None else self.exported
            timeout = float(self.config.get("RAY_LOAD_TIMEOUT_S"))
            actor, _info, exported, node_id = self.plugin.start(
                self.config, self.name, self.data, exported, timeout, reuse=False
            )
            lost, self.actor = self.actor, actor
            self.node_id, self.exported = node_id, exported
        except Exception as exc:
            log.warning("%s: not compiled again on its node: %s", self.where, exc)
            return
        finally:
            self._revive.release()
        self.plugin.release(lost)
        if self._closed:  # closed meanwhile: the new actor goes too
            self.plugin.release(actor)
            return
        log.warning("%s: its node came back; the network is compiled there again", self.where)

    def close(self) -> None:
        self._closed = True
        super().close()
        self.plugin.release(self.actor)
