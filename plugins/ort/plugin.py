"""The ORT device: ONNX Runtime's CPU execution provider.

``load_network`` validates the model with plugserve's own reader (same InvalidModel errors as
NUMPY, external data inlined safely), then opens one InferenceSession per stream from it; the
network keeps its sessions and where the model came from, not the model (see :mod:`.source`),
and an export has onnxruntime optimize it again at most at EXTENDED (portable).
``query_network`` asks onnxruntime's kernel registry (see :mod:`.query`).
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx

from plugserve.plugins import amplify, memory, reading
from plugserve.plugins.api import (
    BackendUnavailable,
    InvalidArgument,
    InvalidModel,
    Model,
    Plugin,
    Unsupported,
    available_cores,
    cpu_name,
)
from plugserve.plugins.ir import (
    Graph,
    graph_from_proto,
    has_loop,
    load_model,
    read_model,
    refuse_external_data,
    refuse_narrow_io,
)
from plugserve.plugins.model_copies import serialized
from plugserve.plugins.ort import backend, locales, saturation
from plugserve.plugins.ort.compiled import OrtCompiledNetwork, spec_from_json
from plugserve.plugins.ort.config import OrtConfiguration
from plugserve.plugins.ort.held import HeldSession, open_held
from plugserve.plugins.ort.query import KernelIndex, kernel_index, unsupported_nodes
from plugserve.plugins.ort.source import FileSource, ModelSource, SpilledSource
from plugserve.plugins.passes.sizes import check_load_constants
from plugserve.plugins.shapecheck import shape_model

__all__ = ["OrtPlugin"]

log = logging.getLogger(__name__)


class OrtPlugin(Plugin):
    name = "ORT"
    config_class = OrtConfiguration
    cancellation = (
        "before each node, Loop bodies included; a short run that holds the GIL "
        "(HOLD_GIL_UNDER_US) runs to its end"
    )
    CAPABILITIES = (
        "FP32", "FP16", "BF16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "BOOL",
        "STRING", "EXPORT_IMPORT",
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        ort = backend.ort
        if ort is None:
            raise BackendUnavailable(
                f"onnxruntime cannot be imported: {backend.IMPORT_ERROR!r}"
            ) from backend.IMPORT_ERROR
        try:
            providers = ort.get_available_providers()
        except Exception as exc:
            raise BackendUnavailable(f"onnxruntime does not work here: {exc}") from exc
        if backend.PROVIDER not in providers:
            raise BackendUnavailable(
                f"onnxruntime {ort.__version__} has no {backend.PROVIDER} "
                f"(providers: {', '.join(providers) or 'none'})"
            )
        self.version = ort.__version__
        self.architecture = f"{platform.machine() or 'unknown'}-ort{self.version.split('.')[0]}"
        try:
            self.kernels: KernelIndex | None = kernel_index()
        except Exception:  # a private API; without it QueryNetwork asks a session instead
            self.kernels = None

    # --- networks

    def _read(self, model: Model) -> tuple[Graph, bytes, onnx.ModelProto]:
        """The model validated, its bytes for onnxruntime, and its proto; the graph without
        its initializers' values (onnxruntime's sessions hold the weights: the graph's copy
        of them, once checked, would only raise a load's peak memory by the weights' size)."""
        proto, _ = read_model(model)  # external data inlined here, safely
        graph = load_model(proto)
        check_load_constants(graph, self.name)  # onnxruntime folds constants without a limit
        graph.initializers.clear()
        locales.settle(proto, f"model {graph.name!r}")  # a StringNormalizer's missing locale
        if saturation.saturates():  # this CPU's int8 GEMMs would saturate: make them exact
            rewritten = saturation.exact_integer_gemms(proto)
            if rewritten:
                log.info(
                    "model %s: %d int8 GEMM weights run as uint8 (this CPU has no VNNI, where "
                    "onnxruntime's int8 kernel saturates)", graph.name, rewritten,
                )  # fmt: skip
        return graph, serialized(proto), proto

    def _read_file(self, path: Path) -> bytes:
        return self._read(path)[1]

    @memory.giving_back  # the parsed model, its IR, its bytes, onnxruntime's own parse
    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> OrtCompiledNetwork:
        cfg = self.merged_config(config)
        graph, data, proto = self._read(model)
        shapes = shape_model(proto)
        refuse_narrow_io(graph, self.name)  # onnxruntime's numpy binding has no such types
        amplifying = amplify.probe(proto)
        held = self._held(data, proto, graph, cfg)  # None unless the model is small
        del proto  # the sessions parse their own: not held beside them at a load's peak
        try:
            sessions = backend.sessions(data, cfg)
        except Exception as exc:
            raise self._load_error(graph, exc) from None
        # a network that profiles makes sessions while it serves: from its own copy, which a
        # change to the repository's file cannot take away
        source: ModelSource = (
            FileSource(Path(model).absolute(), self._read_file, data)
            if isinstance(model, str | os.PathLike) and not cfg.get("PERF_COUNT")
            else SpilledSource(data)
        )
        network = OrtCompiledNetwork(
            self,
            cfg,
            graph.name,
            source,
            list(graph.inputs),
            list(graph.outputs),
            [n.name for n in graph.nodes],
            sessions,
        )
        network.shape_model = shapes
        network.open_ended = has_loop(graph)
        network.held = held
        network.amplifying = amplifying
        return network

    @staticmethod
    def _held(
        data: bytes, proto: onnx.ModelProto, graph: Graph, cfg: OrtConfiguration
    ) -> HeldSession | None:
        """The network's session whose runs keep the GIL, when they are short (see
        :mod:`.held`); profiled networks have none (their runs go through profiling
        sessions)."""
        if cfg.get("PERF_COUNT"):
            return None
        return open_held(
            data,
            proto,
            [s.name for s in graph.inputs],
            cfg.get("GRAPH_OPTIMIZATION_LEVEL"),
            cfg.get("HOLD_GIL_UNDER_US"),
            graph.name,
        )

    def _load_error(self, graph: Graph, exc: Exception) -> Exception:
        failures = self._unsupported(graph)
        if failures:
            shown = "; ".join(f"node {name!r}: {why}" for name, why in failures.items())
            return Unsupported(f"model {graph.name!r} has nodes ORT cannot run: {shown}")
        return InvalidModel(
            f"model {graph.name!r}: onnxruntime cannot load it: {backend.message(exc)}"
        )

    def _unsupported(self, graph: Graph) -> dict[str, str]:
        if self.kernels is None:
            return {}
        return unsupported_nodes(graph, self.kernels)

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        self.merged_config(config, strict=False)
        graph = load_model(model)
        check_load_constants(graph, self.name)  # what load_network would refuse
        return self._supported(model, config, graph, self._unsupported(graph))

    def unsupported_nodes(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """Why each unsupported original node is refused (for error messages and the CLI)."""
        return self._unsupported(load_model(model))

    def query_with_reasons(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        self.merged_config(config, strict=False)
        graph = load_model(model)
        check_load_constants(graph, self.name)
        why = self._unsupported(graph)
        return self._supported(model, config, graph, why), why

    def _supported(
        self, model: Model, config: Mapping[str, Any] | None, graph: Graph, why: dict[str, str]
    ) -> dict[str, str]:
        if self.kernels is None:  # all or nothing: can onnxruntime open it?
            try:
                self.load_network(model, config)
            except Unsupported:
                return {}
            return {n.name: self.name for n in graph.nodes}
        return {n.name: self.name for n in graph.nodes if n.name not in why}

    @memory.giving_back
    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> OrtCompiledNetwork:
        header, payload, cfg = self._unpack(data, config)
        try:
            inputs = [spec_from_json(s) for s in header["inputs"]]
            outputs = [spec_from_json(s) for s in header["outputs"]]
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument("exported network is corrupt (bad input/output list)") from None
        name = str(header.get("network_name") or "model")
        try:  # bounded as a model's bytes are (plugins/reading.py), and its nodes counted
            proto = reading.parse_model(payload, "the exported network")
            reading.check_nodes(proto, proto.graph.name or "model")
        except InvalidModel as exc:
            raise InvalidArgument(f"exported network is refused: {exc}") from None
        except Exception:
            raise InvalidArgument("exported network is corrupt (payload does not parse)") from None
        refuse_external_data(proto, "ImportNetwork")  # onnxruntime would read the files
        if locales.settle(proto, f"exported network {name!r}"):  # made where the locale was
            payload = proto.SerializeToString()
        try:
            graph = graph_from_proto(proto.graph, proto, name)
        except InvalidModel as exc:
            raise InvalidArgument(f"exported network is corrupt: {exc}") from None
        check_load_constants(graph, self.name)  # onnxruntime folds them again at import
        try:
            sessions = backend.sessions(payload, cfg)
        except Exception as exc:
            raise InvalidArgument(
                f"exported network {name!r} is corrupt: onnxruntime cannot load it: "
                f"{backend.message(exc)}"
            ) from None
        network = OrtCompiledNetwork(
            self,
            cfg,
            name,
            SpilledSource(payload),
            inputs,
            outputs,
            list(header.get("node_names", [])),
            sessions,
        )
        network.open_ended = has_loop(graph)
        network.held = self._held(payload, proto, graph, cfg)
        return network

    # --- metrics

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "SUPPORTED_OPS"]

    def device_name(self) -> str:
        return f"{cpu_name()} (onnxruntime {self.version} {backend.PROVIDER})"

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        if name == "SUPPORTED_OPS":
            ops = self.kernels.ops() if self.kernels is not None else []
            return [f"{d}::{op}" if d else op for d, op in ops]
        if name == "RANGE_FOR_STREAMS":
            return (1, available_cores())
        return super()._metric(name, options)
