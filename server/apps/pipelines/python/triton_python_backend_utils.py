"""The module a Triton python-backend model imports (``import triton_python_backend_utils as
pb_utils``), as plugserve serves it: the same names and behaviour as Triton's own
(python_backend's ``src/resources/triton_python_backend_utils.py`` and its README are the
specification), over plugserve's worker protocol (``ipc.py``, its kinds of message in
``kinds.py``). Standard library and numpy only.
"""

from __future__ import annotations

import contextvars
import json
import sys
import threading
from typing import Any

import numpy as np
from kinds import Call, Kind

#: set by worker.py: the process's worker, how a BLS request goes to the server
#: (``_bls(request, decoupled)``), and how a decoupled response does (``_send(rid, response,
#: final)``)
_worker: Any = None
_bls: Any = None
_send: Any = None

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2

_TYPES = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32, "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_, "TYPE_BF16": np.float32,
}  # fmt: skip


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return _TYPES[triton_type_string]


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray | np.bytes_):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


class TritonError(Exception):
    """An error a model returns in a response (``InferenceResponse(error=...)``)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS = range(7)
    CANCELLED = 7
    _NAMES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
              "ALREADY_EXISTS", "CANCELLED")  # fmt: skip

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def code_name(self) -> str:
        return self._NAMES[self._code] if 0 <= self._code < len(self._NAMES) else "UNKNOWN"


class TritonModelException(Exception):
    """What a model raises to fail the requests of its ``execute``."""


class Tensor:
    def __init__(self, name: str, numpy_array: Any) -> None:
        if not isinstance(name, str):
            raise TritonModelException("a Tensor's name must be a string")
        array = np.asarray(numpy_array)
        if array.dtype.kind in "SU":
            array = array.astype(object)
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        return Tensor(name, np.from_dlpack(dlpack))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._array.dtype}, {list(self._array.shape)})"


class InferenceResponse:
    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._tensors = list(output_tensors or [])
        self._error = error
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        )

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """A decoupled request's sender (``request.get_response_sender()``): any number of
    responses, from any thread, until one is sent with ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``
    (alone, or with the last response)."""

    def __init__(self, rid: int) -> None:
        self._rid = rid
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send takes an InferenceResponse, not a {type(response).__name__}"
            )
        with self._lock:
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            if response is None and not final:
                return
            self._closed = final
            _send(self._rid, response, final)

    def is_cancelled(self) -> bool:
        return _worker is not None and _worker.is_cancelled(self._rid)

    def _fail(self, message: str) -> None:
        """Fail the request with ``message`` unless its final response went already."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _send(self._rid, InferenceResponse(error=TritonError(message)), True)


class ResponseIterator:
    """The responses of a decoupled BLS call (``exec(decoupled=True)``), ending with the
    final one (an empty response when the model sent the final flag alone)."""

    def __init__(self, take: Any, cancel: Any) -> None:
        self._take, self._cancel = take, cancel
        self._done = False

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        response, final = self._take()
        if final or response.has_error():
            self._done = True
        return response

    def cancel(self) -> None:
        """Ask the called model to stop (Triton's request cancellation)."""
        if not self._done:
            self._cancel()


class InferenceTrace:
    """A request's trace, as ``request.trace()`` gives it (Triton's): ``get_context()`` is
    the request's span as W3C trace context (JSON: ``{"traceparent": ...}``), None when the
    request is not traced. A BLS request made with ``trace=request.trace()`` is traced under
    that request's execute; one made without it, under the execute it is made in. It also
    names the request: a BLS request made with it is that request's tenant's while the request
    is open (a decoupled model's thread answering it after its execute returned: bls.py)."""

    def __init__(self, traceparent: str | None = None, _rid: int | None = None) -> None:
        self._traceparent = traceparent
        self._rid = _rid

    def get_context(self) -> str | None:
        if not self._traceparent:
            return None
        return json.dumps({"traceparent": self._traceparent})


#: the execute under way in this context (the number the server gave it; None: none): a BLS
#: request made in it names it, and is its requests' tenant's (server/apps/pipelines/python/
#: bls.py); a thread the model starts has a context of its own, outside any execute
EXECUTE: contextvars.ContextVar[int | None] = contextvars.ContextVar("execute", default=None)
#: the execute span of the traced execute under way in this context (its ``traceparent``;
#: None: none): a BLS request made in it is traced under it; a thread the model starts is not
#: (before, the span was the process's, which a decoupled model's thread answering an earlier
#: request took for its own)
TRACING: contextvars.ContextVar[str | None] = contextvars.ContextVar("tracing", default=None)


