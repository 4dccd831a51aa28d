"""The OPENVINO device: ONNX compiled and run by the openvino runtime on the CPU.

``load_network`` validates the model with plugserve's own reader (so a bad model fails exactly
as on NUMPY), then hands the validated bytes (external data already inlined) to openvino's ONNX
frontend and compiles them for openvino's CPU device with the properties the configuration
stands for. ``query_network`` asks openvino's own ``query_model`` and maps its op names back to
the original ONNX node names (see :mod:`.query`), in a bounded helper process: QueryNetwork is
open to any ``infer`` client, and openvino's native code can crash on, or fold without bound,
the model it is sent (:mod:`.query_process`). Export is openvino's compiled-model blob under
plugserve's shared header.

A path to an OpenVINO IR (``.xml`` with its ``.bin``) is read by openvino itself and compiled
whole (:mod:`.ir`); ``PAGED_ATTENTION=YES`` rewrites an LLM's IR into openvino's
paged-attention form first (:mod:`.paged`), the form generative models are served in.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from plugserve.plugins import amplify, cancel, memory
from plugserve.plugins.api import (
    STATE_PAIRS,
    BackendUnavailable,
    Configuration,
    InvalidArgument,
    Model,
    Plugin,
    TensorSpec,
    Unsupported,
    check_state_pairs,
    listing,
)
from plugserve.plugins.ir import (
    Graph,
    has_loop,
    keep_constants_with_readers,
    load_model,
    narrow_value,
    read_model,
    refuse_narrow_io,
)
from plugserve.plugins.model_copies import serialized
from plugserve.plugins.openvino import query_process
from plugserve.plugins.openvino.compiled import OpenvinoCompiledNetwork
from plugserve.plugins.openvino.config import (
    OpenvinoConfiguration,
    compile_properties,
    precision_name,
)
from plugserve.plugins.openvino.ir import has_loop as ir_has_loop
from plugserve.plugins.openvino.ir import is_ir, ports, read_ir
from plugserve.plugins.openvino.paged import to_paged
from plugserve.plugins.openvino.query import (
    Names,
    cut_model,
    frontend_unsupported,
    owners,
    runtime_names,
    single_node_models,
    supported_nodes,
)
from plugserve.plugins.openvino.verify import wrong_nodes
from plugserve.plugins.passes.sizes import check_load_constants
from plugserve.plugins.shapecheck import shape_model

try:
    import openvino as ov
    from openvino._offline_transformations import apply_make_stateful_transformation
except Exception as exc:  # ImportError, or a broken install failing at import
    ov = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None
    # openvino's bindings set up their numpy bridge on first use inside a C++ static whose
    # initializer waits for the GIL: two threads converting their first arrays at once (two
    # models loading in parallel, each checking its nodes) deadlock, one holding the static and
    # waiting for the GIL, the other holding the GIL and waiting for the static (a server at
    # startup never became ready). Set up here, on the importing thread, before any other.
    ov.Type.f32.to_dtype()
    ov.Tensor(np.zeros(1, np.float32))

__all__ = ["OpenvinoPlugin"]

log = logging.getLogger(__name__)

TARGET = "CPU"  # openvino's device this plugin compiles for
_IO_OPS = ("Parameter", "Result", "Constant")


def _first_line(exc: BaseException) -> str:
    """openvino's messages start with source locations; keep the lines a person can use."""
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip() and not line.strip().startswith(("Exception from ", "Check '"))
    ]
    return lines[0] if lines else str(exc).strip().splitlines()[-1] if str(exc).strip() else ""


def _conversion_failures(exc: BaseException) -> str:
    """What openvino's "Failed operations detailed log" says, one ``Op-version: reason`` per
    op it failed to convert (the first line of its message only says that it failed)."""
    text = str(exc)
    if "Failed operations detailed log" not in text:
        return _first_line(exc)
    log = text.split("Failed operations detailed log:", 1)[1].split("Summary:", 1)[0]
    failures = []
    for block in log.split("\n-- "):
        lines = [line.strip() for line in block.strip().lstrip("- ").splitlines() if line.strip()]
        if lines:
            op = lines[0].removesuffix(" with a message:")
            failures.append(f"{op}: {lines[-1]}" if len(lines) > 1 else op)
    return "; ".join(failures) or _first_line(exc)


