"""Soak: mixed traffic against a local server for a bounded time; errors, latency, memory.

Run as ``python tests/benchmarks/soak.py [--minutes 10] [--clients 8] [--json FILE]``. It starts
``plugserve serve`` on 127.0.0.1 (free ports) on a copy of the bundled example models, then
``--clients`` threads send a mix until the time is up:

* plugserve.v1 ``Infer``: add (checked exactly), echo (strings, checked), mlp (batches 1-8),
  cnn (one 28x28 image);
* KServe v2 ``ModelInfer`` through ``tritonclient.grpc``: add (checked exactly);
* plugserve.v1 ``InferStream``: 4 add requests on one call, paired by id (checked);
* metadata: ``ListNetworks`` and KServe ``ModelMetadata``;
* about every 50th operation a client loads its own small network, infers on it and unloads it.

It reports requests, errors (by kind), p50/p99 latency per kind and overall, and the server's
resident memory (``VmRSS``, or psutil when installed) at start, after warm-up (the first 10 % of
the time, at least 10 s) and at the end, with the growth after warm-up. The target of issue 6 is
zero errors and under 5 % memory growth after warm-up. Exit status 1 when there were errors.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # serving, models

from models import mlp
from serving import RunningServer, examples_repository

from plugserve.client import Client


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc: install psutil")


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.errors: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, str] = {}

    def ok(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latency[kind].append(seconds)

    def error(self, kind: str, exc: BaseException) -> None:
        code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
        key = f"{kind}: {code}"
        with self.lock:
            self.errors[key] += 1
            self.examples.setdefault(key, str(exc)[:300])


def client_loop(k: int, target: str, end: float, rec: Recorder) -> None:
    import tritonclient.grpc as tc

    rng = random.Random(k)
    nprng = np.random.default_rng(k)
    own = mlp(seed=k, sizes=(8, 16, 4)).SerializeToString()
    with Client(target, timeout=60) as client, tc.InferenceServerClient(target) as triton:
        step = 0
        while time.monotonic() < end:
            step += 1
            kind = rng.choices(
                ["add", "echo", "mlp", "cnn", "kserve", "stream", "meta", "load"],
                weights=[30, 10, 15, 10, 20, 8, 5, 2],
            )[0]
            started = time.perf_counter()
            try:
                if kind == "add":
                    a, b = nprng.normal(size=(2, 16)).astype(np.float32)
                    out = client.infer("add", {"a": a, "b": b})["sum"]
                    assert np.array_equal(out, a + b), "wrong sum"
                elif kind == "echo":
                    text = np.array([f"soak-{k}-{step}", "é" * (step % 7)], dtype=object)
                    out = client.infer("echo", {"text": text})["echo"]
                    assert out.tolist() == text.tolist(), "wrong echo"
                elif kind == "mlp":
                    x = nprng.normal(size=(rng.randint(1, 8), 16)).astype(np.float32)
                    out = client.infer("mlp", {"input": x})["probabilities"]
                    assert out.shape == (len(x), 4) and np.allclose(out.sum(1), 1, atol=1e-4)
                elif kind == "cnn":
                    x = nprng.normal(size=(1, 1, 28, 28)).astype(np.float32)
                    assert client.infer("cnn", {"image": x})["logits"].shape == (1, 10)
                elif kind == "kserve":
                    a, b = nprng.normal(size=(2, 16)).astype(np.float32)
                    inputs = [tc.InferInput("a", [16], "FP32"), tc.InferInput("b", [16], "FP32")]
                    inputs[0].set_data_from_numpy(a)
                    inputs[1].set_data_from_numpy(b)
                    out = triton.infer("add", inputs, client_timeout=60).as_numpy("sum")
                    assert np.array_equal(out, a + b), "wrong KServe sum"
                elif kind == "stream":
                    pairs = nprng.normal(size=(4, 2, 8)).astype(np.float32)
                    sent = [
                        (f"{k}-{step}-{i}", "add", {"a": p[0], "b": p[1]})
                        for i, p in enumerate(pairs)
                    ]
                    got = {}
                    for rid, out, message in client.infer_stream(sent, timeout=60):
                        if not isinstance(out, dict):  # an error status for this request
                            raise grpc.RpcError(f"{out.name}: {message}")
                        got[rid] = out
                    for rid, _, feeds in sent:
                        assert np.array_equal(got[rid]["sum"], feeds["a"] + feeds["b"]), rid
                elif kind == "meta":
                    assert {"add", "mlp"} <= {n.name for n in client.networks()}
                    assert triton.get_model_metadata("mlp").name == "mlp"
                else:
                    name = f"soak_{k}"
                    client.load(name, own)
                    try:
                        x = nprng.normal(size=(2, 8)).astype(np.float32)
                        assert client.infer(name, {"x": x})["y"].shape == (2, 4)
                    finally:
                        client.unload(name)
                rec.ok(kind, time.perf_counter() - started)
            except Exception as exc:  # counted, never fatal: the soak keeps going
                rec.error(kind, exc)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("server_args", nargs="*", help="extra `plugserve serve` arguments")
    args = parser.parse_args(argv)
    duration = args.minutes * 60
    warmup = max(10.0, duration * 0.1)
    rec = Recorder()
    with tempfile.TemporaryDirectory() as tmp:
        repo = examples_repository(Path(tmp))
        # The queue holds every request the clients can have in flight (each at most 4, on a
        # stream), so errors mean faults, not the overload refusals
        # tests/server/test_overload.py covers.
        queue = ["--queue-size", str(max(64, 8 * args.clients))]
        running = RunningServer("--model-repository", str(repo), *queue, *args.server_args)
        running.start()
        try:
            pid = running.process.pid
            rss_start = rss_bytes(pid)
            began = time.monotonic()
            end = began + duration
            threads = [
                threading.Thread(target=client_loop, args=(k, running.target, end, rec))
                for k in range(args.clients)
            ]
            for t in threads:
                t.start()
            samples = []
            rss_warm = None
            while any(t.is_alive() for t in threads):
                time.sleep(1.0)
                now = time.monotonic() - began
                rss = rss_bytes(pid)
                samples.append((round(now, 1), rss))
                if rss_warm is None and now >= warmup:
                    rss_warm = rss
            for t in threads:
                t.join()
            rss_end = rss_bytes(pid)
            alive = running.process.poll() is None
        finally:
            code = running.stop()
    rss_warm = rss_warm or rss_end
    every = [s for values in rec.latency.values() for s in values]
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": len(every) + sum(rec.errors.values()),
        "errors": sum(rec.errors.values()),
        "errors_by_kind": dict(rec.errors),
        "error_examples": rec.examples,
        "p50_ms": percentile(every, 50),
        "p99_ms": percentile(every, 99),
        "by_kind": {
            kind: {
                "count": len(v),
                "p50_ms": percentile(v, 50),
                "p99_ms": percentile(v, 99),
            }
            for kind, v in sorted(rec.latency.items())
        },
        "rss_mb_start": rss_start / 2**20,
        "rss_mb_after_warmup": rss_warm / 2**20,
        "rss_mb_end": rss_end / 2**20,
        "rss_mb_max": max(r for _, r in samples) / 2**20 if samples else rss_end / 2**20,
        "rss_growth_after_warmup_pct": 100.0 * (rss_end - rss_warm) / rss_warm,
        "server_alive_at_end": alive,
        "server_exit_code": code,
    }
    print(f"soak: {args.minutes:g} min, {args.clients} clients")
    print(
        f"  requests {result['requests']}, errors {result['errors']}, "
        f"p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms, "
        f"{result['requests'] / duration:.0f} req/s"
    )
    for kind, row in result["by_kind"].items():
        print(
            f"  {kind:7} {row['count']:8d}  "
            f"p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms"
        )
    for key, count in rec.errors.items():
        print(f"  error {key}: {count} (e.g. {rec.examples[key]})")
    print(
        f"  server RSS: start {result['rss_mb_start']:.1f} MB, after warm-up "
        f"{result['rss_mb_after_warmup']:.1f} MB, end {result['rss_mb_end']:.1f} MB, max "
        f"{result['rss_mb_max']:.1f} MB; growth after warm-up "
        f"{result['rss_growth_after_warmup_pct']:+.1f} %"
    )
    print(f"  server exit code after SIGTERM: {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if not result["errors"] and alive and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
