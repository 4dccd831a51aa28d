"""The ``PYTHON`` device: Triton python-backend models, each instance a process of its own.

A repository entry whose ``config.pbtxt`` says ``backend: "python"`` loads here (its version
folder's ``model.py``). Each instance of its ``instance_group`` (``NUM_STREAMS``) is a worker
process (``worker.py``, Triton's stub) with the model's ``TritonPythonModel`` in it, and one
stream of the network's executor: the data plane, deadlines, the memory budget, statistics and
every protocol treat it as any network. Tensors cross in sealed memfds (``ipc.py``), never
pickled.

What a model cannot do to the server: an exception answers its request with the traceback's
last lines; a process that dies answers its request with an error and is started again for
the next one; an ``execute`` that runs past ``MAX_EXECUTE_SECONDS`` (default 300 s, the
operator's hang bound) is taken as hung: its process is killed and started again, its
requests answered with an error; a model that fails to import or to initialize fails its
load with the reason, and other models load.

A client's deadline never kills a process other clients share (Triton never kills its stub
for one): a request still queued when its deadline (or ``--max-request-seconds``) passes is
answered at once (DEADLINE_EXCEEDED, 504) and never reaches the model; one already in
``execute`` is told (``request.is_cancelled()`` turns true, each request of a batch its own)
and is answered with its deadline's error when ``execute`` returns. Before, every deadline
killed the process: a 50 ms deadline on a model whose execute takes 200 ms restarted it each
time, and the next client waited 3.5-3.9 s for ``initialize`` instead of 0.2 s.

A process's memory is its own (a leak grows the worker, which the operator bounds like any
process), and the server maps only memfds sealed against shrinking, so no worker can make the
server fault.

A model may name its own Python: the ``EXECUTION_ENV_PATH`` parameter, a virtual environment
(its ``bin/python``) or an interpreter, which needs numpy only.

At load, the first instance's process runs the model's ``auto_complete_config`` (when it has
one) before ``initialize``; its result is the model's configuration. Model readiness asks each
instance (``readiness.py``: the process runs, and the model's ``is_ready()`` answers True on a
socket of its own within READY_SECONDS). With dynamic batching, a ``batcher.Gatherer`` hands
several waiting requests to one ``execute``. What a model asks the server besides BLS (custom
metrics, the model loading API) is in ``calls.py``; its Logger lines reach the server's log.

A traced request (its run's span: the data plane's ``compute``) gets an ``execute`` span under
it: its process times ``execute`` and sends the times back with its answer, and the span is made
here with them, so the model's process needs no OpenTelemetry; the model's BLS calls made
meanwhile go under it (``bls.py``).

This module is the device as the server sees it (the plugin, the network, its infer requests);
the rest of the room, one job a module:

===================  ==========================================================================
``config.py``        the device's keys, the model's config.pbtxt and auto_complete_config's result
``instance.py``      one instance: its process, what is in flight on it, one execute's hop
``process.py``       the process: sandbox, start, bounds, restart, kill, the hang watch
``readiness.py``     the model's is_ready(), asked on a socket of its own
``inflight.py``      what is in flight by id (decoupled requests, calls, spans), the process's
                     messages handled as they are read
``bls.py``           the model's BLS calls through the data plane
``calls.py``         the model's other calls: custom metrics, the model loading API
``protocol.py``      every message the server sends, made; every one the process sends, checked
``batcher.py``       Triton's dynamic batcher: several requests to one execute
``kinds.py``         the kinds of message, declared once for both sides
``ipc.py``           the transport: a JSON header and sealed memfds over a SEQPACKET socket
``worker.py``        the process's side (Triton's stub); ``sandbox.py`` its bounds
===================  ==========================================================================
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins import cancel, run_context
from plugserve.plugins.api import (
    CompiledNetwork,
    Configuration,
    InferenceError,
    InferRequest,
    InvalidModel,
    PerfCount,
    PermissionDenied,
    Plugin,
    PlugserveError,
    ResponseSender,
    Unsupported,
)
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.streams import StreamsExecutor
from plugserve.server.apps.pipelines.python import config as model_config
from plugserve.server.apps.pipelines.python import protocol
from plugserve.server.apps.pipelines.python.batcher import MAX_GATHER_STREAMS, Gatherer
from plugserve.server.apps.pipelines.python.calls import Host
from plugserve.server.apps.pipelines.python.config import PythonConfiguration
from plugserve.server.apps.pipelines.python.instance import Instance
from plugserve.server.apps.pipelines.python.process import Limits
from plugserve.server.plane import budget

__all__ = ["PythonPlugin"]

log = logging.getLogger(__name__)

#: how long a model's readiness check may take (Triton's is_ready timeout)
READY_SECONDS = 5.0

_rids = itertools.count(1)


class PythonNetwork(CompiledNetwork):
    #: readiness asks the model's processes (and its is_ready(), up to READY_SECONDS)
    slow_readiness = True

    @property
    def precision(self) -> str:
        """None to name: the model's own code decides what it computes in (not "f32")."""
        return ""

    def __init__(self, plugin: PythonPlugin, config: Configuration, path: Path) -> None:
        message, configured = model_config.model_config(path)
        name = message.name
        super().__init__(plugin, name, config)
        self.where = where = f"python model {name!r}"
        python = model_config.interpreter(str(config.get("EXECUTION_ENV_PATH") or ""), where)
        count = max(config.streams(), 1)
        plane = plugin.plane
        #: the metric families the model declares belong to this load (dropped at close)
        self._custom = plane.metrics.custom if plane is not None else None
        self._owner = self._custom.owner() if self._custom is not None else 0
        limits = Limits(
            max_bytes=int(config.get("MAX_PROCESS_BYTES") or 0) or budget.default_limit(),
            niceness=int(config.get("PROCESS_NICENESS")),
            shm_bytes=int(config.get("MAX_SHM_BYTES")),
            max_execute_seconds=float(config.get("MAX_EXECUTE_SECONDS")),
        )
        hosts = [
            Host(f"{where} (instance {i})", plane, plugin.control, self._owner, name)
            for i in range(count)
        ]
        self.instances = [Instance(python, path, host, limits) for host in hosts]
        self._next = 0
        #: dynamic batching: (rows, seconds) and what gathers the requests; None: one at a time
        self.batching_settings: tuple[int, float] | None = None
        #: dynamic_batching's priority_levels (0: one level)
        self.priority_levels = 0
        self.gatherer: Gatherer | None = None
        try:
            completed = self.instances[0].process.auto_complete(configured)
            if completed is not None:
                configured = model_config.completed(where, message, completed)
            self._configure(configured, path)
            for instance in self.instances:
                instance.process.start()
            if self.batching_settings is not None:
                self.gatherer = Gatherer(self, *self.batching_settings)
                self.gathers = True  # a request waits in the gatherer until its batch starts
        except BaseException:
            for instance in self.instances:
                instance.process.stop()
            if self._custom is not None:
                self._custom.drop(self._owner)
            raise

    def _configure(self, configured: dict[str, Any], path: Path) -> None:
        """The model's final configuration (config.pbtxt's, or what auto_complete_config made
        of it): its tensors, transaction policy and batch size, and its instances' ``args``."""
        name, where = self.name, self.where
        self._inputs = model_config.specs(configured, "input", where)
        self._outputs = model_config.specs(configured, "output", where)
        #: what every request reads (made once: a small model's request is a few of them)
        self.input_names = [spec.name for spec in self._inputs]
        self.output_specs = {spec.name: spec for spec in self._outputs}
        self.decoupled = bool(configured.get("model_transaction_policy", {}).get("decoupled"))
        self.max_batch_size = int(configured.get("max_batch_size", 0))
        self.model_config = configured
        batching = configured.get("dynamic_batching")
        if batching is not None and self.max_batch_size > 0 and not self.decoupled:
            preferred = [int(n) for n in batching.get("preferred_batch_size", [])]
            size = min(max(preferred, default=self.max_batch_size), self.max_batch_size)
            # (at most 10 minutes: past threading's bound the batcher's wait raised)
            delay = min(int(batching.get("max_queue_delay_microseconds", 0)), 600_000_000) / 1e6
            self.batching_settings = (size, delay)
            self.priority_levels = int(batching.get("priority_levels", 0))
        for i, instance in enumerate(self.instances):
            args = {
                "model_config": json.dumps(configured),
                "model_instance_kind": "CPU",
                "model_instance_name": f"{name}_0_{i}",
                "model_instance_device_id": "0",
                "model_repository": str(path.parent.parent),
                "model_version": path.parent.name,
                "model_name": name,
            }
            instance.configure(args, self.decoupled, self._outputs)

    def ready(self) -> bool:
        """Every instance's process runs and, when the model has ``is_ready()``, says so
        within READY_SECONDS (one deadline for the whole model)."""
        end = time.monotonic() + READY_SECONDS
        for instance in self.instances:
            ok, why = instance.readiness.check(max(0.0, end - time.monotonic()))
            if not ok:
                log.info("%s is not ready: %s", instance.label, why)
                return False
        return True

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self._streams()
        return super()._metric(name)

    def _streams(self) -> int:
        """One stream per instance; with dynamic batching, enough for every instance's batch
        to gather (at most MAX_GATHER_STREAMS). With priority levels, MAX_GATHER_STREAMS: a
        request of a higher level must reach the gatherer while lower ones wait there (which
        orders them), not wait for a stream behind them, as Triton's batcher sees its whole
        queue (with streams for one batch, four requests of level 2 held the streams and ran
        before eight of level 1 queued after them)."""
        count = len(self.instances)
        if self.batching_settings is None:
            return count
        if self.priority_levels > 1:
            return max(count, MAX_GATHER_STREAMS)
        return max(count, min(MAX_GATHER_STREAMS, count * (self.batching_settings[0] + 1)))

    def _new_executor(self) -> StreamsExecutor:
        """One stream per instance, each with its own process (with dynamic batching, the
        streams wait for their batch and the gatherer's threads run the instances)."""
        instances = self.instances
        return StreamsExecutor(
            f"PYTHON/{self.name}",
            self._streams(),
            state_factory=lambda i: PythonInferRequest(self, instances[i % len(instances)]),
        )

    def batching(self) -> tuple[int, float] | None:
        if self.batching_settings is None:
            return None
        size, delay = self.batching_settings
        return size, delay * 1000.0

    def create_infer_request(self) -> InferRequest:
        instance = self.instances[self._next % len(self.instances)]
        self._next += 1
        return PythonInferRequest(self, instance)

    def export(self) -> bytes:
        raise Unsupported(f"python model {self.name!r} cannot be exported; serve its folder")

    def close(self) -> None:
        super().close()
        if self.gatherer is not None:
            self.gatherer.close()
        for instance in self.instances:
            instance.finalize()
        if self._custom is not None:  # its metric families leave /metrics with it
            self._custom.drop(self._owner)


