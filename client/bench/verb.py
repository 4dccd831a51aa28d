"""The ``plugserve bench`` verb: its arguments, the run and the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.client.bench.measure import measure, summarize
from plugserve.client.bench.plot import plot
from plugserve.client.bench.runners import KserveRunner, PlugserveRunner, Runner, tritonclient_grpc
from plugserve.client.bench.server_metrics import device_figures, scrape
from plugserve.client.inputs import make_inputs, spec_dtype

__all__ = ["InprocessFactory", "add_arguments", "bench"]


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
        tc = tritonclient_grpc()
        from tritonclient.utils import InferenceServerException, triton_to_np_dtype

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
    return [(s.name, spec_dtype(s.dtype), list(s.shape)) for s in network.inputs]


def _check_arguments(args: argparse.Namespace) -> None:
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


def _server_runner(client: Any, args: argparse.Namespace) -> tuple[Runner, dict[str, np.ndarray]]:
    inputs = make_inputs(_server_specs(client, args), args.batch, args.input, args.seed)
    if args.protocol == "kserve":
        runner: Runner = KserveRunner(
            args.target, args.model, inputs, args.version, args.timeout,
            token=args.token, tls_ca=args.tls_ca, tls=args.tls,
        )  # fmt: skip
    else:
        runner = PlugserveRunner(
            args.target, args.model, inputs, args.version, args.timeout, client=client
        )
    return runner, inputs


#: Makes the runner of ``--inprocess`` from the parsed arguments and the concurrency: given by
#: whoever can load models (``plugserve.server.bench_inprocess.runner``); the client package
#: itself needs only the protocol.
InprocessFactory = Callable[[argparse.Namespace, int], tuple[Runner, dict[str, np.ndarray]]]


def bench(client: Any, args: argparse.Namespace, inprocess: InprocessFactory | None = None) -> int:
    """The ``plugserve bench`` verb (``client`` is unused with ``--inprocess``)."""
    _check_arguments(args)
    duration = args.time if args.time is not None or args.iterations is not None else 10.0
    before: dict[str, dict[str, float]] | None = None
    url = metrics_note = ""
    report: dict[str, Any] = {"model": args.model, "mode": args.mode, "batch": args.batch}
    if args.inprocess:
        concurrency = args.nireq or args.concurrency
        if inprocess is None:
            raise SystemExit(
                "plugserve bench: --inprocess loads the model in this process, which takes "
                "plugserve's server package: run it as `plugserve bench --inprocess ...`"
            )
        runner, inputs = inprocess(args, concurrency)
        report.update(target="inprocess", device=args.device, protocol="inprocess")
    else:
        concurrency = args.concurrency
        runner, inputs = _server_runner(client, args)
        report.update(target=args.target, device="", protocol=args.protocol)
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
