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
instance (:meth:`Worker.readiness`: the process runs, and the model's ``is_ready()`` answers True
on a socket of its own within READY_SECONDS). With dynamic batching, a :class:`Gatherer` hands
several waiting requests to one ``execute``. What a model asks the server besides BLS (custom
metrics, the model loading API) is in ``calls.py``; its Logger lines reach the server's log.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
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
from plugserve.plugins.configuration import parse_non_negative_int
from plugserve.plugins.streams import StreamsExecutor
from plugserve.server.apps.pipelines.python import ipc
from plugserve.server.apps.pipelines.python.calls import CALLS
from plugserve.server.apps.pipelines.python.output import PUMP, LineBudget
from plugserve.server.control.triton_types import DTYPES
from plugserve.server.plane import budget
from plugserve.server.plane.request import Request
from plugserve.server.plane.sequences import sequence_step

__all__ = ["PythonPlugin"]

log = logging.getLogger(__name__)
#: where a model's Logger lines go, each at its level and with the model's name
model_log = logging.getLogger(f"{__name__}.model")
#: Triton's Logger levels -> the server's (VERBOSE shows with --log-level DEBUG)
_LOG_LEVELS = {"INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
               "VERBOSE": logging.DEBUG}  # fmt: skip

#: what the server runs: the process's bounds (sandbox.py), then the worker (worker.py)
SANDBOX = Path(__file__).resolve().parent / "sandbox.py"
#: how long a model's initialize may take before its load fails
INITIALIZE_SECONDS = 300.0
#: how long finalize may take when a model is unloaded
FINALIZE_SECONDS = 10.0
#: how long a model's readiness check may take (Triton's is_ready timeout)
READY_SECONDS = 5.0
#: each instance's two arenas (requests in, answers out): larger tensors travel in a memfd of
#: their own; memory is taken only as pages are touched
ARENA_BYTES = 8 << 20
#: seconds a request's thread polls for its process's answer before it sleeps, while most
#: of the model's recent answers came within it: a sleeping thread is woken ~100 us after the
#: answer on these machines, as long as the whole hop of a small model. A model slower than
#: this is not polled for (its thread sleeps and leaves the core to others); each poll
#: yields the core
ANSWER_SPIN = 0.0005
#: the weight of the newest answer in the running share of answers that came within
#: ANSWER_SPIN (a share, not a mean time: one late answer, the machine busy elsewhere, does
#: not stop the polling)
ANSWER_WEIGHT = 0.125

#: a response's TritonError code -> the typed error its request fails with
_ERRORS = {"INVALID_ARG": InvalidInput, "NOT_FOUND": NotFound, "UNSUPPORTED": Unsupported}
#: a typed error's gRPC code -> the TritonError code a BLS call's response carries
_CODES = {"INVALID_ARGUMENT": "INVALID_ARG", "NOT_FOUND": "NOT_FOUND",
          "UNIMPLEMENTED": "UNSUPPORTED", "UNAVAILABLE": "UNAVAILABLE",
          "CANCELLED": "CANCELLED", "DEADLINE_EXCEEDED": "UNAVAILABLE"}  # fmt: skip


def parse_non_negative_seconds(value: str) -> float:
    number = float(str(value).strip())
    if not 0 <= number < 1e9:
        raise ValueError("expected a number of seconds >= 0")
    return number


def parse_niceness(value: str) -> int:
    number = int(str(value).strip())
    if not 0 <= number <= 19:
        raise ValueError("expected an integer from 0 to 19")
    return number


class PythonConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "EXECUTION_ENV_PATH",
            "",
            str,
            doc="the model's own Python: a virtual environment folder or an interpreter",
        ),
        ConfigKey(
            "MAX_PROCESS_BYTES",
            0,
            parse_non_negative_int,
            doc=(
                "memory one instance's process may hold (0: half of what the server may use): "
                "its allocations past it fail in the model, and a process found over it after "
                "a request is started again"
            ),
        ),
        ConfigKey(
            "MAX_SHM_BYTES",
            64 << 20,
            parse_non_negative_int,
            doc=(
                "size of each instance's own /dev/shm, a tmpfs gone with its process (0: the "
                "host's /dev/shm, unbounded): files past it fail to grow in the model"
            ),
        ),
        ConfigKey(
            "MAX_EXECUTE_SECONDS",
            300.0,
            parse_non_negative_seconds,
            doc=(
                "longest one execute may run (0: no bound): past it the model is taken as "
                "hung, its process killed and started again, its requests answered with an "
                "error; a client's deadline never stops a process"
            ),
        ),
        ConfigKey(
            "PROCESS_NICENESS",
            10,
            parse_niceness,
            doc=(
                "how far below the server's priority each instance's process runs (0-19, "
                "nice(2)): the server's threads, which answer every model's requests, take "
                "a core from a model busy on all of them at once"
            ),
        ),
    )


def _model_config(path: Path) -> tuple[Any, dict[str, Any]]:
    """The entry's ``config.pbtxt`` as Triton's message and as the JSON models read (none:
    the name alone, and ``auto_complete_config`` may complete it)."""
    from google.protobuf import text_format

    from plugserve.server.control.triton_config import messages

    file = path.parent.parent / "config.pbtxt"
    message = messages().ModelConfig()
    if file.is_file():
        text_format.Parse(file.read_text(), message)
    if not message.name:
        message.name = path.parent.parent.name
    if not message.backend:
        message.backend = "python"  # Triton's auto-complete says so for a model.py
    return message, _as_json(message)


