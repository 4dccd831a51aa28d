"""Prometheus metrics: per device and model, named ``plugserve_*`` with units in the name.

Request counts and latency histograms are plain numbers a request updates under one lock as it
finishes (:class:`_Series`), turned into Prometheus families only when /metrics is scraped:
prometheus_client's Counter and two Histogram observes took three locks and ~15 Python calls
per request, a tenth of a small request's server time. Gauges that describe the present (queue
depth, busy streams) are read from the executors at scrape time, so they are never stale and
cost nothing per request. The same readings, summed over the server into one unlabelled
series each (:class:`_ServerCollector`), are what a router in front of many servers reads.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gzip
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from plugserve.plugins.errors import Cancelled, DeadlineExceeded, InvalidInput
from plugserve.server.plane.custom_metrics import CustomMetrics
from plugserve.server.plane.gpu_metrics import GpuMetrics
from plugserve.server.plane.metrics_http import serve_wsgi
from plugserve.server.plane.vllm_metrics import VllmCollector, cumulative

__all__ = ["Metrics", "Recorder", "Stats", "failure_status"]

_FAILURES = {DeadlineExceeded: "deadline", Cancelled: "cancelled", InvalidInput: "invalid"}


def failure_status(error: BaseException) -> str:
    """The ``status`` label of a request that failed with ``error`` after its admission."""
    return _FAILURES.get(type(error), "error")


_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_BOUNDS = (*_LATENCY_BUCKETS, float("inf"))
_LE = [floatToGoString(b) for b in _BOUNDS]
_LABELS = ["device", "model", "version"]


class _Series:
    """One network's request counts by status and its two latency histograms (per-bucket
    counts, not cumulative, and sums), as Prometheus would hold them for its labels; updated
    under ``lock`` by its :class:`Recorder` (a reload on the same device shares it, so its
    series go on counting, as the labels of a Prometheus metric would)."""

    __slots__ = ("compute", "compute_sum", "created", "lock", "queue", "queue_sum", "statuses")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.created = time.time()
        #: status -> [count, when its series appeared]; success from the start, as before
        self.statuses: dict[str, list[float]] = {"success": [0, self.created]}
        self.queue = [0] * len(_BOUNDS)
        self.compute = [0] * len(_BOUNDS)
        self.queue_sum = 0.0
        self.compute_sum = 0.0

    def count(self, status: str, requests: int = 1) -> None:
        """``requests`` more under ``status`` (call with the lock held)."""
        counted = self.statuses.get(status)
        if counted is None:
            self.statuses[status] = [requests, time.time()]
        else:
            counted[0] += requests


class _RequestCollector:
    """``plugserve_inference_requests`` and the queue-wait and compute histograms, from the
    series at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self):
        requests = CounterMetricFamily(
            "plugserve_inference_requests",
            "Inference requests by outcome",
            labels=[*_LABELS, "status"],
        )
        queue = HistogramMetricFamily(
            "plugserve_queue_wait_seconds", "Time a request waited for a stream", labels=_LABELS
        )
        compute = HistogramMetricFamily(
            "plugserve_compute_seconds", "Time a request ran on a stream", labels=_LABELS
        )
        created = getattr(prometheus_metrics, "_use_created", True)
        for labels, series in self._metrics.series():
            with series.lock:
                statuses = [(k, v[0], v[1]) for k, v in series.statuses.items()]
                histograms = (
                    (queue, list(series.queue), series.queue_sum),
                    (compute, list(series.compute), series.compute_sum),
                )
            for status, value, since in statuses:
                requests.add_metric([*labels, status], value, since if created else None)
            for family, counts, total in histograms:
                cumulative, buckets = 0, []
                for le, n in zip(_LE, counts):
                    cumulative += n
                    buckets.append((le, cumulative))
                family.add_metric(labels, buckets, total)
                if created:
                    named = dict(zip(_LABELS, labels))
                    family.samples.append(Sample(f"{family.name}_created", named, series.created))
        yield from (requests, queue, compute)


