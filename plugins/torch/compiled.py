"""TORCH's and GPU's compiled network: the converted program, on one device, in one
precision. Its export is the validated ONNX model with the precision it was compiled for;
import converts it again (converting is fast: no tuning to keep)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, Configuration, TensorSpec
from plugserve.plugins.torch.graphs import GraphCounters, listed_inputs, parse_shapes
from plugserve.plugins.torch.program import Program
from plugserve.plugins.torch.request import TorchInferRequest

if TYPE_CHECKING:
    from plugserve.plugins.torch.plugin import TorchPlugin

__all__ = ["TorchCompiledNetwork"]


class TorchCompiledNetwork(CompiledNetwork):
    plugin: TorchPlugin

    def __init__(
        self,
        plugin: TorchPlugin,
        config: Configuration,
        name: str,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        program: Program,
        model: bytes,
        precision: str,
        device: Any,
    ) -> None:
        super().__init__(plugin, name, config)
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self.output_names = [o.name for o in outputs]
        self.program = program
        self.model = model  # the validated ONNX model, for export
        self._precision = precision
        self.torch_device = device
        self.open_ended = False  # control flow is never converted
        self.graph_counters = GraphCounters()  # its requests' lanes count here (.graphs)
        listed_inputs(self, parse_shapes(config.get("CUDA_GRAPH_SHAPES") or ""))  # checked now

    @property
    def precision(self) -> str:
        return self._precision

    def graph_statistics(self) -> dict[str, int]:
        """Its requests' graph events: shapes captured, replays, evictions, failed captures
        (``plugserve_graph_events`` on /metrics)."""
        return self.graph_counters.snapshot()

    def create_infer_request(self) -> TorchInferRequest:
        return TorchInferRequest(self)

    def export(self) -> bytes:
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            self.model,
            {"network_name": self.name, "precision": self._precision},
        )
