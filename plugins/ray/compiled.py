"""RAY's compiled network: a handle on the actor that holds the network on its node.

Its streams are the node's network's (``OPTIMAL_NUMBER_OF_INFER_REQUESTS`` there), so the
server's executor keeps as many runs in flight as the node runs at once, each a thread here
waiting on its remote call. The export is the node device's own blob, kept in the object
store of the node that made it (the caller owns the reference) and fetched only when asked
for, wrapped in RAY's header so it imports on RAY again (on any node).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, Unsupported
from plugserve.plugins.ray.config import RayConfiguration
from plugserve.plugins.ray.request import RayInferRequest

if TYPE_CHECKING:
    from plugserve.plugins.ray.plugin import RayPlugin

__all__ = ["RayCompiledNetwork"]


class RayCompiledNetwork(CompiledNetwork):
    plugin: RayPlugin

    def __init__(
        self,
        plugin: RayPlugin,
        config: RayConfiguration,
        actor: Any,
        info: dict[str, Any],
        exported: Any,
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

    def close(self) -> None:
        super().close()
        self.plugin.release(self.actor)
