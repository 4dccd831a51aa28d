"""The NUMPY device: the reference plugin (the seeds' TEMPLATE), running ONNX on numpy kernels.

``load_network`` = read and validate the model, ``transform`` (the seed's TransformNetwork: one
pass pipeline), compile a :class:`Plan`. ``query_network`` runs the same transformations and maps
what the kernels accept back to original node names, following the seed's steps.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from plugserve.plugins import reading
from plugserve.plugins.api import (
    BackendUnavailable,
    InvalidArgument,
    InvalidModel,
    Model,
    Plugin,
    TensorSpec,
    cpu_name,
)
from plugserve.plugins.ir import (
    Graph,
    Node,
    graph_from_proto,
    keep_constants_with_readers,
    load_model,
    read_model,
    refuse_external_data,
    subgraph_free_names,
)
from plugserve.plugins.numpy import blas
from plugserve.plugins.numpy import kernels as _kernels  # noqa: F401  (registers the kernels)
from plugserve.plugins.numpy.compiled import NumpyCompiledNetwork
from plugserve.plugins.numpy.config import NumpyConfiguration
from plugserve.plugins.numpy.engine import compile_plan
from plugserve.plugins.numpy.kernels.registry import KernelEntry, Registry, default_registry
from plugserve.plugins.numpy.tuning import Tuner
from plugserve.plugins.outputcheck import made_up_inputs
from plugserve.plugins.passes import PassContext, standard_pipeline
from plugserve.plugins.shapecheck import shape_model

__all__ = ["Extension", "NumpyPlugin"]

log = logging.getLogger(__name__)

#: symbolic dimensions of :meth:`NumpyPlugin.computed_types`'s made-up inputs, tried in turn:
#: small first (cheap), then long enough for a window over the input (Silero VAD's STFT is a
#: Conv of 256 taps over its samples)
_PROBE_DIMS = (3, 512)

#: Held while a load times its kernels: loads run in parallel (the server's
#: --model-load-threads), and two tunings timing at once would each see the other's work as
#: their kernels' cost.
_TUNING = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Extension:
    """A custom op written in Python, for :meth:`NumpyPlugin.add_extension`.

    ``kernel`` is either a plain function of the input arrays returning the output(s), or, with
    ``builder=True``, a builder ``(ctx) -> kernel`` that reads attributes at load time like the
    built-in kernels. ``infer`` gives output types for nodes ONNX cannot type:
    ``infer(*(dtype, shape) per input) -> (dtype, shape) or list of them``.
    """

    domain: str
    op_type: str
    kernel: Callable[..., Any]
    infer: Callable[..., Any] | None = None
    builder: bool = False
    multi_output: bool = False


class NumpyPlugin(Plugin):
    name = "NUMPY"
    config_class = NumpyConfiguration
    cancellation = "before each node and Loop/Scan iteration"
    CAPABILITIES = (
        "FP32", "FP16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "BOOL", "STRING",
        "EXPORT_IMPORT",
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        try:
            check = np.ones((4, 4), dtype=np.float32) @ np.ones((4, 4), dtype=np.float32)
            if float(check[0, 0]) != 4.0:
                raise RuntimeError("matmul returned a wrong result")
        except Exception as exc:
            raise BackendUnavailable(f"numpy does not work here: {exc}") from exc
        if not default_registry.ops():
            raise BackendUnavailable("no numpy kernels are registered")
        self.registry: Registry = default_registry.child()
        self.extensions: list[Extension] = []
        self.architecture = f"{platform.machine() or 'unknown'}-numpy{np.__version__.split('.')[0]}"

    # --- transformations

    @property
    def type_rules(self) -> dict[tuple[str, str], Callable[..., Any]]:
        """Output-type rules of this plugin's extensions (HETERO types its cut points with them)."""
        return {(e.domain, e.op_type): e.infer for e in self.extensions if e.infer}

    def _context(self, config: NumpyConfiguration) -> PassContext:
        return PassContext(
            supports=self._supports,
            evaluate=self._evaluate,
            type_rules=self.type_rules,
            f16_to_f32=config.get("INFERENCE_PRECISION_HINT") == "f32",
        )

    def _supports(self, node: Node, graph: Graph) -> bool:
        return self.registry.lookup(node.domain, node.op_type, graph.node_opset(node)) is not None

    def _evaluate(self, node: Node, graph: Graph, inputs: list[Any]) -> list[Any]:
        single = Graph(
            name=f"{graph.name}/{node.name}",
            nodes=[node],
            inputs=[],
            outputs=[graph.spec(o) or _spec(o) for o in node.outputs],
            initializers={n: v for n, v in zip(node.inputs, inputs) if n},
            value_info=graph.value_info,
            opsets=graph.opsets,
        )
        return compile_plan(single, self.registry).run([])

    def computed_types(self, graph: Graph, names: Iterable[str]) -> dict[str, TensorSpec]:
        """The element type and rank of each of ``names`` as these kernels compute it, running
        the nodes it depends on over made-up inputs (``outputcheck.made_up_inputs``), and
        again over their opposites (booleans negated, numbers mirrored).

        For values ONNX's inference leaves without a rank, though the graph fixes it (a Conv
        after an If whose branches differ in rank): HETERO must declare them where it cuts.
        Symbolic dimensions are made up small, then long (:data:`_PROBE_DIMS`) when the small
        ones are refused.
        A value whose rank differs between the two runs is the data's choice and is left out,
        as is one that is not a tensor; one the data decides beyond both runs is caught at run
        time by the check of every value a piece hands on. The dimensions stay unknown. Empty
        when the inputs cannot be made up or a run fails.
        """
        wanted = [n for n in dict.fromkeys(names) if n]
        model = graph.to_model()
        if not wanted or made_up_inputs(model) is None:
            return {}
        producers = graph.producers()
        needed: set[int] = set()
        todo = list(wanted)
        while todo:
            node = producers.get(todo.pop())
            if node is not None and id(node) not in needed:
                needed.add(id(node))
                todo += [*node.inputs, *subgraph_free_names(node)]
        probe = dataclasses.replace(
            graph.copy(),
            nodes=[n for n in graph.nodes if id(n) in needed],
            outputs=[graph.spec(n) or TensorSpec(n, None, None) for n in wanted],
        )
        try:
            plan = compile_plan(probe, self.registry)
        except Exception:  # no answer: the caller says what it cannot type
            log.debug("NUMPY: compiling a probe of %r failed", graph.name, exc_info=True)
            return {}
        runs = None
        for dim in _PROBE_DIMS:  # a window (an STFT's Conv of 256 taps) wants long inputs
            feeds = made_up_inputs(model, dim)
            opposite = {k: ~v if v.dtype == bool else 1 - v if v.dtype.kind in "iu" else -v
                        for k, v in feeds.items()}  # fmt: skip
            try:
                runs = [plan.run([f[s.name] for s in probe.inputs]) for f in (feeds, opposite)]
                break
            except Exception:
                log.debug("NUMPY: %r on made-up inputs of size %d failed", graph.name, dim,
                          exc_info=True)  # fmt: skip
        if runs is None:
            return {}
        found: dict[str, TensorSpec] = {}
        for name, first, second in zip(wanted, *runs):
            if not isinstance(first, np.ndarray) or not isinstance(second, np.ndarray):
                continue
            if first.dtype == second.dtype and first.ndim == second.ndim:
                found[name] = TensorSpec(name, first.dtype, (None,) * first.ndim)
        return found

    def transform(self, graph: Graph, config: NumpyConfiguration) -> Graph:
        """The seed's TransformNetwork: a copy of ``graph`` rewritten by the pass pipeline."""
        if config.get("DISABLE_TRANSFORMATIONS"):
            return graph.copy()
        return standard_pipeline().run(graph, self._context(config))

    # --- networks

    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> NumpyCompiledNetwork:
        cfg = self.merged_config(config)
        proto, _ = read_model(model)
        original = load_model(proto)
        transformed = self.transform(original, cfg)
        tuner = Tuner(cfg.threads_per_stream(), enabled=bool(cfg.get("KERNEL_TUNING")))
        plan = compile_plan(transformed, self.registry, tuner=tuner)
        network = NumpyCompiledNetwork(self, cfg, original, transformed, plan, tuner)
        network.shape_model = shape_model(proto)
        if tuner.enabled:
            with _TUNING:
                network.tune()
        return network

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        return self.query_with_reasons(model, config)[0]

    def unsupported_nodes(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """Why each unsupported original node is refused (for error messages and the CLI)."""
        return self.query_with_reasons(model, config)[1]

    def query_with_reasons(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        cfg = self.merged_config(config, strict=False)
        original = load_model(model)
        # 1. the original names, 2. the same transformations as load_network
        original_names = {n.name for n in original.nodes}
        transformed = self.transform(original, cfg)
        # 3. supported and unsupported through fused names
        failures: dict[str, str] = {}
        compile_plan(transformed, self.registry, unsupported=failures)
        supported: set[str] = set(transformed.absorbed) & original_names
        unsupported: set[str] = set()
        for node in transformed.nodes:
            target = unsupported if node.name in failures else supported
            target.update(n for n in node.fused_names if n in original_names)
        # 4. a node is supported only if everything made from it is
        supported -= unsupported
        # 5./6. housekeeping: a Constant goes with the first node that reads it
        keep_constants_with_readers(original, supported)
        # why: each original node of a node that failed
        by_name = {n.name: n for n in transformed.nodes}
        why = {orig: text for name, text in failures.items() for orig in by_name[name].fused_names}
        return {name: self.name for name in sorted(supported)}, why

    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> NumpyCompiledNetwork:
        header, payload, cfg = self._unpack(data, config)
        try:  # bounded as a model's bytes are (plugins/reading.py), and its nodes counted
            proto = reading.parse_model(payload, "the exported network")
            reading.check_nodes(proto, proto.graph.name or "model")
        except InvalidModel as exc:
            raise InvalidArgument(f"exported network is refused: {exc}") from None
        except Exception:
            raise InvalidArgument("exported network is corrupt (payload does not parse)") from None
        refuse_external_data(proto, "ImportNetwork")
        name = header.get("network_name") or proto.graph.name
        try:
            graph = graph_from_proto(proto.graph, proto, name)
        except InvalidModel as exc:
            raise InvalidArgument(f"exported network is corrupt: {exc}") from None
        graph.absorbed = list(header.get("absorbed", []))
        tuner = Tuner(
            cfg.threads_per_stream(),
            enabled=bool(cfg.get("KERNEL_TUNING")),
            stored=header.get("tuning") if isinstance(header.get("tuning"), dict) else None,
        )
        plan = compile_plan(graph, self.registry, tuner=tuner)
        network = NumpyCompiledNetwork(self, cfg, graph, graph, plan, tuner)
        if tuner.enabled and not tuner.restored:  # exported on another machine
            network.tune()
        return network

    def extension_names(self) -> list[str]:
        return [f"{e.domain}::{e.op_type}" for e in self.extensions]

    def add_extension(self, extension: Extension) -> None:
        """Register a custom op kernel; QueryNetwork then reports its nodes supported."""
        if not isinstance(extension, Extension):
            raise InvalidArgument("add_extension takes a plugserve.plugins.numpy.Extension")
        if extension.builder:
            build = extension.kernel
        else:

            def build(ctx: Any, fn: Callable[..., Any] = extension.kernel) -> Callable[..., Any]:
                return fn

        self.registry.add(
            KernelEntry(
                extension.domain,
                extension.op_type,
                frozenset({1}),
                build,
                extension.multi_output,
                extension.infer,
            )
        )
        self.extensions.append(extension)

    # --- metrics

    def supported_metrics(self) -> list[str]:
        return [*super().supported_metrics(), "SUPPORTED_OPS"]

    def device_name(self) -> str:
        kernel = f" {blas.core_name()}" if blas.core_name() else ""
        return f"{cpu_name()} (numpy {np.__version__}, {blas.library_name()}{kernel})"

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        if name == "SUPPORTED_OPS":
            return [f"{d}::{op}" if d else op for d, op in self.registry.ops()]
        return super()._metric(name, options)


def _spec(name: str) -> Any:
    return TensorSpec(name, None, None)