class PythonInferRequest(InferRequest):
    network: PythonNetwork

    def __init__(self, network: PythonNetwork, instance: Instance) -> None:
        super().__init__(network)
        self.instance = instance

    def _request(self, arrays: list[Any], rid: int, run: RunContext, span: Any) -> dict[str, Any]:
        """The execute message's entry for this request (``rid``: its id; ``run``: what the
        model reads of it)."""
        network = self.network
        return protocol.request_entry(
            network.input_names, arrays, list(network.output_specs), rid, run, span
        )

    def _span(self, run: RunContext) -> Any:
        """A traced request's execute span, under its run's (``run.trace``; None: not
        traced)."""
        parent = run.trace
        if parent is None:
            return None
        instance = self.instance
        return parent.span("execute", {"plugserve.instance": instance.label})

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        network = self.network
        rid = next(_rids)
        token = run.token
        span = self._span(run)
        request = self._request(arrays, rid, run, span)
        if network.gatherer is not None:  # dynamic batching: with the requests waiting
            first = next((a for a in arrays if a is not None), None)
            rows = int(first.shape[0]) if first is not None and first.ndim else 1
            return network.gatherer.run(arrays, request, rows, span, token, run.tenant)
        where = network.where
        try:
            reply, tensors = self.instance.run(
                protocol.inputs_of(arrays, network.input_names),
                protocol.execute(network.name, [request]),
                [(rid, token)],
                [span] if span is not None else None,
                run.tenant,
            )
        except ValueError as exc:
            raise InferenceError(
                f"{where}: its answer cannot be read: {exc}; its process is started again for "
                "the next request"
            ) from None
        if token.error is not None:  # told, and its execute returned
            raise token.failure()
        if reply.get("error"):
            raise InferenceError(f"{where}: {reply['error']}")
        (response,) = reply["responses"]
        if response.get("error"):
            raise protocol.error_of(where, response["error"])
        partial = run.partial_outputs
        return protocol.outputs_of(
            where, response["outputs"], tensors, network.output_specs, "0/", not partial
        )

    def infer_decoupled(
        self, arrays: list[Any], sender: ResponseSender, run: RunContext | None = None
    ) -> None:
        """A decoupled model's request: its execute runs here (holding this stream); its
        responses reach ``sender`` through the instance's reader, during and after it. ``run``:
        what the model reads of its request; its token is the run under way on this thread
        while it runs."""
        if not self.network.decoupled:
            super().infer_decoupled(arrays, sender, run)
            return
        if run is None:
            run = run_context.untold()
        with cancel.running(run.token):
            self._decoupled(arrays, sender, run)

    def _decoupled(self, arrays: list[Any], sender: ResponseSender, run: RunContext) -> None:
        network, instance = self.network, self.instance
        inflight = instance.inflight
        rid = next(_rids)
        span = self._span(run)
        inflight.opened(rid, sender, run.tenant)
        forget = sender.on_cancel(lambda: inflight.cancel_request(rid))
        try:
            reply, _ = instance.run(
                protocol.inputs_of(arrays, network.input_names),
                protocol.execute(network.name, [self._request(arrays, rid, run, span)]),
                spans=[span] if span is not None else None,
                tenant=run.tenant,
            )
        except (PlugserveError, ValueError) as exc:
            inflight.fail(rid, sender, protocol.unreadable(network.where, "answer", exc))
            return
        finally:
            if sender.cancelled:
                forget()
        if reply.get("error"):
            inflight.fail(rid, sender, InferenceError(f"{network.where}: {reply['error']}"))
        instance.bound_memory()  # (only while none of its requests is open)

    def get_performance_counts(self) -> list[PerfCount]:
        return []


