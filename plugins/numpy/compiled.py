"""NUMPY's compiled network: the transformed graph, its plan and the kernel choices timed for it
(streams: see the base class)."""

from __future__ import annotations

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

    def tune(self) -> None:
        """Time every site on made-up inputs (:meth:`warm_up`) for a channel-last network;
        if most convs still chose NCHW kernels, make the network NCHW and time again."""
        self.tuner.channel_last = True
        if not self.warm_up():
            self.tuner.channel_last = False
            return
        if not self.tuner.prefers_channel_last():
            self.tuner.channel_last = False
            self.warm_up()

    def warm_up(self) -> bool:
        """One inference on made-up inputs of the declared shapes (an unknown batch taken as
        1), so every tuning site times its candidates now rather than on the first request.
        Returns False when the inputs cannot be made up (an unknown non-batch dim, a string
        input) or the run fails on them; the sites then time on the requests that come."""
        arrays = []
        for spec in self._inputs:
            if spec.kind != "tensor" or spec.dtype is None or spec.shape is None:
                return False
            if spec.dtype.kind not in "biuf":
                return False
            dims = [d if isinstance(d, int) and d >= 0 else None for d in spec.shape]
            if dims and dims[0] is None:
                dims[0] = 1
            if None in dims:
                return False
            arrays.append(np.zeros(dims, spec.dtype))
        set_thread_count(1)
        parallel.use_threads(self.gemm_threads)
        self.tuner.eager = True
        try:
            self.plan.run(arrays)
        except PlugserveError:
            return False
        finally:
            self.tuner.eager = False
        return True

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
