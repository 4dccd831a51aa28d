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

import collections
import dataclasses
import logging
import os
import random
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from plugserve.plugins.api import PlugserveError
from plugserve.plugins.threads import start_daemon
from plugserve.plugins.tracing import Trace
from plugserve.plugins.version import plugserve_version
from plugserve.server.plane.tracing import LEVELS, Stage

__all__ = ["INSTALL", "SHUTDOWN_SECONDS", "Exporter", "TraceConfig", "TracingUnavailable"]

log = logging.getLogger("plugserve.tracing")
_bits = random.getrandbits

INSTALL = "pip install 'plugserve[trace]'"
#: Longest a stopping server waits for queued traces to reach the collector.
SHUTDOWN_SECONDS = 5.0
#: traces dropped from a full queue are logged at most this often (one warning, its count)
DROP_WARNING_SECONDS = 5.0
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
    """The OpenTelemetry side: a bounded queue of finished traces, and a thread that encodes
    them as OTLP's ``ExportTraceServiceRequest`` and sends them with the OTLP/HTTP exporter's
    client.

    Calling it with a finished :class:`Trace` queues it (never blocks); :meth:`close` sends
    what is queued, for at most :data:`SHUTDOWN_SECONDS`. Making one without the extra raises
    :class:`TracingUnavailable` naming the install line.

    The SDK's ``BatchSpanProcessor``'s contract, kept by hand because of what the processor
    costs a request. Bounds: at most ``bsp_max_queue_size`` traces wait to be encoded (a full
    queue drops its oldest, counted, and logged when it happens, at most every
    :data:`DROP_WARNING_SECONDS`), and at most
    ``bsp_max_export_batch_size`` encoded ones wait to be sent, which they are as soon as that
    many are, or ``bsp_schedule_delay`` ms after the first of them was queued. The thread
    encodes a trace soon after it comes, :data:`CHUNK` at a time (the request that queues the
    :data:`CHUNK`-th wakes it): a trace held until its batch leaves, ~50 ms at 10,000 requests
    a second, outlives the collector's young generations and brings about collections of the
    whole heap; its bytes do not. Encoding a chunk holds the GIL ~0.5 ms, so a request that
    wants it meanwhile waits at most that, not a whole batch's ~4 ms. (Giving the GIL away
    more often starves the thread instead: every 8 traces, it got it back only at the
    interpreter's 5 ms switch interval, the request thread taking it first at each of its own
    system calls, and dropped 2,658 traces of 11 s at 7,000 REST requests a second; none
    without.)

    Measured on the tiny REST request (~95 us) at rate 1, against the SDK's processor: an
    append where its ``on_end`` asked the kernel for the process id (0.4 us here) and counted
    through its metrics (~2.5 us a request in all); and an encoder writing the protobuf wire
    format itself (:class:`_Encoder`, ~9 us a three-span trace) where the SDK's spans and
    encoder took ~125 us a span and ``opentelemetry-proto``'s messages ~20 us a trace. The
    payload goes out through the OTLP/HTTP exporter's client, so its environment variables
    (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``,
    certificates) and retries apply; an exporter without that client (another version) is
    sent to with one plain POST instead."""

    #: traces queued that wake the thread to encode them
    CHUNK = 64

    def __init__(self, config: TraceConfig) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
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
        self._encoder = _Encoder(dict(resource.attributes))
        self._sender = _Sender(otlp, self._encoder)
        self._queue: collections.deque[Trace] = collections.deque()
        self._most = config.bsp_max_queue_size
        self._batch = config.bsp_max_export_batch_size
        self._chunk = min(self.CHUNK, self._batch)
        self._delay = config.bsp_schedule_delay / 1000
        self._wake = threading.Event()
        self._stopping = False
        #: when a stopping exporter gives up sending (SHUTDOWN_SECONDS after close)
        self._give_up = float("inf")
        #: traces dropped because the queue was full (counted by requests, logged by the thread)
        self.dropped = 0
        self._logged = 0  # of them, those a warning counted
        self._warn_at = 0.0  # when a request's thread may warn of drops again
        self._warn_lock = threading.Lock()
        self._thread = start_daemon("trace-export", self._work)
        log.info(
            "tracing: OTLP/HTTP to %s, up to %d traces queued",
            config.endpoint() or "the OTEL_EXPORTER_OTLP_* endpoint (default localhost:4318)",
            config.bsp_max_queue_size,
        )

    def __call__(self, trace: Trace) -> None:
        """Queue a finished trace (a request's thread: a few appends, never a wait)."""
        queue = self._queue
        if len(queue) >= self._most:
            try:
                queue.popleft().release()
                self.dropped += 1
            except IndexError:  # the thread took them meanwhile
                pass
            else:
                if time.monotonic() >= self._warn_at:
                    self._warn_dropped()
        queue.append(trace)
        if len(queue) >= self._chunk and not self._wake.is_set():
            self._wake.set()

    def _work(self) -> None:
        """The exporter's thread: encode what is queued when a chunk waits or a batch is
        due, send a batch when it is whole or due, until :meth:`close`."""
        queue, encode = self._queue, self._encoder.spans
        pending: list[bytes] = []
        due = float("inf")  # when the pending batch must leave
        while True:
            wait = self._delay if not pending else max(0.0, due - time.monotonic())
            timed_out = not self._wake.wait(wait)
            self._wake.clear()
            stopping = self._stopping
            while queue:
                trace = queue.popleft()
                if not pending:
                    due = time.monotonic() + self._delay
                pending.append(encode(trace))
                if len(pending) >= self._batch:
                    self._send(pending)
                    pending, due = [], float("inf")
            if pending and (timed_out or stopping or time.monotonic() >= due):
                self._send(pending)
                pending, due = [], float("inf")
            if self.dropped != self._logged:
                self._warn_dropped()
            if stopping:
                return

    def _warn_dropped(self) -> None:
        """Log the traces dropped since the last warning, at most once every
        :data:`DROP_WARNING_SECONDS` from the requests' threads: the export thread may be
        blocked in a send to a collector that does not answer (the OTLP client's timeout and
        retries), and a warning left to it came only once that send returned (issue 52)."""
        with self._warn_lock:
            count = self.dropped - self._logged
            if count <= 0:
                return
            self._logged += count
            self._warn_at = time.monotonic() + DROP_WARNING_SECONDS
        log.warning(
            "tracing: %d trace(s) dropped, the queue of %d was full (the collector is "
            "slow or down; --trace-config opentelemetry,bsp_max_queue_size=N)",
            count,
            self._most,
        )

    def _send(self, pieces: list[bytes]) -> None:
        if time.monotonic() < self._give_up:
            try:
                self._sender.send(pieces)
            except Exception:  # the batch is lost; the thread, and tracing, go on
                log.exception("tracing: a batch of traces could not be sent")

    def close(self) -> None:
        """Send what is queued, waiting at most :data:`SHUTDOWN_SECONDS` (the thread is a
        daemon: what it has not sent by then is lost with the process)."""
        self._give_up = time.monotonic() + SHUTDOWN_SECONDS
        self._stopping = True
        self._wake.set()
        self._thread.join(SHUTDOWN_SECONDS)
        if self._thread.is_alive():
            log.warning("tracing: the collector did not take the last traces in time")
        else:
            self._sender.shutdown()


