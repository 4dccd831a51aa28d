"""The ``PYTHON`` device: Triton python-backend models, each instance a process of its own.

A repository entry whose ``config.pbtxt`` says ``backend: "python"`` loads here (its version
folder's ``model.py``). Each instance of its ``instance_group`` (``NUM_STREAMS``) is a worker
process (``worker.py``, Triton's stub) with the model's ``TritonPythonModel`` in it, and one
stream of the network's executor: the data plane, deadlines, the memory budget, statistics and
every protocol treat it as any network. Tensors cross in sealed memfds (``ipc.py``), never
pickled.

What a model cannot do to the server: an exception answers its request with the traceback's
last lines; a process that dies answers its request with an error and is started again for
the next one; a request that hangs ends at its deadline (or ``--max-request-seconds``), its
process killed and started again; a model that fails to import or to initialize fails its
load with the reason, and other models load. A process's memory is its own (a leak grows the
worker, which the operator bounds like any process), and the server maps only memfds sealed
against shrinking, so no worker can make the server fault.

A model may name its own Python: the ``EXECUTION_ENV_PATH`` parameter, a virtual environment
(its ``bin/python``) or an interpreter, which needs numpy only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    CompiledNetwork,
    ConfigKey,
    Configuration,
    InferenceError,
    InferRequest,
    InvalidInput,
    InvalidModel,
    NotFound,
    PerfCount,
    Plugin,
    PlugserveError,
    TensorSpec,
    Unsupported,
)
from plugserve.plugins.streams import StreamsExecutor
from plugserve.server.pipelines.python import ipc
from plugserve.server.pipelines.types import DTYPES

__all__ = ["PythonPlugin"]

log = logging.getLogger(__name__)

WORKER = Path(__file__).resolve().parent / "worker.py"
#: how long a model's initialize may take before its load fails
INITIALIZE_SECONDS = 300.0
#: how long finalize may take when a model is unloaded
FINALIZE_SECONDS = 10.0
#: each instance's two arenas (requests in, answers out): larger tensors travel in a memfd of
#: their own; memory is taken only as pages are touched
ARENA_BYTES = 8 << 20

#: a response's TritonError code -> the typed error its request fails with
_ERRORS = {"INVALID_ARG": InvalidInput, "NOT_FOUND": NotFound, "UNSUPPORTED": Unsupported}
#: a typed error's gRPC code -> the TritonError code a BLS call's response carries
_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "NOT_FOUND": "NOT_FOUND",
          "UNIMPLEMENTED": "UNSUPPORTED", "UNAVAILABLE": "UNAVAILABLE",
          "CANCELLED": "CANCELLED", "DEADLINE_EXCEEDED": "UNAVAILABLE"}  # fmt: skip


class PythonConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "EXECUTION_ENV_PATH",
            "",
            str,
            doc="the model's own Python: a virtual environment folder or an interpreter",
        ),
    )


def _model_config(path: Path) -> tuple[Any, dict[str, Any]]:
    """The entry's ``config.pbtxt`` as Triton's message and as the JSON models read."""
    from google.protobuf import json_format, text_format

    from plugserve.server.triton_config import messages

    file = path.parent.parent / "config.pbtxt"
    message = messages().ModelConfig()
    if file.is_file():
        text_format.Parse(file.read_text(), message)
    if not message.name:
        message.name = path.parent.parent.name
    as_json = json_format.MessageToDict(message, preserving_proto_field_name=True)
    for kind in ("input", "output"):  # int64 dims are strings in protobuf's JSON: Triton's ints
        for entry in as_json.get(kind, []):
            entry["dims"] = [int(d) for d in entry.get("dims", [])]
            entry.setdefault("data_type", "TYPE_INVALID")
    as_json.setdefault("max_batch_size", 0)
    return message, as_json


def _specs(config: dict[str, Any], kind: str, where: str) -> list[TensorSpec]:
    batched = int(config.get("max_batch_size", 0)) > 0
    specs = []
    for entry in config.get(kind, []):
        dtype = DTYPES.get(entry.get("data_type", ""))
        if dtype is None:
            raise InvalidModel(
                f"{where}: {kind} {entry.get('name')!r} has data_type "
                f"{entry.get('data_type')!r}; use one of {', '.join(DTYPES)}"
            )
        dims = [None if d < 0 else d for d in entry["dims"]]
        shape = tuple(([None] if batched else []) + dims)
        specs.append(TensorSpec(entry["name"], np.dtype(dtype), shape))
    return specs


def _interpreter(setting: str, where: str) -> str:
    if not setting:
        return sys.executable
    path = Path(setting)
    candidate = path / "bin" / "python" if path.is_dir() else path
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        raise InvalidModel(
            f"{where}: EXECUTION_ENV_PATH {setting!r} is neither a virtual environment (with "
            "bin/python) nor a Python interpreter"
        )
    return str(candidate)


class Worker:
    """One instance's process, started (and initialized) on demand, one request at a time."""

    def __init__(self, python: str, model_path: Path, args: dict[str, Any], label: str) -> None:
        self.python, self.model_path, self.args, self.label = python, model_path, args, label
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.restarts = 0
        #: the server's data plane, which the model's BLS calls run through
        self.plane: Any = None
        self.inbox: ipc.Arena | None = None  # the process reads requests from it
        self.outbox: ipc.Arena | None = None  # and writes answers into this one

    def start(self) -> None:
        """Spawn the process and initialize the model in it; InvalidModel with the model's
        own reason when it cannot."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [self.python, str(WORKER), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        self.inbox, self.outbox = ipc.Arena(ARENA_BYTES), ipc.Arena(ARENA_BYTES, writable=False)
        ours.settimeout(INITIALIZE_SECONDS)
        try:
            ipc.send(ours, {"op": "initialize", "model_path": str(self.model_path),
                            "args": self.args}, self.inbox.fd, self.outbox.fd)  # fmt: skip
            reply, _ = ipc.receive(ours)
        except (OSError, EOFError, ValueError) as exc:
            self.kill()
            raise InvalidModel(f"{self.label}: its process did not initialize: {exc}") from None
        ours.settimeout(None)
        if "error" in reply:
            self.kill()
            raise InvalidModel(f"{self.label}: {reply['error']}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        process, sock = self.process, self.sock
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        if sock is not None:
            sock.close()
        self.sock = None
        for arena in (self.inbox, self.outbox):
            if arena is not None:
                arena.close()
        self.inbox = self.outbox = None

    def run(self, tensors: dict[str, np.ndarray], header: dict[str, Any]) -> Any:
        """``header`` with ``tensors`` to the process, and its answer: ``(reply, outputs)``,
        the outputs copied out of the answer's memory (the next request reuses it)."""
        with self.lock:
            self._ready()
            inbox, outbox = self.inbox, self.outbox  # a cancel may close them meanwhile
            described = inbox.pack(tensors)
            fd = -1
            if described is None:
                described, fd = ipc.pack_tensors(tensors)
            else:
                header["arena"] = True
            header["tensors"] = described
            try:
                reply, out_fd = self._exchange(header, fd)
            finally:
                if fd >= 0:
                    os.close(fd)
            if "error" in reply:
                if out_fd >= 0:
                    os.close(out_fd)
                return reply, {}
            if reply.get("arena"):
                return reply, outbox.unpack(reply.get("tensors", []), copy=True)
            return reply, ipc.unpack_tensors(reply.get("tensors", []), out_fd)

    def _ready(self) -> None:
        if not self.alive():
            if self.process is not None:
                self.restarts += 1
                log.warning("%s: starting its process again", self.label)
            self.kill()
            self.start()

    def _exchange(self, header: dict[str, Any], fd: int) -> tuple[dict[str, Any], int]:
        """One exchange with the process, answering to the run's token: cancelled (its
        deadline, its client gone), the process is killed and started again next time."""
        token = cancel.current()
        forget = token.on_cancel(self.kill) if token is not None else None
        try:
            ipc.send(self.sock, header, fd)
            while True:
                reply, reply_fd = ipc.receive(self.sock)
                if reply.get("op") != "bls":
                    return reply, reply_fd
                self._serve_bls(reply, reply_fd)  # the model calls a model meanwhile
        except (OSError, EOFError, ValueError, AttributeError) as exc:
            if token is not None and token.error is not None:
                raise token.failure() from None
            code = None
            if self.process is not None:  # its socket closed: it is exiting, or hung up
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.process.wait(2)
            self.kill()
            raise InferenceError(
                f"{self.label}: its process ended while running the request (exit code "
                f"{code}: {exc or 'no answer'}); it is started again for the next request"
            ) from None
        finally:
            if forget is not None:
                forget()

    def _serve_bls(self, header: dict[str, Any], fd: int) -> None:
        """One BLS request from the model: run through the data plane as any client's (its
        deadline the model's request's; errors answered as Triton returns them)."""
        try:
            inputs = ipc.unpack_tensors(header.get("tensors", []), fd)
            if self.plane is None:
                raise Unsupported("BLS calls need the server's data plane")
            version = int(header.get("version") or -1)
            entry = self.plane.get(str(header["model"]), max(version, 0))
            outputs = self.plane.submit(
                entry, inputs, list(header.get("outputs") or []) or None, inline=True
            ).result()
        except PlugserveError as exc:
            code = _CODES.get(getattr(exc, "code", ""), "INTERNAL")
            ipc.send(self.sock, {"error": [str(exc), code]})
            return
        described, out_fd = ipc.pack_tensors(dict(outputs))
        try:
            ipc.send(self.sock, {"tensors": described}, out_fd)
        finally:
            if out_fd >= 0:
                os.close(out_fd)

    def finalize(self) -> None:
        with self.lock:
            if self.alive() and self.sock is not None:
                try:
                    self.sock.settimeout(FINALIZE_SECONDS)
                    ipc.send(self.sock, {"op": "finalize"})
                    ipc.receive(self.sock)
                    self.process.wait(FINALIZE_SECONDS)
                except (OSError, EOFError, ValueError, subprocess.TimeoutExpired):
                    pass
            self.kill()


