"""Helper processes that run native code on a client's model, bounded from outside.

Some native code reads a model a client sent before anything in the server can bound it:
onnx's shape inference keeps values the model decides (``plugins/reading.py``), openvino's
frontend, ``query_model`` and per-node compiles fold constants, allocate inputs of the declared
sizes and compile node after node (``plugins/openvino/query_process.py``); and a model can crash
such code outright (openvino 2026.4 dies of SIGSEGV folding a ``CumSum`` whose constant axis is
out of range). In the server's process each of these takes every client down with it, or holds
its memory, GIL or CPU for as long as the model asks. In a process of its own:

* its data is bounded by ``RLIMIT_DATA`` (:func:`bound_data`: heap and private mappings, where
  onnx's and openvino's allocations fail as ``bad_alloc``, which they raise as exceptions);
* its time by the caller's limit, and its life by the caller's cancellation (a QueryNetwork
  whose client is gone): the process is killed and a fresh one takes the next request; and
  should the server itself be gone, the helper ends itself a few seconds past the time
  (``SIGALRM``);
* a crash costs the request that caused it, answered as an error; the server and every other
  client go on.

The server waits on a pipe, never holding the GIL. A program serves requests one at a time on
stdin and stdout until stdin closes (:func:`serve`): a frame is an 8-byte little-endian length
and that many bytes; a request is a JSON header frame and a body frame, an answer the same.
:class:`Workers` keeps a few processes of one program warm between requests (starting one
imports its backend: about a second), at most ``size`` at once, and ends one that has had no
request for :data:`IDLE_SECONDS` (one daemon thread looks, started with the first request).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import BinaryIO

from plugserve.plugins import cancel
from plugserve.plugins.errors import ResourceExhausted
from plugserve.plugins.threads import Watchlist

__all__ = [
    "Crashed",
    "NoWorker",
    "TooLarge",
    "Worker",
    "Workers",
    "bound_data",
    "read_frame",
    "serve",
    "vm_data",
    "write_frame",
]

#: how often a wait for an answer looks whether its caller is gone
_POLL = 0.1
#: a helper ends itself (SIGALRM) this long after its request's time, should its server be
#: gone and unable to kill it; a request of a day or more has no such end
_ALARM_GRACE = 5
_DAY = 86400.0
#: a helper's pipes hold this much (Linux's most for an unprivileged process, by default; 64
#: KiB otherwise): 128 MB of a model crossed in 0.24 s through 64 KiB turns
_PIPE_BYTES = 1 << 20
#: a helper with no request for this long ends (its process's memory, 50-120 MB, goes back to
#: the system); the next request starts one again (0.35-1 s)
IDLE_SECONDS = 300.0


class NoWorker(Exception):
    """No helper process could be started here (a sandbox without fork, a broken install)."""


class TooLarge(Exception):
    """An answer larger than the caller may read (``args[0]``: its size)."""


class Crashed(Exception):
    """The helper process ended while it worked on the request (``args[0]``: its return code,
    negative for the signal that killed it)."""


# ----------------------------------------------------------------- frames (both sides)


def _read(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if data is None or len(data) < size:
        raise EOFError
    return data


def read_frame(stream: BinaryIO) -> bytes:
    (size,) = struct.unpack("<Q", _read(stream, 8))
    return _read(stream, size)


def write_frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)


# ----------------------------------------------------------------- the helper's side


def vm_data() -> int:
    """This process's data now (``VmData``, what ``RLIMIT_DATA`` counts), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def bound_data(max_bytes: int) -> int:
    """Let this process's data grow by ``max_bytes`` from now at most (0: no bound), and return
    the limit set. The hard limit stays open, so a later call may move the bound either way."""
    soft = vm_data() + max_bytes if max_bytes > 0 else resource.RLIM_INFINITY
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (soft, resource.RLIM_INFINITY))
    return soft


def serve(answer: Callable[[dict, bytes], tuple[dict, bytes]]) -> None:
    """Answer requests on stdin until it closes (the server ended: no parent-death signal, the
    kernel sends it when the *thread* that started the process ends, and the server's handler
    threads come and go). ``answer`` turns its own failures into an error header."""
    with contextlib.suppress(OSError):
        os.nice(5)  # the server's threads first
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    write_frame(sink, json.dumps({"ready": True}).encode())
    sink.flush()
    while True:
        try:
            header = json.loads(read_frame(source))
            body = read_frame(source)
        except EOFError:
            return
        # a request outlives its server by a few seconds at most: the server kills a helper
        # past its time, and a server that is gone cannot
        signal.alarm(int(header.get("alarm", 0)))
        reply, data = answer(header, body)
        signal.alarm(0)
        del body
        write_frame(sink, json.dumps(reply).encode())
        write_frame(sink, data)
        sink.flush()


# ----------------------------------------------------------------- the server's side


