"""The server's side of the protocol with a Python model's process: every message the server
sends is made here, and every message the process sends is checked here, once, before anything
reads it.

The process is a peer, not a part of the server: a model may write anything to its socket.
So what it sends is checked where it arrives (a reply's responses, a response's outputs
against the model's config, a BLS call's fields, the times of its execute) and the rest of the
server reads only what passed; a reply that fails its check is the process's error (the
request fails naming it, and the process is not trusted with another request). The transport
(one JSON header and at most one descriptor a message, tensors in sealed memfds) is
``ipc.py``; the kinds of message are ``kinds.py``; the process's side is ``worker.py``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import (
    InferenceError,
    InvalidInput,
    NotFound,
    PlugserveError,
    Response,
    TensorSpec,
    Unsupported,
)
from plugserve.server.apps.pipelines.python import ipc
from plugserve.server.apps.pipelines.python.kinds import Kind
from plugserve.server.plane.sequences import sequence_step

if TYPE_CHECKING:
    from plugserve.plugins.run_context import RunContext
    from plugserve.plugins.tracing import Span

__all__ = [
    "BlsCall",
    "check_reply",
    "code_of",
    "error_of",
    "execute",
    "failure",
    "outputs_of",
    "request_entry",
    "response_of",
    "stamp",
    "tensors_of",
]

#: a response's TritonError code -> the typed error its request fails with
ERRORS = {"INVALID_ARG": InvalidInput, "NOT_FOUND": NotFound, "UNSUPPORTED": Unsupported}
#: a typed error's gRPC code -> the TritonError code a BLS call's response carries
CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "NOT_FOUND": "NOT_FOUND",
         "UNIMPLEMENTED": "UNSUPPORTED", "UNAVAILABLE": "UNAVAILABLE",
         "CANCELLED": "CANCELLED", "DEADLINE_EXCEEDED": "UNAVAILABLE"}  # fmt: skip


# --- what the server sends


def auto_complete(model_path: str, config: dict[str, Any]) -> dict[str, Any]:
    return {"op": Kind.AUTO_COMPLETE, "model_path": model_path, "config": config}


def initialize(model_path: str, args: dict[str, Any], decoupled: bool) -> dict[str, Any]:
    """The message that imports and initializes the model (the two arenas go beside it)."""
    return {"op": Kind.INITIALIZE, "model_path": model_path, "args": args, "decoupled": decoupled}


def request_entry(
    names: list[str],
    arrays: list[Any],
    outputs: list[str],
    rid: int,
    run: RunContext | None,
    trace: Span | None = None,
) -> dict[str, Any]:
    """One request of an execute message: its inputs' names (present ones), the outputs it
    wants, ``rid`` (its id, which the model's ``is_cancelled()`` and a decoupled model's
    responses name), what the model reads of it from its run's context (``run``: its client's
    id, parameters, sequence and timeout) and, when it is traced, its execute span as a W3C
    ``traceparent``: the model's BLS calls name it, and their spans go under it."""
    request: dict[str, Any] = {
        "inputs": [n for n, a in zip(names, arrays) if a is not None],
        "outputs": outputs,
        "rid": rid,
    }
    if run is not None:
        if run.parameters:
            request["parameters"] = json.dumps(run.parameters)
        if run.request_id:  # the client's id: request_id()
            request["id"] = run.request_id
        if run.sequence is not None:  # correlation_id() and flags()
            request["correlation_id"], request["flags"] = run.sequence
        if run.timeout:  # timeout(), in microseconds
            request["timeout"] = round(run.timeout * 1e6)
    if trace is not None:
        request["trace"] = trace.traceparent()
    return request