#: The attributes naming a stage's model and request: the spans under a model's span name
#: them as it does, unless they name their own (a HETERO piece's device).
IDENTITY = ("triton.model_name", "triton.model_version", "plugserve.device", "triton.request_id")

# --- the protobuf wire format of the OTLP messages written (opentelemetry/proto/trace/v1)

_pack_q = struct.Struct("<Q").pack
_ids = struct.Struct(">2sQ2sQ").pack  # two ids: a tag each, big-endian as W3C writes them
_times = struct.Struct("<BQBQ").pack  # two fixed64 fields
_pack_i = struct.Struct("<I").pack
_pack_d = struct.Struct("<d").pack
_SERVER, _INTERNAL = b"\x30\x02", b"\x30\x01"  # Span.kind (field 6)
#: Span.flags (field 16, fixed32): sampled, and whether the parent is known to be remote
_LOCAL_PARENT = b"\x85\x01" + _pack_i(0x101)
_REMOTE_PARENT = b"\x85\x01" + _pack_i(0x301)
_ERROR = b"\x18\x02"  # Status.code (field 3) STATUS_CODE_ERROR


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(0x80)]


def _sized(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, its length, its bytes."""
    size = len(payload)
    return tag + (_SMALL[size] if size < 0x80 else _varint(size)) + payload


def _any(value: Any) -> bytes:
    """An ``AnyValue`` (str, bool, int, float, or a list of one of them)."""
    if isinstance(value, str):
        return _sized(b"\x0a", value.encode("utf-8", "replace"))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if isinstance(value, list | tuple):
        return _sized(b"\x2a", b"".join([_sized(b"\x0a", _any(v)) for v in value]))
    return _any(str(value))


def _pair(tag: bytes, key: str, value: Any) -> bytes:
    """One ``KeyValue`` as the field ``tag`` (Span.attributes, Event.attributes, ...)."""
    pair = _sized(b"\x0a", key.encode("utf-8", "replace")) + _sized(b"\x12", _any(value))
    return _sized(tag, pair)


class _Encoder:
    """Finished traces as one OTLP ``ExportTraceServiceRequest`` (its serialized bytes),
    written field by field. What repeats is encoded once and kept (at most :data:`MEMO`
    entries, then the memo starts again): the resource and scope, span names, and attributes
    by their value (a model's name, version and device; a request's counts and sizes, which
    repeat in a steady load). A tiny request's trace of three spans takes ~10 us here."""

    #: encodings kept (names and attributes)
    MEMO = 4096

    def __init__(self, resource: Mapping[str, Any]) -> None:
        #: ResourceSpans.resource (Resource.attributes), ScopeSpans.scope (name, version)
        attributes = [_pair(b"\x0a", key, value) for key, value in resource.items()]
        self._resource = _sized(b"\x0a", b"".join(attributes))
        scope = _sized(b"\x0a", b"plugserve") + _sized(b"\x12", plugserve_version().encode())
        self._scope = _sized(b"\x0a", scope)
        self._memo: dict[Any, bytes] = {}

    def spans(self, trace: Trace) -> bytes:
        """A finished trace's spans, as they stand in a ScopeSpans (its field 2, repeated);
        the trace lets go of them (``Trace.release``)."""
        out: list[bytes] = []
        try:
            self._encode_trace(out, trace)
        except Exception:  # one bad trace must not stop the exporter
            log.exception("tracing: a trace could not be encoded; it is dropped")
            out = []
        trace.release()
        if len(self._memo) > self.MEMO:
            self._memo.clear()
        return b"".join(out)

    def request(self, pieces: Sequence[bytes]) -> bytes:
        """An ``ExportTraceServiceRequest`` of encoded traces (:meth:`spans`)."""
        scope_spans = self._scope + b"".join(pieces)
        resource_spans = self._resource + _sized(b"\x12", scope_spans)
        return _sized(b"\x0a", resource_spans)

    def __call__(self, traces: Sequence[Trace]) -> bytes:
        """The ``ExportTraceServiceRequest`` of ``traces``."""
        return self.request([self.spans(trace) for trace in traces])

    def _attribute(self, key: str, value: Any) -> bytes:
        """A span's attribute (Span.attributes), from the memo when it was seen."""
        memo_key = (key, value, value.__class__)  # True and 1 are one key otherwise
        try:
            return self._memo[memo_key]
        except KeyError:
            self._memo[memo_key] = found = _pair(b"\x4a", key, value)
            return found
        except TypeError:  # a list: not kept
            return _pair(b"\x4a", key, value)

    def _name(self, name: str) -> bytes:
        """A span's name (Span.name)."""
        found = self._memo.get(name)
        if found is None:
            self._memo[name] = found = _sized(b"\x2a", name.encode("utf-8", "replace"))
        return found

    def _model(self, key: tuple[Any, ...]) -> bytes:
        """The model's name, version and device as a span's attributes."""
        found = self._memo.get(key)
        if found is None:
            parts = [self._attribute(k, v) for k, v in zip(IDENTITY, key) if v is not None]
            self._memo[key] = found = b"".join(parts)
        return found

    def _encode_trace(self, out: list[bytes], trace: Trace) -> None:
        attribute = self._attribute
        head = b"\x0a\x10" + trace.ids_of_trace().to_bytes(16, "big")  # Span.trace_id
        end_ns = trace.end_ns
        request = attribute(IDENTITY[3], trace.request_id) if trace.request_id else b""
        #: each span's (model, version, device) and their encoding with the request's id
        identities: dict[int, tuple[tuple[Any, ...], bytes]] = {}
        nobody = ((None, None, None), request)
        for span in list(trace.spans):
            parent = span.parent
            own = span.attributes
            extra: list[bytes] = []
            if parent is None:  # the request's span: what it asked for, and what was found
                entry = getattr(trace.stage, "entry", None)
                key = (
                    trace.model or None,
                    None if entry is None else entry.version,
                    None if entry is None else entry.device,
                )
                if trace.protocol:
                    extra.append(attribute("plugserve.protocol", trace.protocol))
                if trace.request_bytes >= 0:
                    extra.append(attribute("plugserve.request_bytes", trace.request_bytes))
                if trace.response_bytes >= 0:
                    extra.append(attribute("plugserve.response_bytes", trace.response_bytes))
            elif isinstance(span, Stage):
                entry = span.entry
                key = (entry.name, entry.version, entry.device)
                if span.inputs >= 0:
                    extra.append(attribute("plugserve.inputs", span.inputs))
                    extra.append(attribute("plugserve.input_bytes", span.input_bytes))
                if span.outputs >= 0:
                    extra.append(attribute("plugserve.outputs", span.outputs))
                    extra.append(attribute("plugserve.output_bytes", span.output_bytes))
            else:
                key = identities.get(id(parent), nobody)[0]
            if own and any(k in own for k in _MODEL):  # its own (a HETERO piece's device)
                key = tuple(own.get(k, v) for k, v in zip(_MODEL, key))
            identity = self._model(key) + request
            identities[id(span)] = (key, identity)
            if parent is None:
                parent_id = trace.parent_span_id
                flags = _REMOTE_PARENT if parent_id else _LOCAL_PARENT
                kind = _SERVER
            else:
                parent_id, flags, kind = parent.ids(), _LOCAL_PARENT, _INTERNAL
            attributes = [identity, *extra]
            if own:
                attributes += [attribute(k, v) for k, v in own.items() if k not in IDENTITY]
            span_end = span.end_ns or end_ns
            out.append(
                self._span(head, span, parent_id, flags, kind, span_end, attributes, span.error)
            )
            if isinstance(span, Stage) and span.queued:  # its wait, up to its run (or end)
                compute = span.compute
                waited = compute.start_ns if compute is not None else span_end
                error = span.error if compute is None else None
                queue = _Wait(span.start_ns)
                out.append(
                    self._span(
                        head, queue, span.ids(), _LOCAL_PARENT, _INTERNAL, waited, [identity], error
                    )
                )

    def _span(
        self,
        head: bytes,
        span: Any,
        parent_id: int,
        flags: bytes,
        kind: bytes,
        end_ns: int,
        attributes: list[bytes],
        error: str | None,
    ) -> bytes:
        """One ``Span`` as ScopeSpans.spans (field 2)."""
        span_id = span.span_id or span.ids()
        parts = [
            head,
            _ids(b"\x12\x08", span_id, b"\x22\x08", parent_id)  # span_id, parent_span_id
            if parent_id
            else b"\x12\x08" + span_id.to_bytes(8, "big"),
            self._name(span.name),
            kind,
            _times(0x39, span.start_ns, 0x41, end_ns),  # start_, end_time_unix_nano
            *attributes,
        ]
        for name, at, extra in span.events or ():
            event = [b"\x09" + _pack_q(at), _sized(b"\x12", name.encode("utf-8", "replace"))]
            event += [_pair(b"\x1a", k, v) for k, v in (extra or {}).items()]
            parts.append(_sized(b"\x5a", b"".join(event)))
        if error is not None:  # OpenTelemetry's exception event (as record_exception), status
            type_name, _, text = error.partition(": ")
            event = [
                b"\x09" + _pack_q(end_ns),
                b"\x12\x09exception",
                _pair(b"\x1a", "exception.type", type_name),
                _pair(b"\x1a", "exception.message", text),
            ]
            parts.append(_sized(b"\x5a", b"".join(event)))
            message = _sized(b"\x12", error.encode("utf-8", "replace"))
            parts.append(_sized(b"\x7a", message + _ERROR))
        parts.append(flags)
        return _sized(b"\x12", b"".join(parts))


#: the model's three of :data:`IDENTITY`
_MODEL = IDENTITY[:3]


class _Wait:
    """The queue span the exporter writes for a :class:`Stage` that waited."""

    __slots__ = ("events", "name", "span_id", "start_ns")

    def __init__(self, start_ns: int) -> None:
        self.name = "queue"
        self.start_ns = start_ns
        self.events = None
        self.span_id = 0

    def ids(self) -> int:
        return _bits(64) or 1


class _Sender:
    """A batch of traces encoded once and sent (on the exporter's thread)."""

    def __init__(self, otlp: Any, encode: _Encoder) -> None:
        self._otlp = otlp
        self._encode = encode
        client = getattr(otlp, "_client", None)
        self._client = client if callable(getattr(client, "export", None)) else None
        #: the collector's URL, for the plain POST of an exporter without its client
        self._url = getattr(otlp, "_endpoint", "") or "http://localhost:4318/v1/traces"
        self._failures = 0

    def send(self, pieces: Sequence[bytes]) -> bool:
        """Send encoded traces (``_Encoder.spans``) as one request."""
        payload = self._encode.request(pieces)
        try:
            sent = self._client.export(payload).success if self._client else self._post(payload)
        except Exception:  # the client's own failure: the batch is lost, the thread goes on
            log.exception("tracing: sending a batch of traces failed")
            sent = False
        if sent:
            self._failures = 0
            return True
        self._failures += 1
        if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
            log.warning(
                "tracing: %d batch(es) of traces in a row could not be sent to the collector; "
                "they are dropped (requests are not affected)",
                self._failures,
            )
        return False

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
