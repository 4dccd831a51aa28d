"""What a Python model asks the server besides BLS: Triton's custom metrics (``MetricFamily``,
``Metric``) and its model loading API (``load_model``, ``unload_model``, ``is_model_ready``).

Each is a small function in :data:`CALLS` under the name the model's
``triton_python_backend_utils`` sends (``{"op": "call", "what": NAME, ...}``), run on a thread
of the server with the model's worker, the call's header and its tensors, and answering a
dict (or raising a typed error, which the model sees as TritonModelException with its
message). The metrics live in ``server/plane/custom_metrics.py`` (bounds there); loads go through
the server's model control as a client's RepositoryModelLoad does, under the same rule: they
are refused with ``--model-control-mode none`` or ``poll`` (Triton's README: the model loading
API needs explicit model control; plugserve's default mode allows loads too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, NotFound, Unsupported
from plugserve.server.plane.networks import NotReady

if TYPE_CHECKING:
    from plugserve.server.apps.pipelines.python.device import Worker

__all__ = ["CALLS", "call"]

Handler = Callable[["Worker", dict[str, Any], dict[str, np.ndarray]], dict[str, Any]]
#: what a model may ask the server besides BLS (``{"op": "call", "what": NAME}``): NAME ->
#: ``handler(worker, header, inputs) -> reply``, run on a worker thread by the device
#: (``device.Worker``); each answers ``{"call": id, ...}``
CALLS: dict[str, Handler] = {}


def call(name: str) -> Callable[[Handler], Handler]:
    """Register a handler for the model's call ``name``."""

    def register(handler: Handler) -> Handler:
        CALLS[name] = handler
        return handler

    return register


# --- custom metrics


def _metrics(worker: Worker) -> Any:
    plane = worker.plane
    if plane is None or not worker.owner:
        raise Unsupported(f"{worker.label}: custom metrics need the server's /metrics")
    return plane.metrics.custom


@call("metric_family")
def metric_family(worker: Worker, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    kind = _metrics(worker).family(
        worker.owner, worker.label, header.get("name"), header.get("description"),
        header.get("kind"),
    )  # fmt: skip
    return {"kind": kind}


@call("metric")
def metric(worker: Worker, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    handle = _metrics(worker).metric(
        worker.owner, worker.label, str(header.get("family")), header.get("labels"),
        header.get("buckets"),
    )  # fmt: skip
    return {"metric": handle}


@call("metric_op")
def metric_op(worker: Worker, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    value = _metrics(worker).operate(
        worker.owner, worker.label, header.get("metric"), str(header.get("do")),
        header.get("value", 0.0),
    )  # fmt: skip
    return {"value": value}


# --- the model loading API


def _control(worker: Worker) -> Any:
    if worker.control is None or worker.plane is None:
        raise Unsupported(f"{worker.label}: the model loading API needs the server")
    return worker.control


def _name(header: dict[str, Any], worker: Worker) -> str:
    name = header.get("model_name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{worker.label}: give a model name, not {name!r}")
    return name


@call("load_model")
def load_model(worker: Worker, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    control = _control(worker)
    name = _name(header, worker)
    control.check_control(f"{worker.label}: load_model({name!r})")
    parameters: dict[str, Any] = {}
    config = header.get("config")
    if config:
        parameters["config"] = config
    for key, value in inputs.items():  # "file:<version>/<name>": one BYTES element each
        parameters[key] = bytes(value.reshape(-1)[0])
    control.load_request(name, parameters)  # RepositoryModelLoad's own path
    return {}


@call("unload_model")
def unload_model(worker: Worker, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    control = _control(worker)
    name = _name(header, worker)
    control.check_control(f"{worker.label}: unload_model({name!r})")
    if name == worker.args.get("model_name"):
        raise InvalidArgument(
            f"{worker.label}: a model cannot unload itself (its unload waits for the execute "
            "that asks it); unload it from another model or a client"
        )
    control.unload(name, 0, remove=False)
    return {}


@call("is_model_ready")
def is_model_ready(worker: Worker, header: dict[str, Any], inputs: Any) -> dict[str, Any]:
    plane = worker.plane
    if plane is None:
        raise Unsupported(f"{worker.label}: is_model_ready needs the server")
    name = _name(header, worker)
    version = str(header.get("model_version") or "")
    if version and not version.isdigit():
        raise InvalidArgument(f"{worker.label}: model_version {version!r} is not a number")
    try:
        entry = plane.get(name, int(version or 0))
    except (NotFound, NotReady):  # not loaded, or loading
        return {"ready": False}
    return {"ready": bool(entry.network.ready())}
