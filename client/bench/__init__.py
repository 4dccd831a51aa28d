"""``plugserve bench``: throughput and latency of a network, like benchmark_app / perf_analyzer.

Against a running server (``--target``, ``--protocol plugserve|kserve``) or in-process
(``--inprocess --device D MODEL.onnx``)::

    plugserve bench mlp --time 10 --mode async --concurrency 8
    plugserve bench --inprocess --device ORT model.onnx --iterations 200 --batch 8 --json r.json

``--mode sync`` runs ``--concurrency`` (``--nireq`` in-process) callers, each waiting for its
answer before sending the next request; ``--mode async`` keeps that many requests in flight
through the asynchronous API (gRPC futures, ``start_async``), completions driving new requests.

One module a job: ``runners`` (how a request is sent), ``measure`` (driving a runner, the
summary), ``server_metrics`` (what the server counted, from its ``/metrics``), ``plot`` and
``verb`` (arguments, the run, the report). The measuring core is a library too: the benchmark
suite in ``tests/benchmarks`` drives it directly. The client package needs only the generated
protocol code: the in-process runner (:mod:`plugserve.server.process.bench_inprocess`) is handed to
:func:`bench` by the ``plugserve`` command, which is the server package's.
"""

from plugserve.client.bench.measure import BenchResult, measure, summarize
from plugserve.client.bench.runners import Done, KserveRunner, PlugserveRunner, Runner
from plugserve.client.bench.server_metrics import scrape
from plugserve.client.bench.verb import InprocessFactory, add_arguments, bench

__all__ = [
    "BenchResult",
    "Done",
    "InprocessFactory",
    "KserveRunner",
    "PlugserveRunner",
    "Runner",
    "add_arguments",
    "bench",
    "measure",
    "scrape",
    "summarize",
]
