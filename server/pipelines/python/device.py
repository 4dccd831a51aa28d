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
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Cancelled,
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
    ResourceExhausted,
    Response,
    ResponseSender,
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
        # a Python model gets BYTES as Triton hands them over: the bytes, whatever they hold
        binary = np.dtype(dtype) == np.dtype(object)
        specs.append(TensorSpec(entry["name"], np.dtype(dtype), shape, binary=binary))
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


#: what the server handles at once when it reads them (the rest answer the thread that waits)
_HANDLED = frozenset({"bls", "bls_cancel", "send", "call"})
#: seconds a decoupled model's execute may go on after its request was cancelled, to see
#: ``is_cancelled()`` and return, before its process is stopped (Triton's models poll it)
CANCEL_GRACE = 5.0
#: what a model may ask the server besides BLS (``{"op": "call", "what": NAME}``): NAME ->
#: ``handler(worker, header, inputs) -> reply``, run on a worker thread (custom metrics, the
#: model loading API); each answers ``{"call": id, ...}``
CALLS: dict[str, Callable[[Worker, dict[str, Any], dict[str, np.ndarray]], dict[str, Any]]] = {}

_rids = itertools.count(1)


def _route(header: dict[str, Any]) -> Any:
    return None if header.get("op") in _HANDLED else "main"


