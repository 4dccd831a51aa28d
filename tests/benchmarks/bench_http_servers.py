"""Our HTTP/1.1 server against uvicorn (and granian) under the same REST routes (issue 52).

    python tests/benchmarks/bench_http_servers.py --rounds 5 --seconds 2      # the comparison
    python tests/benchmarks/bench_http_servers.py --smoke                     # CI: < 60 s
    python tests/benchmarks/bench_http_servers.py --servers plugserve,uvicorn --attacks ''

Each server is a process of its own serving the same repository (the bundled examples and a
``plugserve make-model`` tiny-llama) with the same flags: ``plugserve`` is ``plugserve serve``
with its own REST port (``server/protocols/http/http_server.py``); ``uvicorn`` and ``granian``
are the same server with its REST port off and :meth:`RestApp.dispatch` mounted under that ASGI
server by ``asgi_shim.py`` (uvicorn with httptools and uvloop, as fast as it is configured;
granian with one worker, uvloop). Only the HTTP layer differs.

Speed, every case interleaved over the servers, round by round (medians over rounds, ratios to
``plugserve`` within each round):

- ``tiny``: a small ``/v2/models/add/infer`` JSON request (two [16] FP32), one client: p50;
- ``tiny x4``: the same from 4 concurrent keep-alive clients: requests/s;
- ``64 MB``: ``add`` with two [8 Mi] FP32 as binary tensors (64 MiB up, 32 MiB back): p50;
- ``SSE``: an OpenAI streaming chat completion (tiny-llama, 32 tokens, greedy): the whole
  stream's p50, and its first event's.

Attacks, the red team's of issue 52, each against each server in turn, while a probe opens a
fresh connection for ``GET /v2/health/live`` every 50 ms (5 s timeout, as a liveness probe) and
a client sends tiny infers on a keep-alive connection: health p50 / p99 / failures, infers
failed, and the server's RSS (its process tree) at its peak and after, against before:

- ``no body``: 70 sockets send a JSON ``/infer``'s headers with a Content-Length whose
  declared charge fills the memory budget (--max-inflight-bytes, 4 GiB here), and no body;
- ``dribble``: 260 sockets send headers and then one body byte every 2 s;
- ``1-byte chunks``: one chunked body of 1-byte chunks (4 MB full, 128 KB smoke);
- ``raw BYTES``: one raw binary request (``Inference-Header-Content-Length: 0``) to ``echo1``
  (a BYTES [1] identity): the whole body is one element (128 MiB full, 1 MiB smoke).

The client runs in this process, on the same 2 cores as the servers: it compresses the ratios
of the speed cases (the HTTP layer is a fraction of what each request costs here). Nothing
asserts on time; the run fails only when a server cannot be started or a case cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness  # sets sys.path
import numpy as np
from harness import HttpRawRunner, block

HERE = Path(__file__).resolve().parent
SHIM = HERE / "asgi_shim.py"
BUDGET = 4 << 30  # --max-inflight-bytes of every server, so the attack's size is known
PROFILES = {
    "smoke": {"seconds": 0.2, "rounds": 1, "attack_s": 1.0, "chunked": 128 << 10, "raw": 1 << 20,
              "big_s": 0.2, "sse_s": 0.2, "servers": ["plugserve", "uvicorn"]},
    "full": {"seconds": 2.0, "rounds": 5, "attack_s": 8.0, "chunked": 4 << 20, "raw": 128 << 20,
             "big_s": 3.0, "sse_s": 2.0, "servers": ["plugserve", "uvicorn", "granian"]},
}  # fmt: skip
#: a JSON /infer body is charged 20x (server/plane/budget.py): 64 sockets fill the budget
NO_BODY_LENGTH = BUDGET // 20 // 64  # (less than a tiny request's charge left over)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def echo_one() -> Any:
    """``echo`` with input shape [1]: Triton takes a raw binary BYTES body only for that."""
    from onnx import TensorProto, helper

    from plugserve.server.control.examples import onnx_model

    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"], name="identity")],
        "echo1",
        [helper.make_tensor_value_info("text", TensorProto.STRING, [1])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, [1])],
    )
    return onnx_model(graph)


def repository() -> tuple[Path, bool]:
    """The bundled examples and a tiny-llama (if ``tokenizers`` is installed); whether it has
    the generative model."""
    from plugserve.server.control.examples import _save, build_examples

    root = Path(tempfile.gettempdir()) / "plugserve-bench-http-repo"
    if not (root / "add").exists():
        build_examples(root, pipelines=False)
    if not (root / "echo1").exists():  # one BYTES element: what a raw binary body may be
        _save(root, "echo1", echo_one())
    llm = root / "tiny-llama"
    if not (llm / "config.json").exists():
        try:
            from plugserve.server.control.examples.tiny_decoder import make_tiny_llama

            make_tiny_llama(str(llm))
        except Exception as exc:  # tokenizers missing: no SSE case
            log(f"tiny-llama: not made ({type(exc).__name__}: {exc}): no SSE case")
    return root, (llm / "config.json").exists()


# --------------------------------------------------------------------------- servers


class Served:
    """One server process on ``port``: ``plugserve`` (its own HTTP server) or an ASGI one."""

    def __init__(self, kind: str, root: Path, python: str = "") -> None:
        """``python``: the interpreter ``plugserve`` runs with (another checkout's virtual
        environment: its HTTP server against the same uvicorn)."""
        self.kind = kind
        self.port = _free_port()
        serve = [
            "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
            "--model-repository", str(root), "--max-inflight-bytes", str(BUDGET),
            "--log-level", "warning",
        ]  # fmt: skip
        # PYTHONPATH kept: a folder holding another checkout as ``plugserve`` serves that code
        # under both servers (an editable install's finder comes after it)
        path = os.environ.get("PYTHONPATH", "")
        if kind == "plugserve":
            command = [python or sys.executable, "-m", "plugserve.server.process.cli", "serve",
                       *serve, "--http-port", str(self.port)]  # fmt: skip
        else:
            command = [sys.executable, str(SHIM), "--server", kind, "--port", str(self.port),
                       "--", *serve]  # fmt: skip
        self.log = tempfile.TemporaryFile(prefix=f"bench-http-{kind}-")  # noqa: SIM115
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), path]))},
        )  # fmt: skip

    def wait_ready(self, models: list[str], timeout: float = 240.0) -> None:
        end = time.monotonic() + timeout
        paths = ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in models]
        while time.monotonic() < end:
            if self.process.poll() is not None:
                break
            if all(get(self.port, path, 2.0)[0] == 200 for path in paths):
                return
            time.sleep(0.3)
        self.log.seek(0)
        tail = self.log.read()[-3000:].decode(errors="replace")
        why = (
            f"exited ({self.process.returncode})"
            if self.process.poll() is not None
            else (f"not ready within {timeout:.0f} s")
        )
        raise RuntimeError(f"{self.kind}: {why}:\n{tail}")

    def rss_mb(self) -> float:
        """The RSS of the process and its descendants (granian's worker is a child)."""
        total, todo = 0, [self.process.pid]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return total / 1024

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.log.close()


# --------------------------------------------------------------------------- clients


def _read_reply(sock: socket.socket, on_body: Callable[[bytes], None] | None = None) -> int:
    """Read one HTTP reply to its end; its status."""
    import httptools

    state = {"done": False}

    class Reply:
        def on_body(self, body: bytes) -> None:
            if on_body is not None:
                on_body(body)

        def on_message_complete(self) -> None:
            state["done"] = True

    parser = httptools.HttpResponseParser(Reply())
    while not state["done"]:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed before the reply's end")
        parser.feed_data(data)
    return parser.get_status_code()


def get(port: int, path: str, timeout: float) -> tuple[int, float]:
    """A GET on a fresh connection (as a probe): its status (0: failed) and seconds."""
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(max(0.01, timeout - (time.perf_counter() - start)))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            status = _read_reply(sock)
    except (OSError, ConnectionError, Exception):
        status = 0
    return status, time.perf_counter() - start


def tiny_body() -> bytes:
    values = list(range(16))
    inputs = [{"name": n, "shape": [16], "datatype": "FP32", "data": values} for n in ("a", "b")]
    return json.dumps({"inputs": inputs}).encode()


def big_request() -> tuple[bytes, dict[str, str]]:
    n = 8 << 20
    a = np.ones(n, np.float32).tobytes()
    header = json.dumps({
        "inputs": [{"name": k, "shape": [n], "datatype": "FP32",
                    "parameters": {"binary_data_size": n * 4}} for k in ("a", "b")],
        "outputs": [{"name": "sum", "parameters": {"binary_data": True}}],
    }).encode()  # fmt: skip
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + a + a, headers


def sse_call(port: int) -> Callable[[], dict[str, float]]:
    """A streaming chat completion on a keep-alive connection: seconds to the first event and
    to the end."""
    body = json.dumps({
        "model": "tiny-llama", "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True,
    }).encode()  # fmt: skip
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    conn: dict[str, socket.socket] = {}

    def stream(sock: socket.socket) -> dict[str, float]:
        start = time.perf_counter()
        first: list[float] = []
        events = [0]

        def on_body(data: bytes) -> None:
            if not first:
                first.append(time.perf_counter() - start)
            events[0] += data.count(b"data:")

        sock.sendall(request)
        status = _read_reply(sock, on_body)
        if status != 200 or events[0] < 2:
            raise RuntimeError(f"SSE: HTTP {status}, {events[0]} events")
        return {"first": first[0], "total": time.perf_counter() - start}

    def call() -> dict[str, float]:
        for attempt in (0, 1):  # a keep-alive connection the server closed: reopen once
            sock = conn.get("sock")
            if sock is None:
                sock = conn["sock"] = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                return stream(sock)
            except (ConnectionError, OSError):
                sock.close()
                del conn["sock"]
                if attempt:
                    raise
        raise AssertionError("unreachable")

    call.close = lambda: conn.get("sock") and conn["sock"].close()  # type: ignore[attr-defined]
    return call


def sse_block(call: Callable[[], dict[str, float]], seconds: float) -> dict[str, Any]:
    call()  # warm
    firsts, totals, end = [], [], time.monotonic() + seconds
    while time.monotonic() < end or len(totals) < 3:
        r = call()
        firsts.append(r["first"])
        totals.append(r["total"])
    return {
        "latency_ms": {"p50": statistics.median(totals) * 1e3},
        "first_ms": statistics.median(firsts) * 1e3,
        "throughput_rps": len(totals) / sum(totals),
    }


# --------------------------------------------------------------------------- attacks


class Attack:
    """Started by ``start(port)``; ``done()`` once it has nothing more to send; ``close()``."""

    name = ""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.sent = threading.Event()  # an attack that holds its sockets has opened them
        self.sockets: list[socket.socket] = []
        self.thread: threading.Thread | None = None
        self.note = ""

    def start(self, port: int) -> None:
        self.thread = threading.Thread(target=self.run, args=(port,), daemon=True)
        self.thread.start()

    def run(self, port: int) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        """Nothing more to send: its requests are answered, or it holds what it opened."""
        return self.sent.is_set() or (self.thread is not None and not self.thread.is_alive())

    def connect(self, port: int) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            return None
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(30)
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def _post_head(path: str, length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{size}{extra}\r\n"
    ).encode()


class NoBody(Attack):
    name = "no body: 70 x headers, declared length, no body"

    def run(self, port: int) -> None:
        head = _post_head("/v2/models/add/infer", NO_BODY_LENGTH)
        for _ in range(70):
            sock = self.connect(port)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(head)
        self.sent.set()
        self.stop.wait()  # held until the window ends


class Dribble(Attack):
    name = "dribble: 260 x a body byte every 2 s"

    def run(self, port: int) -> None:
        head = _post_head("/v2/models/add/infer", 100_000)
        live = []
        for _ in range(260):
            sock = self.connect(port)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(head + b"[")
                    live.append(sock)
        self.sent.set()
        while not self.stop.wait(2.0):
            for sock in live:
                with contextlib.suppress(OSError):
                    sock.send(b" ")


class OneByteChunks(Attack):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.name = f"1-byte chunks: a {size >> 10} KiB chunked body"

    def run(self, port: int) -> None:
        sock = self.connect(port)
        if sock is None:
            return
        sock.settimeout(120)
        piece = b"1\r\nx\r\n" * 10_000
        try:
            sock.sendall(_post_head("/v2/models/add/infer", None, "Transfer-Encoding: chunked\r\n"))
            sent = 0
            while sent < self.size and not self.stop.is_set():
                sock.sendall(piece)
                sent += 10_000
            sock.sendall(b"0\r\n\r\n")
            self.note = f"HTTP {_read_reply(sock)}"
        except (OSError, ConnectionError) as exc:
            self.note = type(exc).__name__


class RawBytes(Attack):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.name = f"raw BYTES: one {size >> 20} MiB element"

    def run(self, port: int) -> None:
        sock = self.connect(port)
        if sock is None:
            return
        sock.settimeout(120)
        body = b"x" * self.size
        head = (
            f"POST /v2/models/echo1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
            f"application/octet-stream\r\nInference-Header-Content-Length: 0\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            sock.sendall(head + body)
            del body
            self.note = f"HTTP {_read_reply(sock)}"
        except (OSError, ConnectionError) as exc:
            self.note = type(exc).__name__


def under_attack(served: Served, attack: Attack, seconds: float) -> dict[str, Any]:
    """Health probes, tiny infers and RSS while ``attack`` runs (at least ``seconds``, at most
    60 s more for an attack still sending), then RSS once it is over."""
    rss_before = served.rss_mb()
    stop = threading.Event()
    probes: list[tuple[int, float]] = []
    infers = {"ok": 0, "failed": 0}
    peak = [rss_before]

    def probe() -> None:
        while not stop.is_set():
            probes.append(get(served.port, "/v2/health/live", 5.0))
            stop.wait(0.05)

    runner = HttpRawRunner("127.0.0.1", served.port, "/v2/models/add/infer", tiny_body(),
                           {"Content-Type": "application/json"}, workers=1)  # fmt: skip

    def infer() -> None:
        while not stop.is_set():
            try:
                runner.call()
                infers["ok"] += 1
            except Exception:
                infers["failed"] += 1
                runner.local.conn = None
                stop.wait(0.05)

    def sample() -> None:
        while not stop.wait(0.1):
            peak[0] = max(peak[0], served.rss_mb())

    threads = [threading.Thread(target=f, daemon=True) for f in (probe, infer, sample)]
    for t in threads:
        t.start()
    attack.start(served.port)
    start = time.monotonic()
    while time.monotonic() - start < seconds or (
        not attack.done() and time.monotonic() - start < seconds + 60
    ):
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(10)
    attack.close()
    runner.close()
    time.sleep(1.0)
    rss_after = served.rss_mb()
    times = sorted(t for _, t in probes)
    failed = sum(1 for status, _ in probes if status != 200)
    return {
        "health_p50_ms": statistics.median(times) * 1e3 if times else float("nan"),
        "health_p99_ms": times[math.ceil(0.99 * len(times)) - 1] * 1e3 if times else float("nan"),
        "health_failed": failed,
        "health_probes": len(probes),
        "infer_ok": infers["ok"],
        "infer_failed": infers["failed"],
        "rss_before_mb": rss_before,
        "rss_peak_mb": peak[0],
        "rss_after_mb": rss_after,
        "seconds": time.monotonic() - start,
        "note": attack.note,
    }


# --------------------------------------------------------------------------- the run


def recovered(port: int) -> bool:
    return harness.wait_until(lambda: get(port, "/v2/health/live", 2.0)[0] == 200, 60)


def available(kind: str) -> bool:
    try:
        __import__(kind)
    except ImportError:
        return False
    return True


def compare(
    profile: str = "full",
    kinds: list[str] | None = None,
    attacks: str = "nobody,dribble,chunks,raw",
    rounds: int | None = None,
    seconds: float | None = None,
    speed: bool = True,
    python: str = "",
) -> dict[str, Any]:
    """Start the servers, run the interleaved speed rounds, then the attacks; every figure."""
    p = dict(PROFILES[profile])
    if rounds:
        p["rounds"] = rounds
    if seconds:
        p["seconds"] = seconds
    kinds = kinds or p["servers"]
    skipped = [k for k in kinds if k != "plugserve" and not available(k)]
    for k in skipped:
        log(f"{k}: not installed (pip install {k}): left out")
    kinds = [k for k in kinds if k not in skipped]
    root, has_llm = repository()
    models = ["add", "echo1"] + (["tiny-llama"] if has_llm else [])
    servers: dict[str, Served] = {}
    figures: dict[str, Any] = {"kinds": kinds, "skipped": skipped, "profile": p, "speed": {},
                               "attacks": {}, "load": [harness.load_average()]}  # fmt: skip
    try:
        for kind in kinds:
            servers[kind] = Served(kind, root, python if kind == "plugserve" else "")
        for kind, served in servers.items():
            served.wait_ready(models)
            log(f"{kind}: ready on port {served.port}, RSS {served.rss_mb():.0f} MB")
        big, big_headers = big_request()
        cases: dict[str, Callable[[], dict[str, Any]]] = {}
        closers: list[Callable[[], Any]] = []
        for kind, served in servers.items():
            json_type = {"Content-Type": "application/json"}
            tiny = HttpRawRunner("127.0.0.1", served.port, "/v2/models/add/infer", tiny_body(),
                                 json_type, label=kind, workers=4)  # fmt: skip
            large = HttpRawRunner("127.0.0.1", served.port, "/v2/models/add/infer", big,
                                  big_headers, label=kind, workers=1)  # fmt: skip
            closers += [tiny.close, large.close]
            cases[f"{kind}|tiny"] = block(tiny, p["seconds"])
            cases[f"{kind}|tiny x4"] = block(tiny, p["seconds"], "async", 4)
            cases[f"{kind}|64 MB"] = block(large, p["big_s"], min_requests=2)
            if has_llm:
                sse = sse_call(served.port)
                closers.append(sse.close)  # type: ignore[attr-defined]
                cases[f"{kind}|SSE"] = (lambda s: lambda: sse_block(s, p["sse_s"]))(sse)
        # the order within a round: case by case, each case's servers in turn
        ordered = dict(sorted(cases.items(), key=lambda kv: kv[0].split("|")[1]))
        log(f"speed: {len(ordered)} cases x {p['rounds']} rounds, interleaved")
        blocks = harness.interleave(ordered, p["rounds"] if speed else 0, log, alternate=True)
        for closer in closers:
            closer()
        figures["speed"] = blocks
        figures["load"].append(harness.load_average())
        made: dict[str, Callable[[], Attack]] = {
            "nobody": NoBody,
            "dribble": Dribble,
            "chunks": lambda: OneByteChunks(p["chunked"]),
            "raw": lambda: RawBytes(p["raw"]),
        }
        for key in [a for a in attacks.split(",") if a]:
            for kind, served in servers.items():
                attack = made[key]()
                log(f"attack {attack.name} -> {kind}")
                result = under_attack(served, attack, p["attack_s"])
                figures["attacks"].setdefault(attack.name, {})[kind] = result
                shown = {k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()}
                log(f"    {json.dumps(shown)}")
                recovered(served.port)  # the next attack meets a server that has recovered
        figures["load"].append(harness.load_average())
        figures["alive"] = {k: s.process.poll() is None for k, s in servers.items()}
    finally:
        for served in servers.values():
            served.close()
    return figures


def table(figures: dict[str, Any]) -> str:
    """The results as markdown: speed (each server's median over rounds and, in brackets, its
    best round: the least disturbed by the machine's other load; the median of the per-round
    ratios to plugserve and their range), then the attacks."""
    kinds = figures["kinds"]
    blocks = {name: b for name, b in figures["speed"].items() if b}
    out = []
    if blocks:
        others = [k for k in kinds if k != "plugserve"]
        columns = [*kinds, *(f"{k} / plugserve" for k in others)]
        out.append("| case | " + " | ".join(columns) + " |")
        out.append("|" + "---|" * (1 + len(kinds) + len(others)))
        order = ["tiny", "tiny x4", "64 MB", "SSE"]
        for case in sorted({name.split("|")[1] for name in blocks}, key=order.index):
            rate = case == "tiny x4"
            key = "throughput_rps" if rate else "latency_ms.p50"
            cells, ratios = [], []
            base = blocks[f"plugserve|{case}"]
            for k in kinds:
                values = [harness.median_of([b], key) for b in blocks[f"{k}|{case}"]]
                best = max(values) if rate else min(values)
                cells.append(f"{statistics.median(values):.3g} ({best:.3g})")
                if k != "plugserve":
                    per = [
                        harness.median_of([b], key) / harness.median_of([a], key)
                        for a, b in zip(base, blocks[f"{k}|{case}"])
                    ]
                    ratios.append(f"{statistics.median(per):.2f}x ({min(per):.2f}-{max(per):.2f})")
            unit = "req/s" if rate else "ms p50"
            out.append(f"| {case}, {unit} | " + " | ".join(cells + ratios) + " |")
            if case == "SSE":
                firsts = [f"{harness.median_of(blocks[f'{k}|SSE'], 'first_ms'):.3g}" for k in kinds]
                out.append("| SSE first event, ms p50 | " + " | ".join(firsts) + " |"
                           + " |" * len(others))  # fmt: skip
        out.append("")
    if figures["attacks"]:
        out.append("| attack | server | health p50 / p99 ms | health failed | tiny infers ok / "
                   "failed | RSS before / peak / after MB | attacker got |")  # fmt: skip
        out.append("|---|---|---|---|---|---|---|")
        for name, per in figures["attacks"].items():
            for kind, r in per.items():
                out.append(
                    f"| {name} | {kind} | {r['health_p50_ms']:.1f} / {r['health_p99_ms']:.1f} | "
                    f"{r['health_failed']}/{r['health_probes']} | {r['infer_ok']} / "
                    f"{r['infer_failed']} | {r['rss_before_mb']:.0f} / {r['rss_peak_mb']:.0f} / "
                    f"{r['rss_after_mb']:.0f} | {r['note'] or '-'} |"
                )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one short round (CI)")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument(
        "--servers", default="", help="default: plugserve,uvicorn (smoke), and granian"
    )
    parser.add_argument(
        "--attacks", default="nobody,dribble,chunks,raw", help="which ('': none), in this order"
    )
    parser.add_argument("--no-speed", action="store_true", help="the attacks only")
    parser.add_argument(
        "--plugserve-python",
        default="",
        help="our server's interpreter (another checkout's venv: BRANCH/.venv/bin/python)",
    )
    parser.add_argument("--json", default="", help="write every figure here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    log(f"load average at start {harness.load_average()}")
    figures = compare(
        "smoke" if args.smoke else "full",
        args.servers.split(",") if args.servers else None,
        args.attacks,
        args.rounds or None,
        args.seconds or None,
        not args.no_speed,
        args.plugserve_python,
    )
    machine = harness.machine()
    print(f"bench_http_servers.py: {time.perf_counter() - start:.0f} s; load average "
          f"{' -> '.join(figures['load'])}")  # fmt: skip
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    versions = {k: _version(k) for k in ("uvicorn", "granian", "httptools", "uvloop")}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print()
    print(table(figures))
    if args.json:
        every = {**figures, "machine": machine, "versions": versions}
        Path(args.json).write_text(json.dumps(every, indent=1, default=float))
    return 0 if all(figures.get("alive", {}).values()) else 1


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
