"""``plugserve bench``: throughput and latency of a network, like benchmark_app / perf_analyzer.

Against a running server (``--target``, ``--protocol plugserve|kserve``) or in-process
(``--inprocess --device D MODEL.onnx``)::

    plugserve bench mlp --time 10 --mode async --concurrency 8
    plugserve bench --inprocess --device ORT model.onnx --iterations 200 --batch 8 --json r.json

``--mode sync`` runs ``--concurrency`` (``--nireq`` in-process) callers, each waiting for its
answer before sending the next request; ``--mode async`` keeps that many requests in flight
through the asynchronous API (gRPC futures, ``start_async``), completions driving new requests.

The measuring core (:func:`measure`, the runners) is a library too: the benchmark suite in
``tests/benchmarks`` drives it directly. The in-process runner lives in
:mod:`plugserve.server.bench_inprocess` (imported only for ``--inprocess``): the client package
does not depend on the server.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "BenchResult",
    "KserveRunner",
    "PlugserveRunner",
    "Runner",
    "add_arguments",
    "bench",
    "measure",
    "scrape",
    "summarize",
]

Done = Callable[[BaseException | None], None]


class Runner:
    """One way of sending a request: ``call()`` blocks; ``submit(done)`` returns at once and
    calls ``done(error)`` when the request completes (on any thread)."""

    description = ""

    def call(self) -> None:
        raise NotImplementedError

    def submit(self, done: Done) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- inputs


def concrete_shape(shape: Sequence[Any] | None, batch: int) -> list[int]:
    """Dynamic dims (negative, None or named) become 1, except a dynamic first dim: ``batch``."""
    out = []
    for i, d in enumerate(shape or []):
        if isinstance(d, int) and d >= 0:
            out.append(d)
        else:
            out.append(batch if i == 0 else 1)
    return out


def random_array(dtype: Any, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(dtype if dtype is not None else np.float32)
    if dtype.kind == "f":
        return rng.normal(size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    if dtype.kind in "OSU":
        return np.full(shape, "plugserve", dtype=object)
    return rng.integers(0, 10, size=shape).astype(dtype)


def read_inputs(items: Sequence[str], names: Sequence[str]) -> dict[str, np.ndarray]:
    """``NAME=file.npy``, ``file.npz`` (arrays by name) or a lone ``file.npy`` (one input)."""
    inputs: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            path = item
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"plugserve bench: --input {item}: cannot read it ({exc})") from None
        if isinstance(data, np.ndarray):
            if not sep:
                if len(names) != 1:
                    raise SystemExit(
                        f"plugserve bench: --input {item}: name the input (NAME=file.npy); "
                        f"the network's inputs are {', '.join(names) or 'unknown'}"
                    )
                name = names[0]
            inputs[name] = data
        else:
            with data:
                inputs.update({k: data[k] for k in data.files})
    return inputs


def make_inputs(
    specs: Sequence[tuple[str, Any, Sequence[Any] | None]],
    batch: int,
    files: Sequence[str] = (),
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Inputs from files, the rest random per ``(name, dtype, shape)`` metadata."""
    inputs = read_inputs(files, [s[0] for s in specs])
    rng = np.random.default_rng(seed)
    for name, dtype, shape in specs:
        if name not in inputs:
            inputs[name] = random_array(dtype, concrete_shape(shape, batch), rng)
    return inputs


# --------------------------------------------------------------------------- runners


