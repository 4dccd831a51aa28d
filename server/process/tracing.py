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
from plugserve.plugins.tracing import Span, Trace
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
    """The OpenTelemetry side: the SDK's batch span processor over its OTLP/HTTP exporter.

    Calling it with a finished :class:`Trace` queues it (never blocks); :meth:`close` sends
    what is queued, for at most :data:`SHUTDOWN_SECONDS`. Making one without the extra raises
    :class:`TracingUnavailable` naming the install line."""

    def __init__(self, config: TraceConfig) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
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
        converter = _Converter(
            OTLPSpanExporter(endpoint=config.endpoint()),
            resource,
            InstrumentationScope("plugserve", plugserve_version()),
        )
        self._processor = BatchSpanProcessor(
            converter,
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


class _Converter:
    """The processor's exporter: each queued trace becomes OpenTelemetry spans, sent on by the
    OTLP exporter. Runs on the processor's thread."""

    def __init__(self, exporter: Any, resource: Any, scope: Any) -> None:
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self._exporter = exporter
        self._resource = resource
        self._scope = scope
        self._readable, self._event, self._context = ReadableSpan, Event, SpanContext
        self._server, self._internal = SpanKind.SERVER, SpanKind.INTERNAL
        self._ok, self._status, self._error = Status(StatusCode.UNSET), Status, StatusCode.ERROR
        self._sampled = TraceFlags(TraceFlags.SAMPLED)

    def export(self, finished: Sequence[_Finished]) -> Any:
        spans = []
        for item in finished:
            try:
                spans.extend(self._spans(item.trace))
            except Exception:  # one bad trace must not lose the batch
                log.exception("tracing: a trace could not be converted; it is dropped")
        return self._exporter.export(spans)

    def _spans(self, trace: Trace) -> list[Any]:
        trace_id = trace.ids_of_trace()
        context, sampled = self._context, self._sampled
        remote = (
            context(trace_id, trace.parent_span_id, True, sampled) if trace.parent_span_id else None
        )
        made = []
        for span in list(trace.spans):
            parent = span.parent
            parent_context = (
                context(trace_id, parent.ids(), False, sampled) if parent is not None else remote
            )
            made.append(
                self._readable(
                    name=span.name,
                    context=context(trace_id, span.ids(), False, sampled),
                    parent=parent_context,
                    resource=self._resource,
                    attributes=span.attributes,
                    events=self._events(span),
                    kind=self._server if span is trace else self._internal,
                    status=self._ok
                    if span.error is None
                    else self._status(self._error, span.error),
                    start_time=span.start_ns,
                    end_time=span.end_ns or trace.end_ns,
                    instrumentation_scope=self._scope,
                )
            )
        return made

    def _events(self, span: Span) -> list[Any]:
        events = [self._event(name, attributes, at) for name, at, attributes in span.events or ()]
        if span.error is not None:  # OpenTelemetry's exception event, as record_exception
            kind, _, message = span.error.partition(": ")
            events.append(
                self._event(
                    "exception",
                    {"exception.type": kind, "exception.message": message},
                    span.end_ns or span.start_ns,
                )
            )
        return events

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