def _as_json(message: Any) -> dict[str, Any]:
    from google.protobuf import json_format

    as_json = json_format.MessageToDict(message, preserving_proto_field_name=True)
    for kind in ("input", "output"):  # int64 dims are strings in protobuf's JSON: Triton's ints
        for entry in as_json.get(kind, []):
            entry["dims"] = [int(d) for d in entry.get("dims", [])]
            entry.setdefault("data_type", "TYPE_INVALID")
    as_json.setdefault("max_batch_size", 0)
    as_json.setdefault("input", [])
    as_json.setdefault("output", [])
    return as_json


#: what auto_complete_config may change (Triton's ModelConfig setters); the rest is the
#: repository's (instances, parameters, versions), and a change there is not acted on
_COMPLETABLE = ("input", "output", "max_batch_size", "dynamic_batching", "model_transaction_policy")


def _completed(where: str, original: Any, completed: Any) -> dict[str, Any]:
    """What ``auto_complete_config`` returned, checked as Triton's ModelConfig: the model's
    configuration from now on (InvalidModel naming what is wrong)."""
    from google.protobuf import json_format

    from plugserve.server.control.triton_config import messages

    if not isinstance(completed, dict):
        raise InvalidModel(f"{where}: auto_complete_config gave {completed!r}, not a configuration")
    message = messages().ModelConfig()
    try:
        json_format.ParseDict(completed, message)
    except (json_format.ParseError, TypeError, ValueError) as exc:
        raise InvalidModel(
            f"{where}: auto_complete_config returned a configuration that is not Triton's "
            f"ModelConfig: {exc}"
        ) from None
    final = messages().ModelConfig()
    final.CopyFrom(original)
    for field in _COMPLETABLE:
        final.ClearField(field)
        if field in ("input", "output"):
            getattr(final, field).extend(getattr(message, field))
        elif field == "max_batch_size":
            final.max_batch_size = message.max_batch_size
        elif message.HasField(field):
            getattr(final, field).CopyFrom(getattr(message, field))
    if final.max_batch_size < 0:
        raise InvalidModel(f"{where}: auto_complete_config set max_batch_size below 0")
    ignored = [
        f.name for f, _ in message.ListFields()
        if f.name not in _COMPLETABLE and f.name != "name" and getattr(original, f.name) != _
    ]  # fmt: skip
    if ignored:
        log.warning("%s: auto_complete_config changed %s: not acted on (the repository's)",
                    where, ", ".join(ignored))  # fmt: skip
    return _as_json(final)


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
_HANDLED = frozenset({"bls", "bls_cancel", "send", "call", "log"})
#: how often the hang watch looks at the executes under way, at most (it looks at least four
#: times per the smallest MAX_EXECUTE_SECONDS of the models it watches)
HANG_LOOK_SECONDS = 1.0

