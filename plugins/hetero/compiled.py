"""HETERO's compiled network: one compiled network per subgraph, run in topological order."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, TensorSpec, joined_precision
from plugserve.plugins.hetero.config import HeteroConfiguration
from plugserve.plugins.hetero.request import HeteroInferRequest
from plugserve.plugins.outputcheck import expectations, static

if TYPE_CHECKING:
    from plugserve.plugins.hetero.plugin import HeteroPlugin

__all__ = ["HeteroCompiledNetwork", "Step"]


@dataclasses.dataclass
class Step:
    device: str
    network: CompiledNetwork
    node_names: list[str]
    inputs: list[str]
    outputs: list[str]
    #: value -> the node of this piece that makes it (known for pieces loaded, not imported)
    producers: dict[str, str] = dataclasses.field(default_factory=dict)


class HeteroCompiledNetwork(CompiledNetwork):
    plugin: HeteroPlugin

    def __init__(
        self,
        plugin: HeteroPlugin,
        name: str,
        config: HeteroConfiguration,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        steps: list[Step],
        constants: dict[str, np.ndarray],
    ) -> None:
        super().__init__(plugin, name, config)
        self._inputs = inputs
        self._outputs = outputs
        self.input_names = [s.name for s in inputs]
        self.output_names = [s.name for s in outputs]
        self.steps = steps
        self.constants = constants  # graph outputs that are initializers
        #: per step, what each value it hands on must be (outputcheck.py): a device's wrong
        #: answer is an error naming it, never passed on
        dims_too = static(inputs)
        self.checks = [expectations(step.network.outputs, dims_too) for step in steps]
        self.open_ended = any(step.network.open_ended for step in steps)

    def create_infer_request(self) -> HeteroInferRequest:
        return HeteroInferRequest(self)

    @property
    def precision(self) -> str:
        return joined_precision(step.network for step in self.steps)

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "HETERO_SUBGRAPHS", "EXECUTION_DEVICES"]

    def _metric(self, name: str) -> Any:
        if name == "HETERO_SUBGRAPHS":
            return [{"device": s.device, "nodes": list(s.node_names)} for s in self.steps]
        if name == "EXECUTION_DEVICES":
            return list(dict.fromkeys(s.device for s in self.steps))
        return super()._metric(name)

    def export(self) -> bytes:
        payload = {
            "name": self.name,
            "inputs": [_spec_json(s) for s in self._inputs],
            "outputs": [_spec_json(s) for s in self._outputs],
            "steps": [
                {
                    "device": s.device,
                    "nodes": s.node_names,
                    "inputs": s.inputs,
                    "outputs": s.outputs,
                    "blob": base64.b64encode(s.network.export()).decode(),
                }
                for s in self.steps
            ],
            "constants": {
                k: {
                    "dtype": v.dtype.str,
                    "shape": list(v.shape),
                    "data": base64.b64encode(v.tobytes()).decode(),
                }
                for k, v in self.constants.items()
            },
        }
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            json.dumps(payload).encode(),
        )

    def close(self) -> None:
        super().close()
        for step in self.steps:
            step.network.close()


def _spec_json(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "dtype": None if spec.dtype is None else np.dtype(spec.dtype).str,
        "shape": None if spec.shape is None else list(spec.shape),
        "kind": spec.kind,
    }


def spec_from_json(data: dict[str, Any]) -> TensorSpec:
    dtype = None if data["dtype"] is None else np.dtype(data["dtype"])
    shape = None if data["shape"] is None else tuple(data["shape"])
    return TensorSpec(data["name"], dtype, shape, str(data.get("kind", "tensor")))
