"""``plugserve serve``: the long-running server.

One gRPC port serves plugserve.v1, KServe v2 (``inference.GRPCInferenceService``), health and
reflection; KServe v2 over HTTP/REST has its own port (``server/protocols/kserve/rest.py``, same
data plane and
model control, auth, TLS and limits); Prometheus scrapes ``/metrics`` on its own port. The
gRPC server is grpcio's thread-pool server, chosen by measurement: a 602 KB echo takes 1.1 ms
on it and 2.0 ms on grpc.aio here (64 B: 0.6 ms on both), and inference itself runs on the
device executors, so handler threads only wait on futures. Its threads come from a
:class:`CallPool` (``server/plane/callpool.py``): a few run calls at once, so they do not fight over
the GIL, and more start only while calls wait. ``maximum_concurrent_rpcs`` bounds what is
admitted.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from plugserve.plugins import reading
from plugserve.plugins.api import PlugserveError
from plugserve.plugins.threads import start_daemon
from plugserve.plugins.version import plugserve_version
from plugserve.proto import plugserve_pb2, tensors
from plugserve.server.apps.generate import limits as generate_limits
from plugserve.server.apps.generate.engine.kvevents import Publisher
from plugserve.server.apps.generate.network import GenerativeNetwork
from plugserve.server.apps.pipelines.ensemble import EnsemblePlugin
from plugserve.server.apps.pipelines.python.device import PythonPlugin
from plugserve.server.control.allocator import freeze_heap, reuse_freed_memory
from plugserve.server.control.core import ConfigLimits, Core
from plugserve.server.control.examples import build_examples, default_examples_dir
from plugserve.server.control.model_control import ModelControl
from plugserve.server.control.on_demand import OnDemand
from plugserve.server.control.repository import Repository, single_model_repository
from plugserve.server.plane import children
from plugserve.server.plane.budget import default_limit
from plugserve.server.plane.callpool import CallPool
from plugserve.server.plane.dataplane import DataPlane
from plugserve.server.plane.metrics import Metrics
from plugserve.server.plane.shm import SharedMemory
from plugserve.server.plane.tracing import Tracing
from plugserve.server.process.rest_faces import build_rest
from plugserve.server.process.security import security_problems, server_credentials
from plugserve.server.process.settings import Settings
from plugserve.server.process.tracing import Exporter, TraceConfig, TracingUnavailable
from plugserve.server.protocols.auth import (
    AuthInterceptor,
    guard_settings,
    load_tokens,
    local_control,
)
from plugserve.server.protocols.grpc import reflection
from plugserve.server.protocols.grpc.callgate import CallGate, keepalive_options
from plugserve.server.protocols.grpc.handlers import add_service
from plugserve.server.protocols.grpc.tenant_calls import TenantCalls
from plugserve.server.protocols.grpc.wrapping import Wrap, WrappingServer
from plugserve.server.protocols.http import json_bounds
from plugserve.server.protocols.http.app import HttpService
from plugserve.server.protocols.openai import OpenAIRoutes
from plugserve.server.protocols.v1.servicer import PlugserveServicer

__all__ = ["NotServable", "Server", "main"]

log = logging.getLogger("plugserve")


_PLUGIN_KEYS = ("config", "extensions")


def load_plugins_file(path: str) -> dict[str, Any]:
    """The ``--plugins`` file: which plugins to load, their config and extensions (JSON).

    ``{"plugins": {"NUMPY": {"config": {"NUM_STREAMS": "2"}, "extensions": ["pkg.mod:ext"]}}}``
    Like OpenVINO's plugins.xml: only the devices named are used. The shape is checked here
    (an unknown key is an error, not ignored); device names and config keys are checked
    against the devices when they are configured.
    """
    where = f"plugserve: --plugins {path}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{where}: {exc}") from None
    plugins = data.get("plugins") if isinstance(data, dict) else None
    if not isinstance(plugins, dict) or set(data) != {"plugins"}:
        raise SystemExit(f'{where}: expected {{"plugins": {{NAME: {{...}}}}}} and nothing else')
    for name, entry in plugins.items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise SystemExit(f"{where}: plugin {name!r}: expected an object")
        unknown = sorted(set(entry) - set(_PLUGIN_KEYS))
        if unknown:
            raise SystemExit(
                f"{where}: plugin {name!r}: unknown key(s) {unknown}; "
                f"expected {', '.join(_PLUGIN_KEYS)}"
            )
        if not isinstance(entry.get("config", {}), dict):
            raise SystemExit(f"{where}: plugin {name!r}: 'config' must be an object of key: value")
        extensions = entry.get("extensions", [])
        if not isinstance(extensions, list) or not all(
            isinstance(e, str) and e.count(":") == 1 and all(e.split(":")) for e in extensions
        ):
            raise SystemExit(
                f"{where}: plugin {name!r}: 'extensions' must be a list of \"module:attribute\""
            )
    return plugins


class ReadinessHealth(health.HealthServicer):
    """grpc.health.v1 as Triton's gRPC health answers: ``Check`` says SERVING only while the
    server is ready, asked at each call (a load or an unload changes it:
    ``ModelControl.unready``); ``Watch`` streams the statuses set (started, shutting down)."""

    def __init__(self, unready: Callable[[], list[str]]) -> None:
        super().__init__()
        self._unready = unready

    def Check(self, request: Any, context: Any) -> Any:
        response = super().Check(request, context)
        if response.status == health_pb2.HealthCheckResponse.SERVING and self._unready():
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return response


class NotServable(RuntimeError):
    """A model the server was asked to serve cannot be, and --exit-on-error says to stop."""


class Server:
    #: freeze the start's heap at ready (allocator.freeze_heap): ``plugserve serve``'s own
    #: process sets it; a server embedded in an application leaves that heap alone
    freeze_heap = False

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics(plugserve_version())
        tensors.set_max_string_elements(settings.max_string_elements)
        # Triton's python backend is a device of the server's (its models run in processes
        # of their own: server/apps/pipelines/python)
        self.core = Core(plugins={"PYTHON": PythonPlugin, "ENSEMBLE": EnsemblePlugin})
        self.plugin_settings = load_plugins_file(settings.plugins) if settings.plugins else None
        self._configure_plugins()
        # after the operator's --plugins file: the caps bound what clients ask for
        self.core.limits = ConfigLimits.of(
            settings.max_num_streams, settings.max_batch_size, settings.max_inference_threads
        )
        self.kv_events = self._kv_events(settings)  # --kv-events-config; None: off
        self.core.format_settings["transformers"] = settings.generate_defaults(self.kv_events)
        root = settings.model_repository or str(build_examples(default_examples_dir()))
        if settings.exit_on_error and not Path(root).exists():
            raise SystemExit(
                f"plugserve: --model-repository {root}: no such file or folder "
                "(--exit-on-error 0 starts without it)"
            )
        #: a folder this server made (--model-name over a single file), removed when it stops
        self._scratch: Path | None = None
        if settings.model_name:
            try:
                served = single_model_repository(root, settings.model_name)
            except PlugserveError as exc:
                raise SystemExit(f"plugserve: --model-name {settings.model_name}: {exc}") from None
            if served != Path(root):
                self._scratch = served
            root = str(served)
        self.repository = Repository(root)
        self.plane = DataPlane(
            self.metrics,
            settings.max_request_seconds,
            default_limit() if settings.max_inflight_bytes < 0 else settings.max_inflight_bytes,
            settings.max_message_bytes,
        )
        reading.set_limits(  # what one read of a model may compute (plugins/reading.py)
            reading.ReadLimits(
                settings.read_bytes(self.plane.budget.limit),
                settings.max_read_seconds,
                settings.max_model_nodes,
            )
        )
        self.plane.shm = SharedMemory(
            settings.shared_memory == "system", settings.shared_memory_prefix, self.plane.budget
        )
        #: the OpenTelemetry exporter, made when a trace setting first turns tracing on
        self.exporter: Exporter | None = None
        self.plane.tracing = self._tracing(settings.trace())
        json_bounds.configure(settings.max_json_values, settings.max_json_depth)
        generate_limits.configure(  # what a generation request may make the server do
            self.plane.budget,
            settings.max_prompt_bytes,
            settings.max_stream_unread_bytes,
            settings.request_read_timeout,
        )
        for device in ("ENSEMBLE", "PYTHON"):  # ensembles' steps and BLS calls run through it
            if device in self.core.available_devices:
                self.core.plugin(device).plane = self.plane
        self.control = ModelControl(
            self.plane,
            self.core,
            self.metrics,
            self.repository,
            settings.default_device,
            settings.queue_size,
            settings.max_networks,
            settings.max_model_bytes,
            settings.load_threads(),
            settings.max_sequences,
            settings.model_unload_timeout,
            allow_code_from_clients=bool(settings.allow_code_from_clients),
            max_queries=max(1, settings.grpc_workers // 4),  # as the gate's reading calls
        )
        if settings.allow_code_from_clients:
            log.warning(
                "--allow-code-from-clients 1: PyTorch programs and Python models that clients "
                "send are loaded, and loading one runs its code with this server's rights"
            )
        self.metrics.watch_generation(self._generation_stats)
        if "PYTHON" in self.core.available_devices:  # its models' load_model calls
            self.core.plugin("PYTHON").control = self.control
        self.health = ReadinessHealth(self.control.unready)
        self.grpc_server: grpc.Server | None = None
        self.grpc_port = 0
        self.health_server: grpc.Server | None = None
        self.health_port = 0
        self.metrics_port = 0
        self.rest: HttpService | None = None
        self.openai: OpenAIRoutes | None = None
        self.http_port = 0
        self._stopped = threading.Event()  # stop() began
        self._hurry = threading.Event()  # a second signal: stop waiting for admitted requests
        self._done = threading.Event()  # stop() finished
        self.abandoned = 0  # requests and loads still running when stop() gave up on them
        #: --model-load-on-demand's loader and idle timer (started by load_models)
        self.on_demand: OnDemand | None = None

    def _front(self) -> dict[str, int]:
        """The ports' counts for /metrics (``metrics._FRONT``), read at a scrape."""
        counts = {"grpc_streams": self.gate.open_streams, "grpc_threads": self.calls.threads}
        server = self.rest.server if self.rest is not None else None
        if server is not None:
            counts["http_open"], counts["http_serving"] = server.counts()
            counts["http_limit"] = server.limit
        return counts

    def _kv_events(self, settings: Settings) -> Publisher | None:
        """The publisher --kv-events-config asks for, its sockets open (a taken port stops the
        start), its counts in /metrics; None when off."""
        config = settings.kv_events()
        if not config.enabled:
            return None
        try:
            publisher = Publisher(config)
        except PlugserveError as exc:
            raise SystemExit(f"plugserve: --kv-events-config: {exc}") from None
        except ImportError as exc:
            raise SystemExit(
                f"plugserve: --kv-events-config needs {exc.name}: pip install 'plugserve[generate]'"
            ) from None
        self.metrics.watch_kv_events(publisher.counts)
        log.info(
            "KV events on %s (replay %s, topic %r)",
            config.endpoint, config.replay_endpoint or "off", config.topic,
        )  # fmt: skip
        return publisher

    def _tracing(self, config: TraceConfig) -> Tracing:
        """The trace settings --trace-config starts with. Asking for traces without the
        OpenTelemetry packages is logged with the install line, and the server serves
        untraced (a trace-setting request that turns tracing on is refused with the same)."""

        def open_sink() -> Exporter:
            if self.exporter is None:
                self.exporter = Exporter(config)
            return self.exporter

        level = config.level
        while True:
            try:
                return Tracing(
                    level,
                    config.rate,
                    config.count,
                    open_sink=open_sink,
                    options=config.options(),
                    known=self.plane.table_has,
                )
            except TracingUnavailable as exc:
                log.error("--trace-config asks for traces: %s; nothing is traced", exc)
                level = 0

    def _generation_stats(self) -> list[tuple[str, str, str, Any]]:
        """Each loaded generative model's engine statistics, for /metrics."""
        with self.plane.table.lock:
            entries = [
                e for versions in self.plane.table.by_name.values() for e in versions.values()
            ]
        return [
            (e.device, e.name, str(e.version), e.network.engine.stats().snapshot())
            for e in entries
            if isinstance(e.network, GenerativeNetwork)
        ]

    def _configure_plugins(self) -> None:
        if self.plugin_settings is None:
            return
        where = f"plugserve: --plugins {self.settings.plugins}"
        known = {info.name for info in self.core.devices()}
        listed = {k.upper(): v or {} for k, v in self.plugin_settings.items()}
        unknown = sorted(set(listed) - known)
        if unknown:
            raise SystemExit(
                f"{where}: unknown device(s) {', '.join(unknown)}; "
                f"known devices: {', '.join(sorted(known)) or 'none'}"
            )
        unlisted = [name for name in self.core.available_devices if name not in listed]
        for name in known - set(listed):  # unavailable ones too: the file says what is used
            self.core.disable(name)
        if unlisted:  # models on them will not load: say so before they fail
            log.warning(
                "devices not listed in --plugins are not used: %s (list them to keep them)",
                ", ".join(unlisted),
            )
        for name, entry in listed.items():
            if name not in self.core.available_devices:
                log.warning("device %s from --plugins is unavailable", name)
                continue
            if entry.get("config"):
                try:
                    self.core.set_config({k: str(v) for k, v in entry["config"].items()}, name)
                except PlugserveError as exc:
                    raise SystemExit(f"{where}: device {name}: {exc}") from None
                log.info("device %s: config %s", name, entry["config"])
            for ref in entry.get("extensions", []):
                module, _, attr = ref.partition(":")
                try:
                    extension = getattr(importlib.import_module(module), attr)
                except Exception as exc:  # ImportError, AttributeError, or the module's own
                    raise SystemExit(
                        f"{where}: device {name}: extension {ref!r} cannot be loaded: "
                        f"{type(exc).__name__}: {exc}"
                    ) from None
                try:
                    for item in extension if isinstance(extension, list) else [extension]:
                        self.core.add_extension(item, name)
                except PlugserveError as exc:
                    raise SystemExit(f"{where}: device {name}: extension {ref!r}: {exc}") from None
                log.info("device %s: extension %s added", name, ref)

    def start(self) -> None:
        """Start the ports (gRPC, health, metrics, REST), then load the repository: the
        server answers health (not serving) while it loads, and is ready once it has."""
        s = self.settings
        if reuse_freed_memory(s.malloc_reuse_bytes):
            log.debug("malloc: freed blocks up to %d bytes are reused", s.malloc_reuse_bytes)
        for info in self.core.devices():  # one line each: the Core warned of unavailable ones
            if info.available:
                log.info("device %s loaded: %s", info.name, info.full_name)
        problems = security_problems(s)
        if problems:
            raise SystemExit(f"plugserve: invalid settings: {'; '.join(problems)}")
        credentials = server_credentials(s)
        self.control.starting = True  # until the repository is loaded (load_models)
        auth = self._start_grpc(credentials)
        if s.health_port >= 0:
            self._serve_health(s.host, s.health_port)
        if s.metrics_port >= 0:
            self.metrics.watch_gpus(s.metrics_interval_ms / 1000, bool(s.gpu_metrics))
            self.metrics.watch_front(self._front)
            try:
                self.metrics_port = self.metrics.serve(s.host, s.metrics_port)
            except SystemExit:  # the port is taken: one line, and nothing left running
                self._stop_grpc(0)
                raise
        if s.http_port >= 0:
            self._start_rest(auth)
        host = f"[{s.host}]" if ":" in s.host else s.host  # (an IPv6 address, as URLs write it)
        rest = f", HTTP {'https' if credentials else 'http'}://{host}:{self.http_port}"
        log.info(
            "listening: gRPC %s:%d, metrics http://%s:%d/metrics%s",
            host,
            self.grpc_port,
            host,
            self.metrics_port,
            rest if self.rest else "",
        )
        self.plane.ports = {
            "grpc": self.grpc_port,
            "http": self.http_port if self.rest else -1,
            "metrics": self.metrics_port if s.metrics_port >= 0 else -1,
            "health": self.health_port if s.health_port >= 0 else -1,
        }
        try:
            self.load_models()
        except NotServable as exc:
            self._stop_grpc(0)
            self.plane.close()
            self.control.close()
            raise SystemExit(f"plugserve: {exc}") from None

    def _start_grpc(self, credentials: grpc.ServerCredentials | None) -> AuthInterceptor | None:
        """The gRPC port with its call gate, auth and services; the auth interceptor (None
        without tokens), which the REST port shares."""
        s = self.settings
        self.gate = CallGate(
            s.max_open_streams or max(1, s.grpc_workers // 2),
            max(1, s.grpc_workers // 4),
            s.request_read_timeout,
            s.stream_idle_timeout,
        )
        wraps: list[Wrap] = [self.gate.wrap]
        interceptors: list[grpc.ServerInterceptor] = []
        auth = self._auth(credentials, wraps)
        if auth is not None:
            interceptors.append(auth)
        options = [
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_receive_message_length", s.max_message_bytes),
            # grpcio shares a port with any process listening on it unless told not to: a
            # second server would silently take some of the first one's connections
            ("grpc.so_reuseport", s.reuse_grpc_port),
        ]
        options += keepalive_options(s.stream_idle_timeout)
        if s.max_streams_per_connection:
            options.append(("grpc.max_concurrent_streams", s.max_streams_per_connection))
        self.calls = CallPool(s.grpc_workers, s.active_grpc_workers())
        server = grpc.server(
            self.calls,
            interceptors=interceptors,
            options=options,
            maximum_concurrent_rpcs=4 * s.grpc_workers,
        )
        # the gate and the local-control check wrap each handler here, once, not per call
        registrar = cast(grpc.Server, WrappingServer(server, wraps))
        plugserve = plugserve_pb2.DESCRIPTOR.services_by_name["Plugserve"]
        tenant_of = auth.tenant if auth is not None else None
        v1 = PlugserveServicer(self.plane, self.control, tenant_of)
        services = [add_service(registrar, plugserve, v1)]
        services += self._add_kserve(registrar, tenant_of)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)
        services.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable(services, registrar)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_port = _bind(server, s.host, s.grpc_port, "--grpc-port", credentials)
        if credentials is not None:
            log.info("TLS on%s", " with client certificates (mTLS)" if s.tls_client_ca else "")
        server.start()
        self.grpc_server = server
        return auth

    def _auth(
        self, credentials: grpc.ServerCredentials | None, wraps: list[Wrap]
    ) -> AuthInterceptor | None:
        """Token auth from --auth-tokens, or (without tokens) model control from this machine
        only unless --allow-remote-control: added to ``wraps``."""
        s = self.settings
        if s.auth_tokens:
            tokens = load_tokens(s.auth_tokens)
            overlap = self.plane.shm.overlapping(tokens.names())
            if overlap:
                raise SystemExit(f"plugserve: {overlap}")
            log.info(
                "token auth on: %d token(s); health %s, reflection %s",
                len(tokens),
                "open" if s.open_health else "needs a token",
                "open" if s.open_reflection else "needs a token",
            )
            if credentials is None:
                log.warning("token auth without TLS: tokens cross the network in plaintext")
            calls = TenantCalls(s.grpc_token_calls, s.grpc_workers, self.gate.max_streams)
            auth = AuthInterceptor(
                tokens, bool(s.open_health), bool(s.open_reflection), calls=calls
            )
            wraps.append(guard_settings(auth, local=False))
            return auth
        if not s.allow_remote_control:
            wraps += [local_control, guard_settings(None, local=True)]
            log.info("no tokens: model control is taken from this machine only")
        else:
            log.warning(
                "no tokens and --allow-remote-control 1: any client that reaches the ports "
                "may load models and set device config"
            )
        return None

    def _start_rest(self, auth: AuthInterceptor | None) -> None:
        """KServe v2 over HTTP, with the OpenAI routes on the same port."""
        s = self.settings
        faces = build_rest(self.plane, self.control, s, auth)
        self.openai = faces.openai  # closed by stop
        self.rest = HttpService(faces.router, s)
        self.http_port = self.rest.start()

    def load_models(self) -> None:
        """The repository's models (--model-control-mode, --load-model), then ready; under
        Triton's --exit-on-error a model that cannot be served is :class:`NotServable` (the
        server exits; a Ray Serve replica fails its start)."""
        s = self.settings
        self.control.control_mode = s.model_control_mode
        names = None
        if s.model_control_mode == "explicit":
            names = {n.strip() for n in s.load_model.split(",") if n.strip()}
            if "*" in names:
                names = None
        self.control.strict_readiness = bool(s.strict_readiness)
        if s.model_load_on_demand:  # listed now, loaded by their first request
            self.on_demand = OnDemand(
                self.control,
                self.metrics,
                s.models_max,
                s.model_idle_unload_seconds,
                s.model_load_wait_seconds,
                s.model_min_loaded_seconds,
            )
            self.on_demand.start()
            names = names or set()  # (explicit mode's --load-model still load at startup)
        try:
            ready, problems = self.control.load_repository(names)
        finally:
            self.control.starting = False
        for problem in problems:
            log.error("model repository: %s", problem)
        # what failed, and the ensembles whose steps it leaves without a model (Triton's
        # --exit-on-error: the bundled examples too, so a --plugins file that leaves out a
        # device they need is an error, not a server serving part of them)
        unready = self.control.failures()
        if unready and s.exit_on_error:
            raise NotServable(
                f"{len(unready)} model(s) cannot be served at startup: "
                f"{'; '.join(unready)} (each logged above); --exit-on-error 0 serves the models "
                "that loaded, not ready"
            )
        for entry in ready:
            log.info("model %s version %d is ready on %s", entry.name, entry.version, entry.device)
        if self.freeze_heap:
            freeze_heap()
        self.plane.ready = True
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if s.model_control_mode == "poll" and self.repository is not None:
            start_daemon("repository-poll", self._poll)
        root = self.repository.root
        if unready and s.strict_readiness:
            log.warning(
                "server not ready: %d model version(s) from %s; %d cannot be served "
                "(--strict-readiness 0 reports ready regardless): %s",
                len(ready),
                root,
                len(unready),
                "; ".join(unready),
            )
        else:
            log.info("server ready: %d model version(s) from %s", len(ready), root)

    def _poll(self) -> None:
        """--model-control-mode poll: the repository's changes, every --repository-poll-secs."""
        while not self._stopped.wait(self.settings.repository_poll_secs):
            try:
                self.control.poll_repository()
            except Exception:  # a bad look at the repository must not end polling
                log.exception("repository poll failed; trying again")

    def _serve_health(self, host: str, port: int) -> None:
        """The health service alone on a plaintext port: the same statuses as on the main port
        (it reveals nothing else), for probes that cannot present TLS or a token."""
        # 4 threads: one Watch stream, two calls waiting for their message, one answering
        self.health_gate = CallGate(1, 2, self.settings.request_read_timeout, 60.0, "health")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health"),
            options=keepalive_options(60.0),
            maximum_concurrent_rpcs=16,
        )
        registrar = cast(grpc.Server, WrappingServer(server, [self.health_gate.wrap]))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)
        self.health_port = _bind(server, host, port, "--health-port")
        server.start()
        self.health_server = server
        log.info("health (plaintext, health service only): %s:%d", host, self.health_port)

    def _add_kserve(self, server: grpc.Server, tenant_of: Any = None) -> list[str]:
        try:
            from plugserve.server.protocols.kserve.grpc_service import add_kserve_service
        except ImportError:
            return []
        return add_kserve_service(self.plane, self.control, server, tenant_of)

    def _set_health(self, status: int) -> None:
        self.health.set("", status)
        self.health.set("plugserve.v1.Plugserve", status)
        self.health.set("inference.GRPCInferenceService", status)

    def stop(self, grace: float | None = None) -> None:
        """Drain, then stop: health NOT_SERVING and new requests and loads UNAVAILABLE at once;
        admitted and queued requests (and loads under way) run to the end for up to ``grace``
        seconds (``--exit-timeout``); then the gRPC server stops, the executors close, and every
        process the server started ends (``plane/children.py``: asked, then killed past
        ``children.STOP_SECONDS``, hung or not)."""
        if self._stopped.is_set():
            self._hurry.set()  # a second signal: stop waiting for admitted requests
            return
        self._stopped.set()
        timeout = self.settings.exit_timeout if grace is None else grace
        end = time.monotonic() + timeout
        self.health.enter_graceful_shutdown()  # NOT_SERVING for good, even if start() goes on
        self.plane.drain()
        left = self.abandoned = self.plane.wait_idle(timeout, self._hurry)
        if left:
            log.warning(
                "shutdown: %d admitted request(s) or load(s) still running after %.1f s; "
                "their runs and calls are cancelled",
                left,
                time.monotonic() - end + timeout,
            )
            self.plane.cancel_all("the server is shutting down (--exit-timeout passed)")
        else:
            log.info("shutdown: every admitted request finished")
        # responses of finished requests may still be on their way: a short grace for them
        self._stop_grpc(0 if left else max(1.0, end - time.monotonic()))
        if self.on_demand is not None:
            self.on_demand.close()
        self.plane.close()
        self.control.close()
        children.stop_all()
        if self.openai is not None:  # a job stuck on its workers would hold the exit
            self.abandoned += self.openai.close()
        self.plane.tracing.close()
        if self.exporter is not None:  # the last requests' traces leave, or are given up
            self.exporter.close()
        self.metrics.close()
        if self.kv_events is not None:  # after the engines (control.close): their last events
            self.kv_events.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._done.set()

    def _stop_grpc(self, grace: float) -> None:
        if self.rest is not None:
            self.rest.stop(grace)
        stopping = []
        for server in (self.grpc_server, self.health_server):
            if server is None:
                continue
            try:  # a stop with a grace period starts a thread to end it
                stopping.append(server.stop(grace))
            except RuntimeError:  # none can be started (all taken): stop at once instead
                log.warning("shutdown: no thread left for a grace period; stopping now")
                stopping.append(server.stop(None))
        for stopped in stopping:
            stopped.wait()

    def wait(self) -> None:
        """Block until :meth:`stop` has finished (signals still reach their handlers)."""
        while not self._done.wait(0.5):
            pass


