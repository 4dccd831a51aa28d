"""A real ``plugserve serve`` in a subprocess on 127.0.0.1, for tests to talk to."""

from __future__ import annotations

import array
import fcntl
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import grpc

_HOST = r"(?:[\d.]+|\[[\da-f:]+\])"  # (an IPv4 address, or an IPv6 one in brackets)
_LISTENING = re.compile(
    rf"listening: gRPC {_HOST}:(\d+), metrics http://{_HOST}:(-?\d+)/metrics"
    rf"(?:, HTTPS? https?://{_HOST}:(\d+))?"
)


def serve_command(*args: str, python: str = "") -> list[str]:
    """``plugserve serve`` on 127.0.0.1 with every port free-picked, then ``args``; ``python``:
    another interpreter's plugserve (a baseline commit's virtual environment)."""
    ports = ["--grpc-port", "0", "--metrics-port", "0", "--http-port", "0"]
    return [
        python or sys.executable,
        "-m",
        "plugserve.server.process.cli",
        "serve",
        "--host",
        "127.0.0.1",
        *ports,
        *args,
    ]


_SCRATCH = itertools.count()


class RunningServer:
    """Call :meth:`start`; ``target`` is host:port for gRPC, ``metrics_url`` the scrape URL,
    ``http_url`` the KServe v2 REST base (``http_port``; 0 when the server runs without it)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        python: str = "",
    ) -> None:
        self.args = list(args)
        self.python = python
        self.env = {**os.environ, **(env or {})}
        # A server's relative paths (a client-chosen CACHE_DIR, say) land in a scratch folder,
        # never in the checkout the tests run from; one made here is removed when the server
        # stops (and made again if it is started again).
        self._scratch = cwd is None
        # named now, made when the server starts (a server never started leaves nothing)
        self.cwd = cwd or os.path.join(
            tempfile.gettempdir(), f"plugserve-server-{os.getpid()}-{next(_SCRATCH)}"
        )
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.grpc_port = 0
        self.metrics_port = 0
        self.http_port = 0
        #: the address clients reach it at (a server in a network namespace has its own)
        self.host = "127.0.0.1"
        self._ready = threading.Event()
        self._listening = threading.Event()
        self._exited = threading.Event()  # its output ended: the process is gone
        self._waiting = threading.Event()  # the reader waits on an empty pipe
        self._reads = 0  # the reader's reads so far

    @property
    def target(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def http_target(self) -> str:
        """host:port of the REST port, as tritonclient.http wants it."""
        return f"{self.host}:{self.http_port}"

    @property
    def log(self) -> str:
        """Its output so far. The server writes a line before it answers the request that made
        it, but the answer can reach the test before the reader thread reads the pipe: what the
        pipe holds now is read first (a test asserting on a warning failed in CI without)."""
        self._drain()
        return "\n".join(self.lines)

    def _drain(self, timeout: float = 2.0) -> None:
        """Wait until the pipe is empty and the reader waits on it (everything written is in
        ``lines``), or ``timeout``."""
        process = self.process
        if process is None or process.stdout is None or self._exited.is_set():
            return
        end = time.monotonic() + timeout
        pending = array.array("i", [0])
        quiet = 0  # looks in a row that saw an empty pipe, a waiting reader and no new read
        reads = -1
        while time.monotonic() < end and quiet < 2:
            try:
                fcntl.ioctl(process.stdout.fileno(), termios.FIONREAD, pending)
            except (OSError, ValueError):
                return  # closed: the reader has ended or is ending
            idle = pending[0] == 0 and self._waiting.is_set() and reads == self._reads
            quiet = quiet + 1 if idle else 0
            reads = self._reads
            time.sleep(0.002)

    def start(self, wait_ready: bool = True, timeout: float = 120) -> RunningServer:
        if self.process is not None and self.process.poll() is None:
            # a second process would replace the first's handle, and the first would outlive
            # the test (``with RunningServer(...).start()`` started two)
            raise RuntimeError("this server is running: stop() it before starting it again")
        if self._scratch:
            os.makedirs(self.cwd, exist_ok=True)
        for event in (self._ready, self._listening, self._exited):  # a restart waits anew
            event.clear()
        self.process = subprocess.Popen(
            serve_command(*self.args, python=self.python),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=self.cwd,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._wait(self._listening, timeout):
            self.stop()
            raise RuntimeError(f"server did not start listening:\n{self.log}")
        if wait_ready and not self._wait(self._ready, timeout):
            self._stacks()
            self.stop()
            raise RuntimeError(f"server did not become ready:\n{self.log}")
        return self

    def _stacks(self) -> None:
        """The server's threads' stacks into its log (SIGUSR2), to show where it waits."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR2)
            time.sleep(1.0)  # written from the signal handler; read by _read

    def _wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait for ``event``, giving up at once when the server exits (a startup error)."""
        end = time.monotonic() + timeout
        while not event.wait(0.05):
            if self._exited.is_set() or time.monotonic() > end:
                return event.is_set()
        return True

    def _read(self) -> None:
        """Read the pipe's raw bytes (not its buffered text), so that ``_drain`` knows an empty
        pipe and a waiting reader mean every written line is in ``lines``."""
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        partial = b""
        while True:
            self._waiting.set()
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            self._reads += 1
            self._waiting.clear()
            if not chunk:
                break
            # universal newlines, as text mode read them (a lone \r ends a line too)
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            *complete, partial = (partial + chunk).split(b"\n")
            for raw in complete:
                self._line(raw.decode("utf-8", "replace"))
        if partial:
            self._line(partial.decode("utf-8", "replace"))
        self._exited.set()

    def _line(self, line: str) -> None:
        self.lines.append(line)
        match = _LISTENING.search(line)
        if match:
            self.grpc_port, self.metrics_port = int(match.group(1)), int(match.group(2))
            self.http_port = int(match.group(3) or 0)
            self._listening.set()
        if "server ready:" in line or "server not ready:" in line:  # started either way
            self._ready.set()

    def wait_ready(self, timeout: float = 120) -> None:
        if not self._wait(self._ready, timeout):
            self._stacks()
            raise RuntimeError(f"server did not become ready:\n{self.log}")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self, timeout: float = 30) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        # its last lines are still in the pipe: a test reading .log after stop() sees them all
        self._exited.wait(5)
        if self._scratch:
            shutil.rmtree(self.cwd, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> RunningServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def graph_events(server: RunningServer, model: str) -> dict[str, float]:
    """``plugserve_graph_events_total`` of ``model`` on the server's /metrics, by event
    (captured, replayed, evicted, failed): the torch device's CUDA graph counters."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.metrics_url, timeout=30) as answer:
        text = answer.read().decode()
    return {
        sample.labels["event"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "plugserve_graph_events_total" and sample.labels.get("model") == model
    }


def wait_for(predicate, timeout: float = 30, interval: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return False


def examples_repository(tmp_path: Path, pipelines: bool = False) -> Path:
    """A fresh copy of the bundled example repository (tests may write into it);
    ``pipelines``: with the example applications (ensembles whose Python steps each start a
    process, which the tests of other things need not pay for)."""
    from plugserve.server.control.examples import build_examples

    return build_examples(tmp_path / "models", pipelines=pipelines)


def examples_in_a_fresh_process(script: str, argument: str, tmp_path: Path) -> str:
    """What ``script`` prints, run by a fresh Python as ``script argument REPOSITORY`` (the
    examples' repository): an in-process server whose imports or process-wide state (the
    collector's frozen heap) must not be pytest's. It must exit 0."""
    repo = examples_repository(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", script, argument, str(repo)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
