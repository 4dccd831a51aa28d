"""NUMPY's compiled network: the transformed graph and its plan (streams: see the base class)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork
from plugserve.plugins.ir import Graph
from plugserve.plugins.numpy.config import NumpyConfiguration
from plugserve.plugins.numpy.engine import Plan
from plugserve.plugins.numpy.request import NumpyInferRequest

if TYPE_CHECKING:
    from plugserve.plugins.numpy.plugin import NumpyPlugin

__all__ = ["NumpyCompiledNetwork"]


class NumpyCompiledNetwork(CompiledNetwork):
    plugin: NumpyPlugin

    def __init__(
        self,
        plugin: NumpyPlugin,
        config: NumpyConfiguration,
        original: Graph,
        transformed: Graph,
        plan: Plan,
    ) -> None:
        super().__init__(plugin, original.name, config)
        self._inputs = list(original.inputs)
        self._outputs = list(original.outputs)
        self.output_names = [o.name for o in self._outputs]
        self.transformed = transformed
        self.plan = plan
        #: OpenBLAS threads each request runs with (see ``blas.py``), decided once here.
        self.blas_threads = config.threads_per_stream()

    def create_infer_request(self) -> NumpyInferRequest:
        return NumpyInferRequest(self)

    def export(self) -> bytes:
        model = self.transformed.to_model()
        extra: dict[str, Any] = {
            "network_name": self.name,
            "inputs": [s.name for s in self._inputs],
            "outputs": [s.name for s in self._outputs],
            "absorbed": self.transformed.absorbed,
        }
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            model.SerializeToString(),
            extra,
        )
