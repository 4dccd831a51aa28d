"""What tracing costs a tiny request: off, and on at rate 1 (every request traced), beside the
commit before tracing existed.

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_tracing.py
--baseline BASE_VENV/bin/python [--seconds S] [--rounds N] [--device ORT]``

Three servers serve the [1, 16] float32 identity (``bench_small.py``'s) on the same device:
the baseline checkout's (``--baseline``), this one's with no ``--trace-config`` (tracing off,
the default), and this one's with ``level=TIMESTAMPS rate=1`` exporting OTLP/HTTP to a
receiver in a process of its own (it reads each export and answers 200, as a collector on
another machine would cost this one nothing more). The same pre-serialized requests reach
KServe gRPC ``ModelInfer`` (``harness.RawRunner``) and REST ``/infer`` with JSON tensors
(``harness.HttpRawRunner``), one at a time, in interleaved blocks (the order reversed every
other round); each figure is the median over the rounds of a block's p50, and each ratio the
median of the rounds' ratios. Issue 43's goals: off within 2 % of the baseline, on within 15 %.
The receiver's count of export requests and bytes shows the traces did leave, and the traced
server's log how many its exporter dropped (none, when it keeps up). Beside the
latencies, each server's CPU time per request (all its threads: the exporter's too, from
``/proc``; Linux only), which a loaded machine disturbs far less than a latency: what tracing
costs in all, where the p50 shows what a request waits for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np
from bench_before_after import identity16
from bench_mlserver import json_request
from bench_small import METHOD, request_bytes

_RECEIVER = r"""
import http.server, sys, threading
seen = [0, 0]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        seen[0] += 1
        seen[1] += len(body)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
sys.stdin.read()
print(seen[0], seen[1], flush=True)
"""


@contextlib.contextmanager
def receiver():
    """An OTLP/HTTP endpoint in its own process: yields (url, counts), where ``counts()``
    stops it and gives (export requests, bytes) received."""
    process = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    port = int(process.stdout.readline())
    counted: list[int] = []

    def counts() -> list[int]:
        if not counted:
            out, _ = process.communicate("", timeout=30)
            counted.extend(int(v) for v in out.split())
        return counted

    try:
        yield f"127.0.0.1:{port}/v1/traces", counts
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def _cpu_seconds(pid: int) -> float | None:
    """A process's user and system CPU time so far (None: no /proc here)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _with_cpu(case, pid: int):
    """``case`` (a block), its summary with the server's CPU time per request added."""

    def run() -> dict:
        before = _cpu_seconds(pid)
        summary = case()
        after = _cpu_seconds(pid)
        spent = None if before is None or after is None else after - before
        summary["cpu_us"] = None if spent is None else spent / summary["requests"] * 1e6
        return summary

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, metavar="PYTHON")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="ORT")
    args = parser.parse_args(argv)
    from serving import RunningServer

    from plugserve.client import Client

    folder = Path(tempfile.mkdtemp(prefix="plugserve-tracing-bench-"))
    path = identity16(folder / "identity16.onnx")
    repo = folder / "repo"
    repo.mkdir()
    x = np.random.default_rng(0).normal(size=(1, 16)).astype(np.float32)
    payload = request_bytes(x)
    body = json_request({"input": x})
    log = print if sys.stderr.isatty() else (lambda s: print(s, file=sys.stderr))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        url, counts = stack.enter_context(receiver())
        traced = [
            *("--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1"),
            *("--trace-config", f"opentelemetry,url={url}"),
        ]
        servers = {"before": (args.baseline, []), "off": ("", []), "on": ("", traced)}
        cases = {}
        logs = {}
        for label, (python, flags) in servers.items():
            extra = {"python": python} if python else {}
            running = stack.enter_context(
                RunningServer("--model-repository", str(repo), *flags, **extra)
            )
            with Client(running.target, timeout=600) as client:
                client.load("identity16", path, args.device, {"PERFORMANCE_HINT": "LATENCY"})
            grpc_runner = harness.RawRunner(running.target, METHOD, payload, label)
            host, port = running.http_target.split(":")
            rest_runner = harness.HttpRawRunner(
                host, int(port), "/v2/models/identity16/infer", body, label=label, workers=1
            )
            stack.callback(rest_runner.close)
            logs[label] = running
            pid = running.process.pid
            cases[f"grpc/{label}"] = _with_cpu(harness.block(grpc_runner, args.seconds), pid)
            cases[f"rest/{label}"] = _with_cpu(harness.block(rest_runner, args.seconds), pid)
        blocks = harness.interleave(cases, args.rounds, log, alternate=True)
        exports, sent = counts()
        # traces the exporter dropped (its queue full: it could not keep up), from its log
        dropped = sum(map(int, re.findall(r"tracing: (\d+) trace\(s\) dropped", logs["on"].log)))
    result: dict = {"machine": harness.machine(), "device": args.device}
    for protocol in ("grpc", "rest"):
        p50s = {
            label: [b["latency_ms"]["p50"] for b in blocks[f"{protocol}/{label}"]]
            for label in servers
        }
        row: dict = {f"{label} p50 ms": round(statistics.median(v), 4) for label, v in p50s.items()}
        for label in servers:
            cpu = [b["cpu_us"] for b in blocks[f"{protocol}/{label}"] if b["cpu_us"] is not None]
            if cpu:
                row[f"{label} server cpu us/request"] = round(statistics.median(cpu), 1)
        for label in ("off", "on"):
            ratios = [a / b for a, b in zip(p50s[label], p50s["before"])]
            row[f"{label}/before"] = round(statistics.median(ratios), 3)
            row[f"{label}/before rounds"] = [round(r, 3) for r in ratios]
        result[protocol] = row
    result["receiver"] = {"export requests": exports, "bytes": sent, "traces dropped": dropped}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