def execute(model: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """An execute message of ``requests`` (:func:`request_entry`; their tensors are named
    ``<index>/<input>``)."""
    return {"op": Kind.EXECUTE, "model": model, "requests": requests}


def inputs_of(arrays: list[Any], names: list[str], index: int = 0) -> dict[str, np.ndarray]:
    """The tensors of request ``index`` of an execute, by the names the process reads."""
    return {f"{index}/{n}": a for n, a in zip(names, arrays) if a is not None}


def failure(exc: BaseException, **fields: Any) -> dict[str, Any]:
    """A reply to the model's call that failed with ``exc`` (the model raises it as
    TritonModelException, or sees it as its BLS response's ``error()``)."""
    return {"error": [str(exc), code_of(exc)], **fields}


def code_of(exc: BaseException) -> str:
    """The TritonError code a typed error becomes in the model's process."""
    return CODES.get(getattr(exc, "code", ""), "INTERNAL")


# --- what the process sends, checked


def check_reply(reply: Mapping[str, Any], count: int) -> None:
    """ValueError unless ``reply`` holds ``count`` responses as the worker writes them (each
    its output names, an error or None, its parameters): what the requests' answers are read
    from is checked once, here, not trusted by every reader."""
    responses = reply.get("responses")
    if not isinstance(responses, list) or len(responses) != count:
        raise ValueError(f"its answer holds no list of {count} responses")
    for response in responses:
        if not isinstance(response, dict):
            raise ValueError("a response of its answer is not an object")
        names, error = response.get("outputs", []), response.get("error")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("a response of its answer names its outputs wrongly")
        if error is not None and not (
            isinstance(error, list) and len(error) == 2 and all(isinstance(e, str) for e in error)
        ):
            raise ValueError("a response of its answer has a malformed error")


def tensors_of(reply: Mapping[str, Any], fd: int, outbox: ipc.Arena) -> dict[str, np.ndarray]:
    """A reply's tensors: copied out of the answer arena (the next request reuses it), or
    views of the memfd sent beside it (ValueError for descriptions that do not fit)."""
    if reply.get("arena"):
        if fd >= 0:  # a descriptor beside an arena answer: nothing of it is read
            os.close(fd)
        return outbox.unpack(reply.get("tensors", []), copy=True)
    return ipc.unpack_tensors(reply.get("tensors", []), fd)


def unreadable(where: str, what: str, exc: BaseException) -> BaseException:
    """What a decoupled request fails with when its process's ``what`` ("answer",
    "response") failed its check with ``exc``: a typed error as it is, a ValueError (what
    the transport refused) named."""
    if isinstance(exc, ValueError):
        return InferenceError(f"{where}: its {what} cannot be read: {exc}")
    return exc


def error_of(where: str, error: list[str]) -> PlugserveError:
    """A response's ``[message, TritonError code]`` (checked by :func:`check_reply`) as the
    typed error its request fails with."""
    message, code = error
    return ERRORS.get(code, InferenceError)(f"{where}: {message}")


def response_of(
    label: str,
    described: dict[str, Any],
    tensors: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
) -> Response:
    """A response a decoupled model sent, its outputs checked against its config."""
    parameters = described.get("parameters") or "{}"
    try:
        parameters = json.loads(parameters) if isinstance(parameters, str) else parameters
    except ValueError:
        parameters = {}
    if described.get("error"):
        message, code = described["error"]
        return Response(
            parameters=parameters, error=ERRORS.get(code, InferenceError)(f"{label}: {message}")
        )
    outputs = outputs_of(label, list(described.get("outputs", [])), tensors, specs, "")
    return Response(outputs, parameters if isinstance(parameters, dict) else {})


def outputs_of(
    where: str,
    names: list[str],
    tensors: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
    prefix: str,
    require_all: bool = False,
) -> dict[str, np.ndarray]:
    """The response's tensors, each an output of the model's config, of its type and rank."""
    outputs: dict[str, np.ndarray] = {}
    for name in names:
        spec = specs.get(name)
        if spec is None:
            raise InferenceError(
                f"{where}: output {name!r} is not an output of its config.pbtxt "
                f"({', '.join(specs) or 'none'})"
            )
        value = tensors.get(f"{prefix}{name}")
        if value is None:
            raise InferenceError(f"{where}: output {name!r} is named in its response but not sent")
        if value.dtype != spec.dtype and not (spec.dtype == object and value.dtype == object):
            value = _as_config_type(where, name, value, np.dtype(spec.dtype))
        if spec.shape is not None and len(value.shape) != len(spec.shape):
            raise InferenceError(
                f"{where}: output {name!r} has shape {list(value.shape)}, its config.pbtxt "
                f"says rank {len(spec.shape)}"
            )
        outputs[name] = value
    if require_all:
        missing = [n for n in specs if n not in outputs]
        if missing:
            raise InferenceError(
                f"{where}: its response has no output {', '.join(repr(m) for m in missing)}"
            )
    return outputs


def _as_config_type(where: str, name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An integer output whose values its config's integer type holds exactly is given that
    type (Triton's own bls_decoupled example answers an INT32 output with numpy's default
    int64: Triton passes it on, and its client reads the same numbers); any other difference
    of type is the model's error, named."""
    if value.dtype.kind in "biu" and dtype.kind in "biu":
        cast = value.astype(dtype)
        if np.array_equal(cast, value):
            return cast
        raise InferenceError(
            f"{where}: output {name!r} is {value.dtype} with values its config.pbtxt's "
            f"{dtype} cannot hold"
        )
    raise InferenceError(
        f"{where}: output {name!r} is {value.dtype}, its config.pbtxt says {dtype}"
    )


def stamp(spans: list[Span], reply: Mapping[str, Any] | None, error: Any = None) -> None:
    """End the execute spans of one execute: from and to the times its process measured
    (``times``: ``time.time_ns`` at its ``execute``'s call and return, the clock the server's
    spans use), kept within the span's making and now (the process is not trusted with the
    server's trace); the server's own times when the reply has none. ``error``: what failed
    the execute (the reply's error, or the exchange's)."""
    times = reply.get("times") if reply is not None else None
    now = time.time_ns()
    if error is None and reply is not None and reply.get("error"):
        last = str(reply["error"]).strip().splitlines() or [""]
        error = f"TritonModelException: {last[-1]}"
    for span in spans:
        if (
            type(times) is list
            and len(times) == 2
            and type(times[0]) is int
            and type(times[1]) is int
        ):
            start = min(max(times[0], span.start_ns), now)
            span.start_ns, span.end_ns = start, min(max(times[1], start), now)
        if error is not None:
            span.fail(error)
        span.end()


# --- a BLS call


class BlsCall:
    """A model's BLS request as its message says it, checked (InvalidInput naming what is
    wrong)."""

    __slots__ = (
        "decoupled",
        "execute",
        "model",
        "outputs",
        "parameters",
        "parent",
        "step",
        "timeout",
        "trace",
        "version",
    )

    def __init__(self, header: Mapping[str, Any]) -> None:
        self.decoupled = bool(header.get("decoupled"))
        model = header.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidInput(f"a BLS request names a model as a string, not {model!r}")
        self.model = model
        try:
            self.version = max(int(header.get("version") or -1), 0)
        except (TypeError, ValueError):
            raise InvalidInput(
                f"a BLS request's model_version must be an integer, not {header.get('version')!r}"
            ) from None
        try:
            parameters = json.loads(header.get("parameters") or "{}")
        except (TypeError, ValueError):
            raise InvalidInput("a BLS request's parameters are not a JSON object") from None
        self.parameters = parameters if isinstance(parameters, dict) and parameters else None
        timeout = header.get("timeout") or 0
        if type(timeout) is not int or timeout < 0:
            raise InvalidInput(f"a BLS request's timeout must be microseconds, not {timeout!r}")
        #: seconds (None: none; the request's deadline, or its model's queue policy's)
        self.timeout = timeout / 1e6 if timeout else None
        self.outputs = list(header.get("outputs") or []) or None
        self.step = _sequence_of(header)
        if self.decoupled and self.step is not None:
            raise InvalidInput(
                f"model {model!r}: a decoupled BLS call carries no sequence (correlation_id, "
                "flags); call a sequence model with exec()"
            )
        trace = header.get("trace")
        #: the execute span the call was made under, as the server named it (None: untraced)
        self.trace = trace if isinstance(trace, str) else None
        execute = header.get("execute")
        #: the execute the call was made in, as the server numbered it (None: none)
        self.execute = execute if type(execute) is int else None
        parent = header.get("parent")
        #: the request whose ``trace()`` the call was made with (its id; None: none)
        self.parent = parent if type(parent) is int else None


def call_id(header: Mapping[str, Any]) -> int:
    """The id of the model's call ``header`` (its replies name it); -1 when it has none."""
    call = header.get("call", -1)
    return call if type(call) is int and call >= 0 else -1


def _sequence_of(header: Mapping[str, Any]) -> Any:
    """A BLS request's place in a sequence: its ``correlation_id`` and ``flags`` (Triton's
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START 1, _END 2), as a client's sequence_* parameters
    say it; None for a request that names no sequence."""
    flags = header.get("flags") or 0
    if type(flags) is not int:
        raise InvalidInput(f"a BLS request's flags must be an integer, not {flags!r}")
    return sequence_step(
        {
            "sequence_id": header.get("correlation_id") or 0,
            "sequence_start": bool(flags & 1),
            "sequence_end": bool(flags & 2),
        }
    )
