"""TORCH's and GPU's compiled network: the converted program, on one device, in one
precision. Its export is the validated ONNX model (or the PyTorch program's archive, its
``program`` kind in the header) with the precision it was compiled for; import converts or
loads it again (converting is fast: no tuning to keep)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, Configuration, TensorSpec
from plugserve.plugins.torch import devmem
from plugserve.plugins.torch.devmem import Activations, DeviceMemory
from plugserve.plugins.torch.graphs import GraphCounters, listed_inputs, parse_shapes
from plugserve.plugins.torch.program import Program
from plugserve.plugins.torch.programs import EXPORT, TORCHSCRIPT, TorchProgram
from plugserve.plugins.torch.request import TorchInferRequest

if TYPE_CHECKING:
    from plugserve.plugins.torch.plugin import TorchPlugin

__all__ = ["TorchCompiledNetwork"]

#: the platform a program's metadata names: Triton's for TorchScript; a .pt2 of torch.export
#: is not what Triton's ``torch_aoti`` runs (AOTInductor's), so it is named for what it is
PLATFORMS = {TORCHSCRIPT: "pytorch_libtorch", EXPORT: "torch_export"}


class TorchCompiledNetwork(CompiledNetwork):
    plugin: TorchPlugin

    def __init__(
        self,
        plugin: TorchPlugin,
        config: Configuration,
        name: str,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        program: Program | TorchProgram,
        model: bytes,
        precision: str,
        device: Any,
    ) -> None:
        super().__init__(plugin, name, config)
        self._inputs = list(inputs)
        self._outputs = list(outputs)
        self.output_names = [o.name for o in outputs]
        self.program = program
        self.model = model  # the validated ONNX model or the program's archive, for export
        self._precision = precision
        self.torch_device = device
        # an ONNX graph's control flow is never converted; a program's own (TorchScript's
        # loops, a .pt2's) may run as long as its data says
        self.open_ended = isinstance(program, TorchProgram)
        #: Triton's platform name of a PyTorch program (KServe metadata reports it)
        self.platform = PLATFORMS.get(program.kind, "") if isinstance(program, TorchProgram) else ""
        #: the device's memory budget and this network's activation estimate (devmem.py),
        #: set by the plugin's compile
        self.memory: DeviceMemory | None = None
        self.activations: Activations | None = None
        self.graph_counters = GraphCounters()  # its requests' lanes count here (.graphs)
        listed_inputs(self, parse_shapes(config.get("CUDA_GRAPH_SHAPES") or ""))  # checked now

    def cuda_inputs(self) -> int | None:
        """The GPU whose memory this network takes inputs from without a host copy
        (``plugins/cuda_array.py``: a client's CUDA shared memory): a converted ONNX network
        on CUDA, whose lane copies them device to device; None on the CPU and for a PyTorch
        program (its inputs come as host arrays)."""
        device = self.torch_device
        if getattr(device, "type", "") != "cuda" or not isinstance(self.program, Program):
            return None
        return device.index or 0

    @property
    def precision(self) -> str:
        return self._precision

    def ready(self) -> bool:
        """Not once its device has failed (a sticky CUDA error: devmem's module docstring)."""
        return devmem.device_failure(self.torch_device) is None

    def unready_reasons(self) -> list[str]:
        reason = devmem.device_failure(self.torch_device)
        if reason is None:
            return []
        return [
            f"model {self.name!r}: {devmem.device_name(self.torch_device)} failed (a sticky "
            f"CUDA error: {reason[:200]}); restart the server"
        ]

    def graph_statistics(self) -> dict[str, int]:
        """Its requests' graph events: shapes captured, replays, evictions, failed captures
        (``plugserve_graph_events`` on /metrics)."""
        return self.graph_counters.snapshot()

    def cuda_graphs(self) -> int:
        return int(self.config.get("CUDA_GRAPHS") or 0)

    def create_infer_request(self) -> TorchInferRequest:
        return TorchInferRequest(self)

    def export(self) -> bytes:
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            self.model,
            {
                "network_name": self.name,
                "precision": self._precision,
                # a PyTorch program's kind: import loads it whole
                "program": self.program.kind if isinstance(self.program, TorchProgram) else "",
            },
        )
