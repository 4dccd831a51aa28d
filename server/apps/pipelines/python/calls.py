"""What a Python model asks the server besides BLS: Triton's custom metrics (``MetricFamily``,
``Metric``) and its model loading API (``load_model``, ``unload_model``, ``is_model_ready``).

Each is a small function in :data:`CALLS` under the name the model's
``triton_python_backend_utils`` sends (a :attr:`Kind.CALL` message whose ``what`` is one of
``kinds.Call``), run by :class:`Calls` on a thread of the server with the server's side of the
model (:class:`Host`), the call's header and its tensors, and answering a dict (or raising a
typed error, which the model sees as TritonModelException with its message). The metrics live
in ``server/plane/custom_metrics.py`` (bounds there); loads go through the server's model
control as a client's RepositoryModelLoad does, under the same rule: they are refused with
``--model-control-mode none`` or ``poll`` (Triton's README: the model loading API needs
explicit model control; plugserve's default mode allows loads too).

Bounds: CALL_THREADS (4) threads run one instance's calls at once, and MAX_CALLS (256) calls may
run or wait at once: a model waits for each answer, so only a model that floods its socket with
calls meets the bound (its calls past it are refused at once, not given a thread each).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, NotFound, PlugserveError, Unsupported
from plugserve.server.apps.pipelines.python import ipc, protocol
from plugserve.server.apps.pipelines.python.kinds import Call
from plugserve.server.plane.networks import NotReady

__all__ = ["CALLS", "CALL_THREADS", "MAX_CALLS", "Calls", "Host", "call"]

log = logging.getLogger(__name__)

CALL_THREADS = 4
MAX_CALLS = 256


@dataclasses.dataclass(frozen=True)
class Host:
    """The server as one instance of a Python model reaches it: its data plane (BLS calls, the
    metrics), its model control (the model loading API), who owns the metric families the
    model declares (one load of it), and the model's name and the instance's label."""

    label: str
    plane: Any = None
    control: Any = None
    owner: int = 0
    model_name: str = ""


Handler = Callable[[Host, dict[str, Any], dict[str, np.ndarray]], dict[str, Any]]
#: what a model may ask the server besides BLS: ``kinds.Call`` NAME -> ``handler(host,
#: header, inputs) -> reply``, run on a thread by :class:`Calls`; each answers ``{"call": id,
#: ...}``
CALLS: dict[str, Handler] = {}


def call(name: str) -> Callable[[Handler], Handler]:
    """Register a handler for the model's call ``name``."""

    def register(handler: Handler) -> Handler:
        CALLS[name] = handler
        return handler

    return register


class Calls:
    """One instance's calls to the server besides BLS, each answered through ``reply(call id,
    answer)`` (which never blocks) from a thread of a pool made at the first call."""

    def __init__(self, host: Host, reply: Callable[[int, dict[str, Any]], None]) -> None:
        self.host, self.reply = host, reply
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._waiting = 0  # calls running or waiting for a thread

    def start(self, header: dict[str, Any], fd: int) -> None:
        """Run the call ``header`` asks for on a thread (some of them load models)."""
        number = protocol.call_id(header)
        handler = CALLS.get(str(header.get("what")))
        try:
            inputs = ipc.unpack_tensors(header.get("tensors", []), fd)
        except ValueError as exc:
            self.reply(number, {"error": [str(exc), "INVALID_ARG"]})
            return
        if handler is None:
            self.reply(number, {"error": [f"unknown call {header.get('what')!r}", "UNSUPPORTED"]})
            return
        pool = self._claim()
        if pool is None:
            label = self.host.label
            message = f"{label}: {MAX_CALLS} of its calls wait already; wait for their answers"
            self.reply(number, {"error": [message, "UNAVAILABLE"]})
            return
        try:
            pool.submit(self._run, handler, number, header, inputs)
        except RuntimeError:  # the network is closing: its pool is shut down
            self._done()

    def _claim(self) -> ThreadPoolExecutor | None:
        """The pool, with a place taken in it; None past MAX_CALLS."""
        with self._lock:
            if self._waiting >= MAX_CALLS:
                return None
            self._waiting += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    CALL_THREADS, thread_name_prefix=f"{self.host.label}-call"
                )
            return self._pool

    def _run(self, handler: Handler, number: int, header: dict[str, Any], inputs: Any) -> None:
        try:
            self.reply(number, handler(self.host, header, inputs))
        except PlugserveError as exc:
            self.reply(number, protocol.failure(exc))
        except Exception as exc:
            log.exception("%s: its call %r failed", self.host.label, header.get("what"))
            self.reply(number, {"error": [f"{type(exc).__name__}: {exc}", "INTERNAL"]})
        finally:
            self._done()

    def _done(self) -> None:
        with self._lock:
            self._waiting -= 1

    def close(self) -> None:
        """No more calls run (those waiting for a thread are dropped)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# --- custom metrics


def _metrics(host: Host) -> Any:
    plane = host.plane
    if plane is None or not host.owner:
        raise Unsupported(f"{host.label}: custom metrics need the server's /metrics")
    return plane.metrics.custom


@call(Call.METRIC_FAMILY)
def metric_family(host: Host, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    fields = (header.get("name"), header.get("description"), header.get("kind"))
    return {"kind": _metrics(host).family(host.owner, host.label, *fields)}


@call(Call.METRIC)
def metric(host: Host, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    fields = (str(header.get("family")), header.get("labels"), header.get("buckets"))
    return {"metric": _metrics(host).metric(host.owner, host.label, *fields)}


@call(Call.METRIC_OP)
def metric_op(host: Host, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    fields = (header.get("metric"), str(header.get("do")), header.get("value", 0.0))
    return {"value": _metrics(host).operate(host.owner, host.label, *fields)}


# --- the model loading API


def _control(host: Host) -> Any:
    if host.control is None or host.plane is None:
        raise Unsupported(f"{host.label}: the model loading API needs the server")
    return host.control


def _name(header: dict[str, Any], host: Host) -> str:
    name = header.get("model_name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{host.label}: give a model name, not {name!r}")
    return name


@call(Call.LOAD_MODEL)
def load_model(host: Host, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    control = _control(host)
    name = _name(header, host)
    control.check_control(f"{host.label}: load_model({name!r})", client=False)
    parameters: dict[str, Any] = {}
    config = header.get("config")
    if config:
        parameters["config"] = config
    for key, value in inputs.items():  # "file:<version>/<name>": one BYTES element each
        parameters[key] = bytes(value.reshape(-1)[0])
    control.load_request(name, parameters)  # RepositoryModelLoad's own path
    return {}


@call(Call.UNLOAD_MODEL)
def unload_model(host: Host, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    control = _control(host)
    name = _name(header, host)
    control.check_control(f"{host.label}: unload_model({name!r})", client=False)
    if name == host.model_name:
        raise InvalidArgument(
            f"{host.label}: a model cannot unload itself (its unload waits for the execute "
            "that asks it); unload it from another model or a client"
        )
    control.unload(name, 0, remove=False)
    return {}


@call(Call.IS_MODEL_READY)
def is_model_ready(host: Host, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    plane = host.plane
    if plane is None:
        raise Unsupported(f"{host.label}: is_model_ready needs the server")
    name = _name(header, host)
    version = str(header.get("model_version") or "")
    if version and not version.isdigit():
        raise InvalidArgument(f"{host.label}: model_version {version!r} is not a number")
    try:
        entry = plane.get(name, int(version or 0))
    except (NotFound, NotReady):  # not loaded, or loading
        return {"ready": False}
    return {"ready": bool(entry.network.ready())}