class _ExecutorCollector:
    """Gauges read at scrape time: queue depth, busy streams, streams, loaded networks."""

    def __init__(self, read: Callable[[], list[tuple[str, int, int, int, int]]]) -> None:
        self._read = read

    def collect(self):
        depth = GaugeMetricFamily(
            "plugserve_queue_depth", "Requests waiting for a stream", labels=["device"]
        )
        busy = GaugeMetricFamily(
            "plugserve_busy_streams", "Streams running a request", labels=["device"]
        )
        streams = GaugeMetricFamily(
            "plugserve_streams", "Streams of the device's executor", labels=["device"]
        )
        loaded = GaugeMetricFamily(
            "plugserve_loaded_networks", "Networks loaded on the device", labels=["device"]
        )
        for device, pending, running, total, networks in self._read():
            depth.add_metric([device], pending)
            busy.add_metric([device], running)
            streams.add_metric([device], total)
            loaded.add_metric([device], networks)
        yield from (depth, busy, streams, loaded)


class _SequenceCollector:
    """Per sequence model, read at scrape time: its active sequences and the bytes of state
    they hold (Triton's sequence batching)."""

    def __init__(self, read: Callable[[], list[tuple[str, str, str, int, int]]]) -> None:
        self._read = read

    def collect(self):
        labels = ["device", "model", "version"]
        active = GaugeMetricFamily(
            "plugserve_sequences_active", "Sequences started and not yet ended", labels=labels
        )
        held = GaugeMetricFamily(
            "plugserve_sequence_state_bytes", "Bytes of implicit state the sequences hold",
            labels=labels,
        )  # fmt: skip
        for device, model, version, count, nbytes in self._read():
            active.add_metric([device, model, version], count)
            held.add_metric([device, model, version], nbytes)
        yield from (active, held)


class _GraphCollector:
    """Per network whose device replays shapes as CUDA graphs (``plugins/torch/graphs.py``),
    read at scrape time: its shapes captured, replays, evictions and failed captures."""

    def __init__(self, read: Callable[[], list[tuple[str, str, str, dict[str, int]]]]) -> None:
        self._read = read

    def collect(self):
        events = CounterMetricFamily(
            "plugserve_graph_events",
            "CUDA graph events of a network, by event (captured, replayed, evicted, failed)",
            labels=["device", "model", "version", "event"],
        )
        for device, model, version, counts in self._read():
            for event, count in sorted(counts.items()):
                events.add_metric([device, model, version, event], count)
        yield events


class _CudaShmCollector:
    """Inputs and outputs moved through clients' CUDA shared memory regions, by direction
    and path (``server/plane/cuda_shm.py``): ``device`` device to device, ``host`` through a
    host copy. Nothing until a CUDA region has been used."""

    def __init__(self, read: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self):
        counts = self._read()
        if not any(counts.values()):
            return
        copies = CounterMetricFamily(
            "plugserve_cuda_shm_copies",
            "Tensors moved through CUDA shared memory regions, by direction (input, output) "
            "and path (device: device to device; host: through a host copy)",
            labels=["direction", "path"],
        )
        for (direction, path), count in sorted(counts.items()):
            copies.add_metric([direction, path], count)
        yield copies


