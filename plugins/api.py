"""The Plugin API: what every device plugin implements and what users of plugserve call.

It follows the OpenVINO plugin guide (``shared/seeds``): a :class:`Plugin` is a device that
loads or imports networks, a :class:`CompiledNetwork` is a network compiled for that device,
and an :class:`InferRequest` runs it. Errors are typed here so that the server can map every
one of them to a gRPC status in one place and users can catch what they can act on.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.errors import (
    BackendUnavailable,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InferenceError,
    InvalidArgument,
    InvalidInput,
    InvalidModel,
    NotFound,
    PlugserveError,
    ResourceExhausted,
    Unsupported,
)

if TYPE_CHECKING:
    from plugserve.plugins.streams import StreamsExecutor

__all__ = [
    "BackendUnavailable",
    "Callback",
    "Cancelled",
    "CompiledNetwork",
    "ConfigKey",
    "Configuration",
    "DeadlineExceeded",
    "Devices",
    "FailedPrecondition",
    "InferRequest",
    "InferenceError",
    "InvalidArgument",
    "InvalidInput",
    "InvalidModel",
    "NotFound",
    "PerfCount",
    "Plugin",
    "PlugserveError",
    "ResourceExhausted",
    "Unsupported",
    "available_cores",
    "check_input_shape",
    "device_refusals",
    "joined_precision",
    "listing",
    "refusal_reasons",
    "refuse_non_tensors",
]


def listing(items: Iterable[Any], limit: int = 10, plain: bool = False) -> str:
    """``['a', 'b'] ... and 990 more`` (``plain``: ``a, b ... and 990 more``): names for an
    error message, however many a caller sent (a status message travels in a header)."""
    items = list(items)
    shown = ", ".join(map(str, items[:limit])) if plain else repr(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


# --------------------------------------------------------------------------- configuration


def _parse_bool(value: str) -> bool:
    text = str(value).strip().upper()
    if text in ("YES", "TRUE", "1", "ON"):
        return True
    if text in ("NO", "FALSE", "0", "OFF"):
        return False
    raise ValueError("expected YES or NO")


def _format_bool(value: bool) -> str:
    return "YES" if value else "NO"


def _parse_non_negative_int(value: str) -> int:
    number = int(str(value).strip())
    if number < 0:
        raise ValueError("expected an integer >= 0")
    return number


def _parse_hint(value: str) -> str:
    text = str(value).strip().upper()
    if text not in ("LATENCY", "THROUGHPUT", ""):
        raise ValueError("expected LATENCY or THROUGHPUT")
    return text


def _parse_mode(value: str) -> str:
    text = str(value).strip().upper()
    if text not in ("PERFORMANCE", "ACCURACY"):
        raise ValueError("expected PERFORMANCE or ACCURACY")
    return text


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One configuration key: how its string form is parsed, shown and defaulted."""

    name: str
    default: Any
    parse: Callable[[str], Any] = str
    format: Callable[[Any], str] = str
    doc: str = ""


BOOL = {"parse": _parse_bool, "format": _format_bool}


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name, for a device's FULL_DEVICE_NAME."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