class PlugserveRunner(Runner):
    """plugserve.v1 Infer over one gRPC channel (sync stub; futures for async)."""

    def __init__(
        self,
        target: str,
        network: str,
        inputs: Mapping[str, np.ndarray],
        version: int = 0,
        timeout: float = 600.0,
        client: Any = None,
    ) -> None:
        from plugserve.client.client import Client, infer_request

        self.client = client or Client(target, timeout=timeout)
        self._own = client is None
        self.request = infer_request(network, inputs, version=version)
        self.timeout = timeout
        self.description = f"plugserve {target} {network}"

    def call(self) -> None:
        self.client.stub.Infer(self.request, timeout=self.timeout)

    def submit(self, done: Done) -> None:
        future = self.client.stub.Infer.future(self.request, timeout=self.timeout)

        def finished(f: Any) -> None:
            error = f.exception()
            done(error)

        future.add_done_callback(finished)

    def close(self) -> None:
        if self._own:
            self.client.close()


class KserveRunner(Runner):
    """KServe v2 ModelInfer through tritonclient.grpc."""

    def __init__(
        self,
        target: str,
        network: str,
        inputs: Mapping[str, np.ndarray],
        version: int = 0,
        timeout: float = 600.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls: bool = False,
    ) -> None:
        try:
            import tritonclient.grpc as tc
            from tritonclient.utils import np_to_triton_dtype
        except ImportError as exc:
            raise SystemExit(
                f"plugserve bench: --protocol kserve needs tritonclient[grpc] ({exc})"
            ) from None
        self.client = tc.InferenceServerClient(
            target, ssl=bool(tls or tls_ca), root_certificates=tls_ca
        )
        self.headers = {"authorization": f"Bearer {token}"} if token else None
        self.network = network
        self.version = str(version) if version else ""
        self.timeout = timeout
        self.inputs = []
        for name, array in inputs.items():
            tensor = tc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            self.inputs.append(tensor)
        self.description = f"kserve {target} {network}"

    def call(self) -> None:
        self.client.infer(
            self.network,
            self.inputs,
            model_version=self.version,
            client_timeout=self.timeout,
            headers=self.headers,
        )

    def submit(self, done: Done) -> None:
        def finished(result: Any, error: Any) -> None:
            done(error)

        self.client.async_infer(
            self.network,
            self.inputs,
            finished,
            model_version=self.version,
            client_timeout=self.timeout,
            headers=self.headers,
        )

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- measuring


@dataclasses.dataclass
class BenchResult:
    latencies: list[float]  # seconds, in completion order
    starts: list[float]  # seconds since the run began, when each request was sent
    errors: int
    wall: float
    first_error: str = ""


class _Progress:
    """A bar on stderr while a run goes (when stderr is a tty); a final line either way."""

    def __init__(self, label: str, total: float, unit: str, enabled: bool) -> None:
        self.label, self.total, self.unit, self.enabled = label, total, unit, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.stop = threading.Event()
        self.value: Callable[[], float] = lambda: 0.0
        self.count: Callable[[], int] = lambda: 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _line(self) -> str:
        fraction = min(1.0, self.value() / self.total) if self.total else 0.0
        filled = int(30 * fraction)
        return (
            f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {100 * fraction:3.0f}% "
            f"{self.count()} requests"
        )

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            sys.stderr.write(self._line())
            sys.stderr.flush()

    def __enter__(self) -> _Progress:
        if self.tty:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.tty:
            self.thread.join()
            sys.stderr.write(self._line() + "\n")
        elif self.enabled:
            sys.stderr.write(f"{self.label}: {self.count()} requests done\n")