class _GenerationCollector:
    """Per generative model (``server/apps/generate/``), read at scrape time from its engine's
    statistics: histograms of time to first token, inter-token latency and end-to-end
    latency, counters of prompt (and prompt-from-cache) and generated tokens and of finished
    sequences by reason, gauges of running and waiting requests and of the key/value cache
    (the share of its slots held, and its bytes). vLLM's names, plugserve's prefix."""

    _HISTOGRAMS = (
        ("time_to_first_token", "Seconds from a request's arrival to its first token"),
        ("inter_token_latency", "Seconds between two tokens of a sequence"),
        ("e2e_request_latency", "Seconds from a request's arrival to its end"),
    )
    #: one family per number of the engine's ``stats.Numbers``: its field, the family's kind,
    #: its name after ``plugserve_generate_`` and its help (``finished``, counts by reason, is
    #: labelled ``finish_reason``)
    _NUMBERS = (
        ("prompt_tokens", CounterMetricFamily, "prompt_tokens",
         "Prompt tokens of requests started"),
        ("cached_prompt_tokens", CounterMetricFamily, "prompt_tokens_cached",
         "Prompt tokens whose key/value cache came from the prefix cache"),
        ("generation_tokens", CounterMetricFamily, "generation_tokens", "Tokens generated"),
        ("finished", CounterMetricFamily, "sequences_finished",
         "Sequences ended, by reason (stop, length, abort)"),
        ("running", GaugeMetricFamily, "requests_running", "Sequences holding a cache slot"),
        ("waiting", GaugeMetricFamily, "requests_waiting", "Requests waiting for a cache slot"),
        ("kv_cache_usage", GaugeMetricFamily, "kv_cache_usage_ratio",
         "Share of the key/value cache's slots held by running sequences (0 to 1)"),
        ("kv_cache_bytes", GaugeMetricFamily, "kv_cache_bytes", "Bytes of the key/value cache"),
        ("pipelined_steps", CounterMetricFamily, "pipelined_steps",
         "Decode steps launched before the previous step's tokens reached the host "
         "(async scheduling)"),
        ("warmup_requests", CounterMetricFamily, "warmup_requests",
         "Warm-up requests run before the model was ready (at load and at each wake)"),
        ("warmup_seconds", GaugeMetricFamily, "warmup_seconds", "Seconds the last warm-up took"),
        ("kv_offload_bytes", GaugeMetricFamily, "kv_offload_bytes",
         "Bytes of evicted key/value blocks the host tier keeps (--kv-offloading-size)"),
        ("kv_offload_restored_tokens", CounterMetricFamily, "kv_offload_restored_tokens",
         "Prompt tokens whose key/value cache was restored from the host tier"),
        ("kv_disk_bytes", GaugeMetricFamily, "kv_disk_bytes",
         "Bytes of block files the disk tier keeps (--kv-disk-size)"),
        ("kv_disk_restored_tokens", CounterMetricFamily, "kv_disk_restored_tokens",
         "Prompt tokens whose key/value cache was restored from the disk tier"),
    )  # fmt: skip

    def __init__(self, read: Callable[[], list[tuple[str, str, str, Any]]]) -> None:
        self._read = read

    def collect(self):
        labels = ["device", "model", "version"]
        histograms = {
            name: HistogramMetricFamily(f"plugserve_generate_{name}_seconds", text, labels=labels)
            for name, text in self._HISTOGRAMS
        }
        numbers = {
            field: kind(
                f"plugserve_generate_{name}",
                text,
                labels=[*labels, "finish_reason"] if field == "finished" else labels,
            )
            for field, kind, name, text in self._NUMBERS
        }
        for device, model, version, snap in self._read():
            key = [device, model, version]
            for name, family in histograms.items():
                bounds, counts, total = snap.histograms[name]
                family.add_metric(key, cumulative(bounds, counts), total)
            for field, family in numbers.items():
                value = getattr(snap, field)
                if field == "finished":
                    for reason, count in sorted(value.items()):
                        family.add_metric([*key, reason], count)
                else:
                    family.add_metric(key, value)
        yield from histograms.values()
        yield from numbers.values()


class _KVEventsCollector:
    """The KV-event batches published and dropped from a full queue
    (apps/generate/engine/kvevents.py)."""

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read

    def collect(self):
        published, dropped = self._read()
        yield CounterMetricFamily(
            "plugserve_kv_events_published", "KV-event batches sent (one per engine step with "
            "events)", value=published,
        )  # fmt: skip
        yield CounterMetricFamily(
            "plugserve_kv_events_dropped",
            "KV-event batches dropped unsent because the queue was full (max_queue_size)",
            value=dropped,
        )


