"""NUMPY's compiled network: the transformed graph, its plan and the kernel choices timed for it
(streams: see the base class)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, PlugserveError
from plugserve.plugins.ir import Graph, has_loop
from plugserve.plugins.model_copies import serialized
from plugserve.plugins.numpy import parallel
from plugserve.plugins.numpy.blas import set_thread_count
from plugserve.plugins.numpy.config import NumpyConfiguration
from plugserve.plugins.numpy.engine import Plan
from plugserve.plugins.numpy.request import NumpyInferRequest
from plugserve.plugins.numpy.tuning import THREADING_RUNS, THREADING_SKIP, Tuner

if TYPE_CHECKING:
    from plugserve.plugins.numpy.plugin import NumpyPlugin

__all__ = ["NumpyCompiledNetwork"]

#: Ops whose kernels run BLAS GEMMs: a network with none has no threading to choose.
_GEMM_OPS = frozenset(
    {"Conv", "FusedConv", "FusedConvPool", "Gemm", "FusedGemm", "MatMul", "FusedMatMul",
     "Linear", "Attention", "ConvTranspose", "QLinearConv", "ConvInteger", "MatMulInteger",
     "MatMulNBits", "GroupQueryAttention"}
)  # fmt: skip

#: Ops whose kernels move string elements without reading them: a string input that reaches
#: only these may carry bytes that are not UTF-8 (``TensorSpec.binary``); any other op (a
#: text kernel, a comparison, a control-flow subgraph) is taken to read its strings as text.
_MOVES_STRINGS = frozenset(
    {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split",
     "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Compress", "Where",
     "Shape", "Size"}
)  # fmt: skip


def string_readers(graph: Graph) -> dict[str, str]:
    """Each string input of ``graph``: "" when every consumer only moves its elements
    (followed through those consumers' outputs), else the first node found to read them as
    text (``TensorSpec.reads_text``)."""
    users = graph.consumers()
    found = {}
    for spec in graph.inputs:
        if spec.dtype != np.dtype(object):
            continue
        todo, seen, reader = [spec.name], {spec.name}, ""
        while todo and not reader:
            for node in users.get(todo.pop(), []):
                if node.domain not in ("", "ai.onnx") or node.op_type not in _MOVES_STRINGS:
                    named = f" {node.name!r}" if node.name else ""
                    reader = f"NUMPY's {node.op_type} node{named}"
                    break
                for out in node.outputs:
                    if out and out not in seen:
                        seen.add(out)
                        todo.append(out)
        found[spec.name] = reader
    return found


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
        readers = string_readers(original)
        self._inputs = [
            s if s.name not in readers
            else dataclasses.replace(s, binary=True) if not readers[s.name]
            else dataclasses.replace(s, reads_text=readers[s.name])
            for s in original.inputs
        ]  # fmt: skip
        self._outputs = list(original.outputs)
        self.output_names = [o.name for o in self._outputs]
        self.transformed = transformed
        self.open_ended = has_loop(transformed)
        self.plan = plan
        #: threads each request splits its large GEMMs over (see ``parallel.py``)
        self.gemm_threads = config.threads_per_stream()
        #: the kernel choices timed on this machine (``tuning.py``)
        self.tuner = tuner
        splits = any(step.node.op_type in _GEMM_OPS for step in plan.steps)
        self._threads_to_choose = tuner.enabled and self.gemm_threads > 1 and splits
        #: who splits when it is not timed: a network without GEMMs NUMPY splits itself keeps
        #: OpenBLAS's threads for the ones it has (an LSTM's, say)
        self._threading = "split" if splits else "openblas"

    def run_plan(self, arrays: list[Any], profile: list | None = None) -> list[Any]:
        """The plan, its GEMMs split the way chosen for these inputs' shapes (a new shape:
        each way over its first runs, timed, see ``Tuner.threading_for``)."""
        if self._threads_to_choose:
            shapes = tuple(getattr(a, "shape", ()) for a in arrays)
            mode, timed = self.tuner.threading_for(shapes)
        else:
            mode, timed = self._threading, False
        if mode == "openblas":
            set_thread_count(self.gemm_threads)
            parallel.use_threads(1)
        else:
            set_thread_count(1)
            parallel.use_threads(self.gemm_threads)
        if not timed:
            return self.plan.run(arrays, profile)
        start = time.perf_counter()
        outputs = self.plan.run(arrays, profile)
        self.tuner.record(shapes, mode, time.perf_counter() - start)
        return outputs

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
        if self._threads_to_choose:
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
        self.tuner.eager = True
        try:
            self.run_plan(arrays)
        except PlugserveError:
            return False
        finally:
            self.tuner.eager = False
        return True

    def _choose_threading(self, arrays: list[np.ndarray]) -> None:
        """Runs on the made-up inputs until their shapes' threading is chosen (a bounded
        number: each way ``THREADING_SKIP`` times untimed, then ``THREADING_RUNS`` times)."""
        shapes = tuple(a.shape for a in arrays)
        for _ in range(2 * (THREADING_SKIP + THREADING_RUNS)):
            if shapes in self.tuner.threading:
                return
            try:
                self.run_plan(arrays)
            except PlugserveError:
                return

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
            serialized(model),
            extra,
        )