class Configuration:
    """A plugin's configuration: every key parsed once, unknown keys refused.

    Like the template plugin's ``Configuration(config, defaultCfg, throwOnUnsupported)``: a new
    configuration starts from ``defaults`` (the plugin's current one) and overrides key by key,
    which is how per-call config beats the plugin's own (seed note on LoadExeNetworkImpl).
    Subclasses extend ``KEYS`` with their own keys.
    """

    KEYS: ClassVar[tuple[ConfigKey, ...]] = (
        ConfigKey("DEVICE_ID", "", doc="which device of this plugin's kind"),
        ConfigKey("PERF_COUNT", False, **BOOL, doc="collect per-node timings"),
        ConfigKey("PERFORMANCE_HINT", "LATENCY", _parse_hint, doc="LATENCY or THROUGHPUT"),
        ConfigKey(
            "EXECUTION_MODE_HINT",
            "PERFORMANCE",
            _parse_mode,
            doc=(
                "PERFORMANCE (default): the device's fastest precision (openvino: bf16 on CPUs "
                "with it); ACCURACY: the model's own precision on every device"
            ),
        ),
        ConfigKey("NUM_STREAMS", 0, _parse_non_negative_int, doc="0: derived from the hint"),
        ConfigKey("INFERENCE_NUM_THREADS", 0, _parse_non_negative_int, doc="0: all cores"),
        ConfigKey("CACHE_DIR", "", doc="folder for compiled networks; empty: no cache"),
    )

    def __init__(
        self,
        values: Mapping[str, Any] | None = None,
        defaults: Configuration | None = None,
        throw_on_unsupported: bool = True,
    ) -> None:
        keys = self.keys()
        self._values: dict[str, Any] = (
            dict(defaults._values)
            if defaults is not None
            else {k.name: k.default for k in keys.values()}
        )
        for name, raw in (values or {}).items():
            key = keys.get(name)
            if key is None:
                if throw_on_unsupported:
                    raise InvalidArgument(
                        f"unsupported config key {name!r}; supported keys: {', '.join(keys)}"
                    )
                continue
            if isinstance(raw, str) or key.parse is str:
                try:
                    value = key.parse(str(raw))
                except (TypeError, ValueError) as exc:
                    raise InvalidArgument(
                        f"config key {name!r}: bad value {raw!r} ({exc})"
                    ) from None
            else:
                value = raw
                try:
                    key.parse(key.format(raw))
                except (TypeError, ValueError) as exc:
                    raise InvalidArgument(
                        f"config key {name!r}: bad value {raw!r} ({exc})"
                    ) from None
            self._values[name] = value

    @classmethod
    def keys(cls) -> dict[str, ConfigKey]:
        return {k.name: k for k in cls.KEYS}

    def get(self, name: str) -> Any:
        """The parsed value of ``name``; an unknown key raises (seed: GetConfig must throw)."""
        if name not in self._values:
            raise InvalidArgument(
                f"unsupported config key {name!r}; supported keys: {', '.join(self.keys())}"
            )
        return self._values[name]

    def get_string(self, name: str) -> str:
        return self.keys()[name].format(self.get(name)) if name in self._values else self.get(name)

    def to_strings(self) -> dict[str, str]:
        """All keys in their string form, as exported and shown to users."""
        return {name: self.keys()[name].format(value) for name, value in self._values.items()}

    def __getitem__(self, name: str) -> Any:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values == self._values  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_strings()})"

    def streams(self, cores: int | None = None) -> int:
        """How many streams to run: NUM_STREAMS if set, else from PERFORMANCE_HINT."""
        if self.get("NUM_STREAMS"):
            return int(self.get("NUM_STREAMS"))
        if self.get("PERFORMANCE_HINT") == "THROUGHPUT":
            return max(1, cores or available_cores())
        return 1

    def threads_per_stream(self, cores: int | None = None) -> int:
        """Backend threads each stream's request runs with, so that streams x threads stays
        within the cores (INFERENCE_NUM_THREADS, when set, is the total budget instead)."""
        total = int(self.get("INFERENCE_NUM_THREADS") or 0) or cores or available_cores()
        return max(1, total // self.streams(cores))


# --------------------------------------------------------------------------- results


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


# --------------------------------------------------------------------------- plugin classes

Model = Any  # a path (str | os.PathLike), bytes, or onnx.ModelProto

#: What ``start_async`` calls when a run completes: ``(outputs, None)`` or ``(None, error)``.
Callback = Callable[[dict[str, np.ndarray] | None, BaseException | None], None]

_Prepared = TypeVar("_Prepared")  # what a request makes of its inputs before running them


@runtime_checkable
class Devices(Protocol):
    """What a virtual plugin (HETERO, MULTI, AUTO, BATCH) may ask of the Core.

    The Core hands itself to every plugin as ``plugin.devices`` after constructing it, so a
    plugin that composes others never imports the server.
    """

    @property
    def available_devices(self) -> list[str]: ...

    def plugin(self, device: str) -> Plugin: ...

    def load_network(
        self, model: Model, device: str, config: Mapping[str, Any] | None = None
    ) -> CompiledNetwork: ...

    def query_network(
        self, model: Model, device: str, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]: ...

    def import_network(
        self, data: bytes, device: str, config: Mapping[str, Any] | None = None
    ) -> CompiledNetwork: ...


class Plugin(abc.ABC):
    """A device. The constructor raises :class:`BackendUnavailable` when the backend cannot work."""

    #: The device name users write (``NUMPY``, ``ORT``); set by subclasses.
    name: ClassVar[str] = ""
    config_class: ClassVar[type[Configuration]] = Configuration
    #: How soon a running inference stops once cancelled (its deadline, its client gone,
    #: ``InferRequest.cancel()``): the CANCELLATION metric, shown by ``plugserve devices``.
    cancellation: ClassVar[str] = "never: a run goes on to its end"

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

    def merged_config(self, config: Mapping[str, Any] | None, strict: bool = True) -> Configuration:
        """The plugin's configuration overridden by a per-call ``config``."""
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

    def _unpack(
        self, data: bytes, config: Mapping[str, Any] | None
    ) -> tuple[dict[str, Any], bytes, Any]:
        """An exported blob of this device: its header, its payload, and the configuration
        to import it with (the per-call ``config`` over the one it was exported with; keys of
        the saved one this build no longer knows are dropped, not refused)."""
        from plugserve.plugins import blob

        header, payload = blob.unpack(data, self.name, self.architecture)
        saved = self.config_class(header.get("config", {}), throw_on_unsupported=False)
        return header, payload, self.config_class(config or {}, saved)

    # --- networks

    @abc.abstractmethod
    def load_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> CompiledNetwork:
        """Transform and compile ``model``; per-call ``config`` overrides the plugin's."""

    @abc.abstractmethod
    def query_network(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """``{original node name: device}`` for every node this device can run.

        Unknown config keys are ignored here (the seed's ``throwOnUnsupported=false``) so a
        virtual device can pass one config to all of its devices.
        """

    @abc.abstractmethod
    def import_network(
        self, blob: bytes, config: Mapping[str, Any] | None = None
    ) -> CompiledNetwork:
        """Rebuild a network from :meth:`CompiledNetwork.export`; a foreign blob raises."""

    # --- optional hooks: every plugin has them; these defaults are for plugins without

    def unsupported_nodes(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> dict[str, str]:
        """``{original node name: why}`` for nodes this device refuses (for error messages
        and ``plugserve query``); empty when the device gives no reasons."""
        return {}

    def subgraphs(
        self, model: Model, config: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """The split a load would make, ``[{"device": D, "nodes": [...]}, ...]`` in execution
        order; empty for devices that do not split a model."""
        return []

    def refusals(
        self, model: Model, config: Mapping[str, Any] | None = None
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
        # imported here: streams.py imports this module's errors
        from plugserve.plugins.streams import StreamsExecutor

        streams = int(self.get_metric("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
        ref = weakref.ref(self)  # the stream threads must not keep this network alive
        return StreamsExecutor(
            f"{self.device}/{self.name}", streams, state_factory=lambda _i: _new_request(ref)
        )

    def batch_statistics(self) -> dict[int, tuple[int, int]] | None:
        """``{rows: (batches run, nanoseconds)}`` of a network that gathers requests into
        batches; None for one that does not batch."""
        return None

    def batching(self) -> tuple[int, float] | None:
        """``(batch size, timeout ms)`` of a network that gathers requests into batches."""
        return None

    def close(self) -> None:
        """Stop the streams: queued requests still run, new ones are refused.

        Plugins that own more (child networks, temporary files) extend this.
        """
        self._shutdown_executor()

    def _shutdown_executor(self) -> None:
        # getattr: also called from __del__ of a network whose __init__ failed half way
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)

    def __del__(self) -> None:
        # only the threads: a dropped network must not leave them waiting forever, but closing
        # what else it owns (child networks) is for close(), which its owner calls
        self._shutdown_executor()


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A network input or output: name, element type and shape (``None`` or a name if dynamic).

    ``kind`` is ``"tensor"``, or what ONNX calls the other value types (``"sequence"``,
    ``"map"``, ``"optional"``): those have no element type or shape here, run in-process
    (lists, dicts, None) and have no encoding on the wire.

    ``binary``: a string input whose elements may be ``bytes`` that are not UTF-8 text. BYTES
    travel byte for byte (``proto.tensors``); a network that reads its strings as text
    (StringNormalizer, a tokenizer, onnxruntime, whose Python API carries text only) would
    garble or refuse such an element deep inside, so :func:`check_inputs` refuses it up front
    unless the device says the input only moves its elements (NUMPY's Identity, Reshape...).
    """

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None
    kind: str = "tensor"
    binary: bool = False

    def describe(self) -> str:
        if self.kind != "tensor":
            return f"{self.name}: {self.kind}"
        dims = (
            "?"
            if self.shape is None
            else "["
            + ",".join(
                "?" if d is None or (isinstance(d, int) and d < 0) else str(d) for d in self.shape
            )
            + "]"
        )
        return f"{self.name}: {self.dtype if self.dtype is not None else '?'}{dims}"


class InferRequest(abc.ABC):
    """One inference at a time, synchronous (:meth:`infer`) or not (:meth:`start_async`).

    The async form runs on the compiled network's streams; ``wait()`` returns the outputs or
    raises the inference's error, and a callback given to ``start_async`` is called with
    ``(outputs, error)`` when it completes.
    """

    def __init__(self, network: CompiledNetwork) -> None:
        self.network = network
        self._future: Any = None
        #: the cancellation token of the run under way (None: nothing runs)
        self._token: cancel.Token | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A request class that overrides :meth:`infer` alone (a plugin written before
        :meth:`infer_checked` existed) keeps being called through it on every path."""
        super().__init_subclass__(**kwargs)
        if "infer" in cls.__dict__ and "infer_checked" not in cls.__dict__:

            def through_infer(self: InferRequest, arrays: list[Any]) -> dict[str, np.ndarray]:
                return self.infer({s.name: a for s, a in zip(self.network.inputs, arrays)})

            cls.infer_checked = through_infer  # type: ignore[method-assign]

    def infer(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """OpenVINO's ``sync_infer_request``: check the inputs against the network's specs,
        :meth:`_feed` them (the backend's form), then :meth:`_run`. Plugins implement those
        two, or :meth:`_infer` where the backend runs the request itself."""
        return self._checked(check_inputs(self.network.name, self.network.inputs, inputs))

    def infer_checked(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        """:meth:`infer` for inputs already checked by :func:`check_inputs` (in declared
        order): the server's DataPlane checks once at its edge, and MULTI, AUTO and BATCH hand
        their device the values they checked against the same specs.

        The run answers to the token of the run under way on this thread (the server's, or a
        virtual device's parent request's), else to a token of its own, so :meth:`cancel`
        stops it either way."""
        return self._checked(arrays)

    def _checked(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        """The run of checked inputs under its token (both :meth:`infer` and
        :meth:`infer_checked`: a plugin overriding one of them calls the other's base)."""
        token = cancel.current()
        if token is None:
            with cancel.running(cancel.Token()) as token:
                return self._under(token, self._infer, arrays)
        return self._under(token, self._infer, arrays)

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

    def _infer(self, arrays: list[Any]) -> dict[str, np.ndarray]:
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


def refusal_reasons(
    devices: Devices, model: Model, device: str, config: Mapping[str, Any], nodes: Iterable[str]
) -> dict[str, str]:
    """``{node: why device did not take it}`` for ``nodes``, in the device's own words (its
    ``unsupported_nodes``, which a plugin offers beside ``query_network``), for the virtual
    devices' ``refusals``. A device that cannot read the model at all says so for each."""
    explain = getattr(devices.plugin(device), "unsupported_nodes", None)
    try:
        reasons = dict(explain(model, config)) if explain is not None else {}
    except PlugserveError as exc:
        return dict.fromkeys(nodes, f"{device} cannot read the model: {exc}")
    return {n: reasons.get(n, f"not in {device}'s QueryNetwork answer") for n in nodes}


def device_refusals(
    devices: Devices, model: Model, device: str, config: Mapping[str, Any], nodes: Iterable[str]
) -> list[tuple[str, str, str]]:
    """``(node, device, why)`` for each of ``nodes`` that ``device``'s QueryNetwork leaves
    out (all of them when it cannot read the model)."""
    try:
        supported = devices.query_network(model, device, config)
    except PlugserveError:
        supported = {}
    missing = [n for n in nodes if n not in supported]
    why = refusal_reasons(devices, model, device, config, missing)
    return [(n, device, why[n]) for n in missing]


def check_inputs(
    network_name: str, specs: Sequence[TensorSpec], inputs: Mapping[str, Any]
) -> list[np.ndarray]:
    """Inputs in declared order, checked against the specs with errors a person can act on.

    An input is refused only when its rank, a fixed dimension or its element type differs, as
    onnxruntime and OpenVINO refuse it. A named dimension (``batch``, ``?``, ``unk__123``) is
    not a contract between inputs, nor between two axes of one input: exporters reuse ``?``
    and ``-1`` for unrelated dimensions, and a model whose dimensions really must agree fails
    in the node that needs them to, naming it. Arrays come back in native byte order with
    their rank untouched (a 0-d array stays 0-d); contiguity is each device's business.
    """
    if not isinstance(inputs, Mapping):
        raise InvalidInput(f"network {network_name}: inputs must be a mapping name -> array")
    names = [s.name for s in specs]
    extra = [n for n in inputs if n not in names]
    if extra:
        raise InvalidInput(
            f"network {network_name}: unknown input(s) {listing(extra)}; the network's inputs "
            "are "
            + ", ".join(s.describe() for s in specs[:10])
            + (f" ... and {len(specs) - 10} more" if len(specs) > 10 else "")
        )
    arrays: list[np.ndarray] = []
    for spec in specs:
        if spec.name not in inputs:
            raise InvalidInput(f"network {network_name}: missing input {spec.describe()}")
        arrays.append(_check_one(network_name, spec, inputs[spec.name]))
    return arrays


def check_element_type(network_name: str, spec: TensorSpec, dtype: np.dtype) -> None:
    """Refuses ``dtype`` for ``spec``'s input. Protocols call it before decoding a tensor's
    data, so a wrong-typed tensor is refused before its bytes become Python objects."""
    if spec.dtype is None or dtype == spec.dtype:
        return
    if spec.dtype == np.dtype(object) and dtype.kind in "USO":
        return
    raise InvalidInput(
        f"network {network_name}: input {spec.name!r} has element type {dtype}, "
        f"expected {spec.dtype}"
    )


def _check_one(network_name: str, spec: TensorSpec, value: Any) -> np.ndarray:
    if value is None:
        if spec.dtype is None and spec.shape is None:  # an optional input left empty
            return value  # type: ignore[return-value]
        raise InvalidInput(f"network {network_name}: input {spec.describe()} has no value")
    if isinstance(value, list | tuple) and spec.dtype is not None and spec.dtype != object:
        value = np.asarray(value, dtype=spec.dtype)
    elif not isinstance(value, np.ndarray | list | dict):
        value = np.asarray(value)
    if isinstance(value, list | dict):  # a sequence or a map input (ai.onnx.ml)
        return value  # type: ignore[return-value]
    if not value.dtype.isnative and value.dtype.kind not in "OUSV":
        value = value.astype(value.dtype.newbyteorder("="))  # same values, native bytes
    if spec.dtype is not None and value.dtype != spec.dtype:
        check_element_type(network_name, spec, value.dtype)
        value = value.astype(object)  # text given as numpy str for a string input
    if value.dtype == object and not spec.binary:
        _refuse_binary(network_name, spec, value)
    check_input_shape(network_name, spec, value.shape)
    return value


def _refuse_binary(network_name: str, spec: TensorSpec, value: np.ndarray) -> None:
    """A string input of a network that reads it as text: an element that is bytes must be
    UTF-8 (see ``TensorSpec.binary``)."""
    for index, item in enumerate(value.ravel()):
        if type(item) is bytes:
            try:
                item.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(
                    f"network {network_name}: input {spec.name!r} element {index} is not UTF-8 "
                    f"text ({item[:16]!r}{'...' if len(item) > 16 else ''}: {exc.reason} at "
                    f"byte {exc.start}), and this network takes that input as text only; send "
                    "UTF-8 text, or serve a model that only moves the bytes (Identity, Reshape, "
                    "Concat, Gather...) on NUMPY"
                ) from None


def check_input_shape(network_name: str, spec: TensorSpec, shape: Sequence[int]) -> None:
    """Refuse an input of ``shape`` that the network's ``spec`` rules out: its rank, or a
    static dimension (a protocol asks it before it decodes the data, too)."""
    if spec.shape is None:
        return
    if len(shape) != len(spec.shape):
        raise InvalidInput(
            f"network {network_name}: input {spec.name!r} has shape {list(shape)} "
            f"(rank {len(shape)}), expected rank {len(spec.shape)}: {spec.describe()}"
        )
    for axis, (got, want) in enumerate(zip(shape, spec.shape)):
        if isinstance(want, int) and want >= 0 and got != want:
            raise InvalidInput(
                f"network {network_name}: input {spec.name!r} has shape {list(shape)}, "
                f"expected {spec.describe()} (dimension {axis} must be {want})"
            )


def refuse_non_tensors(network: CompiledNetwork, where: str) -> None:
    """Protocols that carry tensors only (KServe v2, plugserve.v1) refuse, at load, a network
    with a sequence or map input or output, saying how to get a tensor model instead."""
    odd = [s for s in (*network.inputs, *network.outputs) if s.kind != "tensor"]
    if odd:
        raise Unsupported(
            f"{where}: {', '.join(s.describe() for s in odd)}: the server's protocols carry "
            "tensors only. A classifier converted with ZipMap returns its probabilities as a "
            "sequence of maps: convert it without (skl2onnx: options={id(model): "
            "{'zipmap': False}}; onnxmltools: zipmap=False) and the probabilities are a "
            "[rows, classes] tensor; or run the model in-process (plugserve.server.Core)"
        )


def names_of(specs: Iterable[TensorSpec]) -> list[str]:
    return [s.name for s in specs]