class _FrontCollector:
    """The front door, read at scrape time: the REST port's connections (open, serving a
    request, the most it keeps), the gRPC port's open streaming calls and its handler threads.
    A count near its bound precedes refusals (503, RESOURCE_EXHAUSTED); one that never falls
    back with the clients gone would be a leak."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self):
        now = self._read()
        for key, name, text in _FRONT:
            if key in now:
                yield GaugeMetricFamily(name, text, value=now[key])


#: (what ``watch_front``'s read names, the series, its help)
_FRONT = (
    ("http_open", "plugserve_http_connections", "REST connections open"),
    ("http_serving", "plugserve_http_connections_serving",
     "REST connections serving a request now"),
    ("http_limit", "plugserve_http_connections_limit",
     "REST connections the port keeps open at most (4 x --grpc-workers)"),
    ("grpc_streams", "plugserve_grpc_streams_open",
     "Streaming gRPC calls open (at most --max-open-streams)"),
    ("grpc_threads", "plugserve_grpc_threads", "gRPC handler threads (at most --grpc-workers)"),
)  # fmt: skip


class _ServerCollector:
    """The server's load as one unlabelled series per metric: what a router in front of many
    servers reads of each one. The inference gateway's endpoint picker (its model server
    protocol: queued requests, running requests, KV-cache utilization, and the cache's block
    size and blocks) takes the first series of a family that matches its selector and never
    sums, so the per-device and per-model gauges above would give it one model's share;
    these add them up, read at scrape time from the same executors and engines:

    - ``plugserve_num_requests_waiting``: requests queued for a device's stream, plus
      generation requests not yet holding a cache slot (counted from their arrival);
    - ``plugserve_num_requests_running``: streams running a request, plus sequences holding
      a cache slot (vLLM's ``num_requests_running`` counts these too);
    - ``plugserve_kv_cache_usage_ratio``: the share of every generative model's cache held by
      running sequences, weighted by bytes, in [0, 1] (0 without a generative model);
    - ``plugserve_cache_config_info{block_size, num_blocks}``: vLLM's ``cache_config_info``:
      the prefix cache's block size in tokens and the blocks all the caches hold (a slot holds
      ``max_model_len`` tokens: slots x max_model_len / block_size); models with different
      block sizes are counted in the smallest; absent while no generative model is loaded.

    deploy/gateway's engine profile names these; tests/deploy/test_gateway_contract.py reads
    them as the picker does."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self):
        waiting = running = 0
        held = total = 0.0
        caches: list[tuple[int, int]] = []
        for _device, pending, busy, _streams, _networks in self._metrics.executor_gauges():
            waiting += pending
            running += busy
        for _device, _model, _version, snap in self._metrics.generation_stats():
            waiting += snap.waiting
            running += snap.running
            held += snap.kv_cache_usage * snap.kv_cache_bytes
            total += snap.kv_cache_bytes
            if snap.block_size > 0:
                caches.append((snap.block_size, snap.kv_cache_blocks))
        yield GaugeMetricFamily(
            "plugserve_num_requests_waiting",
            "Requests waiting in this server: for a device's stream, or for a cache slot",
            value=waiting,
        )
        yield GaugeMetricFamily(
            "plugserve_num_requests_running",
            "Requests running in this server: on a device's stream, or holding a cache slot",
            value=running,
        )
        yield GaugeMetricFamily(
            "plugserve_kv_cache_usage_ratio",
            "Share of the server's key/value caches held by running sequences (0 to 1)",
            value=min(1.0, held / total) if total else 0.0,
        )
        info = GaugeMetricFamily(
            "plugserve_cache_config_info",
            "The key/value caches: prefix-cache block size (tokens) and blocks in all",
            labels=["block_size", "num_blocks"],
        )
        if caches:
            size = min(b for b, _n in caches)
            blocks = sum(n * b // size for b, n in caches)
            info.add_metric([str(size), str(blocks)], 1)
        yield info


class _BudgetCollector:
    """The memory budget every request in flight is charged to (``--max-inflight-bytes``,
    ``budget.py``): what is held now, the limit, and the charges refused. A held figure that
    stays near the limit precedes refusals; one that never returns to what the idle server
    holds (the Responses store, the KV host tier) would be a leak."""

    def __init__(self, read: Callable[[], tuple[int, int, int]]) -> None:
        self._read = read

    def collect(self):
        used, limit, refused = self._read()
        yield GaugeMetricFamily(
            "plugserve_inflight_bytes",
            "Bytes of --max-inflight-bytes held by requests in flight (and what the Responses "
            "store and the KV host tier keep)",
            value=used,
        )
        yield GaugeMetricFamily(
            "plugserve_inflight_bytes_limit", "--max-inflight-bytes (0: no limit)", value=limit
        )
        yield CounterMetricFamily(
            "plugserve_inflight_refused",
            "Charges --max-inflight-bytes had no room for: a request refused (RESOURCE_EXHAUSTED), "
            "or a KV tier keeping less",
            value=refused,
        )


class Metrics:
    def __init__(self, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = _LABELS
        #: (device, model, version) -> its request counts and histograms
        self._series: dict[tuple[str, str, str], _Series] = {}
        self._series_lock = threading.Lock()
        self.registry.register(_RequestCollector(self))
        self.layer_seconds = Counter(
            "plugserve_layer_seconds",
            "Per-layer compute time by op type (PERF_COUNT=YES)",
            [*labels, "op_type"],
            registry=self.registry,
        )
        self.build = Gauge(
            "plugserve_build_info",
            "plugserve build information",
            ["version", "python", "platform"],
            registry=self.registry,
        )
        self.build.labels(version, platform.python_version(), sys.platform).set(1)
        self.networks = Gauge(
            "plugserve_model_info",
            "A loaded network: its device and the precision it computes float32 values in",
            [*labels, "precision"],
            registry=self.registry,
        )
        self._precisions: dict[tuple[str, str, str], str] = {}
        self._op_types: dict[tuple[str, str, str], set[str]] = {}
        #: the families models declare (a Python model's pb_utils.MetricFamily)
        self.custom = CustomMetrics()
        self._server = None
        self.gpus: GpuMetrics | None = None
        self._executors: Callable[[], list[tuple[str, int, int, int, int]]] = list
        self._generation: Callable[[], list[tuple[str, str, str, Any]]] = list
        self.registry.register(_ServerCollector(self))

    def executor_gauges(self) -> list[tuple[str, int, int, int, int]]:
        """``(device, queued, running, streams, networks)`` of each device, now."""
        return self._executors()

    def generation_stats(self) -> list[tuple[str, str, str, Any]]:
        """``(device, model, version, stats snapshot)`` of each generative model, now."""
        return self._generation()

    def watch_executors(self, read: Callable[[], list[tuple[str, int, int, int, int]]]) -> None:
        self._executors = read
        self.registry.register(_ExecutorCollector(read))

    def watch_sequences(self, read: Callable[[], list[tuple[str, str, str, int, int]]]) -> None:
        self.registry.register(_SequenceCollector(read))

    def watch_graphs(self, read: Callable[[], list[tuple[str, str, str, dict[str, int]]]]) -> None:
        """``read()``: ``(device, model, version, {event: count})`` of each graph-replaying
        network."""
        self.registry.register(_GraphCollector(read))

    def watch_cuda_shm(self, read: Callable[[], dict[tuple[str, str], int]]) -> None:
        """``read()``: ``{(direction, path): count}`` of the CUDA shared memory copies."""
        self.registry.register(_CudaShmCollector(read))

    def watch_generation(self, read: Callable[[], list[tuple[str, str, str, Any]]]) -> None:
        """``read()``: ``(device, model, version, stats snapshot)`` of each generative model:
        our families and vLLM's names for the same numbers (``vllm_metrics.py``)."""
        self._generation = read
        self.registry.register(_GenerationCollector(read))
        self.registry.register(VllmCollector(read))

    def watch_budget(self, read: Callable[[], tuple[int, int, int]]) -> None:
        """``read()``: ``(used, limit, refused)`` of the memory budget (--max-inflight-bytes)."""
        self.registry.register(_BudgetCollector(read))

    def watch_kv_events(self, read: Callable[[], tuple[int, int]]) -> None:
        """``read()``: ``(published, dropped)`` KV-event batches (``--kv-events-config``)."""
        self.registry.register(_KVEventsCollector(read))

    def watch_front(self, read: Callable[[], dict[str, int]]) -> None:
        """``read()``: the front door's counts now, by the names in :data:`_FRONT` (a port
        that is off leaves its names out)."""
        self.registry.register(_FrontCollector(read))

    def watch_gpus(self, interval_s: float, enabled: bool = True) -> GpuMetrics:
        """The per-GPU series (``nv_gpu_*``, NVML sampled every ``interval_s``), or none and
        one log line saying why (``gpu_metrics.py``)."""
        self.gpus = GpuMetrics(interval_s, enabled)
        self.registry.register(self.gpus)
        return self.gpus

    def _series_of(self, device: str, model: str, version: str) -> _Series:
        with self._series_lock:
            series = self._series.get((device, model, version))
            if series is None:
                series = self._series[device, model, version] = _Series()
            return series

    def series(self) -> list[tuple[tuple[str, str, str], _Series]]:
        with self._series_lock:
            return list(self._series.items())

    def recorder(self, device: str, model: str, version: int, precision: str) -> Recorder:
        """The bookkeeping of one loaded network (see :class:`Recorder`); its info series
        says the precision it runs in (bf16 on OPENVINO by default on CPUs with it)."""
        v = str(version)
        self._precisions[device, model, v] = precision
        self.networks.labels(device, model, v, precision).set(1)
        return Recorder(self, device, model, version, self._series_of(device, model, v))

    def observe_layers(self, device: str, model: str, version: int, counts: Iterable[Any]) -> None:
        """Add one run's per-node times (``PerfCount``s) to the per-op-type counters."""
        v = str(version)
        seen = self._op_types.setdefault((device, model, v), set())
        for count in counts:
            seen.add(count.op_type)
            self.layer_seconds.labels(device, model, v, count.op_type).inc(count.real_time_s)

    def forget(self, device: str, model: str, version: int) -> None:
        """Drop an unloaded network's series so dashboards do not show ghosts."""
        v = str(version)
        precision = self._precisions.pop((device, model, v), None)
        if precision is not None:
            with contextlib.suppress(KeyError):
                self.networks.remove(device, model, v, precision)
        for op_type in self._op_types.pop((device, model, v), ()):
            with contextlib.suppress(KeyError):
                self.layer_seconds.remove(device, model, v, op_type)
        with self._series_lock:
            self._series.pop((device, model, v), None)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the port (useful when 0 picks one).

        Only ``/metrics`` answers (404 elsewhere): prometheus_client's own server answers every
        path with the metrics, so an HTTP client probing ``/v2/health/ready`` here would see
        200 and take the metrics port for a ready KServe endpoint."""
        scrape = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/metrics":
                if self.custom.names():
                    return self._scrape_with_custom(environ, start_response)
                return scrape(environ, start_response)
            body = b"not found: this port serves Prometheus metrics on /metrics only\n"
            start_response(
                "404 Not Found",
                [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))],
            )
            return [body]

        try:  # bounded: the port takes no token (server/plane/metrics_http.py)
            server = serve_wsgi(host, port, app)
        except OSError as exc:
            raise SystemExit(
                f"plugserve: cannot listen on {host}:{port} (--metrics-port): {exc.strerror}"
            ) from None
        self._server = server
        return server.server_port

    def _scrape_with_custom(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        """The scrape when models declared metrics: the server's families, then theirs, in
        the format asked for (see server/plane/custom_metrics.py for why theirs are written there);
        ``name[]`` chooses families as prometheus_client's own scrape does."""
        query = parse_qs(environ.get("QUERY_STRING", ""))
        names = query.get("name[]")
        registry = self.registry.restricted_registry(names) if names else self.registry
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT"))
        if encoder is generate_latest:
            body = generate_latest(registry) + self.custom.text(names)
        else:
            custom = self.custom

            class Both:
                def collect(self) -> Iterable[Any]:
                    yield from registry.collect()
                    for family in custom.collect():
                        if not names or family.name in names:
                            yield family

            body = encoder(Both())
        headers = [("Content-Type", content_type)]
        if "gzip" in environ.get("HTTP_ACCEPT_ENCODING", ""):
            body = gzip.compress(body)
            headers.append(("Content-Encoding", "gzip"))
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [body]

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@dataclasses.dataclass
class Stats:
    """Per-network counters for KServe's statistics extension (nanoseconds, as Triton)."""

    success: int = 0
    failure: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    last_inference_ms: int = 0
    execution_count: int = 0


class Recorder:
    """One network's bookkeeping, made when it is loaded: KServe's :class:`Stats`, the
    Prometheus series and the per-node time totals, one object for all of them so that they
    cannot disagree: they change together under one lock (its series', which a reload on the
    same device shares). Safe to call from every stream and RPC thread."""

    def __init__(
        self, metrics: Metrics, device: str, model: str, version: int, series: _Series
    ) -> None:
        self._metrics = metrics
        self._labels = (device, model, version)
        self._series = series
        self._lock = series.lock
        self._stats = Stats()
        #: node name -> [its last PerfCount, total seconds, runs]
        self._perf: dict[str, list[Any]] = {}

    def success(self, queue_wait: float, compute: float) -> None:
        queue_bucket = bisect.bisect_left(_BOUNDS, queue_wait)
        compute_bucket = bisect.bisect_left(_BOUNDS, compute)
        now_ms = int(time.time() * 1000)
        series = self._series
        with self._lock:
            series.statuses["success"][0] += 1
            series.queue[queue_bucket] += 1
            series.compute[compute_bucket] += 1
            series.queue_sum += queue_wait
            series.compute_sum += compute
            s = self._stats
            s.success += 1
            s.execution_count += 1
            s.queue_ns += int(queue_wait * 1e9)
            s.compute_ns += int(compute * 1e9)
            s.last_inference_ms = now_ms

    def joined(self, requests: int, error: BaseException | None = None) -> None:
        """``requests`` more requests answered by the run :meth:`success` (or, with
        ``error``, :meth:`failure`) counted: a sequence batch of many rows is one execution,
        and Triton's statistics count each row, succeeded or failed."""
        with self._lock:
            if error is None:
                self._series.statuses["success"][0] += requests
                self._stats.success += requests
                return
            self._stats.failure += requests
            self._stats.last_inference_ms = int(time.time() * 1000)
            self._series.count(failure_status(error), requests)

    def failure(self, status: str) -> None:
        """A request that did not succeed: refused at admission (invalid, overloaded) or
        failed after (deadline, cancelled, error). KServe's ``fail`` counts both, as Triton
        counts rejected requests (perf_analyzer reads it)."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            self._stats.failure += 1
            self._stats.last_inference_ms = now_ms
            self._series.count(status)

    def refused(self, status: str) -> None:
        """A request refused before admission (invalid, overloaded, shutting down): a failure
        in KServe's statistics too, as Triton counts rejected requests (perf_analyzer reads
        them), and counted under ``status`` in Prometheus (``""``: not there)."""
        with self._lock:
            self._stats.failure += 1
            if status:
                self._series.count(status)

    def layers(self, counts: list[Any]) -> None:
        """One run's per-node times (``PerfCount``s), into the totals and the metrics."""
        with self._lock:
            for c in counts:
                entry = self._perf.setdefault(c.node_name, [c, 0.0, 0])
                entry[0] = c
                entry[1] += c.real_time_s
                entry[2] += 1
        self._metrics.observe_layers(*self._labels, counts)

    def stats(self) -> Stats:
        """A consistent copy of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def perf_totals(self) -> list[tuple[Any, float, int]]:
        """``(last PerfCount, total seconds, runs)`` per node, so far."""
        with self._lock:
            return [(c, total, runs) for c, total, runs in self._perf.values()]