def _model_file(model: Any) -> Path:
    if not isinstance(model, str | os.PathLike) or not str(model).endswith(".py"):
        raise InvalidModel(
            "a python model is a model.py in a version folder of a repository entry whose "
            'config.pbtxt says backend: "python"'
        )
    return Path(model)


class PythonPlugin(Plugin):
    """Triton python-backend models (``model.py``) as a device of the server."""

    name = "PYTHON"
    config_class = PythonConfiguration
    cancellation = (
        "queued: at once; in execute: the model is told (is_cancelled()), and its process is "
        "stopped only past MAX_EXECUTE_SECONDS"
    )

    def __init__(self) -> None:
        super().__init__()
        #: the server's data plane (its models' BLS calls run through it), set by the server
        self.plane: Any = None
        #: the server's model control (its models' load_model calls), set by the server
        self.control: Any = None

    def device_name(self) -> str:
        return f"Python {sys.version.split()[0]} worker processes (Triton python backend)"

    def load_network(self, model: Any, config: Any = None) -> CompiledNetwork:
        """A model.py from anyone: refused, since importing it runs it (the models of the
        operator's repository load through :meth:`load_trusted`)."""
        _model_file(model)
        raise PermissionDenied(
            f"python model {Path(model).parent.parent.name!r} was not loaded: its model.py is "
            "code the server would run, and code loads only from the server's model "
            "repository on disk (a load's file overrides are a client's files): put the "
            "model in the repository and load it by name, or ask the server's operator to "
            "allow code from clients"
        )

    def load_trusted(self, model: Any, config: Any = None) -> CompiledNetwork:
        """The operator's model.py (its repository's), run in worker processes."""
        return PythonNetwork(self, self.merged_config(config, strict=False), _model_file(model))

    def query_network(self, model: Any, config: Any = None) -> dict[str, str]:
        return {}

    def import_network(self, blob: bytes, config: Any = None) -> CompiledNetwork:
        raise Unsupported("python models are not exported; serve the model's folder")