class Worker:
    """One helper process (``python -m PROGRAM ARGS...``) and its pipes."""

    def __init__(
        self, program: str, args: tuple[str, ...] = (), start_seconds: float = 60.0
    ) -> None:
        self.args = args
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", program, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            raise NoWorker(str(exc)) from None
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError, AttributeError):  # Linux's: a model crosses in
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)  # 1 MiB turns
        try:
            self._read_header(start_seconds)  # "ready": its backend imported, its bound set
        except (EOFError, TimeoutError, OSError, ValueError) as exc:
            self.close()
            raise NoWorker(f"{program} did not start ({type(exc).__name__})") from None

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(
        self, header: dict, body: bytes, seconds: float, most: int = 0, what: str = ""
    ) -> tuple[dict, bytes]:
        """The answer to one request. Raises TimeoutError past ``seconds``, :class:`TooLarge`
        for an answer's body over ``most`` bytes (0: any) before it is read, :class:`Crashed`
        when the process ends first, and Cancelled once the caller of the query or load
        under way is gone (``cancel.check(what)``); after any of these the process is of no
        more use (:class:`Workers` kills it)."""
        stdin = self.process.stdin
        assert stdin is not None
        header = {**header, "alarm": math.ceil(seconds) + _ALARM_GRACE if seconds < _DAY else 0}
        try:
            write_frame(stdin, json.dumps(header).encode())
            write_frame(stdin, body)
            stdin.flush()
            answer = self._read_header(seconds, what)
            size = int.from_bytes(self._exactly(8, seconds, what), "little")
            if most and size > most:
                raise TooLarge(size)
            return answer, self._exactly(size, seconds, what)
        except (EOFError, BrokenPipeError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)
            raise Crashed(self.process.returncode) from None

    def _read_header(self, seconds: float, what: str = "") -> dict:
        size = int.from_bytes(self._exactly(8, seconds, what), "little")
        return json.loads(self._exactly(size, seconds, what))

    def _exactly(self, size: int, seconds: float, what: str) -> bytes:
        stdout = self.process.stdout
        assert stdout is not None
        fd = stdout.fileno()
        end = time.monotonic() + seconds
        parts: list[bytes] = []
        left = size
        while left:
            wait = end - time.monotonic()
            if wait <= 0:
                raise TimeoutError
            if not select.select([fd], [], [], min(wait, _POLL))[0]:
                if what:
                    cancel.check(what)
                continue
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.wait(5)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()


class Workers:
    """Up to ``size`` helper processes of one program, started when first needed, kept between
    requests for ``idle_seconds`` and replaced after one failed (any exception out of the
    ``with`` block)."""

    def __init__(
        self,
        program: str,
        size: int,
        label: str,
        flag: str = "",
        idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.program = program
        self.label = label
        #: the setting that bounds the wait for a free helper, named in its refusal
        self.flag = flag
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        #: the helpers free now, each with when it last answered (``time.monotonic``)
        self._idle: list[tuple[Worker, float]] = []
        self._slots = threading.BoundedSemaphore(size)

    def retire_idle(self) -> int:
        """End the helpers free for ``idle_seconds`` or more; how many ended."""
        end = time.monotonic() - self.idle_seconds
        with self._lock:
            old = [worker for worker, since in self._idle if since <= end]
            self._idle = [(worker, since) for worker, since in self._idle if since > end]
        for worker in old:
            worker.close()
        return len(old)

    @contextlib.contextmanager
    def one(self, seconds: float, args: tuple[str, ...] = ()) -> Iterator[Worker]:
        """A worker started with ``args`` for one request; ResourceExhausted when none is
        free within ``seconds``."""
        if not self._slots.acquire(timeout=seconds):
            flag = f" ({self.flag})" if self.flag else ""
            raise ResourceExhausted(
                f"no {self.label} helper was free within {seconds:g} s{flag}; retry later"
            )
        _watched.add(self)
        worker: Worker | None = None
        try:
            with self._lock:
                while self._idle and worker is None:
                    found, _ = self._idle.pop()
                    if found.args == args and found.alive:
                        worker = found
                    else:
                        found.close()
            if worker is None:
                worker = Worker(self.program, args)
            yield worker
        except BaseException:
            if worker is not None:
                worker.close()
            worker = None
            raise
        finally:
            if worker is not None:
                with self._lock:
                    self._idle.append((worker, time.monotonic()))
            self._slots.release()


def _retire_loop() -> None:
    """Look at every :class:`Workers` in use, a few times within the shortest idle time and
    at least once a second (one made later with a shorter idle time is seen within a second;
    a look with nothing to end costs a few microseconds)."""
    while True:
        watched = _watched.items()
        shortest = min((w.idle_seconds for w in watched), default=IDLE_SECONDS)
        time.sleep(min(1.0, max(0.05, shortest / 4)))
        for workers in _watched.items():
            workers.retire_idle()


#: the :class:`Workers` that have served a request (their idle helpers are looked at)
_watched: Watchlist[Workers] = Watchlist("helper-retire", _retire_loop, weak=True)