class OpenvinoPlugin(Plugin):
    name = "OPENVINO"
    config_class = OpenvinoConfiguration
    cancellation = "after the running node (Loops the request bounds: refused)"
    native_states = True
    #: QueryNetwork's openvino work runs in a helper process (:mod:`.query_process`); False
    #: in that helper itself
    query_in_helper = True
    #: the NUMPY device :meth:`_verify` compares with, where there is no Core (the helper)
    reference: Plugin | None = None

    def __init__(self) -> None:
        super().__init__()
        if ov is None:
            raise BackendUnavailable(
                f"openvino is not installed or does not import: {_IMPORT_ERROR}"
            )
        try:
            self.core = ov.Core()
            if TARGET not in self.core.available_devices:
                raise RuntimeError(f"openvino sees no {TARGET} device")
            self.cpu_name = str(self.core.get_property(TARGET, "FULL_DEVICE_NAME"))
            self.cpu_architecture = str(self.core.get_property(TARGET, "DEVICE_ARCHITECTURE"))
            #: what openvino computes in under PERFORMANCE without a hint: bf16 on CPUs with
            #: bf16 arithmetic (AVX512-BF16, AMX), f32 elsewhere
            self.fastest_precision = precision_name(
                self.core.get_property(TARGET, "INFERENCE_PRECISION_HINT")
            )
        except Exception as exc:
            raise BackendUnavailable(f"openvino does not work here: {exc}") from exc
        self.version = ov.get_version().split("-")[0]
        # openvino's blobs only import into the same openvino build on the same kind of CPU
        self.architecture = f"{self.cpu_architecture}-openvino{self.version}"

    def precision(self, config: OpenvinoConfiguration) -> str:
        """The precision a network compiled with ``config`` computes in, known before it is
        compiled (QueryNetwork's checks and AUTO's candidates need it)."""
        hint = config.get("INFERENCE_PRECISION_HINT")
        if hint:
            computes = {c.lower().replace("fp", "f") for c in self.capabilities()}
            falls_to = [p for p in (hint, "bf16", "f32") if p in computes or p == "f32"]
            return falls_to[0]
        if config.get("EXECUTION_MODE_HINT") == "ACCURACY":
            return "f32"
        return self.fastest_precision

    def precision_choices(self, config: Configuration) -> list[dict[str, str]]:
        """Its default reduced precision and f32, unless a hint or ACCURACY settles it."""
        if config.get("INFERENCE_PRECISION_HINT") or self.precision(config) == "f32":
            return [{}]
        return [{}, {"INFERENCE_PRECISION_HINT": "f32"}]

    # --- reading models

    def _read(self, model: Model) -> tuple[Graph, onnx.ModelProto, bytes]:
        """Validate as NUMPY does, then the bytes openvino reads (external data inlined)."""
        proto, _ = read_model(model)
        graph = load_model(proto)  # sorts ``proto`` in place; every problem is InvalidModel
        check_load_constants(graph, self.name)  # openvino folds constants without a limit
        return graph, proto, serialized(proto)

    def _unsupported_error(
        self, graph: Graph, data: bytes, names: Names, exc: Exception
    ) -> Unsupported:
        try:
            refused = frontend_unsupported(self.core, data, names)
        except Exception:
            refused = {}
        if refused:
            listed = ", ".join(f"{name!r} ({op})" for name, op in refused.items())
            return Unsupported(
                f"model {graph.name!r}: device {self.name} cannot run node(s) {listed}: "
                "openvino has no conversion for them"
            )
        try:  # name the nodes openvino fails to convert, asking node by node
            _, why = self._query_by_node(graph, names.proto, {})
        except Exception:
            why = {}
        failed = {n: w for n, w in why.items() if w.startswith("openvino cannot convert")}
        if failed:
            listed = ", ".join(f"{name!r} ({_conversion_failures(exc)})" for name in failed)
            return Unsupported(f"model {graph.name!r}: openvino cannot convert node(s) {listed}")
        return Unsupported(f"model {graph.name!r}: openvino cannot read it: {_first_line(exc)}")

    # --- networks

    @memory.giving_back  # the parsed model, its IR, openvino's conversion
    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> OpenvinoCompiledNetwork:
        cfg = self.merged_config(config)
        if is_ir(model):
            return self._load_ir(Path(model), cfg)
        if cfg.get("PAGED_ATTENTION"):
            raise InvalidArgument(
                "PAGED_ATTENTION applies to an OpenVINO IR (an .xml path, as optimum-intel "
                "exports openvino_model.xml), not to an ONNX model"
            )
        graph, proto, data = self._read(model)
        strings = string_nodes(graph)
        if strings:
            listed = ", ".join(repr(n) for n in sorted(strings)[:10])
            raise Unsupported(
                f"model {graph.name!r}: device {self.name} cannot run node(s) {listed}"
                f"{' ...' if len(strings) > 10 else ''}: {_STRINGS}"
            )
        loops = [] if cfg.get("UNBOUNDED_LOOPS") else unbounded_loops(graph)
        if loops:
            raise Unsupported(
                f"model {graph.name!r}: device {self.name} will not run node(s) "
                f"{listing(loops, plain=True)}: {_LOOPS}"
            )
        # openvino truncates float8 without saturating, gives it out as bits and 4-/2-bit types
        # packed; bfloat16 it computes, and it crosses as bits (request.py)
        refuse_narrow_io(graph, self.name, keep={"bfloat16"}, everywhere=True)
        wrong = self._verify(cfg, graph, proto, {n.name for n in graph.nodes})
        if wrong:
            why = next(iter(wrong.values()))
            raise Unsupported(
                f"model {graph.name!r}: device {self.name} will not run node(s) "
                f"{listing(list(wrong), plain=True)}: {why}; HETERO:OPENVINO,NUMPY runs the "
                "rest of the model on openvino and these on NUMPY"
            )
        names = Names(graph, proto)
        try:
            ov_model = self.core.read_model(data)
        except Exception as exc:
            raise self._unsupported_error(graph, data, names, exc) from None
        pairs = cfg.get(STATE_PAIRS)
        states = _state_specs(graph, pairs)
        if pairs:
            apply_make_stateful_transformation(ov_model, dict(pairs))
        mapping = owners(ov_model, names)
        shapes, amplifying = shape_model(proto), amplify.probe(proto)
        # openvino holds its own model from here: the parsed one and its bytes are not kept
        # beside it while it compiles (a load's peak memory, 262 MB each of a 262 MB model)
        del names, proto, data
        try:
            compiled = self.core.compile_model(ov_model, TARGET, compile_properties(cfg))
        except Exception as exc:
            raise Unsupported(
                f"model {graph.name!r}: openvino could not compile it: {_first_line(exc)}"
            ) from None
        network = OpenvinoCompiledNetwork(
            self,
            cfg,
            graph.name,
            [s for s in graph.inputs if s.name not in pairs],
            [s for s in graph.outputs if s.name not in pairs.values()],
            compiled,
            mapping,
            runtime_names(compiled, mapping, graph),
            states,
        )
        network.shape_model = shapes
        network.open_ended = has_loop(graph)
        network.amplifying = amplifying
        log.info(
            "OPENVINO compiled %s in %s (%s)",
            graph.name,
            network.precision,
            ", ".join(f"{k}={v}" for k, v in sorted(compile_properties(cfg).items())),
        )
        return network

    def _load_ir(self, path: Path, cfg: OpenvinoConfiguration) -> OpenvinoCompiledNetwork:
        """An OpenVINO IR compiled whole (see :mod:`.ir`); in the paged-attention form when
        ``PAGED_ATTENTION`` asks (see :mod:`.paged`: decided here, at load, so each run is
        only the forward)."""
        name = path.stem
        if cfg.get(STATE_PAIRS):
            raise InvalidArgument(
                "STATE_PAIRS names ONNX inputs and outputs; an OpenVINO IR keeps its states "
                "as its own variables"
            )
        ov_model = read_ir(self.core, path)
        if cfg.get("PAGED_ATTENTION"):
            to_paged(ov_model, name)
        try:
            compiled = self.core.compile_model(ov_model, TARGET, compile_properties(cfg))
        except Exception as exc:
            raise Unsupported(
                f"model {name!r}: openvino could not compile it: {_first_line(exc)}"
            ) from None
        network = OpenvinoCompiledNetwork(
            self,
            cfg,
            name,
            ports(compiled.inputs, "input", name),
            ports(compiled.outputs, "output", name),
            compiled,
            {},
            {},
        )
        network.open_ended = ir_has_loop(ov_model)
        log.info(
            "OPENVINO compiled IR %s in %s%s (%s)",
            path,
            network.precision,
            ", paged attention" if cfg.get("PAGED_ATTENTION") else "",
            ", ".join(f"{k}={v}" for k, v in sorted(compile_properties(cfg).items())),
        )
        return network

    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        supported, _ = self._query(model, config)
        return {name: self.name for name in sorted(supported)}

    def unsupported_nodes(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """Why each unsupported original node is refused (as NUMPY offers, for the CLI)."""
        return self._query(model, config)[1]

    def query_with_reasons(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        supported, why = self._query(model, config)
        return {name: self.name for name in sorted(supported)}, why

    def _query(
        self, model: Model, config: Mapping[str, Any] | None
    ) -> tuple[set[str], dict[str, str]]:
        """What :meth:`_ask_openvino` answers, without the nodes that touch float8, float4,
        int4 or int2 values (load refuses those: see :func:`refuse_narrow_io`)."""
        cfg = self.merged_config(config, strict=False)
        if is_ir(model):
            raise Unsupported(
                f"an OpenVINO IR ({model}) is loaded whole on {self.name}: QueryNetwork and "
                "HETERO read ONNX models"
            )
        graph, proto, data = self._read(model)
        query_process.check_nesting(proto, graph.name)
        verify = self._reference() is not None
        if self.query_in_helper:
            answered = query_process.ask(data, cfg.to_strings(), graph.name, verify)
            if answered is not None:
                return answered
        return self.answer_query(cfg, graph, proto, data, verify)

    def answer_query(
        self,
        cfg: OpenvinoConfiguration,
        graph: Graph,
        proto: onnx.ModelProto,
        data: bytes,
        verify: bool,
    ) -> tuple[set[str], dict[str, str]]:
        """The nodes of a model read by :meth:`_read` that openvino supports and computes
        right (``verify``: checked against NUMPY, :mod:`.verify`), and why each other one is
        refused; in the query's helper process (:mod:`.query_process`), or here without one."""
        supported, why = self._ask_openvino(cfg, graph, proto, data)
        if not cfg.get("UNBOUNDED_LOOPS"):
            for name in unbounded_loops(graph):
                if name in supported:
                    supported.discard(name)
                    why[name] = _LOOPS
        for node in graph.nodes:
            narrow = narrow_value(graph, node, keep={"bfloat16"})
            if narrow and node.name in supported:
                supported.discard(node.name)
                why[node.name] = (
                    f"reads or writes {narrow}, which openvino does not compute as ONNX says"
                )
        if verify:
            for name, reason in self._verify(cfg, graph, proto, supported).items():
                supported.discard(name)
                why[name] = reason
        return supported, why

    def _verify(
        self, cfg: OpenvinoConfiguration, graph: Graph, proto: onnx.ModelProto, claimed: set[str]
    ) -> dict[str, str]:
        """The claimed nodes openvino computes otherwise than NUMPY (see :mod:`.verify`);
        none without a NUMPY device to compare with."""
        reference = self._reference()
        if reference is None:
            return {}
        props = compile_properties(cfg)

        def run_openvino(single: onnx.ModelProto) -> Any:
            compiled = self.core.compile_model(
                self.core.read_model(single.SerializeToString()), TARGET, props
            )
            return lambda feeds: [np.asarray(v) for v in compiled(feeds).values()]

        return wrong_nodes(
            graph,
            proto,
            claimed,
            run_openvino,
            reference.load_network,
            ov.__version__,
            self.precision(cfg),
        )

    def _reference(self) -> Plugin | None:
        """The NUMPY device the checks compare with: the Core's, or the helper's own."""
        if self.reference is not None:
            return self.reference
        if self.devices is not None and "NUMPY" in self.devices.available_devices:
            return self.devices.plugin("NUMPY")
        return None

    def _ask_openvino(
        self, cfg: OpenvinoConfiguration, graph: Graph, proto: onnx.ModelProto, data: bytes
    ) -> tuple[set[str], dict[str, str]]:
        """The nodes openvino supports, and why each other one is refused.

        A model openvino cannot read whole (an op it fails to convert, even inside an If
        branch) is asked node by node: each node as a model of its own, so that the nodes it
        can run still go to it under HETERO rather than failing the whole query.
        """
        names = Names(graph, proto)
        # Snippets (openvino's fusion of element-wise runs into generated kernels) decide
        # nothing about support, and tokenizing them is superlinear in a run's length: a
        # 1,000-op chain took 6 s to query with them, 0.3 s without (4,000: 1.3 s).
        props = {**compile_properties(cfg), "SNIPPETS_MODE": "DISABLE"}
        refused: dict[str, str] = {}
        try:
            ov_model = self.core.read_model(data)
        except Exception:
            try:
                refused = frontend_unsupported(self.core, data, names)
            except Exception:
                refused = {}
            if not refused:
                return self._query_by_node(graph, proto, props)
            # without the nodes openvino cannot convert, the rest keeps its types
            cut = cut_model(proto, names, refused)
            try:
                ov_model = self.core.read_model(serialized(cut))
            except Exception:
                return self._query_by_node(graph, proto, props)
        try:
            answer = self.core.query_model(ov_model, TARGET, props)
        except Exception as exc:
            raise Unsupported(
                f"model {graph.name!r}: openvino query failed: {_first_line(exc)}"
            ) from None
        supported = supported_nodes(ov_model, names, answer, refused)
        why = {n: f"openvino has no conversion for {op}" for n, op in refused.items()}
        _refuse_strings(graph, supported, why)
        keep_constants_with_readers(graph, supported)
        for node in graph.nodes:
            if node.name not in supported and node.name not in why:
                why[node.name] = f"openvino's {TARGET} device does not support {node.op_type} here"
        return supported, why

    def _query_by_node(
        self, graph: Graph, proto: onnx.ModelProto, props: dict[str, Any]
    ) -> tuple[set[str], dict[str, str]]:
        supported: set[str] = set()
        why: dict[str, str] = {}
        for node, single in single_node_models(graph, proto):
            cancel.check(f"asking openvino about node {node.name!r}")
            try:
                ov_model = self.core.read_model(single.SerializeToString())
                answer = set(self.core.query_model(ov_model, TARGET, props))
            except Exception as exc:
                why[node.name] = f"openvino cannot convert it: {_conversion_failures(exc)}"
                continue
            ops = [op for op in ov_model.get_ordered_ops() if op.get_type_name() not in _IO_OPS]
            missing = [op.get_type_name() for op in ops if op.get_friendly_name() not in answer]
            if missing:
                why[node.name] = (
                    f"openvino's {TARGET} device does not support {node.op_type} here "
                    f"(no {', '.join(sorted(set(missing)))})"
                )
            else:
                supported.add(node.name)
        _refuse_strings(graph, supported, why)
        keep_constants_with_readers(graph, supported)
        for node in graph.nodes:
            if node.name not in supported:
                why.setdefault(node.name, "goes with the node that reads it (a Constant)")
        return supported, why

    @memory.giving_back
    def import_network(
        self, data: bytes, config: Mapping[str, Any] | None = None
    ) -> OpenvinoCompiledNetwork:  # a blob of a string model cannot exist: load refuses it
        header, payload, cfg = self._unpack(data, config)
        # the blob holds a graph compiled for one precision: that one stays
        saved = OpenvinoConfiguration(header.get("config", {}), throw_on_unsupported=False)
        kept = ("INFERENCE_PRECISION_HINT", "EXECUTION_MODE_HINT")
        cfg = OpenvinoConfiguration({k: saved.get_string(k) for k in kept}, cfg)
        try:
            inputs = [_spec_from_json(s) for s in header["inputs"]]
            outputs = [_spec_from_json(s) for s in header["outputs"]]
            mapping = {k: tuple(v) for k, v in header.get("owners", {}).items()}
            runtime = {k: tuple(v) for k, v in header.get("runtime_names", {}).items()}
            states = {str(o): _spec_from_json(s) for s, o in header.get("states", [])}
            name = str(header["network_name"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"exported network is corrupt (header lacks {exc})") from None
        try:
            compiled = self.core.import_model(io.BytesIO(payload), TARGET, compile_properties(cfg))
        except Exception as exc:
            raise InvalidArgument(
                f"exported network is corrupt or from another openvino: {_first_line(exc)}"
            ) from None
        return OpenvinoCompiledNetwork(
            self, cfg, name, inputs, outputs, compiled, mapping, runtime, states
        )

    # --- metrics

    def device_name(self) -> str:
        return f"{self.cpu_name} (OpenVINO {self.version})"

    def capabilities(self) -> list[str]:
        return [str(c) for c in self.core.get_property(TARGET, "OPTIMIZATION_CAPABILITIES")]

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        if name == "RANGE_FOR_STREAMS":
            return tuple(int(v) for v in self.core.get_property(TARGET, "RANGE_FOR_STREAMS"))
        if name == "AVAILABLE_DEVICES":
            return [str(d) for d in self.core.get_property(TARGET, "AVAILABLE_DEVICES")]
        return super()._metric(name, options)


def _spec_from_json(item: Any) -> TensorSpec:
    name, dtype, shape = item
    return TensorSpec(
        str(name),
        None if dtype is None else np.dtype(dtype),
        None if shape is None else tuple(shape),
    )


#: openvino 2026.4 reads and runs string tensors, then aborts the process when they are freed
#: ("munmap_chunk(): invalid pointer", seen with a plain Identity on strings): a server must
#: not load them there.
_STRINGS = (
    "string tensors are not run on openvino (it corrupts the heap freeing them); "
    "use NUMPY or ORT, or HETERO:OPENVINO,NUMPY to keep the rest on openvino"
)


#: Why a Loop bounded by the request is not run on openvino: InferRequest.cancel() takes effect
#: only after the node running ends, and a Loop is one node (a Loop of 10**8 trips, cancelled
#: after 1 s, ran 148 s more here).
_LOOPS = (
    "its trip count or condition comes from the request, and openvino cannot stop a Loop once it "
    "runs (a request past its deadline would hold the device until the Loop ends); use NUMPY "
    "or ORT, HETERO:OPENVINO,NUMPY to keep the rest on openvino, or UNBOUNDED_LOOPS=YES to "
    "accept it"
)

#: The most trips a Loop bounded by a constant may make and still count as bounded.
BOUNDED_TRIPS = 1 << 20


def unbounded_loops(graph: Graph) -> list[str]:
    """Loop nodes (top level, or holding one in a subgraph) that the request can keep running:
    no constant trip count up to :data:`BOUNDED_TRIPS` (a while loop's condition is data)."""
    found = []
    for node in graph.nodes:
        if _unbounded(node.op_type, list(node.inputs), graph.initializers) or any(
            _unbounded_in(attr.g) for attr in node.attrs.values() if attr.type == attr.GRAPH
        ):
            found.append(node.name)
    return found


def _unbounded(op_type: str, inputs: list[str], constants: Mapping[str, Any]) -> bool:
    if op_type != "Loop":
        return False
    trips = constants.get(inputs[0]) if inputs and inputs[0] else None
    if trips is None:
        return True
    try:
        return int(np.asarray(trips).reshape(-1)[0]) > BOUNDED_TRIPS
    except (TypeError, ValueError, IndexError):
        return True


def _unbounded_in(body: onnx.GraphProto) -> bool:
    constants: dict[str, Any] = {i.name: numpy_helper.to_array(i) for i in body.initializer}
    for node in body.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    constants[node.output[0]] = numpy_helper.to_array(attr.t)
        if _unbounded(node.op_type, list(node.input), constants) or any(
            _unbounded_in(attr.g) for attr in node.attribute if attr.type == attr.GRAPH
        ):
            return True
    return False


def string_nodes(graph: Graph) -> set[str]:
    """Nodes that read or make a string tensor. A value ONNX leaves untyped counts as a string
    when a node that reads strings makes it (com.microsoft's Tokenizer, say), and so on down."""
    found: set[str] = set()
    strings: set[str] = set()

    def kind(name: str) -> np.dtype | None:
        spec = graph.spec(name)
        return None if spec is None else spec.dtype

    for node in graph.nodes:  # in topological order
        reads = any(n in strings or kind(n) == np.dtype(object) for n in node.inputs if n)
        if reads or any(kind(o) == np.dtype(object) for o in node.outputs if o):
            found.add(node.name)
            strings.update(
                o
                for o in node.outputs
                if o and (kind(o) == np.dtype(object) or (reads and kind(o) is None))
            )
    return found


def _refuse_strings(graph: Graph, supported: set[str], why: dict[str, str]) -> None:
    for name in string_nodes(graph) & supported:
        supported.discard(name)
        why[name] = _STRINGS


def _state_specs(graph: Graph, pairs: dict[str, str]) -> dict[str, TensorSpec]:
    """``{state output: its input's spec}`` for STATE_PAIRS, each name checked."""
    check_state_pairs(f"model {graph.name!r}", pairs, graph.inputs, graph.outputs)
    inputs = {s.name: s for s in graph.inputs}
    return {o: inputs[i] for i, o in pairs.items()}
