"""A Python model's worker process (Triton's stub process): ``python worker.py FD``, FD one end
of a Unix socket to the server, run by ``sandbox.py`` once the process's bounds are set. It
imports the model's ``model.py``, makes its ``TritonPythonModel``, calls ``initialize(args)``,
then answers ``execute`` messages until the server says ``finalize`` or goes away (``ipc.py``
is the transport, ``kinds.py`` the kinds of message). Standard library and numpy only, run by
whichever Python the model names, so its dependencies need not be the server's.

The process runs no reader thread: the main thread reads the socket while it waits for the next
request, and a thread that waits for an answer (a BLS call's, a decoupled BLS call's
responses) reads while it waits (``ipc.Mailbox``). The server's notices (a request cancelled)
are read with them, or by ``is_cancelled()`` itself. A decoupled model's responses go out from
whichever thread sends them (``InferenceResponseSender``); its ``async def execute`` runs on an
event loop of its own thread, so the next request starts while earlier ones wait (Triton 24.04).

A traced request (its entry names its execute span, a W3C ``traceparent``) has its ``execute``
timed here (``time.time_ns`` at its call and return, sent back as the reply's ``times``: the
server makes the span, so this process needs no OpenTelemetry), and the BLS calls made while it
runs name that span, so the server puts their spans under it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import json
import os
import socket
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ipc
import triton_python_backend_utils as pb_utils
from kinds import LOG_LEVELS, PROCESS_HANDLES, Kind

from plugserve.plugins.threads import start_daemon

#: the lines of a traceback the server shows as a failure's reason
REASON_LINES = 6
#: seconds the process polls for the next request after answering one before it sleeps: a
#: process woken on an idle core answers ~100 us later on these machines (its own core; the
#: server's threads are not held)
SPIN_SECONDS = 0.002
#: threads that run ``async_exec`` calls at once (each waits for its answer)
BLS_THREADS = 8
#: characters of one Logger line sent to the server (longer ones are cut)
MAX_LOG_CHARS = 16384
#: cancelled requests remembered at once (their ids, for ``is_cancelled()``): an ordinary
#: request's is forgotten when its execute returns, a decoupled one's after this many more
MAX_CANCELLED = 4096
#: how sandbox.py says whether this process's /dev/shm is its own
SHM_NOTE = "PLUGSERVE_SHM"

_calls = itertools.count(1)


def _reason(exc: BaseException) -> str:
    """What a failure tells the client: a ``TritonModelException`` with a message is the
    model's own words (Triton's way to fail a request; a BLS caller passing its callee's error
    on), told as they are; anything else, the last lines of its traceback from the model's
    own frames. The worker's frames (this folder: ``worker.py``, ``triton_python_backend_utils``)
    are the server's code, never the client's business; a BLS caller whose callee was unloaded
    had answered ``File "worker.py", line 360, in _execute_plain`` and the rest."""
    if isinstance(exc, pb_utils.TritonModelException) and str(exc):
        return hide_folders(str(exc))
    summary = traceback.TracebackException.from_exception(exc)
    for each in (summary, summary.__cause__, summary.__context__):
        if each is not None:
            frames = [f for f in each.stack if os.path.dirname(f.filename) != _HERE]
            each.stack = traceback.StackSummary.from_list(frames)
    text = "".join(summary.format()).strip().splitlines()
    return hide_folders("\n".join(text[-REASON_LINES:]))


#: the worker's own folder: its frames are left out of a failure's reason
_HERE = os.path.dirname(os.path.abspath(__file__))


#: folders of this machine a failure's reason is told without, longest first: the model
#: repository's (set when the model is imported), the interpreter's and its packages'
_FOLDERS: list[str] = []


def _known_folders(model_path: str | None = None) -> None:
    found = {sys.prefix, sys.base_prefix, os.path.expanduser("~")}
    found.update(p for p in sys.path if p and os.path.isabs(p) and os.path.isdir(p))
    if model_path:  # <repository>/<model>/<version>/model.py: named from the repository
        folder = os.path.dirname(os.path.abspath(model_path))
        found.add(os.path.dirname(os.path.dirname(folder)))
        real = os.path.dirname(os.path.realpath(model_path))
        found.add(os.path.dirname(os.path.dirname(real)))
    roots = {f.rstrip("/") + "/" for f in found if f and f.rstrip("/")}
    _FOLDERS[:] = sorted(roots, key=len, reverse=True)


def hide_folders(text: str) -> str:
    """``text`` without this machine's folders: a reason reaches the client (Triton's answer
    to a failed ``execute``), and a traceback's paths and an error's file names told it where
    the server keeps its models and packages (issue 52). What stays names the file from the
    repository (``add/1/model.py``) or its package (``json/decoder.py``)."""
    if not _FOLDERS:
        _known_folders()
    for folder in _FOLDERS:
        text = text.replace(folder, "")
    return text


def _import(path: str) -> Any:
    _known_folders(path)
    spec = importlib.util.spec_from_file_location("model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise pb_utils.TritonModelException(
            f"{path} defines no class TritonPythonModel (the name Triton's python backend "
            "looks for)"
        )
    return module


def _route(header: dict[str, Any]) -> Any:
    """Where a message from the server goes: a call's answer to the thread that waits for
    it, a notice handled at once, anything else to the main thread."""
    call = header.get("call")
    if call is not None:
        return ("call", call)
    if header.get("op") in PROCESS_HANDLES:
        return None
    return "main"


class Worker:
    """The process's side of the protocol: the mailbox, the model, and what is in flight."""

    def __init__(self, sock: socket.socket) -> None:
        self.mailbox = ipc.Mailbox(sock, _route, self._notice)
        #: requests the server cancelled (their ids, oldest first), as ``is_cancelled()``
        #: reports them
        self.cancelled: dict[int, None] = {}
        self.model: Any = None
        self.module: Any = None  # model.py, imported once (auto_complete_config, then the model)
        #: what the model is doing: the model loading API refuses some (as Triton's)
        self.phase = ""
        self.model_name = ""
        self.instance_name = ""
        self.decoupled = False
        self.loop = asyncio.new_event_loop()
        self.background: asyncio.AbstractEventLoop | None = None  # a decoupled async model's
        self.pool = ThreadPoolExecutor(BLS_THREADS, thread_name_prefix="bls")
        self.inbox: ipc.Arena | None = None  # the server's arenas: requests come in one,
        self.outbox: ipc.Arena | None = None  # answers go out the other

    # --- notices and calls

    def _notice(self, header: dict[str, Any], fds: list[int]) -> None:
        op = header.get("op")
        if op == Kind.CHECKS and fds:  # the socket readiness checks come on
            checks = socket.socket(fileno=fds.pop(0))
            start_daemon("is_ready", self._serve_checks, checks)
        for fd in fds:
            os.close(fd)
        if op == Kind.CANCEL:
            cancelled = self.cancelled
            cancelled[int(header.get("rid", -1))] = None
            if len(cancelled) > MAX_CANCELLED:
                del cancelled[next(iter(cancelled))]

    def _serve_checks(self, checks: socket.socket) -> None:
        """Answer the server's readiness checks with the model's ``is_ready()`` (plain or
        ``async def``, on a loop of this thread's own), while executes go on."""
        loop: asyncio.AbstractEventLoop | None = None
        while True:
            try:
                header, _ = ipc.receive_all(checks, 0)
            except (EOFError, OSError, ValueError):
                return
            reply: dict[str, Any] = {"id": header.get("id")}
            try:
                result = self.model.is_ready()
                if inspect.isawaitable(result):
                    loop = loop or asyncio.new_event_loop()
                    result = loop.run_until_complete(result)
                if not isinstance(result, bool | np.bool_):
                    raise pb_utils.TritonModelException(
                        f"is_ready() returned {type(result).__name__}; it must return a bool"
                    )
                reply["ready"] = bool(result)
            except Exception as exc:
                reply["error"] = _reason(exc)
            try:
                ipc.send(checks, reply)
            except OSError:
                return

    def is_cancelled(self, rid: int) -> bool:
        self.mailbox.poll()
        return rid in self.cancelled

    def call(self, header: dict[str, Any], tensors: dict[str, Any]) -> tuple[dict, list[int]]:
        """Send a call to the server (a BLS request, ...) and wait for its first answer."""
        return self.next_answer(self.post(header, tensors))

    def post(self, header: dict[str, Any], tensors: dict[str, Any]) -> int:
        """Send a call to the server, numbered: its number, which its answers name."""
        number = next(_calls)
        header["call"] = number
        self.mailbox.send_tensors(header, tensors)
        return number

    def log(self, level: int, message: str) -> None:
        """A Logger line to the server's log, never blocking the model: when the server is
        not reading (between requests, a full socket), it goes to standard error instead."""
        name = LOG_LEVELS[level] if 0 <= level < len(LOG_LEVELS) else "INFO"
        if len(message) > MAX_LOG_CHARS:
            message = message[:MAX_LOG_CHARS] + " [cut]"
        try:
            self.mailbox.send({"op": Kind.LOG, "level": name, "message": message}, block=False)
        except OSError:
            print(f"{self.instance_name} {name}: {message}", file=sys.stderr, flush=True)

    def next_answer(self, number: int) -> tuple[dict, list[int]]:
        return self.mailbox.wait(("call", number))

    # --- the main loop

    def serve(self) -> None:
        while True:
            try:
                header, fds = self.mailbox.wait("main", SPIN_SECONDS if self.model else 0.0)
            except EOFError:
                return
            op = header.get("op")
            if op == Kind.EXECUTE:
                self._execute(header, fds)
            elif op == Kind.INITIALIZE:
                if not self._initialize(header, fds):
                    return
            elif op == Kind.AUTO_COMPLETE:
                if not self._auto_complete(header):
                    return
            elif op == Kind.FINALIZE:
                self.phase = "finalize"
                try:
                    if self.model is not None and hasattr(self.model, "finalize"):
                        self.model.finalize()
                finally:
                    self.mailbox.send({"op": Kind.FINALIZED})
                return
            else:
                for fd in fds:
                    os.close(fd)

    def _initialize(self, header: dict[str, Any], fds: list[int]) -> bool:
        try:
            if len(fds) == 2:
                self.inbox = ipc.Arena(fd=fds[0], writable=False)
                self.outbox = ipc.Arena(fd=fds[1], writable=True)
            args = header["args"]
            self.model_name = args.get("model_name", "")
            self.instance_name = args.get("model_instance_name", "")
            self.decoupled = bool(header.get("decoupled"))
            if self.module is None:
                self.module = _import(header["model_path"])
            self.model = self.module.TritonPythonModel()
            self.phase = "initialize"
            if hasattr(self.model, "initialize"):
                result = self.model.initialize(args)
                if inspect.isawaitable(result):
                    self.loop.run_until_complete(result)
            self.phase = "execute"
            ready = callable(getattr(self.model, "is_ready", None))
            shm = os.environ.pop(SHM_NOTE, "not bounded")  # sandbox.py's: "" when private
            self.mailbox.send({"op": Kind.INITIALIZED, "is_ready": ready, "shm": shm})
            return True
        except BaseException as exc:  # the load fails with the reason; the worker ends
            # a TritonModelException is the model's own words (a missing dependency, say):
            # they are the reason, without the traceback's lines
            mine = isinstance(exc, pb_utils.TritonModelException) and str(exc)
            reason = hide_folders(str(exc)) if mine else _reason(exc)
            self.mailbox.send({"op": Kind.INITIALIZED, "error": reason})
            return False

    def _auto_complete(self, header: dict[str, Any]) -> bool:
        """Triton's ``auto_complete_config``: the model's static function completes the
        configuration before ``initialize`` (None: it has none); False when it failed."""
        self.phase = "auto_complete_config"
        try:
            self.module = _import(header["model_path"])
            function = getattr(self.module.TritonPythonModel, "auto_complete_config", None)
            if function is None:
                self.mailbox.send({"op": Kind.COMPLETED, "config": None})
                return True
            given = pb_utils.ModelConfig(json.dumps(header["config"]))
            result = function(given)
            if not isinstance(result, pb_utils.ModelConfig):
                raise pb_utils.TritonModelException(
                    f"auto_complete_config returned {type(result).__name__}; it must return the "
                    "pb_utils.ModelConfig it was given (auto_complete_model_config)"
                )
            config = result.as_dict()
            json.dumps(config)  # what cannot travel as JSON is the model's error, said here
            self.mailbox.send({"op": Kind.COMPLETED, "config": config})
            return True
        except BaseException as exc:
            self.mailbox.send({"op": Kind.COMPLETED, "error": _reason(exc)})
            return False

    def _tensors(self, header: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        fd = fds[0] if fds else -1
        if header.get("arena") and self.inbox is not None:
            # a decoupled model's threads may read inputs after execute returns, when the
            # arena holds the next request: they get copies
            return self.inbox.unpack(header["tensors"], copy=self.decoupled)
        return ipc.unpack_tensors(header["tensors"], fd)

    def _requests(self, header: dict[str, Any], tensors: dict[str, Any]) -> list[Any]:
        made = []
        for index, request in enumerate(header["requests"]):
            inputs = [
                pb_utils.Tensor(name, tensors[f"{index}/{name}"]) for name in request["inputs"]
            ]
            made.append(
                pb_utils.InferenceRequest(
                    model_name=header.get("model", ""),
                    requested_output_names=request.get("outputs", []),
                    inputs=inputs,
                    request_id=request.get("id", ""),
                    correlation_id=request.get("correlation_id", 0),
                    flags=request.get("flags", 0),
                    timeout=request.get("timeout", 0),
                    parameters=request.get("parameters") or "{}",
                    _rid=request.get("rid"),
                    _trace=request.get("trace"),
                    _worker=self,
                )
            )
        return made

    def _execute(self, header: dict[str, Any], fds: list[int]) -> None:
        try:
            requests = self._requests(header, self._tensors(header, fds))
        except Exception as exc:
            self.mailbox.send({"op": Kind.RESULT, "error": _reason(exc)})
            return
        # the first traced request's span is the parent of the BLS calls made in the execute
        tracing = next((r._trace for r in requests if r._trace is not None), None)
        started = time.time_ns() if tracing is not None else 0
        number = header.get("execute")  # its BLS requests name it (their tenant's: bls.py)
        inside = pb_utils.EXECUTE.set(number if type(number) is int else None)
        traced = pb_utils.TRACING.set(tracing)
        try:
            if self.decoupled:
                self._execute_decoupled(requests, started)
            else:
                self._execute_plain(requests, started)
        finally:  # answered: a cancellation of these requests means nothing from now on
            pb_utils.TRACING.reset(traced)
            pb_utils.EXECUTE.reset(inside)
            if not self.decoupled:
                for request in requests:
                    self.cancelled.pop(request._rid, None)

    def _execute_plain(self, requests: list[Any], started: int) -> None:
        try:
            result = self.model.execute(requests)
            if inspect.isawaitable(result):
                result = self.loop.run_until_complete(result)
            reply, outputs = _answer(result, len(requests))
            _timed(reply, started)
            self.mailbox.send_tensors(reply, outputs, self.outbox)
        except Exception as exc:  # the requests fail with the reason; the worker goes on
            self.mailbox.send(_timed({"op": Kind.RESULT, "error": _reason(exc)}, started))

    def _execute_decoupled(self, requests: list[Any], started: int) -> None:
        """A decoupled model's execute: it answers through its requests' senders; the server
        hears ``result`` once execute returned (its stream is free for the next request). An
        ``async def execute`` runs on the background loop: the next request need not wait."""
        try:
            result = self.model.execute(requests)
            if inspect.isawaitable(result):
                loop = self._background()
                future = asyncio.run_coroutine_threadsafe(_awaited(result), loop)
                future.add_done_callback(lambda f, r=requests: self._settled(f, r))
            else:
                self._check_none(result, requests)
            self.mailbox.send(_timed({"op": Kind.RESULT}, started))
        except Exception as exc:
            self.mailbox.send(_timed({"op": Kind.RESULT, "error": _reason(exc)}, started))

    def _settled(self, future: Any, requests: list[Any]) -> None:
        """An async decoupled execute finished: its failure fails the requests still open."""
        try:
            self._check_none(future.result(), requests)
        except Exception as exc:
            for request in requests:
                request._fail_open(_reason(exc))

    def _check_none(self, result: Any, requests: list[Any]) -> None:
        if result is not None:
            message = (
                f"Python model '{self.instance_name}' is using the decoupled mode and the "
                "execute function must return None."
            )
            for request in requests:
                request._fail_open(message)

    def _background(self) -> asyncio.AbstractEventLoop:
        if self.background is None:
            self.background = asyncio.new_event_loop()
            start_daemon("decoupled-execute", self.background.run_forever)
        return self.background


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _timed(reply: dict[str, Any], started: int) -> dict[str, Any]:
    """``reply`` with its traced execute's times (``started``: when it was called; 0: the
    execute is not traced)."""
    if started:
        reply["times"] = [started, time.time_ns()]
    return reply


def _answer(responses: Any, count: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reply's header and its tensors for what ``execute`` returned."""
    if not isinstance(responses, list | tuple) or len(responses) != count:
        got = len(responses) if isinstance(responses, list | tuple) else type(responses).__name__
        raise pb_utils.TritonModelException(
            f"execute returned {got} responses for {count} requests; return one "
            "InferenceResponse per request, in order"
        )
    tensors: dict[str, Any] = {}
    described = []
    for index, response in enumerate(responses):
        if not isinstance(response, pb_utils.InferenceResponse):
            raise pb_utils.TritonModelException(
                f"response {index} is a {type(response).__name__}, not an InferenceResponse"
            )
        described.append(_described(response, tensors, f"{index}/"))
    return {"op": Kind.RESULT, "responses": described}, tensors


def _described(response: Any, tensors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``response`` as its reply describes it; its outputs go into ``tensors`` (each name
    after ``prefix``)."""
    names = []
    for tensor in response.output_tensors():
        tensors[prefix + tensor.name()] = tensor.as_numpy()
        names.append(tensor.name())
    error = response.error()
    return {
        "outputs": names,
        "error": None if error is None else [hide_folders(error.message()), error.code_name()],
        "parameters": response.parameters(),
    }


def send_response(worker: Worker, rid: int, response: Any, final: bool) -> None:
    """A decoupled request's response (or its bare final flag) to the server."""
    header: dict[str, Any] = {"op": Kind.SEND, "rid": rid, "final": final, "response": None}
    tensors: dict[str, Any] = {}
    if response is not None:
        header["response"] = _described(response, tensors)
    worker.mailbox.send_tensors(header, tensors)


def bls_request(worker: Worker, request: Any, decoupled: bool) -> Any:
    """``InferenceRequest.exec``: the call to the server; a response, or for ``decoupled`` an
    iterator of them ending with the final one."""
    header = request._bls_header()
    header["decoupled"] = decoupled
    tensors = {t.name(): t.as_numpy() for t in request.inputs()}
    if not decoupled:
        reply, fds = worker.call(header, tensors)
        return _bls_response(reply, fds)
    number = worker.post(header, tensors)
    return pb_utils.ResponseIterator(
        lambda: _next_bls(worker, number),
        lambda: worker.mailbox.send({"op": Kind.BLS_CANCEL, "call": number}),
    )


def _next_bls(worker: Worker, number: int) -> tuple[Any, bool]:
    reply, fds = worker.next_answer(number)
    return _bls_response(reply, fds), bool(reply.get("final", True))


def _bls_response(reply: dict[str, Any], fds: list[int]) -> Any:
    fd = fds[0] if fds else -1
    if reply.get("error"):
        if fd >= 0:
            os.close(fd)
        message, code = reply["error"]
        message = hide_folders(message)  # the server's error, as the model's client sees it
        codes = pb_utils.TritonError._NAMES
        error = pb_utils.TritonError(message, codes.index(code) if code in codes else 1)
        return pb_utils.InferenceResponse(error=error)
    tensors = ipc.unpack_tensors(reply.get("tensors", []), fd)
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(n, a) for n, a in tensors.items()],
        parameters=json.dumps(reply.get("parameters") or {}),
    )


def main() -> None:
    fd = int(sys.argv[1])  # bounded by sandbox.py, which runs this
    sock = socket.socket(fileno=fd)
    worker = Worker(sock)
    pb_utils._worker = worker
    pb_utils._bls = lambda request, decoupled: bls_request(worker, request, decoupled)
    pb_utils._send = lambda rid, response, final: send_response(worker, rid, response, final)
    try:
        worker.serve()
    finally:
        sock.close()


if __name__ == "__main__":
    main()
