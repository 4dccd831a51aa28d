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

from plugserve.client.bench.generation import (
    GenerationRunner,
    measure_level,
    parse_counts,
    prompt_text,
    summarize_level,
)
from plugserve.client.bench.measure import measure, summarize
from plugserve.client.bench.plot import plot, plot_generation
from plugserve.client.bench.runners import KserveRunner, PlugserveRunner, Runner, tritonclient_grpc
from plugserve.client.bench.server_metrics import device_figures, scrape
from plugserve.client.inputs import make_inputs, spec_dtype

__all__ = ["InprocessFactory", "add_arguments", "bench"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("model", help="a served network's name, or with --inprocess an .onnx file")
    add(
        "--protocol",
        choices=("plugserve", "kserve", "openai"),
        default="plugserve",
        help="openai: a generative model's tokens/s, TTFT and ITL over the server's /v1 API",
    )
    add("--inprocess", action="store_true", help="load MODEL.onnx here instead of a server")
    add("--device", default="NUMPY", help="with --inprocess: the device (NUMPY, ORT, BATCH:ORT...)")
    add("--config", action="append", default=[], metavar="KEY=VALUE", help="with --inprocess")
    add("--version", type=int, default=0)
    add("--mode", choices=("sync", "async"), default="sync")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--time", type=float, default=None, help="seconds to run (default 10)")
    limit.add_argument("--iterations", type=int, default=None, help="requests to complete")
    add(
        "--concurrency",
        default="1",
        help="callers (sync) or requests in flight (async); with --protocol openai, streams "
        "in flight at each of several levels (1,4,8)",
    )
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
    generation = parser.add_argument_group("--protocol openai")
    generation.add_argument(
        "--url",
        default="",
        help="the server's OpenAI API base, http://HOST:PORT/v1 (default: the REST port the "
        "server reports, on --target's host)",
    )
    generation.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    generation.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    generation.add_argument(
        "--prompt-words", type=int, default=64, help="words in each synthetic prompt"
    )
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
    counts = parse_counts(args.concurrency)
    if args.protocol != "openai":
        if len(counts) > 1:
            raise SystemExit(
                "plugserve bench: several --concurrency levels are for --protocol openai; give one"
            )
        args.concurrency = counts[0]
    if args.batch < 1:
        raise SystemExit("plugserve bench: --batch must be >= 1")
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
#: whoever can load models (``plugserve.server.process.bench_inprocess.runner``); the client package
#: itself needs only the protocol.
InprocessFactory = Callable[[argparse.Namespace, int], tuple[Runner, dict[str, np.ndarray]]]


def bench(client: Any, args: argparse.Namespace, inprocess: InprocessFactory | None = None) -> int:
    """The ``plugserve bench`` verb (``client`` is unused with ``--inprocess``)."""
    _check_arguments(args)
    if args.protocol == "openai":
        return bench_generation(client, args)
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


def _openai_url(args: argparse.Namespace, client: Any) -> str:
    """--url, else the REST port the server says it serves (plugserve.v1 GetMetric
    SERVER_PORTS) on --target's host; 8000 (Triton's) when it cannot say."""
    if args.url:
        return args.url
    target = args.target.split("///")[-1]
    host = target.rsplit(":", 1)[0] if ":" in target else target
    port = 8000
    with contextlib.suppress(Exception):
        port = int(client.get_metric("", "SERVER_PORTS")["http"])
    if port < 0:
        raise SystemExit("plugserve bench: the server serves no REST port (--http-port -1)")
    return f"{'https' if args.tls or args.tls_ca else 'http'}://{host or '127.0.0.1'}:{port}/v1"


def bench_generation(client: Any, args: argparse.Namespace) -> int:
    """``--protocol openai``: each --concurrency level in turn (see ``generation.py``)."""
    if args.max_tokens < 1 or args.prompt_words < 1:
        raise SystemExit("plugserve bench: --max-tokens and --prompt-words must be >= 1")
    levels = parse_counts(args.concurrency)
    url = _openai_url(args, client)
    runner = GenerationRunner(
        url,
        args.model,
        prompt_text(args.prompt_words, args.seed),
        args.max_tokens,
        args.endpoint,
        token=args.token,
        timeout=args.timeout,
    )
    report: dict[str, Any] = {
        "model": args.model,
        "protocol": "openai",
        "target": url,
        "endpoint": args.endpoint,
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "levels": [],
    }
    try:
        for _ in range(args.warmup):
            warm = runner.run()
            if warm.error:
                print(f"plugserve bench: {url}: {warm.error}", file=sys.stderr)
                return 1
        for level in levels:
            requests = args.iterations
            duration = None if requests is not None else (args.time or 10.0)
            timings, wall = measure_level(runner, level, requests, duration)
            report["levels"].append(summarize_level(level, timings, wall))
    finally:
        runner.close()
    _print_generation(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"report -> {args.json}", file=sys.stderr)
    if args.plot:
        print(plot_generation(report, args.plot), file=sys.stderr)
    failed = sum(level["errors"] for level in report["levels"])
    if failed or not any(level["requests"] for level in report["levels"]):
        first = next((lv["first_error"] for lv in report["levels"] if lv["first_error"]), "")
        print(f"plugserve bench: {failed} requests failed ({first})", file=sys.stderr)
        return 1
    return 0


def _print_generation(report: Mapping[str, Any]) -> None:
    print(
        f"{report['model']} at {report['target']} ({report['endpoint']}), "
        f"{report['max_tokens']} tokens per request, prompts of {report['prompt_words']} words"
    )
    print(
        f"{'streams':>7} {'requests':>8} {'tok/s':>9} {'req/s':>7} "
        f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} {'p99':>7} (ms)"
    )
    for lv in report["levels"]:
        ttft, itl = lv["ttft_ms"], lv["itl_ms"]
        print(
            f"{lv['concurrency']:>7} {lv['requests']:>8} {lv['output_tokens_per_s']:>9.1f} "
            f"{lv['requests_per_s']:>7.2f} {ttft['p50']:>9.1f} {ttft['p90']:>8.1f} "
            f"{ttft['p99']:>8.1f} {itl['p50']:>8.2f} {itl['p90']:>7.2f} {itl['p99']:>7.2f}"
            + (f"  ({lv['errors']} failed: {lv['first_error']})" if lv["errors"] else "")
        )