class InferenceRequest:
    """A request ``execute`` receives (its inputs, parameters, ...), or one a model makes to
    call another model (Business Logic Scripting: :meth:`exec`)."""

    def __init__(
        self,
        model_name: str = "",
        requested_output_names: list[str] | None = None,
        inputs: list[Tensor] | None = None,
        request_id: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        parameters: dict[str, Any] | str | None = None,
        model_version: int = -1,
        timeout: int = 0,
        trace: InferenceTrace | None = None,
        _rid: int | None = None,
        _trace: str | None = None,
        _worker: Any = None,
        **_: Any,
    ) -> None:
        # a name read from a BYTES tensor is bytes; Triton takes it as the string it holds
        self._model_name, self._model_version = _text(model_name), model_version
        self._outputs = [_text(name) for name in requested_output_names or []]
        self._inputs = list(inputs or [])
        self._id, self._correlation, self._flags = request_id, correlation_id, flags
        if not isinstance(parameters, str | dict | None):
            raise TritonModelException("parameters must be a dict or a JSON string")
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        )
        self._timeout = int(timeout or 0)
        self._rid = _rid
        #: the request's execute span (``traceparent``): the server's for a request execute
        #: receives, the one ``trace`` names for a BLS request (None: its execute's)
        self._trace = _trace if trace is None else getattr(trace, "_traceparent", None)
        #: a BLS request's: the traced execute it was made in (:data:`TRACING`), and the
        #: request whose ``trace`` it was made with (its tenant's while that request is open)
        self._within = TRACING.get()
        self._parent = None if trace is None else getattr(trace, "_rid", None)
        self._sender: InferenceResponseSender | None = None
        #: the execute it was made in (a BLS request: see :data:`EXECUTE`)
        self._execute = EXECUTE.get()

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation

    def flags(self) -> int:
        return self._flags

    def parameters(self) -> str:
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> InferenceTrace:
        """The request's trace (pass it as a BLS request's ``trace``)."""
        return InferenceTrace(self._trace, self._rid)

    def is_cancelled(self) -> bool:
        """Whether the server cancelled the request (its client gone, its deadline)."""
        return self._rid is not None and _worker is not None and _worker.is_cancelled(self._rid)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._rid is None or _worker is None or not _worker.decoupled:
            raise TritonModelException(
                "get_response_sender is for decoupled models (model_transaction_policy "
                "{ decoupled: true } in config.pbtxt); return the responses from execute"
            )
        if self._sender is None:
            self._sender = InferenceResponseSender(self._rid)
        return self._sender

    def _fail_open(self, message: str) -> None:
        """A decoupled execute failed: the request gets ``message`` unless it is complete."""
        if self._rid is not None:
            self.get_response_sender()._fail(message)

    def exec(self, decoupled: bool = False) -> Any:
        """Business Logic Scripting: run this request on any model the server serves (ONNX on
        any device, another Python model, an ensemble) and return its response (with
        ``decoupled``, an iterator of its responses); an error the model answers is the
        response's ``error()``, as Triton returns it."""
        if _bls is None:
            raise TritonModelException("BLS calls are made from a model's execute")
        return _bls(self, decoupled)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """:meth:`exec` without blocking the model's event loop: calls made at once (say with
        ``asyncio.gather``) run at once."""
        import asyncio

        if _worker is None:
            return self.exec(decoupled)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_worker.pool, self.exec, decoupled)

    def _bls_header(self) -> dict[str, Any]:
        header = {
            "op": Kind.BLS,
            "model": self._model_name,
            "version": self._model_version,
            "outputs": self._outputs,
            "id": self._id,
            "parameters": self._parameters,
            "timeout": self._timeout,
            "correlation_id": self._correlation,
            "flags": self._flags,
        }
        trace = self._trace or self._within
        if trace:  # the execute span it is made under: its spans go there
            header["trace"] = trace
        if self._execute is not None:
            header["execute"] = self._execute
        if type(self._parent) is int:
            header["parent"] = self._parent
        return header


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def _config_entry(model_config: dict[str, Any], kind: str, name: str) -> dict[str, Any] | None:
    for entry in model_config.get(kind, []):
        if entry.get("name") == name:
            return entry
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return _config_entry(model_config, "output", name)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def _call(what: str, **fields: Any) -> dict[str, Any]:
    """A call to the server (``worker.py``'s ``Worker.call``): its answer, or the server's
    refusal raised as TritonModelException."""
    if _worker is None:
        raise TritonModelException(
            f"{what}: this is for a model served by plugserve (from its initialize, execute or "
            "finalize)"
        )
    tensors = fields.pop("_tensors", {})
    reply, fds = _worker.call({"op": Kind.CALL, "what": what, **fields}, tensors)
    for fd in fds:
        import os

        os.close(fd)
    if reply.get("error"):
        raise TritonModelException(reply["error"][0])
    return reply