class PythonNetwork(CompiledNetwork):
    def __init__(self, plugin: PythonPlugin, config: Configuration, path: Path) -> None:
        message, model_config = _model_config(path)
        name = message.name
        super().__init__(plugin, name, config)
        where = f"python model {name!r}"
        self._inputs = _specs(model_config, "input", where)
        self._outputs = _specs(model_config, "output", where)
        self.decoupled = bool(model_config.get("model_transaction_policy", {}).get("decoupled"))
        if self.decoupled:
            raise Unsupported(
                f"{where} is decoupled (model_transaction_policy), which this plugserve does "
                "not serve yet"
            )
        python = _interpreter(str(config.get("EXECUTION_ENV_PATH") or ""), where)
        count = max(config.streams(), 1)
        folder = path.parent.parent
        self.workers = [
            Worker(
                python,
                path,
                {
                    "model_config": json.dumps(model_config),
                    "model_instance_kind": "CPU",
                    "model_instance_name": f"{name}_0_{i}",
                    "model_instance_device_id": "0",
                    "model_repository": str(folder),
                    "model_version": path.parent.name,
                    "model_name": name,
                },
                f"{where} (instance {i})",
            )
            for i in range(count)
        ]
        self._next = 0
        for worker in self.workers:
            worker.plane = plugin.plane
        try:
            for worker in self.workers:
                worker.start()
        except BaseException:
            for worker in self.workers:
                worker.kill()
            raise

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return len(self.workers)
        return super()._metric(name)

    def _new_executor(self) -> StreamsExecutor:
        """One stream per instance, each with its own process."""
        return StreamsExecutor(
            f"PYTHON/{self.name}",
            len(self.workers),
            state_factory=lambda i: PythonInferRequest(self, self.workers[i]),
        )

    def create_infer_request(self) -> InferRequest:
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        return PythonInferRequest(self, worker)

    def export(self) -> bytes:
        raise Unsupported(f"python model {self.name!r} cannot be exported; serve its folder")

    def close(self) -> None:
        super().close()
        for worker in self.workers:
            worker.finalize()


