"""TORCH's and GPU's infer request: the program over the checked inputs, each node's time
kept when PERF_COUNT is on. On a GPU (and on the CPU with CUDA_GRAPHS) it runs on its
:class:`~.graphs.Lane`: the stream executor's own CUDA stream, pinned buffers and graphs; the run
waits for its own stream only. Where a node indexes with client data (Gather, Scatter...), the
request owns a bounds flag on the card (ops/bounds.py) that its index checks raise without a
synchronisation; read after the run's own, a raised flag refuses the request INVALID_ARGUMENT
naming the node."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import InferRequest, PerfCount
from plugserve.plugins.torch import devmem
from plugserve.plugins.torch import graphs as lanes
from plugserve.plugins.torch.ops import bounds

if TYPE_CHECKING:
    from plugserve.plugins.torch.compiled import TorchCompiledNetwork

__all__ = ["TorchInferRequest"]


class TorchInferRequest(InferRequest):
    network: TorchCompiledNetwork

    def __init__(self, network: TorchCompiledNetwork) -> None:
        super().__init__(network)
        self._perf = bool(network.config.get("PERF_COUNT"))
        self._counts: list[PerfCount] = []
        program = network.program
        #: on CUDA, where a node indexes with data: the flag its index checks raise
        #: (ops/bounds.py), read after the run's synchronisation; set before the lane, whose
        #: listed shapes are captured now and must write into it
        self._bounds: bounds.BoundsFlag | None = None
        if network.torch_device.type == "cuda" and getattr(program, "checks_bounds", False):
            self._bounds = bounds.BoundsFlag(program.torch, network.torch_device)
        with bounds.active(self._bounds):
            self._lane = lanes.lane_for(network)  # its stream, pinned buffers and graphs
        self._stream: Any = None
        if self._lane is None and network.torch_device.type == "cuda":
            # a PyTorch program (no lane: its steps are its own): a CUDA stream of its own
            self._stream = network.program.torch.cuda.Stream(device=network.torch_device)

    def _run(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        program = self.network.program
        start = time.perf_counter()
        out_of_range = None
        with devmem.charged(self.network, arrays):  # activations charged before the run
            if self._lane is not None:
                with bounds.active(self._bounds):
                    outputs = self._lane.run(arrays)
                if self._bounds is not None:  # after the lane's synchronisation: 8 bytes
                    out_of_range = self._bounds.take(self._lane.stream)
            elif self._stream is not None:
                with program.torch.cuda.stream(self._stream):
                    outputs = program.run(arrays)
            else:
                outputs = program.run(arrays)
        if out_of_range is not None:  # computed with the indices replaced: dropped
            raise bounds.refused(out_of_range)
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