_rids = itertools.count(1)
_PAGE = os.sysconf("SC_PAGE_SIZE")
#: threads that run one instance's calls (custom metrics, the model loading API) at once, and
#: the calls that may run or wait at once: a model waits for each answer, so only a model that
#: floods its socket with calls meets the bound (its calls past it are refused at once, not
#: given a thread each)
CALL_THREADS = 4
MAX_CALLS = 256
#: a process whose data is past this share of its MAX_PROCESS_BYTES after a request is started
#: again (its next allocations would soon fail)
RESTART_AT = 0.8


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
        #: the server's model control (the model loading API), when it has one
        self.control: Any = None
        #: who owns the metric families the model declares (one load of the model)
        self.owner = 0
        self.inbox: ipc.Arena | None = None  # the process reads requests from it
        self.outbox: ipc.Arena | None = None  # and writes answers into this one
        #: a decoupled model's requests not yet complete: request id -> its sender
        self.open: dict[int, ResponseSender] = {}
        #: when the execute under way started (``time.monotonic``; 0: none runs), and the
        #: longest one may run (MAX_EXECUTE_SECONDS; 0: no bound): the hang watch reads both
        self.execute_started = 0.0
        self.max_execute_seconds = 0.0
        #: the process was stopped because its execute ran past max_execute_seconds
        self.hung = False
        self.shm_warned = False
        self._hangup: select.poll | None = None
        #: messages sent to the process since the execute under way (notices, answers)
        self.sent_since = 0
        #: the model's BLS calls in flight: call id -> their tokens (to cancel them)
        self.calls: dict[int, cancel.Token] = {}
        self._calls_lock = threading.Lock()
        #: the threads the model's calls run on (made at its first call), and how many of
        #: its calls run or wait there
        self._call_pool: ThreadPoolExecutor | None = None
        self._calls_waiting = 0
        #: readiness checks: the socket (a model with is_ready()), the check under way, the
        #: last result, and whether a restart runs in the background
        self.checks: socket.socket | None = None
        self._check_cond = threading.Condition()
        self._checking = False
        self._checked = 0
        self._check_result: tuple[bool, str] = (True, "")
        self._reviving = False
        #: the network was closed: nothing starts its process again
        self.closed = False
        #: bytes the process may hold (its data segment's limit; checked after each request)
        self.max_bytes = 0
        #: how far below the server's priority the process runs (PROCESS_NICENESS)
        self.niceness = 0
        #: the size of the process's own /dev/shm (MAX_SHM_BYTES; 0: the host's)
        self.shm_bytes = 0
        #: what the process may put in the server's log (its output, its Logger lines)
        self.output = LineBudget(label, model_log)
        self._statm: tuple[int, int] | None = None  # (pid, descriptor of its /proc statm)
        #: the running share of answers that came within ANSWER_SPIN of their request
        self.answers_within = 1.0

    # --- the process

    def spawn(self) -> None:
        """Start the process (its model not yet initialized: :meth:`auto_complete` may run
        first, then :meth:`start`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            command = [self.python, str(SANDBOX), str(theirs.fileno()), str(self.max_bytes)]
            self.process = subprocess.Popen(
                [*command, str(self.niceness), str(self.shm_bytes)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe: their lines in the order written
                close_fds=True,
                start_new_session=True,  # a group of its own, which kill() stops whole
            )
        finally:
            theirs.close()
        output = self.process.stdout
        PUMP.add(os.dup(output.fileno()), self.output)
        output.close()
        self.mailbox = ipc.Mailbox(ours, _route, self._handle, most_fds=1)
        self._hangup = select.poll()  # the process closed its end (one poll(2), no wait)
        self._hangup.register(ours, select.POLLRDHUP | select.POLLHUP)
        self.inbox, self.outbox = ipc.Arena(ARENA_BYTES), ipc.Arena(ARENA_BYTES, writable=False)

    def auto_complete(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The model's ``auto_complete_config`` run on ``config`` (Triton's JSON form) in the
        process, before ``initialize``: the config it returns, or None when the model has no
        such function. InvalidModel with the model's own reason when it fails."""
        if self.mailbox is None:
            self.spawn()
        mailbox = self.mailbox
        mailbox.sock.settimeout(INITIALIZE_SECONDS)
        try:
            mailbox.send(
                {"op": "auto_complete", "model_path": str(self.model_path), "config": config}
            )
            reply, _ = mailbox.wait("main")
        except (OSError, EOFError, ValueError) as exc:
            self.kill()
            self._discard()
            raise InvalidModel(f"{self.label}: its process did not answer: {exc}") from None
        mailbox.sock.settimeout(None)
        if reply.get("error"):
            self.kill()
            self._discard()
            raise InvalidModel(f"{self.label}: auto_complete_config failed: {reply['error']}")
        return reply.get("config")

    def start(self) -> None:
        """Spawn the process (unless :meth:`spawn` did) and initialize the model in it;
        InvalidModel with the model's own reason when it cannot."""
        if self.mailbox is None:
            self.spawn()
        mailbox = self.mailbox
        ours = mailbox.sock
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
        shm = reply.get("shm")
        if self.shm_bytes and shm and not self.shm_warned:
            self.shm_warned = True
            log.warning(
                "%s: its process uses the host's /dev/shm (%s): files it makes there are not "
                "bounded by MAX_SHM_BYTES; run the server as root or where unprivileged user "
                "namespaces are allowed", self.label, shm,
            )  # fmt: skip
        if reply.get("is_ready"):  # the model has is_ready(): a socket of its own for it
            self._open_checks(mailbox)
        if self.decoupled:  # responses come while no execute waits: read them
            threading.Thread(
                target=self._serve, args=(mailbox,), name=f"{self.label}-reader", daemon=True
            ).start()

    # --- readiness (Triton's is_ready)

    def _open_checks(self, mailbox: ipc.Mailbox) -> None:
        """A socket for readiness checks, served by a thread of the process: a check is
        answered while an execute runs (which reads nothing of the model's socket)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            mailbox.send({"op": "checks"}, theirs.fileno())
        except OSError:
            ours.close()
            return
        finally:
            theirs.close()
        self.checks = ours

    def readiness(self, timeout: float) -> tuple[bool, str]:
        """Whether this instance serves: its process runs and, when the model has
        ``is_ready()``, that says True within ``timeout`` (Triton's five seconds). One check
        at a time: a check asked while another runs takes its result. A process that is not
        running is started again in the background (and the instance is not ready
        meanwhile)."""
        if not self.alive():
            self.revive()
            return False, "its process is not running; it is being started again"
        sock = self.checks
        if sock is None:
            return True, ""
        with self._check_cond:
            if self._checking:
                seen = self._checked
                if not self._check_cond.wait_for(lambda: self._checked != seen, timeout):
                    return False, "timed out waiting for the is_ready() check under way"
                return self._check_result
            self._checking = True
        result = (False, "is_ready() was not asked")
        try:
            result = self._ask_ready(sock, timeout)
        finally:
            with self._check_cond:
                self._checking = False
                self._checked += 1
                self._check_result = result
                self._check_cond.notify_all()
        return result

    def _ask_ready(self, sock: socket.socket, timeout: float) -> tuple[bool, str]:
        number = next(_rids)
        end = time.monotonic() + timeout
        try:
            ipc.send(sock, {"op": "is_ready", "id": number}, flags=socket.MSG_DONTWAIT)
            while True:  # a late answer to an earlier check that timed out is skipped
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                header, _ = ipc.receive_all(sock, 0)
                if header.get("id") == number:
                    break
        except TimeoutError:
            return False, f"its is_ready() did not answer within {timeout:g} s"
        except (OSError, EOFError, ValueError) as exc:
            return False, f"its process did not answer is_ready(): {exc}"
        if header.get("error"):
            last = str(header["error"]).strip().splitlines() or [""]
            return False, f"its is_ready() failed: {last[-1]}"
        if header.get("ready"):
            return True, ""
        return False, "its is_ready() returned False"

    def revive(self) -> None:
        """Start a process that is not running again, in the background (one at a time)."""
        with self._check_cond:
            if self._reviving or self.closed:
                return
            self._reviving = True

        def run() -> None:
            try:
                with self.lock:  # after a run under way
                    if not self.closed and not self.alive():
                        self._ready()
            except PlugserveError as exc:
                log.warning("%s: its process could not be started again: %s", self.label, exc)
            finally:
                with self._check_cond:
                    self._reviving = False

        threading.Thread(target=run, name=f"{self.label}-revive", daemon=True).start()

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
        code = _exit_code(self.process) if self.process is not None else None
        for rid, sender in list(self.open.items()):
            self.open.pop(rid, None)
            sender.fail(
                InferenceError(
                    f"{self.label}: its process ended (exit code {code}) while the request was "
                    "open; it is started again for the next request"
                )
            )

    def alive(self) -> bool:
        return self.process is not None and _exit_code(self.process) is None

    def kill(self) -> None:
        """Stop the process (from any thread: a cancelled run's token calls it) and wake
        whoever waits on its socket. What a run may be using (the arenas) is left to the
        next :meth:`_ready` or :meth:`finalize`, which hold the run lock."""
        process, mailbox = self.process, self.mailbox
        if process is not None:
            if process.returncode is None:  # not reaped: its id is still its group's
                with contextlib.suppress(OSError):  # what the model started goes with it
                    os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.kill()
                process.wait(10)
        if mailbox is not None:
            mailbox.close("its process was stopped")
            mailbox.sock.close()
        checks, self.checks = self.checks, None
        if checks is not None:
            checks.close()

    def _discard(self) -> None:
        """The stopped process's arenas and mailbox let go (with the run lock held)."""
        for arena in (self.inbox, self.outbox):
            if arena is not None:
                arena.close()
        self.inbox = self.outbox = None
        self.mailbox = None
        self._close_statm()

    def _close_statm(self) -> None:
        statm, self._statm = self._statm, None
        if statm is not None:
            with contextlib.suppress(OSError):
                os.close(statm[1])

    def _ready(self) -> ipc.Mailbox:
        mailbox = self.mailbox
        if (
            mailbox is None
            or mailbox.closed
            or not self.alive()
            or (self._hangup is not None and self._hangup.poll(0))
        ):  # a process that closed its socket is exiting (its mount namespace's teardown
            # takes a while): the next request goes to a new one, not into its exit
            if self.process is not None:
                self.restarts += 1
                log.warning("%s: starting its process again", self.label)
            self.kill()
            self._discard()
            self.start()
        return self.mailbox

    # --- execute

    def run(
        self,
        tensors: dict[str, np.ndarray],
        header: dict[str, Any],
        waits: list[tuple[int, cancel.Token | None]] = (),
    ) -> Any:
        """``header`` with ``tensors`` to the process, and its answer: ``(reply, outputs)``,
        the outputs copied out of the answer's memory (the next request reuses it).
        ``waits``: each request's id and token: a token cancelled meanwhile tells the model
        (``is_cancelled()`` for that request), never stops the process."""
        with self.lock:
            try:
                _, outbox, reply, out_fd = self._send(tensors, header, waits)
            except _NotTaken:  # it ended without reading the request: its successor's
                try:
                    _, outbox, reply, out_fd = self._send(tensors, header, waits)
                except _NotTaken:
                    raise InferenceError(
                        f"{self.label}: its process ended before reading the request, twice; "
                        "it is started again for the next request"
                    ) from None
            if reply.get("error") or self.decoupled:
                if out_fd >= 0:
                    os.close(out_fd)
                self._bound_memory()
                return reply, {}
            try:
                _check_responses(reply, len(header.get("requests", ())))
                if reply.get("arena"):
                    outputs = outbox.unpack(reply.get("tensors", []), copy=True)
                else:
                    outputs = ipc.unpack_tensors(reply.get("tensors", []), out_fd)
            except ValueError:
                # an answer the worker would never send: the process is not trusted with
                # another request (what it sends next may answer this one)
                self.kill()
                raise
            self._bound_memory()
            return reply, outputs

    def _send(
        self,
        tensors: dict[str, np.ndarray],
        header: dict[str, Any],
        waits: list[tuple[int, cancel.Token | None]],
    ) -> tuple[ipc.Mailbox, ipc.Arena, dict[str, Any], int]:
        """One execute on the process (started again first if it is gone): its mailbox and
        answer arena, the reply, and the reply's descriptor."""
        mailbox = self._ready()
        inbox, outbox = self.inbox, self.outbox  # a cancel may close them meanwhile
        described = inbox.pack(tensors)
        fd = -1
        if described is None:
            described, fd = ipc.pack_tensors(tensors)
            header.pop("arena", None)
        else:
            header["arena"] = True
        header["tensors"] = described
        try:
            reply, out_fd = self._exchange(mailbox, header, fd, waits)
        finally:
            if fd >= 0:
                os.close(fd)
        return mailbox, outbox, reply, out_fd

    def _bound_memory(self) -> None:
        """Stop a process whose data (what its ``RLIMIT_DATA`` counts: heap and private
        mappings) is past ``RESTART_AT`` of ``max_bytes`` after a request, so the next request
        starts a fresh one before the model's allocations begin to fail (a model that leaks
        would otherwise fail every request from then on); one ``pread`` of ``/proc``, from
        a descriptor opened once per process (opening the file took 15 us a request, the
        read takes 1). Not while a decoupled request of the process is open."""
        process = self.process
        if not self.max_bytes or process is None or self.open:
            return
        try:
            if self._statm is None or self._statm[0] != process.pid:
                self._close_statm()
                self._statm = (process.pid, os.open(f"/proc/{process.pid}/statm", os.O_RDONLY))
            data = int(os.pread(self._statm[1], 256, 0).split()[5]) * _PAGE  # data + stack
        except (OSError, ValueError, IndexError):
            self._close_statm()
            return
        if data > self.max_bytes * RESTART_AT:
            log.warning(
                "%s: its process holds %d MiB, over %d%% of its MAX_PROCESS_BYTES (%d MiB): "
                "started again for the next request", self.label, data >> 20,
                RESTART_AT * 100, self.max_bytes >> 20,
            )  # fmt: skip
            self.kill()

    def _exchange(
        self,
        mailbox: ipc.Mailbox,
        header: dict[str, Any],
        fd: int,
        waits: list[tuple[int, cancel.Token | None]],
    ) -> tuple[dict[str, Any], int]:
        """One execute. A request's token cancelled meanwhile (its deadline, its client gone)
        is told to the model, which may stop early; the process is stopped only by the hang
        watch (past MAX_EXECUTE_SECONDS), or when it ends by itself."""
        forgets = []
        for rid, token in waits:
            if token is not None:
                forgets.append(token.on_cancel(lambda rid=rid: self.tell_cancelled(rid)))
        self.hung = False
        self.sent_since = 0
        try:
            within = self.answers_within
            start = time.perf_counter()
            self.execute_started = time.monotonic()
            mailbox.send(header, fd)
            reply, fds = mailbox.wait("main", ANSWER_SPIN if within >= 0.5 else 0.0)
            fast = time.perf_counter() - start < ANSWER_SPIN
            self.answers_within = within + (fast - within) * ANSWER_WEIGHT
            return reply, (fds[0] if fds else -1)
        except (OSError, EOFError, ValueError, AttributeError) as exc:
            code = None
            if self.process is not None:  # its socket closed: it is exiting, or hung up
                end = time.monotonic() + 2
                while (code := _exit_code(self.process)) is None and time.monotonic() < end:
                    time.sleep(0.01)
            self.kill()
            reset = isinstance(exc, ConnectionResetError) or isinstance(
                mailbox.failure, ConnectionResetError
            )
            if reset and not self.sent_since and not self.hung:
                # it closed with this request unread (nothing else was sent since: the kernel
                # resets a socket closed with messages unread): it never ran it
                raise _NotTaken from None
            if self.hung:
                raise InferenceError(
                    f"{self.label}: its execute ran past MAX_EXECUTE_SECONDS "
                    f"({self.max_execute_seconds:g} s), taken as hung: its process was stopped "
                    "and is started again for the next request"
                ) from None
            raise InferenceError(
                f"{self.label}: its process ended while running the request (exit code "
                f"{code}: {exc or 'no answer'}); it is started again for the next request"
            ) from None
        finally:
            self.execute_started = 0.0
            for forget in forgets:
                forget()

    def tell_cancelled(self, rid: int) -> None:
        """Tell the model request ``rid`` was cancelled (its ``is_cancelled()``), without
        blocking: a model that does not read its socket misses the notice, nothing else."""
        mailbox = self.mailbox
        if mailbox is None or mailbox.closed:
            return
        self.sent_since += 1
        with contextlib.suppress(OSError):
            mailbox.send({"op": "cancel", "rid": rid}, block=False)

    def cancel_request(self, rid: int) -> None:
        """A decoupled request was cancelled: tell the model (``is_cancelled()``) and stop
        expecting its responses (its execute, if it runs on, is the hang watch's)."""
        self.open.pop(rid, None)
        self.tell_cancelled(rid)

    def past_bound(self, now: float) -> bool:
        """The hang watch's look: stop the process when its execute has run past
        MAX_EXECUTE_SECONDS (True when it did)."""
        started, bound = self.execute_started, self.max_execute_seconds
        if not started or not bound or now - started <= bound:
            return False
        log.warning(
            "%s: its execute has run %.1f s, past MAX_EXECUTE_SECONDS (%g s): taken as hung, "
            "its process is stopped and started again", self.label, now - started, bound,
        )  # fmt: skip
        self.hung = True
        self.execute_started = 0.0
        self.kill()
        return True

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
            elif op == "log":
                if fd >= 0:
                    os.close(fd)
                level = _LOG_LEVELS.get(str(header.get("level")), logging.INFO)
                self.output.emit(level, str(header.get("message", "")))
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
        self.sent_since += 1
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
            parameters = json.loads(header.get("parameters") or "{}")
            timeout = header.get("timeout") or 0
            if type(timeout) is not int or timeout < 0:
                raise InvalidInput(f"a BLS request's timeout must be microseconds, not {timeout!r}")
            outputs = list(header.get("outputs") or []) or None
            step = _sequence_of(header)
            if decoupled and step is not None:
                raise InvalidInput(
                    f"model {entry.name!r}: a decoupled BLS call carries no sequence "
                    "(correlation_id, flags); call a sequence model with exec()"
                )
            request = Request(
                entry, inputs, outputs=outputs, step=step,
                timeout=timeout / 1e6 if timeout else None,  # its deadline, or queue policy's
                parameters=parameters if isinstance(parameters, dict) and parameters else None,
                holds=sum(getattr(a, "nbytes", 0) for a in inputs.values()),  # the budget's
                protocol="bls",
            )  # fmt: skip
            with self._calls_lock:
                self.calls[call] = request.run
            if decoupled:
                stream = plane.stream(request)
                lock = threading.Lock()
                stream.add_listener(lambda: self._forward(call, stream, lock))
            else:
                future = plane.infer(request)
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
        with self._calls_lock:
            if self._calls_waiting >= MAX_CALLS:
                pool = None
            else:
                self._calls_waiting += 1
                pool = self._call_pool
                if pool is None:
                    pool = self._call_pool = ThreadPoolExecutor(
                        CALL_THREADS, thread_name_prefix=f"{self.label}-call"
                    )
        if pool is None:
            message = f"{self.label}: {MAX_CALLS} of its calls wait already; wait for their answers"
            self._reply(call, {"error": [message, "UNAVAILABLE"]})
            return

        def run() -> None:
            try:
                self._reply(call, handler(self, header, inputs))
            except PlugserveError as exc:
                self._reply(call, {"error": [str(exc), _code_of(exc)]})
            except Exception as exc:
                log.exception("%s: its call %r failed", self.label, header.get("what"))
                self._reply(call, {"error": [f"{type(exc).__name__}: {exc}", "INTERNAL"]})
            finally:
                with self._calls_lock:
                    self._calls_waiting -= 1

        try:
            pool.submit(run)
        except RuntimeError:  # the network is closing: its pool is shut down
            with self._calls_lock:
                self._calls_waiting -= 1

    def finalize(self) -> None:
        self.closed = True
        HANGS.discard(self)
        with self._calls_lock:
            pool, self._call_pool = self._call_pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
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


class _NotTaken(Exception):
    """The process ended with the request unread: it goes to the next process, once."""


def _exit_code(process: subprocess.Popen) -> int | None:
    """``process``'s exit code once it ended (negative: the signal that ended it), else None,
    without reaping it: until :meth:`Worker.kill` does, its id cannot name another process's
    group, so stopping its group never reaches one that is not the model's."""
    if process.returncode is not None:
        return process.returncode
    try:
        found = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile
        return process.poll()
    if found is None:
        return None
    return found.si_status if found.si_code == os.CLD_EXITED else -found.si_status


class HangWatch:
    """One thread for every Python model's instances: stops a process whose execute has run
    past its MAX_EXECUTE_SECONDS (:meth:`Worker.past_bound`). A request pays nothing for it
    but two stores (when its execute starts and ends); the thread looks once a second (more
    often for a bound under four seconds), started with the first model and idle between
    looks."""

    def __init__(self) -> None:
        self._workers: weakref.WeakSet[Worker] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, worker: Worker) -> None:
        with self._lock:
            self._workers.add(worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="python-hangs", daemon=True)
                self._thread.start()

    def discard(self, worker: Worker) -> None:
        with self._lock:
            self._workers.discard(worker)

    def _run(self) -> None:
        while True:
            with self._lock:
                workers = list(self._workers)
            bounds = [w.max_execute_seconds for w in workers if w.max_execute_seconds]
            time.sleep(min([HANG_LOOK_SECONDS, *(b / 4 for b in bounds)]))
            now = time.monotonic()
            for worker in workers:
                try:
                    worker.past_bound(now)
                except Exception:  # one process that cannot be stopped must not stop the watch
                    log.exception("%s: stopping its hung process failed", worker.label)
            del workers


#: the server's one hang watch
HANGS = HangWatch()


def _check_responses(reply: Mapping[str, Any], count: int) -> None:
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


#: streams a dynamically batched model's requests may wait on at once, all instances together
MAX_GATHER_STREAMS = 64


class _Waiting:
    """One request in a :class:`Gatherer`: its inputs, its header entry, its rows, and the
    future its stream waits on."""

    __slots__ = ("arrays", "arrived", "future", "request", "rows", "token")

    def __init__(self, arrays: list[Any], request: dict[str, Any], rows: int, token: Any) -> None:
        self.arrays, self.request, self.rows, self.token = arrays, request, rows, token
        self.arrived = time.monotonic()
        self.future: Future = Future()


class Gatherer:
    """Triton's dynamic batcher for a Python model (``dynamic_batching`` with
    ``max_batch_size`` > 0): the requests waiting for the model are handed to one instance's
    ``execute`` together, as the list Triton's contract says ``requests`` may be, until their
    rows reach the largest ``preferred_batch_size`` (else ``max_batch_size``) or
    ``max_queue_delay_microseconds`` after the first of them (Triton's default 0: what waits
    now). A request with more rows runs alone. Unlike BATCH, nothing is concatenated: each
    request keeps its own tensors and gets its own response.

    One dispatcher thread per instance takes the next batch when its instance is free; the
    requests wait on the network's streams (at most :data:`MAX_GATHER_STREAMS`), so the
    queue is the data plane's, bounded as any model's."""

    def __init__(self, network: PythonNetwork, size: int, delay: float) -> None:
        self.network, self.size, self.delay = network, max(1, size), max(0.0, delay)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._closed = False
        #: batches run, by how many requests they held (statistics and tests)
        self.executions: dict[int, int] = {}
        for worker in network.workers:
            threading.Thread(
                target=self._dispatch, args=(worker,), name=f"{worker.label}-batcher", daemon=True
            ).start()

    def run(self, arrays: list[Any], request: dict[str, Any], rows: int) -> Any:
        """Queue one request; its outputs once the batch it joined has run."""
        token = cancel.current()
        item = _Waiting(arrays, request, rows, token)
        with self._cond:
            if self._closed:
                raise Cancelled(f"python model {self.network.name!r} is unloaded")
            self._queue.append(item)
            self._cond.notify()
        forget = None
        if token is not None:
            forget = token.on_cancel(lambda: _settle(item.future, token.failure()))
        try:
            return item.future.result()
        finally:
            if forget is not None:
                forget()

    def _take(self) -> list[_Waiting] | None:
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                first = self._queue[0].arrived
                while sum(i.rows for i in self._queue) < self.size and not self._closed:
                    left = first + self.delay - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._queue:
                    break
            batch = [self._queue.popleft()]
            rows = batch[0].rows
            while self._queue and rows + self._queue[0].rows <= self.size:
                rows += self._queue[0].rows
                batch.append(self._queue.popleft())
            return batch

    def _dispatch(self, worker: Worker) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            live = [i for i in batch if not i.future.done()]  # cancelled while waiting
            for item in live:
                cancel.started(item.token)
            if live:
                with self._cond:
                    self.executions[len(live)] = self.executions.get(len(live), 0) + 1
                self._run(worker, live)

    def _run(self, worker: Worker, batch: list[_Waiting]) -> None:
        network = self.network
        names, where = network.input_names, network.where
        tensors = {
            f"{k}/{n}": a
            for k, item in enumerate(batch)
            for n, a in zip(names, item.arrays)
            if a is not None
        }
        header = {"op": "execute", "model": network.name, "requests": [i.request for i in batch]}
        try:
            reply, outputs = worker.run(
                tensors, header, [(i.request["rid"], i.token) for i in batch]
            )
            if reply.get("error"):
                raise InferenceError(f"{where}: {reply['error']}")
        except BaseException as exc:
            if isinstance(exc, ValueError):
                exc = InferenceError(
                    f"{where}: its answer cannot be read: {exc}; its process is started again "
                    "for the next request"
                )
            for item in batch:
                _settle(item.future, exc)
            return
        specs = network.output_specs
        for k, (item, response) in enumerate(zip(batch, reply["responses"])):
            try:
                if response.get("error"):
                    message, code = response["error"]
                    raise _ERRORS.get(code, InferenceError)(f"{where}: {message}")
                result = _checked_outputs(where, response["outputs"], outputs, specs, f"{k}/", True)
            except PlugserveError as exc:
                _settle(item.future, exc)
                continue
            _settle(item.future, result=result)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in waiting:
            _settle(item.future, Cancelled("the model was unloaded before its batch ran"))


def _settle(future: Future, error: BaseException | None = None, result: Any = None) -> None:
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class PythonNetwork(CompiledNetwork):
    #: readiness asks the model's processes (and its is_ready(), up to READY_SECONDS)
    slow_readiness = True

    @property
    def precision(self) -> str:
        """None to name: the model's own code decides what it computes in (not "f32")."""
        return ""

    def __init__(self, plugin: PythonPlugin, config: Configuration, path: Path) -> None:
        message, model_config = _model_config(path)
        name = message.name
        super().__init__(plugin, name, config)
        self.where = where = f"python model {name!r}"
        python = _interpreter(str(config.get("EXECUTION_ENV_PATH") or ""), where)
        count = max(config.streams(), 1)
        plane = plugin.plane
        #: the metric families the model declares belong to this load (dropped at close)
        self._custom = plane.metrics.custom if plane is not None else None
        self._owner = self._custom.owner() if self._custom is not None else 0
        self.workers = [Worker(python, path, {}, f"{where} (instance {i})") for i in range(count)]
        self._next = 0
        #: dynamic batching: (rows, seconds) and what gathers the requests; None: one at a time
        self.batching_settings: tuple[int, float] | None = None
        self.gatherer: Gatherer | None = None
        limit = int(config.get("MAX_PROCESS_BYTES") or 0) or budget.default_limit()
        for worker in self.workers:
            worker.plane, worker.control, worker.owner = plane, plugin.control, self._owner
            worker.max_bytes = limit
            worker.niceness = int(config.get("PROCESS_NICENESS"))
            worker.shm_bytes = int(config.get("MAX_SHM_BYTES"))
            worker.max_execute_seconds = float(config.get("MAX_EXECUTE_SECONDS"))
            HANGS.add(worker)
        try:
            completed = self.workers[0].auto_complete(model_config)
            if completed is not None:
                model_config = _completed(where, message, completed)
            self._configure(model_config, path)
            for worker in self.workers:
                worker.start()
            if self.batching_settings is not None:
                self.gatherer = Gatherer(self, *self.batching_settings)
                self.gathers = True  # a request waits in the gatherer until its batch starts
        except BaseException:
            for worker in self.workers:
                worker.kill()
                worker._discard()
            if self._custom is not None:
                self._custom.drop(self._owner)
            raise

    def _configure(self, model_config: dict[str, Any], path: Path) -> None:
        """The model's final configuration (config.pbtxt's, or what auto_complete_config made
        of it): its tensors, transaction policy and batch size, and its instances' ``args``."""
        name, where = self.name, f"python model {self.name!r}"
        self._inputs = _specs(model_config, "input", where)
        self._outputs = _specs(model_config, "output", where)
        #: what every request reads (made once: a small model's request is a few of them)
        self.input_names = [spec.name for spec in self._inputs]
        self.output_specs = {spec.name: spec for spec in self._outputs}
        self.decoupled = bool(model_config.get("model_transaction_policy", {}).get("decoupled"))
        self.max_batch_size = int(model_config.get("max_batch_size", 0))
        self.model_config = model_config
        batching = model_config.get("dynamic_batching")
        if batching is not None and self.max_batch_size > 0 and not self.decoupled:
            preferred = [int(n) for n in batching.get("preferred_batch_size", [])]
            size = min(max(preferred, default=self.max_batch_size), self.max_batch_size)
            delay = int(batching.get("max_queue_delay_microseconds", 0)) / 1e6
            self.batching_settings = (size, delay)
        for i, worker in enumerate(self.workers):
            worker.args = {
                "model_config": json.dumps(model_config),
                "model_instance_kind": "CPU",
                "model_instance_name": f"{name}_0_{i}",
                "model_instance_device_id": "0",
                "model_repository": str(path.parent.parent),
                "model_version": path.parent.name,
                "model_name": name,
            }
            worker.decoupled = self.decoupled
            worker.specs = {spec.name: spec for spec in self._outputs}

    def ready(self) -> bool:
        """Every instance's process runs and, when the model has ``is_ready()``, says so
        within READY_SECONDS (one deadline for the whole model)."""
        end = time.monotonic() + READY_SECONDS
        for worker in self.workers:
            ok, why = worker.readiness(max(0.0, end - time.monotonic()))
            if not ok:
                log.info("%s is not ready: %s", worker.label, why)
                return False
        return True

    def _metric(self, name: str) -> Any:
        if name == "OPTIMAL_NUMBER_OF_INFER_REQUESTS":
            return self._streams()
        return super()._metric(name)

    def _streams(self) -> int:
        """One stream per instance; with dynamic batching, enough for every instance's batch
        to gather (at most MAX_GATHER_STREAMS)."""
        if self.batching_settings is None:
            return len(self.workers)
        size = self.batching_settings[0]
        return max(len(self.workers), min(MAX_GATHER_STREAMS, len(self.workers) * (size + 1)))

    def _new_executor(self) -> StreamsExecutor:
        """One stream per instance, each with its own process (with dynamic batching, the
        streams wait for their batch and the gatherer's threads run the instances)."""
        return StreamsExecutor(
            f"PYTHON/{self.name}",
            self._streams(),
            state_factory=lambda i: PythonInferRequest(self, self.workers[i % len(self.workers)]),
        )

    def batching(self) -> tuple[int, float] | None:
        if self.batching_settings is None:
            return None
        size, delay = self.batching_settings
        return size, delay * 1000.0

    def create_infer_request(self) -> InferRequest:
        worker = self.workers[self._next % len(self.workers)]
        self._next += 1
        return PythonInferRequest(self, worker)

    def export(self) -> bytes:
        raise Unsupported(f"python model {self.name!r} cannot be exported; serve its folder")

    def close(self) -> None:
        super().close()
        if self.gatherer is not None:
            self.gatherer.close()
        for worker in self.workers:
            worker.finalize()
        if self._custom is not None:  # its metric families leave /metrics with it
            self._custom.drop(self._owner)


class PythonInferRequest(InferRequest):
    network: PythonNetwork

    def __init__(self, network: PythonNetwork, worker: Worker) -> None:
        super().__init__(network)
        self.worker = worker

    def _header(self, arrays: list[Any], rid: int) -> dict[str, Any]:
        """The execute message for one request; ``rid``: its id, which the model's
        ``is_cancelled()`` and a decoupled model's responses name."""
        network = self.network
        names = network.input_names
        token = cancel.current()
        request: dict[str, Any] = {
            "inputs": [n for n, a in zip(names, arrays) if a is not None],
            "outputs": list(network.output_specs),
            "rid": rid,
        }
        if token is not None:
            if token.parameters:
                request["parameters"] = json.dumps(token.parameters)
            if token.request_id:  # the client's id: request_id()
                request["id"] = token.request_id
            if token.sequence is not None:  # correlation_id() and flags()
                request["correlation_id"], request["flags"] = token.sequence
            if token.timeout:  # timeout(), in microseconds
                request["timeout"] = round(token.timeout * 1e6)
        return {"op": "execute", "model": network.name, "requests": [request]}

    def _infer(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        network = self.network
        rid = next(_rids)
        if network.gatherer is not None:  # dynamic batching: with the requests waiting
            (request,) = self._header(arrays, rid)["requests"]
            first = next((a for a in arrays if a is not None), None)
            rows = int(first.shape[0]) if first is not None and first.ndim else 1
            return network.gatherer.run(arrays, request, rows)
        names, where = network.input_names, network.where
        token = cancel.current()
        try:
            reply, tensors = self.worker.run(
                {f"0/{n}": a for n, a in zip(names, arrays) if a is not None},
                self._header(arrays, rid),
                [(rid, token)],
            )
        except ValueError as exc:
            raise InferenceError(
                f"{where}: its answer cannot be read: {exc}; its process is started again for "
                "the next request"
            ) from None
        if token is not None and token.error is not None:  # told, and its execute returned
            raise token.failure()
        if reply.get("error"):
            raise InferenceError(f"{where}: {reply['error']}")
        (response,) = reply["responses"]
        if response.get("error"):
            message, code = response["error"]
            raise _ERRORS.get(code, InferenceError)(f"{where}: {message}")
        specs = network.output_specs
        partial = token is not None and token.partial_outputs
        return _checked_outputs(where, response["outputs"], tensors, specs, "0/", not partial)

    def infer_decoupled(
        self, arrays: list[Any], sender: ResponseSender, run: cancel.Token | None = None
    ) -> None:
        """A decoupled model's request: its execute runs here (holding this stream); its
        responses reach ``sender`` through the worker's reader, during and after it. ``run``
        is the run under way on this thread while it runs (what the worker answers to)."""
        if run is not None:
            with cancel.running(run):
                return self.infer_decoupled(arrays, sender)
        if not self.network.decoupled:
            super().infer_decoupled(arrays, sender)
            return
        network, worker = self.network, self.worker
        names, where = network.input_names, network.where
        rid = next(_rids)
        worker.open[rid] = sender
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
            if sender.cancelled:
                forget()
        if reply.get("error"):
            worker.open.pop(rid, None)
            sender.fail(InferenceError(f"{where}: {reply['error']}"))
        worker._bound_memory()  # (only while none of its requests is open)

    def get_performance_counts(self) -> list[PerfCount]:
        return []


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