def measure(
    runner: Runner,
    mode: str = "sync",
    concurrency: int = 1,
    iterations: int | None = None,
    duration: float | None = None,
    warmup: int = 1,
    progress: str = "",
) -> BenchResult:
    """Run until ``iterations`` requests completed or ``duration`` seconds passed."""
    if iterations is None and duration is None:
        duration = 10.0
    concurrency = max(1, concurrency)
    for _ in range(warmup):
        runner.call()
    lock = threading.Lock()
    latencies: list[float] = []
    starts: list[float] = []
    errors = [0]
    first_error = [""]
    sent = [0]
    t0 = time.perf_counter()
    end = t0 + duration if duration is not None else math.inf

    def claim() -> bool:
        with lock:
            if iterations is not None and sent[0] >= iterations:
                return False
            if time.perf_counter() >= end:
                return False
            sent[0] += 1
            return True

    def record(start: float, error: BaseException | None) -> None:
        now = time.perf_counter()
        with lock:
            if error is None:
                latencies.append(now - start)
                starts.append(start - t0)
            else:
                errors[0] += 1
                if not first_error[0]:
                    first_error[0] = _describe_error(error)

    bar = _Progress(
        progress or "bench",
        float(iterations) if iterations is not None else float(duration or 0),
        "",
        bool(progress),
    )
    bar.count = lambda: len(latencies) + errors[0]
    bar.value = (
        (lambda: float(len(latencies) + errors[0]))
        if iterations is not None
        else (lambda: time.perf_counter() - t0)
    )
    with bar:
        if mode == "sync":

            def worker() -> None:
                while claim():
                    start = time.perf_counter()
                    try:
                        runner.call()
                    except Exception as exc:  # counted, the run goes on
                        record(start, exc)
                    else:
                        record(start, None)

            threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        elif mode == "async":
            completions: queue.SimpleQueue[int] = queue.SimpleQueue()
            in_flight = 0

            def start_one(slot: int) -> bool:
                if not claim():
                    return False
                start = time.perf_counter()

                def done(error: BaseException | None) -> None:
                    record(start, error)
                    completions.put(slot)

                try:
                    runner.submit(done)
                except Exception as exc:
                    record(start, exc)
                    completions.put(slot)
                return True

            for slot in range(concurrency):
                if start_one(slot):
                    in_flight += 1
            while in_flight:
                slot = completions.get()
                in_flight -= 1
                if start_one(slot):
                    in_flight += 1
        else:
            raise ValueError(f"mode: sync or async, not {mode!r}")
    wall = time.perf_counter() - t0
    return BenchResult(latencies, starts, errors[0], wall, first_error[0])


def _describe_error(error: BaseException) -> str:
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        with contextlib.suppress(Exception):
            return f"{code().name}: {details()}"
    return f"{type(error).__name__}: {error}"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return float(np.percentile(np.asarray(sorted_values), q))


def summarize(result: BenchResult, batch: int = 1) -> dict[str, Any]:
    lat = sorted(result.latencies)
    ms = [1e3 * v for v in lat]
    done = len(lat)
    return {
        "requests": done,
        "errors": result.errors,
        "duration_s": result.wall,
        "throughput_rps": done / result.wall if result.wall > 0 else 0.0,
        "throughput_ips": done * batch / result.wall if result.wall > 0 else 0.0,
        "latency_ms": {
            "min": ms[0] if ms else float("nan"),
            "p50": percentile(ms, 50),
            "p90": percentile(ms, 90),
            "p99": percentile(ms, 99),
            "max": ms[-1] if ms else float("nan"),
            "mean": float(np.mean(ms)) if ms else float("nan"),
        },
    }


# --------------------------------------------------------------------------- /metrics

_KEYS = {
    "plugserve_compute_seconds_sum": "compute_s",
    "plugserve_compute_seconds_count": "compute_count",
    "plugserve_queue_wait_seconds_sum": "queue_wait_s",
    "plugserve_queue_wait_seconds_count": "queue_wait_count",
}