class Logger:
    """Triton's logger: each line goes to the server's log at its level, with the model's
    name (VERBOSE is the server's DEBUG)."""

    class LogLevel:
        INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3

    INFO, WARNING, ERROR, VERBOSE = 0, 1, 2, 3

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        if _worker is None:
            print(message, file=sys.stderr, flush=True)
            return
        _worker.log(int(level), str(message))

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.VERBOSE)


# --- custom metrics (Triton's Custom Metrics API; the server keeps them:
# server/plane/custom_metrics.py)


class MetricFamily:
    """A family of metrics on the server's ``/metrics``: ``kind`` COUNTER, GAUGE or HISTOGRAM.
    The same name twice is the same family (the first description stays); with another kind
    it is refused."""

    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

    def __init__(self, name: str, description: str, kind: int) -> None:
        if isinstance(kind, bool) or not isinstance(kind, int | str):
            kind = repr(kind)  # refused by the server, which names it
        reply = _call(Call.METRIC_FAMILY, name=name, description=description, kind=kind)
        self._name, self._kind = name, reply["kind"]

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None):
        """A series of this family: its ``labels`` (a dict of strings); a HISTOGRAM's also
        its ``buckets`` (increasing upper bounds)."""
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None and not isinstance(buckets, list):
            raise TritonModelException("Failed to create metric. Buckets must be a list.")
        return Metric(self, labels, buckets)


