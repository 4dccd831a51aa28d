"""The three bases of the Plugin API: a :class:`Plugin` is a device that loads or imports
networks, a :class:`CompiledNetwork` is a network compiled for that device, and an
:class:`InferRequest` runs it; :class:`Devices` is what a virtual device may ask of the Core.

Every hook a caller uses is declared here with its default, so nothing is probed with
``getattr``. It imports the modules below it (errors, configuration, inputs, cancellation,
streams, blobs), none of which imports it.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from plugserve.plugins import blob, cancel, run_context
from plugserve.plugins.configuration import Configuration
from plugserve.plugins.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unsupported,
)
from plugserve.plugins.inputs import TensorSpec, check_inputs
from plugserve.plugins.responses import Response, ResponseSender
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.streams import StreamsExecutor

if TYPE_CHECKING:
    from plugserve.plugins.decoding import Decoder

__all__ = [
    "CallConfig",
    "Callback",
    "CompiledNetwork",
    "Devices",
    "InferRequest",
    "KnownDevice",
    "Model",
    "PerfCount",
    "Plugin",
    "VariableState",
    "check_state_pairs",
    "initial_value",
    "joined_precision",
    "parse_state_pairs",
]

#: The load config key naming a network's state pairs, ``"input:output,input:output"``: each
#: run's ``output`` is the next run's ``input``, kept in the infer request (OpenVINO's
#: variable states; the Core takes it out of the device's config).
STATE_PAIRS = "STATE_PAIRS"


def parse_state_pairs(text: str) -> dict[str, str]:
    """``"h:h_out,c:c_out"`` -> ``{"h": "h_out", "c": "c_out"}``."""
    pairs: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in str(text).split(","))):
        name, sep, output = (part.strip() for part in item.partition(":"))
        if not sep or not name or not output or name in pairs:
            raise InvalidArgument(
                f"config key {STATE_PAIRS!r}: bad value {text!r} (expected "
                "'state_input:state_output,...', each input once)"
            )
        pairs[name] = output
    return pairs


def check_state_pairs(
    where: str,
    pairs: Mapping[str, str],
    inputs: Iterable[TensorSpec],
    outputs: Iterable[TensorSpec],
) -> None:
    """Every pair names an input and an output the model has."""
    names = {s.name for s in inputs}
    results = {s.name for s in outputs}
    wrong = [f"input {i!r}" for i in pairs if i not in names] + [
        f"output {o!r}" for o in pairs.values() if o not in results
    ]
    if wrong:
        raise InvalidArgument(
            f"{where}: {STATE_PAIRS} names {', '.join(wrong)}, which it does not have "
            f"(inputs {sorted(names)}, outputs {sorted(results)})"
        )


def initial_value(spec: TensorSpec) -> np.ndarray:
    """A state's start value: zeros of its input's type and shape, a varying dimension 1 (as
    Triton starts an implicit state)."""
    dims = [d if isinstance(d, int) and d >= 0 else 1 for d in (spec.shape or [])]
    return np.zeros(dims, np.dtype(spec.dtype if spec.dtype is not None else np.float32))


class VariableState:
    """OpenVINO's ``VariableState``: one state an infer request keeps between its runs, its
    ``name`` the state input's. ``state`` reads or replaces the value the next run is fed;
    :meth:`reset` returns it to the start value (zeros of the input's shape, a varying
    dimension taken as 1, as Triton's implicit state starts)."""

    def __init__(self, name: str, initial: np.ndarray) -> None:
        self.name = name
        self._initial = initial
        self._value = initial

    @property
    def state(self) -> np.ndarray:
        return self._value

    @state.setter
    def state(self, value: Any) -> None:
        array = np.asarray(value)
        if array.dtype != self._initial.dtype or array.ndim != self._initial.ndim:
            raise InvalidArgument(
                f"state {self.name!r}: expected {self._initial.dtype} of rank "
                f"{self._initial.ndim}, got {array.dtype} of shape {list(array.shape)}"
            )
        self._value = array

    def reset(self) -> None:
        self._value = self._initial


@dataclasses.dataclass(frozen=True)
class PerfCount:
    """One node's timing from the last inference, as ``get_performance_counts`` reports it."""

    node_name: str
    op_type: str
    status: str  # EXECUTED, NOT_RUN, OPTIMIZED_OUT
    exec_type: str  # the kernel that ran (e.g. "FusedConv", "onnxruntime")
    real_time_s: float
    device: str = ""
    original_names: tuple[str, ...] = ()


Model = Any  # a path (str | os.PathLike), bytes, or onnx.ModelProto

#: A config as a call gives it: strings by key (parsed by the device), or a
#: :class:`Configuration` already parsed (passed down as it is).
CallConfig = Mapping[str, Any] | Configuration

#: What ``start_async`` calls when a run completes: ``(outputs, None)`` or ``(None, error)``.
Callback = Callable[[dict[str, np.ndarray] | None, BaseException | None], None]

_Prepared = TypeVar("_Prepared")  # what a request makes of its inputs before running them


class KnownDevice(Protocol):
    """A device the Core knows (``Core.devices()``): whether it is available, and why not."""

    @property
    def name(self) -> str: ...

    @property
    def available(self) -> bool: ...

    @property
    def reason(self) -> str: ...


@runtime_checkable
class Devices(Protocol):
    """What a virtual plugin (HETERO, MULTI, AUTO, BATCH) may ask of the Core.

    The Core hands itself to every plugin as ``plugin.devices`` after constructing it, so a
    plugin that composes others never imports the server.
    """

    @property
    def available_devices(self) -> list[str]: ...

    def devices(self) -> Sequence[KnownDevice]:
        """Every device the Core knows, available or not (AUTO tells a typo from a device
        that is missing here)."""
        ...

    def plugin(self, device: str) -> Plugin: ...

    def parse_config(self, device: str, config: CallConfig | None = None) -> Configuration:
        """The configuration a load on ``device`` would use, parsed (its plugin's own
        config, the keys its name sets, then ``config``). A virtual device makes each of its
        devices' configurations with it once per load and hands the result down."""
        ...

    def load_network(
        self,
        model: Model,
        device: str,
        config: CallConfig | None = None,
        *,
        trusted: bool = False,
    ) -> CompiledNetwork:
        """``trusted``: the model is the operator's (see :meth:`Plugin.load_trusted`); a
        virtual device passes on what it was given, never more."""
        ...

    def query_network(
        self, model: Model, device: str, config: CallConfig | None = None
    ) -> dict[str, str]: ...

    def import_network(
        self,
        data: bytes,
        device: str,
        config: CallConfig | None = None,
        *,
        trusted: bool = False,
    ) -> CompiledNetwork: ...


class Plugin(abc.ABC):
    """A device. The constructor raises :class:`BackendUnavailable` when the backend cannot work."""

    #: The device name users write (``NUMPY``, ``ORT``); set by subclasses.
    name: ClassVar[str] = ""
    config_class: ClassVar[type[Configuration]] = Configuration
    #: How soon a running inference stops once cancelled (its deadline, its client gone,
    #: ``InferRequest.cancel()``): the CANCELLATION metric, shown by ``plugserve devices``.
    cancellation: ClassVar[str] = "never: a run goes on to its end"

    #: Whether the plugin keeps a load's STATE_PAIRS as states of its own (OPENVINO's
    #: MakeStateful): the Core then leaves the key in its config; for the others the base
    #: infer request keeps them (:meth:`CompiledNetwork.keep_states`).
    native_states: ClassVar[bool] = False

    def __init__(self) -> None:
        self._config = self.config_class()
        self._lock = threading.Lock()
        #: Set by the Core: the other devices, for plugins that compose them.
        self.devices: Devices | None = None

    # --- configuration and metrics

    def set_config(self, config: Mapping[str, Any]) -> None:
        """Override keys of the plugin's configuration; an unknown key raises."""
        with self._lock:
            self._config = self.config_class(config, self._config)

    def get_config(self, key: str) -> Any:
        return self._config.get(key)

    @property
    def config(self) -> Configuration:
        return self._config

    def merged_config(self, config: CallConfig | None, strict: bool = True) -> Configuration:
        """The plugin's configuration overridden by a per-call ``config``, parsed here once
        per load: a ``config`` already parsed (this device's :attr:`config_class`, made by
        the Core or by a virtual device for its child) is the one to use, as it is."""
        if isinstance(config, self.config_class):
            return config
        return self.config_class(config or {}, self._config, throw_on_unsupported=strict)

    def supported_metrics(self) -> list[str]:
        return [
            "SUPPORTED_METRICS",
            "SUPPORTED_CONFIG_KEYS",
            "AVAILABLE_DEVICES",
            "FULL_DEVICE_NAME",
            "IMPORT_EXPORT_SUPPORT",
            "DEVICE_ARCHITECTURE",
            "OPTIMIZATION_CAPABILITIES",
            "RANGE_FOR_ASYNC_INFER_REQUESTS",
            "RANGE_FOR_STREAMS",
            "CANCELLATION",
        ]

    def get_metric(self, name: str, options: Mapping[str, Any] | None = None) -> Any:
        """A static fact about the device; an unknown metric name raises (seed rule)."""
        metrics = self.supported_metrics()
        if name not in metrics:
            raise NotFound(
                f"device {self.name}: unsupported metric {name!r}; supported: {', '.join(metrics)}"
            )
        return self._metric(name, options or {})

    #: OPTIMIZATION_CAPABILITIES, for a device whose backend does not report its own
    CAPABILITIES: tuple[str, ...] = ()
    #: DEVICE_ARCHITECTURE: what an exported blob must match to be imported here
    architecture: str = ""

    def device_name(self) -> str:
        """FULL_DEVICE_NAME: the hardware and backend a person reads in ``plugserve devices``."""
        return self.name

    def capabilities(self) -> list[str]:
        return list(self.CAPABILITIES)

    def _metric(self, name: str, options: Mapping[str, Any]) -> Any:
        """The metrics every device answers the same way; a plugin's own ``_metric`` handles
        its extra ones and calls this for the rest."""
        cores = os.cpu_count() or 1
        common: dict[str, Callable[[], Any]] = {
            "SUPPORTED_METRICS": self.supported_metrics,
            "SUPPORTED_CONFIG_KEYS": lambda: list(self.config_class.keys()),
            "AVAILABLE_DEVICES": lambda: [""],
            "FULL_DEVICE_NAME": self.device_name,
            "DEVICE_ARCHITECTURE": lambda: self.architecture,
            "OPTIMIZATION_CAPABILITIES": self.capabilities,
            "IMPORT_EXPORT_SUPPORT": lambda: True,
            "RANGE_FOR_ASYNC_INFER_REQUESTS": lambda: (1, 4 * cores, 1),
            "RANGE_FOR_STREAMS": lambda: (1, cores),
            "CANCELLATION": lambda: self.cancellation,
        }
        if name in common:
            return common[name]()
        raise NotFound(f"device {self.name}: metric {name!r} has no value")

    def _unpack(self, data: bytes, config: CallConfig | None) -> tuple[dict[str, Any], bytes, Any]:
        """An exported blob of this device: its header, its payload, and the configuration
        to import it with (the per-call ``config`` over the one it was exported with; keys of
        the saved one this build no longer knows are dropped, not refused). A ``config``
        already parsed is the whole configuration (the Core's cache, whose entries are keyed
        by it)."""
        header, payload = blob.unpack(data, self.name, self.architecture)
        if isinstance(config, self.config_class):
            return header, payload, config
        kept = {k: v for k, v in header.get("config", {}).items() if k not in blob.NOT_IMPORTED}
        saved = self.config_class(kept, throw_on_unsupported=False)
        return header, payload, self.config_class(config or {}, saved)

    # --- networks

    @abc.abstractmethod
    def load_network(self, model: Model, config: CallConfig | None = None) -> CompiledNetwork:
        """Transform and compile ``model``; per-call ``config`` overrides the plugin's."""

    @abc.abstractmethod
    def query_network(self, model: Model, config: CallConfig | None = None) -> dict[str, str]:
        """``{original node name: device}`` for every node this device can run.

        Unknown config keys are ignored here (the seed's ``throwOnUnsupported=false``) so a
        virtual device can pass one config to all of its devices.
        """

    @abc.abstractmethod
    def import_network(self, blob: bytes, config: CallConfig | None = None) -> CompiledNetwork:
        """Rebuild a network from :meth:`CompiledNetwork.export`; a foreign blob raises."""

    # --- what the operator vouches for: formats whose loading runs code
    #
    # ``load_network`` and ``import_network`` take models from anyone (a client's bytes, a
    # load's file overrides): a device never runs code a model carries there (a PyTorch
    # program, whose loaders unpickle and compile it; a Python model's ``model.py``), and
    # refuses such a model with PermissionDenied. The two below are for models the server's
    # operator put in its model repository on disk (or an in-process caller names as its
    # own, or an operator allowed from clients: ``--allow-code-from-clients``); the Core picks
    # one or the other (``Core.load_network(..., trusted=...)``). A device whose models never
    # run code needs neither: they are ``load_network`` and ``import_network``.

    def load_trusted(self, model: Model, config: CallConfig | None = None) -> CompiledNetwork:
        """:meth:`load_network` of a model from the operator: may load a format that runs the
        code it carries."""
        return self.load_network(model, config)

    def import_trusted(self, blob: bytes, config: CallConfig | None = None) -> CompiledNetwork:
        """:meth:`import_network` of a blob from the operator (the Core's compiled-model
        cache, for a trusted load): may load a format that runs the code it carries."""
        return self.import_network(blob, config)

    # --- a generative network whose weights the device runs itself (``plugins/decoding.py``)

    def load_decoder(
        self,
        folder: Path,
        model_config: Mapping[str, Any],
        config: CallConfig | None,
        capacity: int,
        slots: Callable[[int], int],
    ) -> tuple[Decoder, int, dict[str, Any]]:
        """A transformers folder's weights (safetensors: no graph) as a decoder on this
        device, its cache ``capacity`` tokens a slot: ``(decoder, slots, report)``, the slots
        ``slots(bytes per slot)`` (the engine's budget) allows, the report what the load
        chose (``precision``, ``torch_device``, ``weights_bytes``, ``load_seconds``). A
        device that runs graphs only refuses it."""
        raise InvalidArgument(
            "a safetensors folder (weights, not a graph) is served by the torch decoder on "
            f"TORCH (the CPU) or GPU (CUDA), not {self.name}; set the model's device, or "
            "export the model to ONNX (optimum-cli export onnx) for the other devices"
        )

    # --- optional hooks: every plugin has them; these defaults are for plugins without

    def unsupported_nodes(self, model: Model, config: CallConfig | None = None) -> dict[str, str]:
        """``{original node name: why}`` for nodes this device refuses (for error messages
        and ``plugserve query``); empty when the device gives no reasons."""
        return {}

    def query_with_reasons(
        self, model: Model, config: CallConfig | None = None
    ) -> tuple[dict[str, str], dict[str, str]]:
        """:meth:`query_network` and :meth:`unsupported_nodes` together: what QueryNetwork
        answers. A device that reads and transforms the model for each overrides this to do
        it once (any ``infer`` client may ask: NUMPY's two walks of a 20,000-node chain took
        3.1 s here, one takes 1.5 s; BENCHMARKS.md)."""
        return self.query_network(model, config), self.unsupported_nodes(model, config)

    def subgraphs(self, model: Model, config: CallConfig | None = None) -> list[dict[str, Any]]:
        """The split a load would make, ``[{"device": D, "nodes": [...]}, ...]`` in execution
        order; empty for devices that do not split a model."""
        return []

    def refusals(
        self, model: Model, config: CallConfig | None = None
    ) -> list[tuple[str, str, str]]:
        """``(node, device, why)`` for the nodes a virtual device's devices did not take;
        empty for a real device (:meth:`unsupported_nodes` gives its reasons)."""
        return []

    def precision_choices(self, config: Configuration) -> list[dict[str, str]]:
        """The config changes that give each precision ``config`` leaves open, fastest
        expected first (AUTO times each); one, no change, for a device that computes in the
        model's own precision."""
        return [{}]

    def add_extension(self, extension: Any) -> None:
        raise Unsupported(f"device {self.name} does not support extensions")

    def extension_names(self) -> list[str]:
        """``domain::op_type`` of every extension added (part of the model cache key)."""
        return []

    @property
    def type_rules(self) -> dict[tuple[str, str], Callable[..., Any]]:
        """``{(domain, op_type): rule}``: the output types of this device's custom ops, which
        ONNX cannot infer (HETERO types its cut points with them); none by default."""
        return {}

    def computed_types(self, graph: Any, names: Iterable[str]) -> dict[str, TensorSpec]:
        """``{value: spec}``: the element type and rank this device computes for each of
        ``names`` (values of ``graph``, a ``plugins.ir.Graph``, that ONNX's inference leaves
        without a rank), for HETERO to declare where it cuts; empty for a device that cannot
        tell."""
        return {}


class CompiledNetwork(abc.ABC):
    """A network compiled for one device: creates infer requests, exports itself.

    :attr:`executor` is the network's one streams executor, as OpenVINO's executor manager
    hands one to each compiled model for its device configuration: one stream per request the
    network can run at once (``OPTIMAL_NUMBER_OF_INFER_REQUESTS``), each stream holding its own
    infer request. In-process ``start_async`` and the server's requests both run on it; nothing
    schedules a network's requests a second time. It is started on first use (most in-process
    networks only ever run synchronously, and idle threads cost) and freed by :meth:`close`.
    """

    #: Whether a run may last as long as the request asks beyond its inputs' size (a Loop
    #: whose trip count or condition is data): such a network is never run on a thread that
    #: serves other clients too (the REST event loop). A plugin that knows its graph has none
    #: says so; unknown counts as open-ended.
    open_ended: bool = True
    #: Triton's platform name for what the network runs where it is not an ONNX model (a
    #: TorchScript program's ``pytorch_libtorch``); "" for an ONNX model. KServe's metadata and
    #: model config report it.
    platform: str = ""
    #: The streams, made on first use; declared here too so that ``__del__`` of a network
    #: whose ``__init__`` failed half way reads None.
    _executor: StreamsExecutor | None = None

    def graph_statistics(self) -> dict[str, int]:
        """Graph events of a network that replays input shapes as CUDA graphs (captured,
        replayed, evicted, failed: ``plugserve_graph_events`` on /metrics); {} for one that
        replays none (every device but the torch ones)."""
        return {}

    def cuda_graphs(self) -> int | None:
        """The input shapes each stream keeps as CUDA graphs (CUDA_GRAPHS; 0: graphs off) of
        a network that can replay them, reported as Triton's ``optimization.cuda.graphs`` in
        its model configuration; None for one that cannot (every device but the torch
        ones)."""
        return None

    def cuda_inputs(self) -> int | None:
        """The GPU whose memory the network takes inputs from without a host copy (a
        client's CUDA shared memory as ``plugins/cuda_array.CudaArray``, which its requests
        copy device to device), or None: its inputs come as host arrays (every device but
        the torch ones on CUDA)."""
        return None

    #: ``{state input: state output}`` its requests keep between runs (:meth:`keep_states`)
    state_pairs: Mapping[str, str] = {}
    #: what computes, before a run, the sizes of the outputs the request's values decide
    #: (``plugins/amplify.py``; set at load by a device that runs a graph whole), or None
    amplifying: Any = None
    #: Whether a request is answered by zero or many responses (Triton's decoupled
    #: transaction policy, a generative model's tokens): run with
    #: :meth:`InferRequest.infer_decoupled`, never with ``infer`` (``plugins/responses.py``).
    decoupled: bool = False
    #: The largest batch its own configuration allows, for a network that decides it itself
    #: (a Python model's ``auto_complete_config``); None: the repository's setting decides.
    max_batch_size: int | None = None
    #: Whether :meth:`ready` may take time (it asks a model's process): callers that serve
    #: other clients on the same thread (the REST event loop) call it on a worker thread.
    slow_readiness: bool = False
    #: Whether a request taken by a stream may still wait inside the network for others to
    #: batch with (BATCH's batcher, a Python model's dynamic batching): the network then says
    #: when each starts (``cancel.started``), which a queue policy counts waiting until.
    gathers: bool = False

    def __init__(self, plugin: Plugin, name: str, config: Configuration) -> None:
        self.plugin = plugin
        self.name = name
        self.config = config
        self.loaded_from_cache = False
        #: The model as plugins.shapecheck keeps it, to blame a failed run on its input shapes.
        self.shape_model: bytes | None = None
        self._inputs: list[TensorSpec] = []
        self._outputs: list[TensorSpec] = []
        self._executor: StreamsExecutor | None = None
        self._executor_lock = threading.Lock()

    @property
    def device(self) -> str:
        return self.plugin.name

    @property
    def inputs(self) -> list[TensorSpec]:
        """The network's inputs: what a plugin's network sets as ``_inputs`` when it is made
        (a network that wraps another one returns that one's instead)."""
        return self._inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._outputs

    @property
    def precision(self) -> str:
        """The precision float32 values are computed in: ``f32`` unless the device reduces
        it (OPENVINO's bf16 or f16), for logs, listings and the metric label; a network made
        of several devices names each of theirs (``bf16+f32``)."""
        return "f32"

    def keep_states(self, pairs: Mapping[str, str]) -> None:
        """Make its requests keep these input/output pairs as variable states: :meth:`infer`
        feeds each state input from the request and keeps the state output for the next
        run, leaving both out of what it takes and gives (the Core calls this with a load's
        STATE_PAIRS). A network that delegates to another passes them on."""
        check_state_pairs(f"network {self.name}", pairs, self.inputs, self.outputs)
        self.state_pairs = dict(pairs)

    def initial_state(self, name: str) -> np.ndarray:
        return initial_value(next(s for s in self.inputs if s.name == name))

    @abc.abstractmethod
    def create_infer_request(self) -> InferRequest: ...

    @abc.abstractmethod
    def export(self) -> bytes: ...

    def supported_metrics(self) -> list[str]:
        return [
            "SUPPORTED_METRICS",
            "NETWORK_NAME",
            "OPTIMAL_NUMBER_OF_INFER_REQUESTS",
            "SUPPORTED_CONFIG_KEYS",
            "INFERENCE_PRECISION",
        ]

    def get_metric(self, name: str) -> Any:
        if name not in self.supported_metrics():
            raise NotFound(
                f"network {self.name}: unsupported metric {name!r}; "
                f"supported: {', '.join(self.supported_metrics())}"
            )
        return self._metric(name)

    def _metric(self, name: str) -> Any:
        values = {
            "SUPPORTED_METRICS": self.supported_metrics(),
            "NETWORK_NAME": self.name,
            "OPTIMAL_NUMBER_OF_INFER_REQUESTS": self.config.streams(),
            "SUPPORTED_CONFIG_KEYS": list(self.config.keys()),
            "INFERENCE_PRECISION": self.precision,
        }
        return values[name]

    def get_config(self, key: str) -> Any:
        return self.config.get(key)

    def infer(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Shorthand for one synchronous inference on a fresh request."""
        return self.create_infer_request().infer(inputs)

    # --- the streams async requests run on

    @property
    def executor(self) -> StreamsExecutor:
        """The streams this network's requests run on, started on first use (under a lock, so
        that requests starting at once share one executor)."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = self._new_executor()
            return self._executor

    def _new_executor(self) -> StreamsExecutor:
        """As many streams as ``OPTIMAL_NUMBER_OF_INFER_REQUESTS``, each making its own infer
        request on first use."""
        streams = int(self.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        ref = weakref.ref(self)  # the stream threads must not keep this network alive
        return StreamsExecutor(
            f"{self.device}/{self.name}", streams, state_factory=lambda _i: _new_request(ref)
        )

    def each_stream(self, fn: Callable[[InferRequest], Any]) -> list[Any]:
        """``fn(request)`` on the infer request of each of the streams its requests run on,
        one after another on the calling thread (each made now if it was not): at load, before
        the network serves (``server/control/warmup.py``: Triton's ``model_warmup`` runs on
        every instance). A network whose requests run on another's streams (BATCH) passes it
        on."""
        return self.executor.each_stream(fn)

    def ready(self) -> bool:
        """Whether the network serves now, as model readiness reports it (a Python model's
        processes running and its ``is_ready()``); a loaded network is, unless it says."""
        return True

    def unready_reasons(self) -> list[str]:
        """Why the network cannot serve now, one line each, as the server's readiness reports
        it (an ensemble whose step's model is not loaded); empty (the default): it can. Asked
        at every readiness request, so it must be cheap."""
        return []

    def step_models(self) -> set[str]:
        """The models this network runs through the server (an ensemble's steps), which it
        cannot serve without: on-demand loading unloads it before any of them
        (``server/control/on_demand.py``); empty (the default): none."""
        return set()

    def batch_statistics(self) -> dict[int, tuple[int, int]] | None:
        """``{rows: (batches run, nanoseconds)}`` of a network that gathers requests into
        batches; None for one that does not batch."""
        return None

    def batching(self) -> tuple[int, float] | None:
        """``(batch size, timeout ms)`` of a network that gathers requests into batches."""
        return None

    def sequences_for(self, admission: Callable[..., Any]) -> Any:
        """What passes sequence requests (Triton's correlation id and flags) on to networks
        this one runs, given the server's admission for it: an ensemble whose step is a
        sequence model answers its relay. None (the default): the network keeps no sequences
        of its own and passes none on."""
        return None

    def close(self) -> None:
        """Stop the streams: queued requests still run, new ones are refused.

        Plugins that own more (child networks, temporary files) extend this.
        """
        self._shutdown_executor()

    def _shutdown_executor(self) -> None:
        executor = self._executor  # None too in a network whose __init__ failed half way
        if executor is not None:
            executor.shutdown(wait=False)

    def __del__(self) -> None:
        # only the threads: a dropped network must not leave them waiting forever, but closing
        # what else it owns (child networks) is for close(), which its owner calls
        self._shutdown_executor()


class InferRequest(abc.ABC):
    """One inference at a time, synchronous (:meth:`infer`) or not (:meth:`start_async`).

    The async form runs on the compiled network's streams; ``wait()`` returns the outputs or
    raises the inference's error, and a callback given to ``start_async`` is called with
    ``(outputs, error)`` when it completes.
    """

    def __init__(self, network: CompiledNetwork) -> None:
        self.network = network
        self._states: dict[str, VariableState] | None = None
        self._future: Any = None
        #: the cancellation token of the run under way (None: nothing runs)
        self._token: cancel.Token | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A request class is checked when it is made: the server, and a virtual device
        handing a run to its children, call :meth:`infer_checked` with the run's context
        (``plugins/run_context.py``), so a device implements :meth:`_infer` (or
        :meth:`infer_checked`) taking it. One written the old way (``_infer(self, arrays)``,
        or ``infer(self, inputs)`` alone, which no server path calls) is refused here, naming
        the signature to write, rather than run without its request on some paths."""
        super().__init_subclass__(**kwargs)
        for name in ("_infer", "infer_checked", "infer"):
            own = cls.__dict__.get(name)
            if own is not None and _positional(own) < 3:
                raise TypeError(
                    f"{cls.__qualname__}.{name} takes no run context; write "
                    f"{_SIGNATURES[name]} (plugins/run_context.py; docs/plugins.md)"
                )
        if "infer" in cls.__dict__ and "infer_checked" not in cls.__dict__:
            raise TypeError(
                f"{cls.__qualname__} overrides infer alone, which the server never calls (it "
                f"calls infer_checked with checked inputs); override "
                f"{_SIGNATURES['_infer']} instead (docs/plugins.md)"
            )

    def infer(
        self, inputs: Mapping[str, Any], run: RunContext | None = None
    ) -> dict[str, np.ndarray]:
        """OpenVINO's ``sync_infer_request``: check the inputs against the network's specs,
        :meth:`_feed` them (the backend's form), then :meth:`_run`. Plugins implement those
        two, or :meth:`_infer` where the backend runs the request itself. A network that
        keeps states (:meth:`CompiledNetwork.keep_states`) is fed them here, and keeps what
        its state outputs give for the next run. ``run``: as :meth:`infer_checked`'s."""
        pairs = self.network.state_pairs
        if not pairs:
            return self._checked(check_inputs(self.network.name, self.network.inputs, inputs), run)
        states = {s.name: s for s in self.query_state()}
        feed = {**{name: state.state for name, state in states.items()}, **inputs}
        outputs = self._checked(check_inputs(self.network.name, self.network.inputs, feed), run)
        for name, output in pairs.items():
            states[name].state = outputs.pop(output)
        return outputs

    def query_state(self) -> list[VariableState]:
        """OpenVINO's ``query_state``: the states this request keeps, one per state input
        (none for a network without STATE_PAIRS)."""
        if self._states is None:
            self._states = {
                name: VariableState(name, self.network.initial_state(name))
                for name in self.network.state_pairs
            }
        return list(self._states.values())

    def reset_state(self) -> None:
        """OpenVINO's ``reset_state``: every state back to its start (a new sequence)."""
        for state in self.query_state():
            state.reset()

    def infer_checked(
        self, arrays: list[Any], run: RunContext | None = None
    ) -> dict[str, np.ndarray]:
        """:meth:`infer` for inputs already checked by :func:`check_inputs` (in declared
        order): the server's DataPlane checks once at its edge, and MULTI, AUTO and BATCH hand
        their device the values they checked against the same specs.

        ``run``: the request the run serves, as the device sees it
        (``plugins/run_context.py``: its cancellation token, the room an output may take, the
        outputs wanted, its id, parameters, sequence and trace), handed down explicitly by the
        server and by a virtual device to its children (HETERO: each piece its own, with
        ``run_context.for_piece``). Without one (an in-process call) it is told only its
        cancellation (``run_context.untold``): the token of the run under way on this thread,
        else a token of its own, so :meth:`cancel` stops it either way."""
        return self._checked(arrays, run)

    #: whether :meth:`infer_into` has the device write the named outputs straight into the
    #: caller's arrays (and lets an output share an input's memory: a key/value cache
    #: updated in place, as onnxruntime's past/present buffer sharing); else the base runs
    #: the network and copies each output into its array
    binds_outputs: ClassVar[bool] = False

    def infer_into(
        self,
        arrays: list[Any],
        outputs: Mapping[str, np.ndarray],
        run: RunContext | None = None,
    ) -> dict[str, np.ndarray]:
        """:meth:`infer_checked` with the named outputs written into the given arrays
        (OpenVINO's ``set_output_tensor``): each must be C-contiguous with the output's element
        type and the shape this run gives it. Returns every output, the given arrays for the
        named ones. A device whose requests do not bind outputs (:attr:`binds_outputs` False)
        computes them elsewhere and copies them in; an output sharing an input's memory then
        sees the input read before it is written, as in a device that binds."""
        result = self.infer_checked(arrays, run)
        for name, target in outputs.items():
            value = result[name]
            if value is not target:
                np.copyto(target, value)
            result[name] = target
        return result

    def infer_decoupled(
        self, arrays: list[Any], sender: ResponseSender, run: RunContext | None = None
    ) -> None:
        """Run checked inputs, answering through ``sender`` (``plugins/responses.py``): a
        decoupled network's requests send zero or many responses, possibly after this returns,
        and end with ``final``. This default serves a network that is not decoupled (a
        decoupled BLS call or a generate_stream to an ordinary model): its one answer, final.
        ``run``: as :meth:`infer_checked`'s."""
        sender.send(Response(self.infer_checked(arrays, run)), final=True)

    def _checked(self, arrays: list[Any], run: RunContext | None = None) -> dict[str, np.ndarray]:
        """The run of checked inputs under its context (both :meth:`infer` and
        :meth:`infer_checked`: a plugin overriding one of them calls the other's base), handed
        to :meth:`_infer`. While it runs, its token is the run under way on this thread (what
        the device's checkpoints, and a nested run given no context, answer to) and the
        context is ``run_context.current()`` (what NUMPY's kernels read). Every small server
        request passes here: kept to two context-variable sets. Without ``run``: see
        ``run_context.untold``."""
        if run is None:
            run = run_context.untold()
        token = run.token
        if token.error is not None:
            raise token.failure()
        probe = self.network.amplifying
        if probe is not None and (run.room or run.answer):  # sizes its values decide
            probe.check(self.network.inputs, arrays, run)
        entered = cancel.enter(token)
        told = run_context.enter(run)
        self._token = token
        try:
            return self._infer(arrays, run)
        finally:
            self._token = None
            run_context.leave(told)
            cancel.leave(entered)

    def _under(
        self, token: cancel.Token, run: Callable[[_Prepared], dict[str, np.ndarray]], value: Any
    ) -> dict[str, np.ndarray]:
        """``run(value)`` as this request's run under way, answering to ``token``."""
        token.raise_if_cancelled()
        self._token = token
        try:
            return run(value)
        finally:
            self._token = None

    def cancel(self) -> None:
        """OpenVINO's ``cancel``: the run under way (synchronous on another thread, or started
        with :meth:`start_async`) stops with :class:`Cancelled` as soon as its device can
        stop (NUMPY: before its next node or loop iteration; ORT: its next node; OPENVINO:
        after the node running, see ``plugserve devices``); a run still queued is dropped.
        With nothing running it does nothing."""
        token = self._token
        if token is not None:
            token.cancel(Cancelled(f"network {self.network.name}: the request was cancelled"))
        future = self._future
        if future is not None:
            future.cancel()

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        """The device's run of checked inputs told its request (``run``), which it reads what
        it needs of; by default :meth:`_feed` then :meth:`_run`, for a device that needs
        nothing of it but its token (and, NUMPY, what its kernels read:
        ``run_context.current()``)."""
        return self._run(self._feed(arrays))

    def start_async(self, inputs: Mapping[str, Any], callback: Callback | None = None) -> None:
        """The same stages, the run on a stream of the network (see :meth:`_start`)."""
        self._start(inputs, self._prepare, self._run, callback)

    def _prepare(self, inputs: Mapping[str, Any]) -> Any:
        return self._feed(check_inputs(self.network.name, self.network.inputs, inputs))

    def _feed(self, arrays: list[Any]) -> Any:
        """Checked inputs in the form :meth:`_run` takes (as they are by default)."""
        return arrays

    def _run(self, prepared: Any) -> dict[str, np.ndarray]:
        raise Unsupported(f"{type(self).__name__} does not run requests itself")

    # --- helpers for start_async

    def _busy(self) -> bool:
        """Whether an async run started here has not finished yet."""
        return self._future is not None and not self._future.done()

    def _refuse_if_busy(self) -> None:
        """One run at a time: a request reuses its state (inputs, sessions, counters), and
        ``wait()`` must know which run it waits for."""
        if self._busy():
            raise FailedPrecondition("this request is still running: wait() for it first")

    def _track(self, future: Future, callback: Callback | None) -> None:
        """Make ``future`` the run ``wait()`` waits for, calling ``callback(outputs, error)``
        when it completes (on the thread that completes it)."""
        if callback is not None:
            future.add_done_callback(lambda f: _call_back(callback, f))
        self._future = future

    def _start(
        self,
        inputs: Mapping[str, Any],
        prepare: Callable[[Mapping[str, Any]], _Prepared],
        run: Callable[[_Prepared], dict[str, np.ndarray]],
        callback: Callback | None,
    ) -> None:
        """``start_async`` for a request that runs on its network's streams
        (:attr:`CompiledNetwork.executor`): refuse while busy, ``prepare`` (check) the inputs
        here so bad ones raise to the caller, then ``run`` the prepared inputs on a stream.

        The order matters: a busy request refuses before its inputs are looked at, and input
        errors are raised at once rather than through ``wait()``.
        """
        self._refuse_if_busy()
        prepared = prepare(inputs)
        token = cancel.Token()

        def on_stream(_state: Any) -> dict[str, np.ndarray]:
            with cancel.running(token):
                return self._under(token, run, prepared)

        future = self.network.executor.submit(on_stream, stateless=True, token=token)
        self._track(future, callback)

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        if self._future is None:
            raise FailedPrecondition("wait() called before start_async()")
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        finally:
            if self._future.done():
                self._future = None

    @abc.abstractmethod
    def get_performance_counts(self) -> list[PerfCount]: ...

    def _require_perf_counts(self) -> None:
        """Counts exist only for networks loaded with PERF_COUNT=YES; say how to get them."""
        if not self.network.config.get("PERF_COUNT"):
            raise FailedPrecondition(
                f"network {self.network.name}: performance counters are off; "
                "load it with PERF_COUNT=YES"
            )


#: the signatures a request class writes, as :meth:`InferRequest.__init_subclass__` names them
_SIGNATURES = {
    "_infer": "_infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]",
    "infer_checked": (
        "infer_checked(self, arrays: list[Any], run: RunContext | None = None) "
        "-> dict[str, np.ndarray]"
    ),
    "infer": (
        "infer(self, inputs: Mapping[str, Any], run: RunContext | None = None) "
        "-> dict[str, np.ndarray]"
    ),
}


def _positional(function: Callable[..., Any]) -> int:
    """How many positional parameters ``function`` takes (a ``*args`` counts as many)."""
    code = getattr(function, "__code__", None)
    if code is None or code.co_flags & 0x04:  # not plain Python, or *args
        return 99
    return code.co_argcount


def joined_precision(networks: Iterable[CompiledNetwork]) -> str:
    """The precisions of several networks, each once in their order (``bf16+f32``)."""
    return "+".join(dict.fromkeys(n.precision for n in networks)) or "f32"


def _new_request(ref: weakref.ref[CompiledNetwork]) -> InferRequest:
    network = ref()
    if network is None:
        raise Cancelled("the network was dropped before its stream ran")
    return network.create_infer_request()


def _call_back(callback: Callback, future: Future) -> None:
    error = future.exception()
    if error is not None:
        callback(None, error)
    else:
        callback(future.result(), None)
