"""NUMPY's compiled network: the transformed graph, its plan and the kernel choices timed for it
(streams: see the base class)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, PlugserveError
from plugserve.plugins.ir import Graph
from plugserve.plugins.numpy import parallel
from plugserve.plugins.numpy.blas import set_thread_count
from plugserve.plugins.numpy.config import NumpyConfiguration
from plugserve.plugins.numpy.engine import Plan
from plugserve.plugins.numpy.request import NumpyInferRequest
from plugserve.plugins.numpy.tuning import Tuner

if TYPE_CHECKING:
    from plugserve.plugins.numpy.plugin import NumpyPlugin

__all__ = ["NumpyCompiledNetwork"]

#: Ops whose kernels run BLAS GEMMs: a network with none has no threading to choose.
_GEMM_OPS = frozenset(
    {"Conv", "FusedConv", "FusedConvPool", "Gemm", "FusedGemm", "MatMul", "FusedMatMul",
     "Linear", "Attention", "ConvTranspose", "QLinearConv", "ConvInteger", "MatMulInteger"}
)  # fmt: skip
#: Timed runs per threading mode after one untimed round.
_THREADING_ROUNDS = 3


class NumpyCompiledNetwork(CompiledNetwork):
    plugin: NumpyPlugin

    def __init__(
        self,
        plugin: NumpyPlugin,
        config: NumpyConfiguration,
        original: Graph,
        transformed: Graph,
        plan: Plan,
        tuner: Tuner,
    ) -> None:
        super().__init__(plugin, original.name, config)
        self._inputs = list(original.inputs)
        self._outputs = list(original.outputs)
        self.output_names = [o.name for o in self._outputs]
        self.transformed = transformed
        self.plan = plan
        #: threads each request splits its large GEMMs over (see ``parallel.py``)
        self.gemm_threads = config.threads_per_stream()
        #: the kernel choices timed on this machine (``tuning.py``)
        self.tuner = tuner

    def use_threads(self) -> None:
        """Set up the calling thread for a run of this network: who splits its GEMMs."""
        if self.tuner.threading == "openblas":
            set_thread_count(self.gemm_threads)
            parallel.use_threads(1)
        else:
            set_thread_count(1)
            parallel.use_threads(self.gemm_threads)

    def tune(self) -> None:
        """Everything :mod:`tuning` decides at load, on made-up inputs of the declared shapes
        (an unknown batch taken as 1): each site's kernel, for a channel-last network, then,
        if most convs still chose NCHW kernels, for an NCHW one; then who splits the GEMMs.
        Without such inputs (an unknown non-batch dim, a string input) or when the network
        fails on them, the sites time on the requests that come and NUMPY splits its GEMMs."""
        arrays = self._made_up_inputs()
        if arrays is None:
            return
        if self.tuner.sites:
            self.tuner.channel_last = True
            if not self._warm_up(arrays):
                self.tuner.channel_last = False
                return
            if not self.tuner.prefers_channel_last():
                self.tuner.channel_last = False
                self._warm_up(arrays)
        if self.gemm_threads > 1 and self._has_gemms():
            self._choose_threading(arrays)

    def _made_up_inputs(self) -> list[np.ndarray] | None:
        arrays = []
        for spec in self._inputs:
            if spec.kind != "tensor" or spec.dtype is None or spec.shape is None:
                return None
            if spec.dtype.kind not in "biuf":
                return None
            dims = [d if isinstance(d, int) and d >= 0 else None for d in spec.shape]
            if dims and dims[0] is None:
                dims[0] = 1
            if None in dims:
                return None
            arrays.append(np.zeros(dims, spec.dtype))
        return arrays

    def _warm_up(self, arrays: list[np.ndarray]) -> bool:
        """One inference with every new key timed at once (``Tuner.eager``)."""
        self.use_threads()
        self.tuner.eager = True
        try:
            self.plan.run(arrays)
        except PlugserveError:
            return False
        finally:
            self.tuner.eager = False
        return True

    def _has_gemms(self) -> bool:
        return any(step.node.op_type in _GEMM_OPS for step in self.plan.steps)

    def _choose_threading(self, arrays: list[np.ndarray]) -> None:
        """OpenBLAS's own threads or NUMPY's split (parallel.py), by timing whole runs of
        the network both ways, interleaved, the first round not counted. Measured on these
        machines, neither wins everywhere: with a core busy, OpenBLAS's static split stalled
        ResNet-18 (71 ms median against 43 split), while the encoder's many 0.2-0.5 ms GEMMs ran
        faster on OpenBLAS's spinning threads (8.8 ms against 12-14 split)."""
        clock = time.perf_counter
        total = dict.fromkeys(("split", "openblas"), 0.0)
        try:
            for turn in range(1 + _THREADING_ROUNDS):
                for mode in total if turn % 2 else reversed(total):
                    self.tuner.threading = mode
                    self.use_threads()
                    start = clock()
                    self.plan.run(arrays)
                    if turn:
                        total[mode] += clock() - start
        except PlugserveError:
            total["openblas"] = float("inf")
        self.tuner.threading = min(total, key=total.__getitem__)
        self.tuner.log.append(("threading", {k: round(v * 1e3, 3) for k, v in total.items()}))

    def create_infer_request(self) -> NumpyInferRequest:
        return NumpyInferRequest(self)

    def export(self) -> bytes:
        model = self.transformed.to_model()
        extra: dict[str, Any] = {
            "network_name": self.name,
            "inputs": [s.name for s in self._inputs],
            "outputs": [s.name for s in self._outputs],
            "absorbed": self.transformed.absorbed,
            "tuning": self.tuner.export(),
        }
        return blob.pack(
            self.plugin.name,
            self.plugin.architecture,
            self.config.to_strings(),
            model.SerializeToString(),
            extra,
        )