def scrape(url: str, timeout: float = 5.0) -> dict[str, dict[str, float]]:
    """Per-device totals from plugserve's counters: requests (by status), compute and queue
    wait seconds (sum and count), read with prometheus-client's own exposition parser. Raises
    OSError when the endpoint cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    devices: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("plugserve_"):
            continue
        for sample in family.samples:
            device = sample.labels.get("device")
            if sample.name == "plugserve_inference_requests_total":
                key = f"requests_{sample.labels.get('status', '')}"
            else:
                key = _KEYS.get(sample.name)
            if device is None or key is None:
                continue
            per = devices.setdefault(device, {})
            per[key] = per.get(key, 0.0) + sample.value
    return devices


def device_figures(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall: float
) -> dict[str, dict[str, float]]:
    """What the server counted per device during the run."""
    out = {}
    for device, values in after.items():
        old = before.get(device, {})
        delta = {k: v - old.get(k, 0.0) for k, v in values.items()}
        requests = sum(v for k, v in delta.items() if k.startswith("requests_"))
        if requests <= 0:
            continue
        figures: dict[str, float] = {"requests": requests}
        for k, v in delta.items():
            if k.startswith("requests_"):
                figures[k] = v
        if delta.get("compute_count", 0) > 0:
            figures["compute_mean_ms"] = 1e3 * delta["compute_s"] / delta["compute_count"]
            figures["utilization"] = delta["compute_s"] / wall if wall > 0 else 0.0
        if delta.get("queue_wait_count", 0) > 0:
            figures["queue_wait_mean_ms"] = 1e3 * delta["queue_wait_s"] / delta["queue_wait_count"]
        out[device] = figures
    return out


# --------------------------------------------------------------------------- plot


def plot(report: Mapping[str, Any], path: str) -> str:
    """A latency histogram and a latency-over-time chart; returns a message for the user."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"--plot {path}: skipped, matplotlib is not installed (pip install 'plugserve[bench]')"
        )
    lat = report.get("latencies_ms") or []
    starts = report.get("starts_s") or []
    fig, (hist, line) = plt.subplots(1, 2, figsize=(12, 4.5))
    hist.hist(lat, bins=min(60, max(5, len(lat) // 4)), color="#4878a8")
    for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
        value = report["latency_ms"][q]
        if value == value:
            hist.axvline(value, color="black", linestyle=style, label=f"{q} {value:.2f} ms")
    hist.set_xlabel("latency (ms)")
    hist.set_ylabel("requests")
    hist.set_title("latency histogram")
    hist.legend()
    line.plot(starts, lat, ".", markersize=3, color="#4878a8")
    line.set_xlabel("time since start (s)")
    line.set_ylabel("latency (ms)")
    line.set_title("latency over time")
    fig.suptitle(
        f"{report.get('model')} on {report.get('device') or report.get('target')}: "
        f"{report['throughput_ips']:.1f} inferences/s, {report['mode']} x{report['concurrency']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot -> {path}"


# --------------------------------------------------------------------------- the verb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("model", help="a served network's name, or with --inprocess an .onnx file")
    add("--protocol", choices=("plugserve", "kserve"), default="plugserve")
    add("--inprocess", action="store_true", help="load MODEL.onnx here instead of a server")
    add("--device", default="NUMPY", help="with --inprocess: the device (NUMPY, ORT, BATCH:ORT...)")
    add("--config", action="append", default=[], metavar="KEY=VALUE", help="with --inprocess")
    add("--version", type=int, default=0)
    add("--mode", choices=("sync", "async"), default="sync")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--time", type=float, default=None, help="seconds to run (default 10)")
    limit.add_argument("--iterations", type=int, default=None, help="requests to complete")
    add("--concurrency", type=int, default=1, help="callers (sync) or requests in flight (async)")
    add(
        "--nireq",
        type=int,
        default=0,
        help="with --inprocess: infer requests (default --concurrency)",
    )
    add("--batch", type=int, default=1, help="the dynamic first dimension of random inputs")
    add("--input", action="append", default=[], help="NAME=file.npy or file.npz; others random")
    add("--seed", type=int, default=0)
    add("--warmup", type=int, default=1, help="requests before measuring")
    add(
        "--metrics-url",
        default="",
        help="server /metrics (default: the port the server reports, on --target's host)",
    )
    add("--json", default="", metavar="FILE", help="write the report as JSON")
    add("--plot", default="", metavar="FILE.png", help="latency histogram and over time")


def _metrics_url(args: argparse.Namespace, client: Any) -> str:
    """--metrics-url, else the port the server says it serves /metrics on (plugserve.v1
    GetMetric SERVER_PORTS), on the host of --target; 8002 (Triton's) when it cannot say."""
    if args.metrics_url:
        return args.metrics_url
    target = args.target.split("///")[-1]
    host = target.rsplit(":", 1)[0] if ":" in target else target
    port = 8002
    with contextlib.suppress(Exception):  # an older or other server: Triton's default port
        port = int(client.get_metric("", "SERVER_PORTS")["metrics"])
    if port < 0:
        raise ValueError("the server serves no /metrics (--metrics-port -1)")
    return f"http://{host or '127.0.0.1'}:{port}/metrics"


def _server_specs(client: Any, args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    if args.protocol == "kserve":
        try:
            import tritonclient.grpc as tc
            from tritonclient.utils import InferenceServerException, triton_to_np_dtype
        except ImportError as exc:
            raise SystemExit(
                f"plugserve bench: --protocol kserve needs tritonclient[grpc] ({exc})"
            ) from None

        kclient = tc.InferenceServerClient(
            args.target, ssl=bool(args.tls or args.tls_ca), root_certificates=args.tls_ca
        )
        headers = {"authorization": f"Bearer {args.token}"} if args.token else None
        try:
            meta = kclient.get_model_metadata(
                args.model,
                str(args.version) if args.version else "",
                headers=headers,
                client_timeout=args.timeout,
            )
        except InferenceServerException as exc:
            raise SystemExit(f"plugserve bench: {args.target}: {exc.message()}") from None
        finally:
            kclient.close()
        return [(i.name, triton_to_np_dtype(i.datatype), list(i.shape)) for i in meta.inputs]
    networks = [n for n in client.networks() if n.name == args.model]
    if args.version:
        networks = [n for n in networks if n.version == args.version]
    if not networks:
        raise SystemExit(f"plugserve bench: no network {args.model!r} on {args.target}")
    network = max(networks, key=lambda n: n.version)
    return [
        (s.name, None if s.dtype == "string" else s.dtype, list(s.shape)) for s in network.inputs
    ]


def bench(client: Any, args: argparse.Namespace) -> int:
    """The ``plugserve bench`` verb (``client`` is unused with ``--inprocess``)."""
    if args.iterations is not None and args.iterations < 1:
        raise SystemExit("plugserve bench: --iterations must be >= 1")
    if args.time is not None and args.time <= 0:
        raise SystemExit("plugserve bench: --time must be > 0")
    if args.batch < 1 or args.concurrency < 1:
        raise SystemExit("plugserve bench: --batch and --concurrency must be >= 1")
    if args.plot:  # asked for a plot: find out now, not after the whole run
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(
                f"plugserve bench: --plot {args.plot} needs matplotlib "
                "(pip install 'plugserve[bench]')"
            ) from None
    duration = args.time if args.time is not None or args.iterations is not None else 10.0
    concurrency = args.concurrency
    before: dict[str, dict[str, float]] | None = None
    metrics_note = ""
    report: dict[str, Any] = {
        "model": args.model,
        "mode": args.mode,
        "batch": args.batch,
    }
    if args.inprocess:
        try:  # only here: the client package needs the server's for nothing else
            from plugserve.server.bench_inprocess import InprocessRunner, load
        except ImportError as exc:
            raise SystemExit(
                f"plugserve bench: --inprocess needs plugserve's server package ({exc})"
            ) from None
        concurrency = args.nireq or args.concurrency
        config = {}
        for item in args.config:
            key, sep, value = item.partition("=")
            if not sep:
                raise SystemExit(f"plugserve bench: --config {item!r}: expected KEY=VALUE")
            config[key] = value
        if not Path(args.model).is_file():
            raise SystemExit(f"plugserve bench: {args.model}: no such model file")
        network = load(args.model, args.device, config)
        specs = [(s.name, s.dtype, s.shape) for s in network.inputs]
        inputs = make_inputs(specs, args.batch, args.input, args.seed)
        runner: Runner = InprocessRunner(network, inputs, nireq=concurrency)
        report.update(target="inprocess", device=args.device, protocol="inprocess")
    else:
        specs = _server_specs(client, args)
        inputs = make_inputs(specs, args.batch, args.input, args.seed)
        if args.protocol == "kserve":
            runner = KserveRunner(
                args.target, args.model, inputs, args.version, args.timeout,
                token=args.token, tls_ca=args.tls_ca, tls=args.tls,
            )  # fmt: skip
        else:
            runner = PlugserveRunner(
                args.target, args.model, inputs, args.version, args.timeout, client=client
            )
        report.update(target=args.target, device="", protocol=args.protocol)
        url = ""
        try:
            url = _metrics_url(args, client)
            before = scrape(url)
        except (OSError, ValueError) as exc:
            metrics_note = f"server metrics unavailable{' at ' + url if url else ''}: {exc}"
    report["concurrency"] = concurrency
    report["inputs"] = {k: [str(v.dtype), list(v.shape)] for k, v in inputs.items()}
    label = f"bench {args.model} {args.mode} x{concurrency}"
    try:
        result = measure(
            runner,
            args.mode,
            concurrency,
            iterations=args.iterations,
            duration=None if args.iterations is not None else duration,
            warmup=args.warmup,
            progress=label,
        )
    finally:
        runner.close()
    report.update(summarize(result, args.batch))
    if result.first_error:
        report["first_error"] = result.first_error
    if before is not None:
        try:
            report["devices"] = device_figures(before, scrape(url), result.wall)
        except (OSError, ValueError) as exc:
            metrics_note = f"server metrics unavailable: {exc}"
    if metrics_note:
        report["metrics_note"] = metrics_note
    report["latencies_ms"] = [1e3 * v for v in result.latencies]
    report["starts_s"] = result.starts
    _print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"report -> {args.json}", file=sys.stderr)
    if args.plot:
        print(plot(report, args.plot), file=sys.stderr)
    if report["errors"] or report["requests"] == 0:
        print(
            f"plugserve bench: {report['errors']} of {report['requests'] + report['errors']} "
            f"requests failed ({report.get('first_error', 'no requests')})",
            file=sys.stderr,
        )
        return 1
    return 0


def _print_report(report: Mapping[str, Any]) -> None:
    lat = report["latency_ms"]
    where = report["device"] if report["protocol"] == "inprocess" else report["target"]
    print(
        f"{report['model']} on {where} ({report['protocol']}), {report['mode']} "
        f"x{report['concurrency']}, batch {report['batch']}"
    )
    print(
        f"requests: {report['requests']} ok, {report['errors']} failed in "
        f"{report['duration_s']:.2f} s"
    )
    print(
        f"throughput: {report['throughput_rps']:.2f} requests/s, "
        f"{report['throughput_ips']:.2f} inferences/s"
    )
    print(
        "latency ms: " + "  ".join(f"{k} {lat[k]:.3f}" for k in ("min", "p50", "p90", "p99", "max"))
    )
    if report.get("first_error"):
        print(f"first error: {report['first_error']}")
    for device, figures in sorted((report.get("devices") or {}).items()):
        parts = [f"{figures['requests']:.0f} requests"]
        if "compute_mean_ms" in figures:
            parts.append(f"compute mean {figures['compute_mean_ms']:.3f} ms")
            parts.append(f"busy {100 * figures['utilization']:.0f}% of the run")
        if "queue_wait_mean_ms" in figures:
            parts.append(f"queue wait mean {figures['queue_wait_mean_ms']:.3f} ms")
        print(f"server {device}: " + ", ".join(parts))
    if report.get("metrics_note"):
        print(report["metrics_note"])
