"""ORT's compiled network: one InferenceSession per stream, and where its model can be read."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import TYPE_CHECKING, Any

import onnx

from plugserve.plugins import blob
from plugserve.plugins.api import CompiledNetwork, InferenceError, PlugserveError, TensorSpec
from plugserve.plugins.ir import np_dtype, onnx_dtype
from plugserve.plugins.ort import backend
from plugserve.plugins.ort.config import OrtConfiguration
from plugserve.plugins.ort.held import HeldSession
from plugserve.plugins.ort.request import OrtInferRequest
from plugserve.plugins.ort.source import ModelSource

if TYPE_CHECKING:
    from plugserve.plugins.ort.plugin import OrtPlugin

__all__ = ["READS_TEXT", "OrtCompiledNetwork", "spec_from_json", "spec_to_json"]

#: who reads an ORT network's string inputs as text (named when an element is not UTF-8):
#: onnxruntime's Python binding takes a string element as ``str`` only (measured on 1.32: a
#: ``bytes`` element becomes its repr, ``b'\xff'`` the text ``"b'\\xff'"``, a numpy bytes
#: array is decoded as UTF-8, and OrtValue and IOBinding take no string tensor at all), though
#: onnxruntime itself holds any bytes
READS_TEXT = "onnxruntime (its Python binding carries string elements as text)"


def spec_to_json(spec: TensorSpec) -> dict[str, Any]:
    """A TensorSpec for the export header (element types as ONNX numbers)."""
    return {
        "name": spec.name,
        "elem_type": None if spec.dtype is None else onnx_dtype(spec.dtype),
        "shape": None if spec.shape is None else list(spec.shape),
        "kind": spec.kind,
    }


def spec_from_json(data: dict[str, Any]) -> TensorSpec:
    elem = data.get("elem_type")
    shape = data.get("shape")
    return TensorSpec(
        str(data["name"]),
        None if elem is None else np_dtype(int(elem)),
        None if shape is None else tuple(shape),
        str(data.get("kind", "tensor")),
    )


class OrtCompiledNetwork(CompiledNetwork):
    """Sessions run the model, one per stream, opened by the plugin at load; ``source`` reads
    the model again for what is rare (export, profiling sessions, profiled nodes' names).

    Streams x intra-op threads stays within the cores (INFERENCE_NUM_THREADS, when set, is the
    total thread budget instead of the core count); inter-op threads are 1; idle intra-op
    threads spin for at most SPIN_DURATION_US.
    """

    plugin: OrtPlugin
    #: the session whose short runs keep the GIL (:mod:`.held`); None: every run releases it
    held: HeldSession | None = None

    def __init__(
        self,
        plugin: OrtPlugin,
        config: OrtConfiguration,
        name: str,
        source: ModelSource,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        node_names: list[str],
        sessions: list[Any],
    ) -> None:
        super().__init__(plugin, name, config)
        self.source = source
        self._inputs = [
            dataclasses.replace(s, reads_text=READS_TEXT) if s.dtype == object else s
            for s in inputs
        ]
        self._outputs = outputs
        self.input_names = [s.name for s in inputs]
        self.output_names = [s.name for s in outputs]
        self.node_names = node_names
        self.streams = config.streams()
        self.threads = config.threads_per_stream()
        self.level = config.get("GRAPH_OPTIMIZATION_LEVEL")
        self.spin_us = config.get("SPIN_DURATION_US")
        self.sessions = list(sessions)
        self._next = itertools.count()
        self._lock = threading.Lock()
        self._producers: dict[str, str] | None = None

    def new_session(self, profile_prefix: str | None = None) -> Any:
        return backend.session(
            self.source.read(), self.level, self.threads, self.spin_us, profile_prefix
        )

    def original_names(self, node: str) -> tuple[str, ...]:
        """The original node a profiled node comes from, when it can be told.

        Nodes keep their names through the saved (EXTENDED) optimizations; the ALL level's
        NCHWc rewrite names a node ``<output>_nchwc`` after the value it computes, which maps
        back through that value's producer in the saved model.
        """
        with self._lock:
            if self._producers is None:
                self._producers = self._saved_producers()
        known = set(self.node_names)
        if node in known:
            return (node,)
        for suffix in ("_nchwc",):
            if node.endswith(suffix):
                producer = self._producers.get(node[: -len(suffix)], "")
                if producer in known:
                    return (producer,)
        return ()

    def _saved_producers(self) -> dict[str, str]:
        """Which node of the saved (EXTENDED) model computes each value; empty when the model
        cannot be read again (the names are a courtesy of profiling, not worth failing it)."""
        try:
            saved = backend.optimized(self.source.read(), self.level)
        except Exception:
            return {}
        proto = onnx.ModelProto()
        proto.ParseFromString(saved)
        return {o: n.name for n in proto.graph.node for o in n.output if o}

    def create_infer_request(self) -> OrtInferRequest:
        session = self.sessions[next(self._next) % len(self.sessions)]
        return OrtInferRequest(self, session)

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self.streams
        return super()._metric(name)

    def export(self) -> bytes:
        extra: dict[str, Any] = {
            "network_name": self.name,
            "inputs": [spec_to_json(s) for s in self._inputs],
            "outputs": [spec_to_json(s) for s in self._outputs],
            "node_names": self.node_names,
            "onnxruntime_version": backend.ort.__version__,
        }
        try:
            saved = backend.optimized(self.source.read(), self.level)
        except PlugserveError:
            raise
        except Exception as exc:
            raise InferenceError(
                f"network {self.name}: onnxruntime cannot save it optimized: {backend.message(exc)}"
            ) from None
        return blob.pack(
            self.plugin.name, self.plugin.architecture, self.config.to_strings(), saved, extra
        )

    def close(self) -> None:
        super().close()
        self.source.close()
