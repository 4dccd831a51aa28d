"""Shared pieces of the benchmark suite: interleaved blocks, medians, bare backends, servers.

Compared cases run in blocks, interleaved (A, B, C, A, B, C, ...), so that a burst of load
from elsewhere on the machine hits every case alike; each figure is the median over blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
SUPPORT = TESTS / "support"
# benchmarks first: its zoo.py, not the tests' zoo package, is the one imported as ``zoo``
for folder in (SUPPORT, TESTS, HERE):
    if str(folder) in sys.path:
        sys.path.remove(str(folder))
    sys.path.insert(0, str(folder))

from plugserve.client.bench import Done, Runner, measure, summarize  # noqa: E402

CORES = os.cpu_count() or 1


# --------------------------------------------------------------------------- blocks


def p50_block(call: Callable[[], Any], seconds: float, warmup: int = 20) -> dict[str, Any]:
    """A case: ``call`` one at a time for ``seconds`` (after ``warmup`` calls), its p50."""
    for _ in range(warmup):
        call()
    times, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"p50_ms": statistics.median(times) * 1e3, "n": len(times)}


def kserve_request(model: str, arrays: Mapping[str, np.ndarray], **sequence: Any) -> bytes:
    """A ``ModelInferRequest``'s bytes as tritonclient sends them (``sequence``: ``id`` and
    ``start`` for a request of a sequence)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import _utils
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in arrays.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return _utils._get_inference_request(
        model_name=model, inputs=inputs, model_version="", request_id="", outputs=None,
        sequence_id=sequence.get("id", 0), sequence_start=sequence.get("start", False),
        sequence_end=False, priority=0, timeout=None, parameters=None,
    ).SerializeToString()  # fmt: skip


def ratio_of(blocks: Mapping[str, list[dict[str, Any]]], top: str, bottom: str) -> tuple:
    """The median of each round's ``top`` / ``bottom`` p50, and the rounds' ratios."""
    ratios = [t["p50_ms"] / b["p50_ms"] for t, b in zip(blocks[top], blocks[bottom])]
    return round(statistics.median(ratios), 3), [round(r, 3) for r in ratios]