class Worker:
    """One instance's process, started (and initialized) on demand, one ``execute`` at a time
    (a decoupled model's responses may go on after it returns)."""

    def __init__(
        self,
        python: str,
        model_path: Path,
        args: dict[str, Any],
        label: str,
        decoupled: bool = False,
        outputs: list[TensorSpec] | None = None,
    ) -> None:
        self.python, self.model_path, self.args, self.label = python, model_path, args, label
        self.decoupled = decoupled
        self.specs = {spec.name: spec for spec in outputs or []}
        self.process: subprocess.Popen | None = None
        self.mailbox: ipc.Mailbox | None = None
        self.lock = threading.Lock()
        self.restarts = 0
        #: the server's data plane, which the model's BLS calls run through
        self.plane: Any = None
        self.inbox: ipc.Arena | None = None  # the process reads requests from it
        self.outbox: ipc.Arena | None = None  # and writes answers into this one
        #: a decoupled model's requests not yet complete: request id -> its sender
        self.open: dict[int, ResponseSender] = {}
        #: request ids whose execute runs now
        self.executing: set[int] = set()
        #: the model's BLS calls in flight: call id -> their tokens (to cancel them)
        self.calls: dict[int, cancel.Token] = {}
        self._calls_lock = threading.Lock()

    # --- the process

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
        mailbox = self.mailbox = ipc.Mailbox(ours, _route, self._handle, most_fds=1)
        self.inbox, self.outbox = ipc.Arena(ARENA_BYTES), ipc.Arena(ARENA_BYTES, writable=False)
        ours.settimeout(INITIALIZE_SECONDS)
        try:
            mailbox.send(
                {"op": "initialize", "model_path": str(self.model_path), "args": self.args,
                 "decoupled": self.decoupled},
                self.inbox.fd,
                self.outbox.fd,
            )  # fmt: skip
            reply, _ = mailbox.wait("main")
        except (OSError, EOFError, ValueError) as exc:
            self.kill()
            self._discard()
            raise InvalidModel(f"{self.label}: its process did not initialize: {exc}") from None
        ours.settimeout(None)
        if reply.get("error"):
            self.kill()
            self._discard()
            raise InvalidModel(f"{self.label}: {reply['error']}")
        if self.decoupled:  # responses come while no execute waits: read them
            threading.Thread(
                target=self._serve, args=(mailbox,), name=f"{self.label}-reader", daemon=True
            ).start()

    def _serve(self, mailbox: ipc.Mailbox) -> None:
        """A decoupled model's reader: keeps the socket read between executes, and fails the
        requests still open when the process goes."""
        try:
            while True:
                _, fds = mailbox.wait("reader")
                for fd in fds:
                    os.close(fd)
        except EOFError:
            pass
        code = self.process.poll() if self.process is not None else None
        for rid, sender in list(self.open.items()):
            self.open.pop(rid, None)
            sender.fail(
                InferenceError(
                    f"{self.label}: its process ended (exit code {code}) while the request was "
                    "open; it is started again for the next request"
                )
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Stop the process (from any thread: a cancelled run's token calls it) and wake
        whoever waits on its socket. What a run may be using (the arenas) is left to the
        next :meth:`_ready` or :meth:`finalize`, which hold the run lock."""
        process, mailbox = self.process, self.mailbox
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)
        if mailbox is not None:
            mailbox.close("its process was stopped")
            mailbox.sock.close()

    def _discard(self) -> None:
        """The stopped process's arenas and mailbox let go (with the run lock held)."""
        for arena in (self.inbox, self.outbox):
            if arena is not None:
                arena.close()
        self.inbox = self.outbox = None
        self.mailbox = None

    def _ready(self) -> ipc.Mailbox:
        if not self.alive() or self.mailbox is None or self.mailbox.closed:
            if self.process is not None:
                self.restarts += 1
                log.warning("%s: starting its process again", self.label)
            self.kill()
            self._discard()
            self.start()
        return self.mailbox

    # --- execute

    def run(self, tensors: dict[str, np.ndarray], header: dict[str, Any]) -> Any:
        """``header`` with ``tensors`` to the process, and its answer: ``(reply, outputs)``,
        the outputs copied out of the answer's memory (the next request reuses it)."""
        with self.lock:
            mailbox = self._ready()
            inbox, outbox = self.inbox, self.outbox  # a cancel may close them meanwhile
            described = inbox.pack(tensors)
            fd = -1
            if described is None:
                described, fd = ipc.pack_tensors(tensors)
            else:
                header["arena"] = True
            header["tensors"] = described
            try:
                reply, out_fd = self._exchange(mailbox, header, fd)
            finally:
                if fd >= 0:
                    os.close(fd)
            if reply.get("error") or self.decoupled:
                if out_fd >= 0:
                    os.close(out_fd)
                return reply, {}
            if reply.get("arena"):
                return reply, outbox.unpack(reply.get("tensors", []), copy=True)
            return reply, ipc.unpack_tensors(reply.get("tensors", []), out_fd)

    def _exchange(
        self, mailbox: ipc.Mailbox, header: dict[str, Any], fd: int
    ) -> tuple[dict[str, Any], int]:
        """One execute, answering to the run's token: cancelled (its deadline, its client
        gone), the process is stopped and started again next time (a decoupled model's is
        told first, and stopped only if its execute does not return within CANCEL_GRACE)."""
        token = cancel.current()
        forget = None
        if token is not None:
            forget = token.on_cancel(self.kill if not self.decoupled else lambda: None)
        try:
            mailbox.send(header, fd)
            reply, fds = mailbox.wait("main")
            return reply, (fds[0] if fds else -1)
        except (OSError, EOFError, ValueError, AttributeError) as exc:
            if token is not None and token.error is not None and not self.decoupled:
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

    def cancel_request(self, rid: int) -> None:
        """A decoupled request was cancelled: tell the model (``is_cancelled()``), stop
        expecting its responses, and stop the process if its execute has not returned
        within CANCEL_GRACE."""
        self.open.pop(rid, None)
        mailbox = self.mailbox
        if mailbox is None:
            return
        with contextlib.suppress(OSError):
            mailbox.send({"op": "cancel", "rid": rid}, block=False)
        if rid in self.executing:
            timer = threading.Timer(CANCEL_GRACE, self._stop_if_running, (rid, mailbox))
            timer.daemon = True
            timer.start()

    def _stop_if_running(self, rid: int, mailbox: ipc.Mailbox) -> None:
        if rid in self.executing and self.mailbox is mailbox:
            log.warning(
                "%s: its execute went on %g s after its request was cancelled; stopping its "
                "process", self.label, CANCEL_GRACE,
            )  # fmt: skip
            self.kill()

    # --- what the model sends while it runs (on the reading thread: nothing here blocks)

    def _handle(self, header: dict[str, Any], fds: list[int]) -> None:
        fd = fds[0] if fds else -1
        op = header.get("op")
        try:
            if op == "send":
                self._response(header, fd)
            elif op == "bls":
                self._start_bls(header, fd)
            elif op == "bls_cancel":
                with self._calls_lock:
                    token = self.calls.get(int(header.get("call", -1)))
                if token is not None:
                    token.cancel(Cancelled(f"{self.label}: the model cancelled its BLS call"))
                if fd >= 0:
                    os.close(fd)
            elif op == "call":
                self._start_call(header, fd)
        except Exception:  # a model's malformed message must not stop the reader
            log.exception("%s: a message from its process could not be handled", self.label)

    def _response(self, header: dict[str, Any], fd: int) -> None:
        """A decoupled request's response, checked against the model's outputs."""
        rid = int(header.get("rid", -1))
        sender = self.open.get(rid)
        final = bool(header.get("final"))
        described = header.get("response")
        if sender is None:  # cancelled, or sent after its final response: dropped
            if fd >= 0:
                os.close(fd)
            return
        if final:
            self.open.pop(rid, None)
        if described is None:
            if fd >= 0:
                os.close(fd)
            sender.send(None, final=True)
            return
        try:
            tensors = ipc.unpack_tensors(header.get("tensors", []), fd)
            response = _response_of(self.label, described, tensors, self.specs)
        except PlugserveError as exc:
            self.open.pop(rid, None)
            sender.fail(exc)
            return
        except ValueError as exc:
            self.open.pop(rid, None)
            sender.fail(InferenceError(f"{self.label}: its response cannot be read: {exc}"))
            return
        sender.send(response, final=final)

    def _reply(self, call: int, reply: dict[str, Any], tensors: dict[str, Any] | None = None):
        """An answer to the model's call ``call`` (not blocking: a model that does not read
        its answers has the call cancelled)."""
        mailbox = self.mailbox
        if mailbox is None:
            return
        reply["call"] = call
        described, fd = ipc.pack_tensors(tensors or {})
        reply["tensors"] = described
        try:
            mailbox.send(reply, fd, block=False)
        except OSError:
            with self._calls_lock:
                token = self.calls.get(call)
            if token is not None:
                token.cancel(ResourceExhausted(f"{self.label}: it does not read its answers"))
        finally:
            if fd >= 0:
                os.close(fd)

    def _start_bls(self, header: dict[str, Any], fd: int) -> None:
        """One BLS request from the model, run through the data plane as any client's
        (counted, budgeted, on its model's device); its answer (or each response of a
        decoupled call) goes back as it comes, never blocking the reader."""
        call = int(header["call"])
        decoupled = bool(header.get("decoupled"))
        try:
            inputs = ipc.unpack_tensors(header.get("tensors", []), fd)
            plane = self.plane
            if plane is None:
                raise Unsupported("BLS calls need the server's data plane")
            version = int(header.get("version") or -1)
            entry = plane.get(str(header["model"]), max(version, 0))
            if entry.network.decoupled and not decoupled:
                raise InvalidInput(
                    f"model {entry.name!r} is decoupled: call it with exec(decoupled=True)"
                )
            token = cancel.Token()
            parameters = json.loads(header.get("parameters") or "{}")
            token.parameters = parameters if isinstance(parameters, dict) and parameters else None
            timeout = int(header.get("timeout") or 0)
            deadline = time.monotonic() + timeout / 1e6 if timeout > 0 else None
            outputs = list(header.get("outputs") or []) or None
            with self._calls_lock:
                self.calls[call] = token
            if decoupled:
                stream = plane.submit_decoupled(entry, inputs, outputs, deadline, token)
                lock = threading.Lock()
                stream.add_listener(lambda: self._forward(call, stream, lock))
            else:
                future = plane.submit(entry, inputs, outputs, deadline, token=token)
                future.add_done_callback(lambda f: self._bls_done(call, f))
        except PlugserveError as exc:
            with self._calls_lock:
                self.calls.pop(call, None)
            self._reply(call, {"error": [str(exc), _code_of(exc)], "final": True})

    def _bls_done(self, call: int, future: Any) -> None:
        with self._calls_lock:
            self.calls.pop(call, None)
        try:
            outputs = future.result()
        except PlugserveError as exc:
            self._reply(call, {"error": [str(exc), _code_of(exc)], "final": True})
            return
        except Exception as exc:
            self._reply(
                call, {"error": [f"{type(exc).__name__}: {exc}", "INTERNAL"], "final": True}
            )
            return
        self._reply(call, {"final": True}, dict(outputs))

    def _forward(self, call: int, stream: Any, lock: threading.Lock) -> None:
        """A decoupled BLS call's responses, in order, as they arrive."""
        with lock:
            try:
                items = stream.take()
            except PlugserveError as exc:
                items = None
                error = exc
            if items is None:
                with self._calls_lock:
                    self.calls.pop(call, None)
                self._reply(call, {"error": [str(error), _code_of(error)], "final": True})
                return
            for item, final in items:
                if final:
                    with self._calls_lock:
                        self.calls.pop(call, None)
                if item is None:
                    self._reply(call, {"final": final})
                elif item.error is not None:
                    self._reply(
                        call, {"error": [str(item.error), _code_of(item.error)], "final": final}
                    )
                else:
                    self._reply(call, {"final": final, "parameters": item.parameters}, item.outputs)

    def _start_call(self, header: dict[str, Any], fd: int) -> None:
        """A model's call to the server beside BLS (see :data:`CALLS`), on a thread: some of
        them load models."""
        call = int(header.get("call", -1))
        handler = CALLS.get(str(header.get("what")))
        try:
            inputs = ipc.unpack_tensors(header.get("tensors", []), fd)
        except ValueError as exc:
            self._reply(call, {"error": [str(exc), "INVALID_ARG"]})
            return
        if handler is None:
            self._reply(call, {"error": [f"unknown call {header.get('what')!r}", "UNSUPPORTED"]})
            return

        def run() -> None:
            try:
                self._reply(call, handler(self, header, inputs))
            except PlugserveError as exc:
                self._reply(call, {"error": [str(exc), _code_of(exc)]})
            except Exception as exc:
                log.exception("%s: its call %r failed", self.label, header.get("what"))
                self._reply(call, {"error": [f"{type(exc).__name__}: {exc}", "INTERNAL"]})

        threading.Thread(target=run, name=f"{self.label}-call", daemon=True).start()

    def finalize(self) -> None:
        with self.lock:
            mailbox = self.mailbox
            if self.alive() and mailbox is not None:
                try:
                    mailbox.sock.settimeout(FINALIZE_SECONDS)
                    mailbox.send({"op": "finalize"})
                    mailbox.wait("main")
                    self.process.wait(FINALIZE_SECONDS)
                except (OSError, EOFError, ValueError, subprocess.TimeoutExpired):
                    pass
            self.kill()
            self._discard()


def _code_of(exc: BaseException) -> str:
    return _CODES.get(getattr(exc, "code", ""), "INTERNAL")


def _response_of(
    label: str,
    described: dict[str, Any],
    tensors: Mapping[str, np.ndarray],
    specs: Mapping[str, TensorSpec],
) -> Response:
    """A response the model sent, its outputs checked against its config."""
    parameters = described.get("parameters") or "{}"
    try:
        parameters = json.loads(parameters) if isinstance(parameters, str) else parameters
    except ValueError:
        parameters = {}
    if described.get("error"):
        message, code = described["error"]
        return Response(
            parameters=parameters, error=_ERRORS.get(code, InferenceError)(f"{label}: {message}")
        )
    outputs = _checked_outputs(label, list(described.get("outputs", [])), tensors, specs, "")
    return Response(outputs, parameters if isinstance(parameters, dict) else {})


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


def _checked_outputs(
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
        value = tensors[f"{prefix}{name}"]
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


class PythonNetwork(CompiledNetwork):
    def __init__(self, plugin: PythonPlugin, config: Configuration, path: Path) -> None:
        message, model_config = _model_config(path)
        name = message.name
        super().__init__(plugin, name, config)
        where = f"python model {name!r}"
        self._inputs = _specs(model_config, "input", where)
        self._outputs = _specs(model_config, "output", where)
        self.decoupled = bool(model_config.get("model_transaction_policy", {}).get("decoupled"))
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
                self.decoupled,
                self._outputs,
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
                worker._discard()
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

    def _header(self, arrays: list[Any], rid: int | None = None) -> dict[str, Any]:
        network = self.network
        names = [spec.name for spec in network.inputs]
        token = cancel.current()
        request: dict[str, Any] = {
            "inputs": [n for n, a in zip(names, arrays) if a is not None],
            "outputs": [s.name for s in network.outputs],
        }
        if token is not None and token.parameters:
            request["parameters"] = json.dumps(token.parameters)
        if rid is not None:
            request["rid"] = rid
        return {"op": "execute", "model": network.name, "requests": [request]}

    def _infer(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        network = self.network
        names = [spec.name for spec in network.inputs]
        where = f"python model {network.name!r}"
        try:
            reply, tensors = self.worker.run(
                {f"0/{n}": a for n, a in zip(names, arrays) if a is not None}, self._header(arrays)
            )
        except ValueError as exc:
            raise InferenceError(f"{where}: its answer cannot be read: {exc}") from None
        if reply.get("error"):
            raise InferenceError(f"{where}: {reply['error']}")
        (response,) = reply["responses"]
        if response.get("error"):
            message, code = response["error"]
            raise _ERRORS.get(code, InferenceError)(f"{where}: {message}")
        specs = {s.name: s for s in network.outputs}
        token = cancel.current()
        partial = token is not None and token.partial_outputs
        return _checked_outputs(where, response["outputs"], tensors, specs, "0/", not partial)

    def infer_decoupled(self, arrays: list[Any], sender: ResponseSender) -> None:
        """A decoupled model's request: its execute runs here (holding this stream); its
        responses reach ``sender`` through the worker's reader, during and after it."""
        if not self.network.decoupled:
            super().infer_decoupled(arrays, sender)
            return
        network, worker = self.network, self.worker
        names = [spec.name for spec in network.inputs]
        where = f"python model {network.name!r}"
        rid = next(_rids)
        worker.open[rid] = sender
        worker.executing.add(rid)
        forget = sender.on_cancel(lambda: worker.cancel_request(rid))
        try:
            reply, _ = worker.run(
                {f"0/{n}": a for n, a in zip(names, arrays) if a is not None},
                self._header(arrays, rid),
            )
        except PlugserveError as exc:
            worker.open.pop(rid, None)
            sender.fail(exc)
            return
        except ValueError as exc:
            worker.open.pop(rid, None)
            sender.fail(InferenceError(f"{where}: its answer cannot be read: {exc}"))
            return
        finally:
            worker.executing.discard(rid)
            if sender.cancelled:
                forget()
        if reply.get("error"):
            worker.open.pop(rid, None)
            sender.fail(InferenceError(f"{where}: {reply['error']}"))

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
