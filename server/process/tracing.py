"""``--trace-config``, as Triton's, and the OpenTelemetry exporter it sets up: OTLP over HTTP.

The flag, repeated, takes Triton's ``<setting>=<value>`` and ``<mode>,<setting>=<value>``
(``docs/user_guide/trace.md``): ``level=OFF|TIMESTAMPS|TENSORS`` (several levels combine;
default OFF: nothing is traced), ``rate=N`` (1 in N requests; default 1000; 0: only requests
carrying a ``traceparent``), ``count=N`` (traces to take; -1, the default: no end),
``mode=opentelemetry`` (the only mode here: Triton's own JSON file, ``mode=triton``, is not
written), and for the exporter ``opentelemetry,url=HOST:PORT/v1/traces`` (the collector's
OTLP/HTTP endpoint; default ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``http://localhost:4318/v1/traces``), ``opentelemetry,resource=KEY=VALUE`` (repeatable; resource
attributes beside ``OTEL_RESOURCE_ATTRIBUTES``; ``service.name`` is ``plugserve`` unless one of
them names it) and the batch span processor's ``bsp_max_queue_size`` (2048),
``bsp_schedule_delay`` (5000 ms) and ``bsp_max_export_batch_size`` (512), whose defaults come
from ``OTEL_BSP_*`` as Triton's do. Level, rate and count change at run time through the
trace-setting routes (``server/plane/tracing.py``); the exporter's options do not, as in Triton.

The exporter is the OpenTelemetry SDK's (the optional extra ``trace``:
``pip install 'plugserve[trace]'``), made the first time a setting turns tracing on, so a
server that never traces imports none of it. A request hands its finished trace to the SDK's
``BatchSpanProcessor`` in one call, which appends to a queue of at most
``bsp_max_queue_size`` traces (the oldest is dropped when full, with a warning) and never
blocks; the processor's own thread turns each trace's records into OpenTelemetry spans
(``plugins/tracing.py`` says why the request path records instead of using the SDK's spans) and
sends them, ``bsp_max_export_batch_size`` traces a request, every ``bsp_schedule_delay`` ms or
as soon as that many wait. A collector that is down or slow costs that thread its retries (at
most ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``, 10 s, a batch) and the traces the queue cannot
hold, never a request. At shutdown, what is queued gets :data:`SHUTDOWN_SECONDS` to leave.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from plugserve.plugins.api import PlugserveError
from plugserve.plugins.tracing import Trace
from plugserve.plugins.version import plugserve_version
from plugserve.server.plane.tracing import LEVELS

__all__ = ["INSTALL", "SHUTDOWN_SECONDS", "Exporter", "TraceConfig", "TracingUnavailable"]

log = logging.getLogger("plugserve.tracing")

INSTALL = "pip install 'plugserve[trace]'"
#: Longest a stopping server waits for queued traces to reach the collector.
SHUTDOWN_SECONDS = 5.0
_MODES = ("opentelemetry", "triton")
_BSP = {
    "bsp_max_queue_size": ("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
    "bsp_schedule_delay": ("OTEL_BSP_SCHEDULE_DELAY", 5000),
    "bsp_max_export_batch_size": ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
}


class TracingUnavailable(PlugserveError):
    """Tracing was asked for, and the OpenTelemetry packages are not installed."""

    code = "UNAVAILABLE"


def _bad(option: str, why: str) -> ValueError:
    return ValueError(f"--trace-config {option}: {why}")


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    """What ``--trace-config`` said (the startup settings and the exporter's options)."""

    level: int = 0
    rate: int = 1000
    count: int = -1
    url: str = ""
    resource: tuple[tuple[str, str], ...] = ()
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay: int = 5000
    bsp_max_export_batch_size: int = 512

    @classmethod
    def parse(cls, text: str, environ: Mapping[str, str] | None = None) -> TraceConfig:
        """The flag's values as the settings object holds them: the repeated flag's values
        joined by commas, so a mode name stands before the one setting it is for. Raises
        ValueError naming the option that is wrong."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        levels: list[int] = []
        resource: list[tuple[str, str]] = []
        for name, (variable, default) in _BSP.items():
            raw = environ.get(variable, "")
            values[name] = _number(variable, raw, 1) if raw.strip() else default
        mode = ""
        for token in (t.strip() for t in text.split(",")):
            if not token:
                continue
            if "=" not in token:
                if token.lower() not in _MODES or mode:
                    raise _bad(
                        token,
                        "expected <setting>=<value> or <mode>,<setting>=<value> "
                        f"(modes: {', '.join(_MODES)})",
                    )
                mode = token.lower()
                continue
            key, _, value = token.partition("=")
            key, option = key.strip(), f"{mode + ',' if mode else ''}{token}"
            if not value:
                raise _bad(option, "the value is empty")
            if mode == "triton":
                raise _bad(
                    option,
                    "plugserve does not write Triton's JSON trace file; it exports "
                    "OpenTelemetry spans (--trace-config mode=opentelemetry)",
                )
            if mode == "opentelemetry":
                if key == "url":
                    values["url"] = value
                elif key == "resource":
                    attribute, equals, attribute_value = value.partition("=")
                    if not equals or not attribute:
                        raise _bad(option, "expected resource=KEY=VALUE")
                    resource.append((attribute, attribute_value))
                elif key in _BSP:
                    values[key] = _number(option, value, 1)
                else:
                    raise _bad(
                        option,
                        f"unknown opentelemetry setting {key!r}; known: url, resource, "
                        + ", ".join(_BSP),
                    )
            elif key == "level":
                levels.append(_level(option, value))
            elif key == "rate":
                values["rate"] = _number(option, value, 0, 2**32 - 1)
            elif key == "count":
                values["count"] = _number(option, value, -1, 2**31 - 1)
            elif key == "mode":
                if value.lower() != "opentelemetry":
                    raise _bad(
                        option,
                        "plugserve exports OpenTelemetry spans only (mode=opentelemetry); "
                        "Triton's JSON trace file (mode=triton) is not written",
                    )
            else:
                raise _bad(option, f"unknown setting {key!r}; known: level, rate, count, mode")
            mode = ""
        if mode:
            raise _bad(mode, "a mode names the setting after it: opentelemetry,url=...")
        # as Triton: OFF anywhere wins; otherwise the levels given combine
        level = 0 if 0 in levels else sum(set(levels))
        if values["bsp_max_export_batch_size"] > values["bsp_max_queue_size"]:
            raise _bad(
                "bsp_max_export_batch_size",
                f"{values['bsp_max_export_batch_size']} is over bsp_max_queue_size "
                f"{values['bsp_max_queue_size']}",
            )
        return cls(level=level, resource=tuple(resource), **values)

    def options(self) -> dict[str, list[str]]:
        """The exporter's options as the trace-setting routes answer them (Triton's keys)."""
        found: dict[str, list[str]] = {}
        if self.url:
            found["url"] = [self.url]
        if self.resource:
            found["resource"] = [f"{k}={v}" for k, v in self.resource]
        for name in _BSP:
            found[name] = [str(getattr(self, name))]
        return found

    def endpoint(self) -> str | None:
        """The collector's URL (None: the SDK's default, from ``OTEL_EXPORTER_OTLP_*``)."""
        if not self.url:
            return None
        return self.url if "://" in self.url else f"http://{self.url}"


def _level(option: str, value: str) -> int:
    word = value.strip().upper()
    if word in ("OFF", "FALSE"):
        return 0
    if word in LEVELS:
        return LEVELS[word]
    raise _bad(option, "the level is OFF, TIMESTAMPS or TENSORS")


def _number(option: str, value: str, low: int, high: int = 2**31 - 1) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise _bad(option, f"{value!r} is not an integer") from None
    if not low <= number <= high:
        raise _bad(option, f"{number} is not between {low} and {high}")
    return number


class Exporter:
    """The OpenTelemetry side: the SDK's batch span processor, OTLP's protobuf messages and
    the OTLP/HTTP exporter's client.

    Calling it with a finished :class:`Trace` queues it (never blocks); :meth:`close` sends
    what is queued, for at most :data:`SHUTDOWN_SECONDS`. Making one without the extra raises
    :class:`TracingUnavailable` naming the install line.

    Traces are encoded here, straight from the records into OTLP's ``ExportTraceServiceRequest``
    (``opentelemetry-proto``'s own messages), not through the SDK's spans and encoder: those
    cost ~125 us a span on this machine (``encode_spans`` builds each message from Python
    keyword arguments and hashes the resource as JSON per span), four times a whole tiny
    request's time for its four spans, on a thread that takes the GIL from requests. The
    payload goes out through the OTLP/HTTP exporter's client, so its environment variables
    (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``,
    certificates) and retries apply; an exporter without that client (another version) is
    sent to with one plain POST instead."""

    def __init__(self, config: TraceConfig) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanContext, TraceFlags
        except ImportError as exc:
            raise TracingUnavailable(
                f"tracing needs the OpenTelemetry SDK and its OTLP/HTTP exporter, which are "
                f"not installed ({exc.name or exc}): {INSTALL}"
            ) from None
        resource = Resource.create(dict(config.resource))
        named = dict(config.resource).get("service.name")
        if named is None and str(resource.attributes.get("service.name", "")).startswith(
            "unknown_service"
        ):
            resource = resource.merge(Resource({"service.name": "plugserve"}))
        otlp = OTLPSpanExporter(endpoint=config.endpoint())
        self._processor = BatchSpanProcessor(
            _Sender(otlp, _Encoder(dict(resource.attributes))),
            max_queue_size=config.bsp_max_queue_size,
            schedule_delay_millis=config.bsp_schedule_delay,
            max_export_batch_size=config.bsp_max_export_batch_size,
        )
        # the processor queues what says it is sampled: one constant context says so for all
        _Finished.context = SpanContext(1, 1, False, TraceFlags(TraceFlags.SAMPLED))
        self._queue = self._processor.on_end
        log.info(
            "tracing: OTLP/HTTP to %s, up to %d traces queued",
            config.endpoint() or "the OTEL_EXPORTER_OTLP_* endpoint (default localhost:4318)",
            config.bsp_max_queue_size,
        )

    def __call__(self, trace: Trace) -> None:
        self._queue(_Finished(trace))

    def close(self) -> None:
        """Send what is queued, waiting at most :data:`SHUTDOWN_SECONDS` (the processor's
        thread is a daemon: what it has not sent by then is lost with the process)."""
        done = threading.Thread(target=self._processor.shutdown, name="trace-flush", daemon=True)
        done.start()
        done.join(SHUTDOWN_SECONDS)
        if done.is_alive():
            log.warning("tracing: the collector did not take the last traces in time")


class _Finished:
    """A finished trace as the batch span processor queues it (it only reads ``context``)."""

    __slots__ = ("trace",)
    context: Any = None

    def __init__(self, trace: Trace) -> None:
        self.trace = trace


#: The attributes naming a stage's model and request, found on the model's span and given at
#: export to the spans under it that do not name their own (the request path records them
#: once); the model's three are encoded once per model (:meth:`_Encoder._identity`).
IDENTITY = ("triton.model_name", "triton.model_version", "plugserve.device", "triton.request_id")
_MODEL = IDENTITY[:3]


class _Encoder:
    """Finished traces as one OTLP ``ExportTraceServiceRequest`` (its serialized bytes)."""

    def __init__(self, resource: Mapping[str, Any]) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, Span

        self._request = ExportTraceServiceRequest
        self._span = Span
        #: the identity attributes' encoding (a span's field 9, KeyValues), by their values:
        #: a model's spans share them, so they are encoded once, not per span
        self._identities: dict[tuple, bytes] = {}
        head = ResourceSpans()
        for key, value in resource.items():
            _attribute(head.resource.attributes.add(), key, value)
        scope = head.scope_spans.add().scope
        scope.name, scope.version = "plugserve", plugserve_version()
        self._head = head.SerializeToString()

    def __call__(self, traces: Sequence[Trace]) -> bytes:
        request = self._request()
        resource_spans = request.resource_spans.add()
        resource_spans.MergeFromString(self._head)
        spans = resource_spans.scope_spans[0].spans
        for trace in traces:
            try:
                self._encode_trace(spans, trace)
            except Exception:  # one bad trace must not lose the batch
                log.exception("tracing: a trace could not be encoded; it is dropped")
            # its spans point at it and it at them: let go of them now, not at the next
            # collection of reference cycles
            trace.spans = []
        return request.SerializeToString()

    def _encode_trace(self, spans: Any, trace: Trace) -> None:
        trace_id = trace.ids_of_trace().to_bytes(16, "big")
        identities: dict[int, dict[str, Any]] = {}
        for span in list(trace.spans):
            own = span.attributes or {}
            parent = span.parent
            # what the spans above say, but what this one says itself (a HETERO piece's device)
            identity = {} if parent is None else identities.get(id(parent), {})
            named = [k for k in IDENTITY if k in own]
            if named:
                identity = {**identity, **{k: own[k] for k in named}}
            identities[id(span)] = identity
            message = spans.add(
                trace_id=trace_id,
                span_id=span.ids().to_bytes(8, "big"),
                name=span.name,
                kind=2 if parent is None else 1,  # SERVER for the request, INTERNAL within it
                start_time_unix_nano=span.start_ns,
                end_time_unix_nano=span.end_ns or trace.end_ns,
            )
            if parent is not None:
                message.parent_span_id = parent.ids().to_bytes(8, "big")
                message.flags = 0x101  # sampled; the parent is not remote
            elif trace.parent_span_id:
                message.parent_span_id = trace.parent_span_id.to_bytes(8, "big")
                message.flags = 0x301  # sampled; the parent is the client's (remote)
            else:
                message.flags = 0x101
            cached = "triton.model_version" in identity  # a model's: encoded once
            if cached:
                message.MergeFromString(self._identity(identity))
            attributes = message.attributes
            for key, value in identity.items():
                if not cached or key not in _MODEL:
                    _attribute(attributes.add(), key, value)
            for key, value in own.items():
                if key not in identity:
                    _attribute(attributes.add(), key, value)
            for name, at, extra in span.events or ():
                event = message.events.add(name=name, time_unix_nano=at)
                for key, value in (extra or {}).items():
                    _attribute(event.attributes.add(), key, value)
            if span.error is not None:  # OpenTelemetry's exception event, as record_exception
                kind, _, text = span.error.partition(": ")
                event = message.events.add(
                    name="exception", time_unix_nano=span.end_ns or trace.end_ns
                )
                _attribute(event.attributes.add(), "exception.type", kind)
                _attribute(event.attributes.add(), "exception.message", text)
                message.status.code = 2  # STATUS_CODE_ERROR
                message.status.message = span.error

    def _identity(self, identity: dict[str, Any]) -> bytes:
        """The model's name, version and device as a span's encoded attributes."""
        key = tuple(identity.get(name) for name in _MODEL)
        encoded = self._identities.get(key)
        if encoded is None:
            span = self._span()
            for name, value in zip(_MODEL, key):
                if value is not None:
                    _attribute(span.attributes.add(), name, value)
            encoded = span.SerializeToString()
            if len(self._identities) >= 1024:  # bounded: the models seen
                self._identities.clear()
            self._identities[key] = encoded
        return encoded


def _attribute(pair: Any, key: str, value: Any) -> None:
    """One OTLP ``KeyValue`` (str, bool, int, float, or a list of one of them)."""
    pair.key = key
    _value(pair.value, value)


def _value(target: Any, value: Any) -> None:
    if isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, list | tuple):
        values = target.array_value.values
        for item in value:
            _value(values.add(), item)
    else:
        target.string_value = str(value)


class _Sender:
    """The processor's exporter: a batch of traces encoded once and sent. Runs on the
    processor's thread."""

    def __init__(self, otlp: Any, encode: _Encoder) -> None:
        self._otlp = otlp
        self._encode = encode
        client = getattr(otlp, "_client", None)
        self._client = client if callable(getattr(client, "export", None)) else None
        #: the collector's URL, for the plain POST of an exporter without its client
        self._url = getattr(otlp, "_endpoint", "") or "http://localhost:4318/v1/traces"
        self._failures = 0

    def export(self, finished: Sequence[_Finished]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        payload = self._encode([item.trace for item in finished])
        sent = self._client.export(payload).success if self._client else self._post(payload)
        if sent:
            self._failures = 0
            return SpanExportResult.SUCCESS
        self._failures += 1
        if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
            log.warning(
                "tracing: %d batch(es) of traces in a row could not be sent to the collector; "
                "they are dropped (requests are not affected)",
                self._failures,
            )
        return SpanExportResult.FAILURE

    def _post(self, payload: bytes) -> bool:
        import urllib.request

        request = urllib.request.Request(
            self._url, payload, {"Content-Type": "application/x-protobuf"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return 200 <= answer.status < 300
        except OSError:
            return False

    def shutdown(self) -> None:
        self._otlp.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
