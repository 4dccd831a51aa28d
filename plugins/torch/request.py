"""TORCH's and GPU's infer request: the program over the checked inputs, each node's time
kept when PERF_COUNT is on. On a GPU (and on the CPU with CUDA_GRAPHS) it runs on its
:class:`~.graphs.Lane`: the stream executor's own CUDA stream, pinned buffers and graphs; the run
waits for its own stream only. Inputs in a client's GPU memory and outputs wanted there
(Triton's CUDA shared memory: ``plugins/cuda_array.py``) are copied device to device by the
lane. Where a node indexes with client data (Gather, Scatter...), the request owns a bounds
flag on the card (ops/bounds.py) that its index checks raise without a synchronisation; read
after the run's own, a raised flag refuses the request INVALID_ARGUMENT naming the node."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import InferRequest, PerfCount
from plugserve.plugins.run_context import RunContext
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
        # its stream, pinned buffers and graphs (a PyTorch program's too: run whole, as one
        # step, captured where capture works)
        with bounds.active(self._bounds):
            self._lane = lanes.lane_for(network)

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        return self._execute(arrays, run.warmup, self._sinks(run))

    def _run(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        """A run started with ``start_async``: told nothing, none of its outputs is wanted in
        a client's GPU memory."""
        return self._execute(arrays, False, None)

    def _execute(
        self, arrays: list[Any], warmup: bool, sinks: dict[int, Any] | None
    ) -> dict[str, np.ndarray]:
        """The run; a warm-up's (``model_warmup``) shape is captured at once; ``sinks``: the
        outputs to copy into a client's GPU memory (:meth:`_sinks`)."""
        program = self.network.program
        start = time.perf_counter()
        out_of_range = None
        # activations charged before the run; by the lane when there is one: not for a replay
        # of a captured graph, whose memory pool is charged while it lives (graphs.Lane._entry)
        lane = self._lane
        with devmem.charged(self.network, arrays, deferred=lane is not None) as charge:
            if lane is not None:
                with bounds.active(self._bounds):
                    outputs = lane.run(arrays, sinks, at_once=warmup, charge=charge.take)
                if self._bounds is not None:  # after the lane's synchronisation: 8 bytes
                    out_of_range = self._bounds.take(lane.stream)
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

    def _sinks(self, run: RunContext) -> dict[int, Any] | None:
        """The outputs the run's request wants in a client's GPU memory, by output index
        (``run.cuda_outputs``): the lane copies them there device to device."""
        wanted = run.cuda_outputs
        if not wanted:
            return None
        return {i: wanted[n] for i, n in enumerate(self.network.output_names) if n in wanted}

    def get_performance_counts(self) -> list[PerfCount]:
        self._require_perf_counts()
        return list(self._counts)