def interleave(
    cases: Mapping[str, Callable[[], dict[str, Any]]],
    rounds: int,
    log: Callable[[str], None],
    alternate: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Run every case once per round, in order (``alternate``: backwards every other round,
    so that no case always follows the same one); returns each case's block summaries."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    order = list(cases)
    for r in range(rounds):
        for name in reversed(order) if alternate and r % 2 else order:
            results[name].append(cases[name]())
        log(f"    round {r + 1}/{rounds} done")
    return results


def per_count_medians(
    blocks: Mapping[str, list[dict[str, dict[str, float]]]], field: str
) -> dict[str, Any]:
    """Rounds of ``{label: [{"x8": {name: value}, ...}, ...]}`` as each label's medians per
    count and name, and, with an "after" and a "before", the median of each round's after /
    before ``field`` (bench_stream_cost.py's and bench_engine_host.py's summaries)."""
    out: dict[str, Any] = {}
    for label, rounds in blocks.items():
        out[label] = {
            key: {
                name: round(statistics.median(r[key][name] for r in rounds), 1)
                for name in rounds[0][key]
            }
            for key in rounds[0]
        }
    if "before" in blocks and "after" in blocks:
        out[f"after / before ({field})"] = {
            key: round(
                statistics.median(
                    a[key][field] / b[key][field] for a, b in zip(blocks["after"], blocks["before"])
                ),
                3,
            )
            for key in blocks["after"][0]
        }
    return out


def thread_time_of(owner: Any, name: str) -> list[float]:
    """Wrap ``owner.name`` (a method, e.g. a decoder's forward ``_run``) to add the calling
    thread's CPU seconds in it to the returned one-item list (reset it by assigning
    ``[0] = 0.0``): what a benchmark subtracts as "the forward"."""
    spent = [0.0]
    inner = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t0

    setattr(owner, name, timed)
    return spent


def print_summary(
    blocks: Mapping[str, list[dict[str, dict[str, float]]]], field: str, **about: Any
) -> None:
    """A before/after benchmark's JSON summary: the machine, ``about`` (folder, device, new
    tokens...), :func:`per_count_medians` of ``field`` and the load average."""
    summary: dict[str, object] = {"machine": machine(), **about}
    summary.update(per_count_medians(blocks, field))
    summary["load_average"] = load_average()
    print(json.dumps(summary, indent=1))


def before_after_options(
    parser: argparse.ArgumentParser,
    *,
    device: str,
    new_tokens: int,
    rounds: int,
    streams: str | None = None,
    configs: bool = False,
) -> argparse.ArgumentParser:
    """The options a generation benchmark takes to run this checkout ("after") beside a
    baseline ("before"), rounds interleaved: ``--baseline PYTHON`` (a base commit's venv,
    made as bench_before_after.py's), ``--folder`` (tiny-llama's when empty), ``--device``,
    ``--streams`` (comma-separated counts, where ``streams`` gives a default),
    ``--new-tokens``, ``--rounds`` and, with ``configs``, ``--config`` / ``--baseline-config``
    (more config keys for both sides; the baseline's instead). The defaults are each
    benchmark's own (bench_stream_cost.py, bench_engine_host.py, bench_engine_step.py)."""
    parser.add_argument("--baseline", default="", metavar="PYTHON")
    parser.add_argument("--folder", default="")
    parser.add_argument("--device", default=device)
    if streams is not None:
        parser.add_argument("--streams", default=streams)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--rounds", type=int, default=rounds)
    if configs:
        parser.add_argument("--config", default="", help="KEY=VALUE,... more config keys")
        parser.add_argument(
            "--baseline-config", default=None, metavar="KEY=VALUE,...",
            help="the baseline's config keys instead (without --baseline: this Python), e.g. "
            "ASYNC_SCHEDULING=NO against the default",
        )  # fmt: skip
    return parser


def median_of(blocks: list[dict[str, Any]], key: str) -> float:
    values = []
    for block in blocks:
        value: Any = block
        for part in key.split("."):
            value = value[part]
        values.append(value)
    return statistics.median(values) if values else float("nan")


def block(
    runner: Runner,
    seconds: float,
    mode: str = "sync",
    concurrency: int = 1,
    batch: int = 1,
    min_requests: int = 3,
) -> Callable[[], dict[str, Any]]:
    """A case: ``seconds`` of ``runner`` (at least ``min_requests``), summarized."""

    def run() -> dict[str, Any]:
        result = measure(runner, mode, concurrency, duration=seconds, warmup=1)
        while len(result.latencies) < min_requests:
            more = measure(runner, mode, concurrency, iterations=min_requests, warmup=0)
            result.latencies += more.latencies
            result.errors += more.errors
            result.wall += more.wall
        if result.errors:
            raise RuntimeError(
                f"{runner.description}: {result.errors} errors: {result.first_error}"
            )
        return summarize(result, batch)

    return run


# --------------------------------------------------------------------------- bare backends


class OrtSession(Runner):
    """Bare onnxruntime, intra-op threads = the cores (``streams``>1: that many sessions
    sharing the cores, threads divided, as the ORT device does in THROUGHPUT mode)."""

    def __init__(self, path: str, inputs: Mapping[str, np.ndarray], streams: int = 1) -> None:
        import onnxruntime as ort

        self.sessions = []
        for _ in range(streams):
            options = ort.SessionOptions()
            options.intra_op_num_threads = max(1, CORES // streams)
            options.inter_op_num_threads = 1
            self.sessions.append(
                ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            )
        self.inputs = dict(inputs)
        self.description = "onnxruntime"
        import queue

        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for s in self.sessions:
            self.free.put(s)

    def call(self) -> None:
        session = self.free.get()
        try:
            session.run(None, self.inputs)
        finally:
            self.free.put(session)

    def submit(self, done: Done) -> None:
        raise NotImplementedError("bare onnxruntime: sync only here")


class OvCompiled(Runner):
    """Bare OpenVINO CPU, INFERENCE_PRECISION_HINT=f32."""

    def __init__(self, path: str, inputs: Mapping[str, np.ndarray], hint: str = "LATENCY"):
        import openvino as ov

        core = ov.Core()
        self.compiled = core.compile_model(
            path, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": hint}
        )
        self.request = self.compiled.create_infer_request()
        self.inputs = dict(inputs)
        self.description = "openvino"

    def call(self) -> None:
        self.request.infer(self.inputs)

    def submit(self, done: Done) -> None:
        raise NotImplementedError("bare openvino: sync only here")


# --------------------------------------------------------------------------- echo


class RawRunner(Runner):
    """Pre-serialized request bytes to one gRPC method; the reply's bytes are not decoded.

    The bare echo, plugserve.v1 Infer and KServe ModelInfer all measured through this same
    client, so their difference is the servers' alone (a client library's own encoding and
    decoding is measured separately, by the library runners).
    """

    def __init__(self, target: str, method: str, payload: bytes, label: str = "") -> None:
        import grpc

        self.channel = grpc.insecure_channel(
            target,
            [
                ("grpc.max_send_message_length", 1 << 30),
                ("grpc.max_receive_message_length", 1 << 30),
            ],
        )
        self.method = self.channel.unary_unary(method)
        self.payload = payload
        self.description = f"{label or method} {target}"

    def call(self) -> None:
        self.method(self.payload, timeout=60)

    def submit(self, done: Done) -> None:
        future = self.method.future(self.payload, timeout=60)
        future.add_done_callback(lambda f: done(f.exception()))

    def close(self) -> None:
        self.channel.close()


class HttpRawRunner(Runner):
    """Pre-built HTTP/1.1 request bytes to one URL over keep-alive connections (one per
    thread); the reply is read to its end with httptools' parser and not decoded. The REST
    counterpart of :class:`RawRunner`: the client's own cost is the same for every server.
    ``submit`` runs ``call`` on a pool of ``workers`` threads (each with its connection)."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
        label: str = "",
        workers: int = 16,
    ) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        self.address = (host, port)
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="http-bench")
        self.description = f"{label or path} {host}:{port}"
        self.opened: list[Any] = []

    def _connection(self) -> Any:
        import socket

        import httptools

        conn = getattr(self.local, "conn", None)
        if conn is None:
            sock = socket.create_connection(self.address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            state = {"done": False, "status": 0}

            class Reply:
                def on_message_complete(self) -> None:
                    state["done"] = True

            parser = httptools.HttpResponseParser(Reply())
            conn = self.local.conn = (sock, parser, state)
            self.opened.append(sock)
        return conn

    def call(self) -> None:
        for attempt in (0, 1):  # a server may close an idle keep-alive connection: reopen once
            sock, parser, state = self._connection()
            state["done"] = False
            try:
                sock.sendall(self.request)
                data = sock.recv(1 << 20)
            except (BrokenPipeError, ConnectionResetError):
                if attempt:
                    raise
                data = b""
            if data or attempt:
                break
            sock.close()
            self.local.conn = None
        while True:
            if not data:
                raise ConnectionError("the server closed the connection")
            parser.feed_data(data)
            if state["done"]:
                break
            data = sock.recv(1 << 20)
        status = parser.get_status_code()
        if status != 200:
            raise RuntimeError(f"HTTP {status}")

    def submit(self, done: Done) -> None:
        future = self.pool.submit(self.call)
        future.add_done_callback(lambda f: done(f.exception()))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for sock in self.opened:
            sock.close()


def wrk_block(
    url: str, body: bytes, headers: Mapping[str, str], seconds: float, connections: int
) -> Callable[[], dict[str, Any]]:
    """A case run by ``wrk`` (C, one thread, ``connections`` keep-alive connections, each with
    one request in flight): the same POST of ``body`` for whole seconds (at least 1); the
    figures read from wrk's report (p50 from ``--latency``). A client far cheaper than a Python
    one, for servers whose own cost per request is near the client's."""
    import shutil
    import tempfile

    if shutil.which("wrk") is None:
        raise RuntimeError("wrk is not installed (Debian: apt-get install wrk)")
    folder = Path(tempfile.mkdtemp(prefix="wrk-"))
    (folder / "body").write_bytes(body)
    lines = [
        'wrk.method = "POST"',
        f'local f = io.open("{folder / "body"}", "rb")',
        "wrk.body = f:read('*a')",
        "f:close()",
        *(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items()),
    ]
    (folder / "post.lua").write_text("\n".join(lines) + "\n")
    command = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency",
               "-s", str(folder / "post.lua"), url]  # fmt: skip

    def run() -> dict[str, Any]:
        report = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return parse_wrk(report)

    return run


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def parse_wrk(report: str) -> dict[str, Any]:
    """p50 (ms), requests/s and the request count from wrk's ``--latency`` report; errors and
    non-2xx replies fail the block, as they do for the other runners."""
    import re

    problems = re.search(r"Non-2xx or 3xx responses: (\d+)|Socket errors: .*", report)
    if problems:
        raise RuntimeError(f"wrk: {problems.group(0)}")
    p50 = re.search(r"^\s+50%\s+([\d.]+)(us|ms|s)\s*$", report, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", report, re.M)
    count = re.search(r"^\s+(\d+) requests in", report, re.M)
    if not (p50 and rps and count):
        raise RuntimeError(f"wrk's report not understood: {report[-500:]}")
    return {
        "latency_ms": {"p50": float(p50.group(1)) * _WRK_UNITS[p50.group(2)]},
        "throughput_rps": float(rps.group(1)),
        "requests": int(count.group(1)),
    }


@contextlib.contextmanager
def echo_server(kind: str = "thread", *options: str) -> Iterator[str]:
    """A bare grpcio echo server in its own process; yields its target."""
    process = subprocess.Popen(
        [sys.executable, str(HERE / "bench_echo.py"), "--kind", kind, *options],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"echo server did not start: {line!r}")
        yield f"127.0.0.1:{int(line.split()[1])}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


# --------------------------------------------------------------------------- machine


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def machine() -> dict[str, str]:
    """What a ratio from a benchmark is only valid for: the CPU and its vector extensions, the
    BLAS and the kernel it picked (threadpoolctl's view), versions, the OPENBLAS_* settings."""
    cpu = platform.processor() or ""
    vector = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not vector:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                vector = " ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "amx"))))
                break
    blas = ""
    with contextlib.suppress(Exception):
        config = np.show_config(mode="dicts")  # numpy >= 2
        info = config["Build Dependencies"]["blas"]
        blas = f"{info.get('name', '')} {info.get('version', '')}".strip()
    with contextlib.suppress(Exception):
        from threadpoolctl import threadpool_info

        pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        if pools:
            blas += f" ({pools[0].get('internal_api')}, {pools[0].get('architecture')})"
    versions = {}
    for name in ("onnxruntime", "openvino", "grpc", "onnx"):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "?")
        except ImportError:
            versions[name] = "not installed"
    return {
        "cpu": cpu,
        "vector": vector or "?",
        "cores": str(CORES),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": blas or "unknown",
        **versions,
        "kernel": platform.release(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", ""),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE", ""),
    }


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False


# --------------------------------------------------------------------------- worker processes


#: Requests each in-process backend serves before its first timed block.
WARMUP_REQUESTS = 16


def _build_runner(spec: Mapping[str, Any]) -> Runner:
    x = {"input": np.random.default_rng(0).normal(size=spec["shape"]).astype(np.float32)}
    kind = spec["kind"]
    if kind == "onnxruntime":
        return OrtSession(spec["model"], x)
    if kind == "openvino":
        return OvCompiled(spec["model"], x)
    from plugserve.server.process.bench_inprocess import InprocessRunner, load

    network = load(spec["model"], spec["device"], spec.get("config") or {})
    return InprocessRunner(network, x, spec.get("nireq", 1))


def _worker(conn: Any, spec: Mapping[str, Any]) -> None:
    try:
        runner = _build_runner(spec)
        # NUMPY settles its kernel choice for a shape its load did not time (a batch of 8)
        # over the first requests that bring it (plugins/numpy/tuning.py): let it, as a
        # serving network has by the time anyone measures it.
        measure(runner, "sync", 1, iterations=WARMUP_REQUESTS, warmup=0)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ""))
    while True:
        command = conn.recv()
        if command is None:
            break
        seconds, mode, concurrency, batch = command
        try:
            conn.send(("ok", block(runner, seconds, mode, concurrency, batch)()))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    runner.close()


class Worker:
    """An in-process backend in a process of its own (its thread pools, BLAS threads and
    allocator undisturbed by the other backends'), as a user running one backend has it.
    ``spec``: kind (inprocess, onnxruntime, openvino), model, shape, device, config, nireq."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, dict(spec)), daemon=True)
        self.process.start()
        status, message = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"{spec.get('kind')} {spec.get('device', '')}: {message}")

    def block(
        self, seconds: float, mode: str = "sync", concurrency: int = 1, batch: int = 1
    ) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            self.conn.send((seconds, mode, concurrency, batch))
            status, value = self.conn.recv()
            if status != "ok":
                raise RuntimeError(value)
            return value

        return run

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
