"""The module a Triton python-backend model imports (``import triton_python_backend_utils as
pb_utils``), as plugserve serves it: the same names and behaviour as Triton's own
(python_backend's ``src/resources/triton_python_backend_utils.py`` and its README are the
specification), over plugserve's worker protocol (``ipc.py``). Standard library and numpy only.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import numpy as np

#: how a worker sends a BLS request to the server and waits for its answer (set by worker.py)
_bls: Any = None

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


class InferenceRequest:
    """A request ``execute`` receives (its inputs, parameters, ...)."""

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
        **_: Any,
    ) -> None:
        self._model_name, self._model_version = model_name, model_version
        self._outputs = list(requested_output_names or [])
        self._inputs = list(inputs or [])
        self._id, self._correlation, self._flags = request_id, correlation_id, flags
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        )
        self._cancelled = False

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

    def is_cancelled(self) -> bool:
        return self._cancelled

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        """Business Logic Scripting: run this request on any model the server serves (ONNX on
        any device, another Python model, an ensemble) and return its response; an error the
        model answers is the response's ``error()``, as Triton returns it."""
        if decoupled:
            raise TritonModelException("decoupled BLS calls are not served by this plugserve yet")
        if _bls is None:
            raise TritonModelException("BLS calls are made from a model's execute")
        return _bls(self)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        return self.exec(decoupled)

    def _bls_header(self) -> dict[str, Any]:
        return {
            "op": "bls",
            "model": self._model_name,
            "version": self._model_version,
            "outputs": self._outputs,
            "id": self._id,
            "parameters": self._parameters,
        }


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


class Logger:
    """Triton's logger: lines on the server's log (the worker's standard error)."""

    _log = logging.getLogger("triton_python_backend")

    @staticmethod
    def log(message: str, level: int = logging.INFO) -> None:
        print(message, file=sys.stderr, flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message)