def _metric_value(value: Any, op: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TritonModelException(f"Metric.{op} takes a number, not {value!r}")
    return float(value)


class Metric:
    """One series of a :class:`MetricFamily` (made by ``family.Metric(labels)``)."""

    def __init__(
        self, family: MetricFamily, labels: dict[str, str] | None, buckets: list[float] | None
    ) -> None:
        try:
            json.dumps(labels)
            json.dumps(buckets)
        except (TypeError, ValueError) as exc:
            raise TritonModelException(f"Failed to create metric: {exc}") from None
        reply = _call(Call.METRIC, family=family._name, labels=labels, buckets=buckets)
        self._family, self._handle = family, reply["metric"]

    def _op(self, op: str, value: Any = 0.0) -> float:
        reply = _call(Call.METRIC_OP, metric=self._handle, do=op, value=value)
        return float(reply["value"])

    def increment(self, value: float) -> None:
        """Add ``value`` (a COUNTER's must not be negative)."""
        self._op("increment", _metric_value(value, "increment"))

    def set(self, value: float) -> None:
        """Set a GAUGE to ``value``."""
        self._op("set", _metric_value(value, "set"))

    def observe(self, value: float) -> None:
        """Count ``value`` into a HISTOGRAM's buckets."""
        self._op("observe", _metric_value(value, "observe"))

    def value(self) -> float:
        """A COUNTER's or GAUGE's value now."""
        return self._op("value")


# --- the model loading API (Triton 23.07; the server's model control does it)


def _loading(what: str) -> None:
    phase = getattr(_worker, "phase", "")
    if phase in ("auto_complete_config", "finalize"):
        raise TritonModelException(
            f"{what} is not supported during {phase} (as in Triton); call it from initialize "
            "or execute"
        )


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or load again) ``model_name`` from the server's repository: with ``config`` (a
    model configuration as JSON) and ``files`` (``{"file:<version>/<name>": bytes}``, which
    need ``config``) as Triton's overrides. The server must allow model control
    (``--model-control-mode explicit``, or plugserve's default)."""
    _loading("load_model")
    if not isinstance(model_name, str) or not isinstance(config, str):
        raise TritonModelException("load_model takes a model name and a config as strings")
    tensors = {}
    for key, data in (files or {}).items():
        if not isinstance(key, str) or not key.startswith("file:"):
            raise TritonModelException(
                f"load_model: file {key!r} must be named 'file:<version>/<file name>'"
            )
        if not isinstance(data, bytes | bytearray):
            raise TritonModelException(f"load_model: file {key!r} must be bytes")
        value = np.empty(1, dtype=object)
        value[0] = bytes(data)
        tensors[key] = value
    _call(Call.LOAD_MODEL, model_name=model_name, config=config, _tensors=tensors)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload every version of ``model_name`` (``unload_dependents`` is accepted as Triton's;
    plugserve has no dependents to unload with it)."""
    _loading("unload_model")
    if not isinstance(model_name, str):
        raise TritonModelException("unload_model takes a model name as a string")
    _call(Call.UNLOAD_MODEL, model_name=model_name, unload_dependents=bool(unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (``model_version``; "": the server's choice) is loaded and
    ready (its own readiness check included)."""
    _loading("is_model_ready")
    if not isinstance(model_name, str) or not isinstance(model_version, str):
        raise TritonModelException("is_model_ready takes a model name and a version as strings")
    return bool(
        _call(Call.IS_MODEL_READY, model_name=model_name, model_version=model_version)["ready"]
    )


# --- auto_complete_config's argument


class ModelConfig:
    """The model's configuration as ``auto_complete_config`` completes it (Triton's JSON form:
    ``as_dict()``): its inputs, outputs, ``max_batch_size``, dynamic batching and transaction
    policy. Conflicts with what config.pbtxt says raise ValueError, as Triton's do."""

    _INPUT_KEYS = ("name", "data_type", "dims", "optional")
    _OUTPUT_KEYS = ("name", "data_type", "dims")

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        config.setdefault("input", [])
        config.setdefault("output", [])
        config.setdefault("max_batch_size", 0)
        self._model_config = config

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise ValueError(
                f"auto-complete-config function for model '{self._name}' gave max_batch_size "
                f"{max_batch_size!r}; it must be an integer"
            )
        if self._model_config["max_batch_size"] > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {self._model_config['max_batch_size']}, "
                f"but in auto-complete-config function for model '{self._name}' specified "
                f"max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{scheduler}', but "
                    f"auto-complete-config function for model '{self._name}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        where = f"in auto-complete-config function for model '{self._name}'"
        if not isinstance(tensor, dict):
            raise ValueError(f"{kind} {where} must be a dict, not {type(tensor).__name__}")
        extra = [key for key in tensor if key not in allowed]
        if extra:
            raise ValueError(
                f"{kind} '{tensor.get('name')}' {where} contains property other than "
                f"{', '.join(repr(k) for k in allowed)}: {', '.join(map(repr, extra))}"
            )
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                raise ValueError(
                    f"{kind} '{tensor.get('name', '')}' {where} is missing '{key}' property."
                )
        for current in self._model_config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            if current.get("data_type", "TYPE_INVALID") not in (
                "TYPE_INVALID",
                tensor["data_type"],
            ):
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects datatype "
                    f"{current['data_type']} for {kind} '{tensor['name']}', model provides "
                    f"{tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model expects dims "
                    f"{tensor['dims']} but the model configuration specifies dims "
                    f"{current['dims']}"
                )
            if (
                "optional" in current
                and "optional" in tensor
                and current["optional"] != tensor["optional"]
            ):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model expects "
                    f"optional {tensor['optional']} but the model configuration specifies "
                    f"optional {current['optional']}"
                )
            current.update(tensor)
            return
        self._model_config[kind].append(dict(tensor))

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input, self._INPUT_KEYS)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output, self._OUTPUT_KEYS)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        where = f"auto-complete-config function for model '{self._name}'"
        if not isinstance(transaction_policy_dict, dict):
            raise ValueError(f"model transaction policy in {where} must be a dict")
        extra = [k for k in transaction_policy_dict if k != "decoupled"]
        if extra:
            raise ValueError(
                f"model transaction property in {where} contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    f"trying to change decoupled property in {where}, which is already set "
                    f"to '{policy['decoupled']}'."
                )
            policy["decoupled"] = wanted