def _bind(
    server: grpc.Server,
    host: str,
    port: int,
    flag: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Listen on ``host:port``, or exit with one line saying which flag's port is taken."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # (--host ::)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:
        bound = 0
    if not bound:
        raise SystemExit(
            f"plugserve: cannot listen on {address} ({flag}): the port is in use or the "
            "address is not this machine's"
        )
    return bound


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log collectors that parse fields rather than text."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(settings: Settings) -> None:
    """Logs go to stdout, where container runtimes collect them (docs/operations.md)."""
    handler = logging.StreamHandler(sys.stdout)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)


def main(argv: list[str]) -> int:
    settings = Settings.from_argv(argv)
    configure_logging(settings)
    server = Server(settings)
    server.freeze_heap = True

    signalled = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        # No thread is started here: with every thread slot taken (a flood of streams), a
        # handler that needs one could not shut the server down. The shutdown thread waits
        # from the start; a second signal only tells a stop under way to hurry.
        if signalled.is_set():
            log.warning(
                "signal %s again: not waiting any longer for admitted requests",
                signal.Signals(signum).name,
            )
            server._hurry.set()
            return
        log.info(
            "signal %s: shutting down (up to %.0f s for admitted requests)",
            signal.Signals(signum).name,
            settings.exit_timeout,
        )
        signalled.set()

    def shutdown() -> None:
        signalled.wait()
        server.stop()
        if server.abandoned:
            # Threads stuck in a device (or in startup loading) cannot be interrupted and would
            # keep the interpreter from exiting: their calls are already cancelled, so go now.
            log.warning("stopped, abandoning %d stuck request(s) or load(s)", server.abandoned)
            logging.shutdown()
            os._exit(0)

    start_daemon("shutdown", shutdown)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # SIGUSR2: every thread's Python stack to stderr, the server running on (a load or a
    # request that never ends shows where it waits; the test harness asks when a server does
    # not become ready). faulthandler writes from the signal handler: it needs no free thread.
    # A handler someone installed first (a sitecustomize, an embedding program) is left alone.
    if signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL:
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    server.start()
    if server._stopped.is_set():
        server._stop_grpc(0)  # a signal during startup may have come before the port was up
    server.wait()
    log.info("stopped")
    return 0
