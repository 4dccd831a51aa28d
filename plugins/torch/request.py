"""TORCH's and GPU's infer request: the program over the checked inputs, each node's time
kept when PERF_COUNT is on. On a GPU the run waits for its own work only (the outputs' copy to
the host), on the stream this request's thread runs on."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import InferRequest, PerfCount
from plugserve.plugins.torch import devmem

if TYPE_CHECKING:
    from plugserve.plugins.torch.compiled import TorchCompiledNetwork

__all__ = ["TorchInferRequest"]


class TorchInferRequest(InferRequest):
    network: TorchCompiledNetwork

    def __init__(self, network: TorchCompiledNetwork) -> None:
        super().__init__(network)
        self._perf = bool(network.config.get("PERF_COUNT"))
        self._counts: list[PerfCount] = []
        self._stream: Any = None
        device = network.torch_device
        if device.type == "cuda":  # one CUDA stream per request: a stream executor's own
            self._stream = network.program.torch.cuda.Stream(device=device)

    def _run(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        program = self.network.program
        start = time.perf_counter()
        with devmem.charged(self.network, arrays):  # activations charged before the run
            if self._stream is not None:
                with program.torch.cuda.stream(self._stream):
                    outputs = program.run(arrays)
            else:
                outputs = program.run(arrays)
        if self._perf:
            self._counts = [
                PerfCount(
                    self.network.name,
                    "Program",
                    "EXECUTED",
                    f"torch {program.device.type}",
                    time.perf_counter() - start,
                    self.network.device,
                )
            ]
        return dict(zip(self.network.output_names, outputs))

    def get_performance_counts(self) -> list[PerfCount]:
        self._require_perf_counts()
        return list(self._counts)