class PythonInferRequest(InferRequest):
    network: PythonNetwork

    def __init__(self, network: PythonNetwork, worker: Worker) -> None:
        super().__init__(network)
        self.worker = worker

    def _infer(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        network = self.network
        names = [spec.name for spec in network.inputs]
        header = {
            "op": "execute",
            "model": network.name,
            "requests": [
                {"inputs": [n for n, a in zip(names, arrays) if a is not None],
                 "outputs": [s.name for s in network.outputs]}
            ],
        }  # fmt: skip
        where = f"python model {network.name!r}"
        try:
            reply, tensors = self.worker.run(
                {f"0/{n}": a for n, a in zip(names, arrays) if a is not None}, header
            )
        except ValueError as exc:
            raise InferenceError(f"{where}: its answer cannot be read: {exc}") from None
        if "error" in reply:
            raise InferenceError(f"{where}: {reply['error']}")
        (response,) = reply["responses"]
        if response.get("error"):
            message, code = response["error"]
            raise _ERRORS.get(code, InferenceError)(f"{where}: {message}")
        return self._outputs(where, response["outputs"], tensors)

    def _outputs(
        self, where: str, names: list[str], tensors: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The response's tensors, each an output of the model's config, of its type and rank."""
        specs = {s.name: s for s in self.network.outputs}
        outputs: dict[str, np.ndarray] = {}
        for name in names:
            spec = specs.get(name)
            if spec is None:
                raise InferenceError(
                    f"{where}: output {name!r} is not an output of its config.pbtxt "
                    f"({', '.join(specs) or 'none'})"
                )
            value = tensors[f"0/{name}"]
            if value.dtype != spec.dtype and not (spec.dtype == object and value.dtype == object):
                raise InferenceError(
                    f"{where}: output {name!r} is {value.dtype}, its config.pbtxt says {spec.dtype}"
                )
            if spec.shape is not None and len(value.shape) != len(spec.shape):
                raise InferenceError(
                    f"{where}: output {name!r} has shape {list(value.shape)}, its config.pbtxt "
                    f"says rank {len(spec.shape)}"
                )
            outputs[name] = value
        missing = [n for n in specs if n not in outputs]
        if missing:
            raise InferenceError(
                f"{where}: its response has no output {', '.join(repr(m) for m in missing)}"
            )
        return outputs

    def get_performance_counts(self) -> list[PerfCount]:
        return []


class PythonPlugin(Plugin):
    """Triton python-backend models (``model.py``) as a device of the server."""

    name = "PYTHON"
    config_class = PythonConfiguration
    cancellation = "at once: the model's process is stopped, and started again for the next"

    def __init__(self) -> None:
        super().__init__()
        #: the server's data plane (its models' BLS calls run through it), set by the server
        self.plane: Any = None

    def device_name(self) -> str:
        return f"Python {sys.version.split()[0]} worker processes (Triton python backend)"

    def load_network(self, model: Any, config: Any = None) -> CompiledNetwork:
        if not isinstance(model, str | os.PathLike) or not str(model).endswith(".py"):
            raise InvalidModel(
                "a python model is a model.py in a version folder of a repository entry whose "
                'config.pbtxt says backend: "python"'
            )
        return PythonNetwork(self, self.merged_config(config, strict=False), Path(model))

    def query_network(self, model: Any, config: Any = None) -> dict[str, str]:
        return {}

    def import_network(self, blob: bytes, config: Any = None) -> CompiledNetwork:
        raise Unsupported("python models are not exported; serve the model's folder")
