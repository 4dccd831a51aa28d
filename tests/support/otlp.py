"""A real OTLP/HTTP trace receiver on 127.0.0.1, built on OpenTelemetry's own protobuf messages.

What a collector (the OpenTelemetry Collector, Jaeger, Tempo) does on ``POST /v1/traces``:
decode an ``ExportTraceServiceRequest`` (``opentelemetry-proto``) and answer an
``ExportTraceServiceResponse``. Tests read what arrived as :class:`Received` spans. Its thread
and port end with :meth:`close` (or the ``with`` block); it keeps at most :data:`MAX_SPANS`.
"""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
import uuid
from typing import Any

import opentelemetry.exporter.otlp.proto.http  # noqa: F401  (the server's exporter: a test of

# traces needs it as much as the receiver's messages; importing this module checks both)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

__all__ = ["MAX_SPANS", "Received", "Receiver", "server_flags", "traceparent"]


def server_flags(url: str, rate: int = 0) -> list[str]:
    """A server's flags to trace to ``url`` at once (a 50 ms export delay): every ``rate``-th
    request, and with rate 0 only those that carry a client's traceparent (each test's trace
    its own)."""
    return [
        *("--trace-config", f"opentelemetry,url={url}"),
        *("--trace-config", "opentelemetry,bsp_schedule_delay=50"),
        *("--trace-config", "level=TIMESTAMPS"),
        *("--trace-config", f"rate={rate}"),
    ]


MAX_SPANS = 100_000


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclasses.dataclass
class Received:
    """One span as the collector received it (ids as lowercase hex, as W3C headers write
    them)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status_code: int
    status_message: str
    resource: dict[str, Any]
    scope: str

    @property
    def failed(self) -> bool:
        return self.status_code == 2  # STATUS_CODE_ERROR


class Receiver:
    """``url`` is what ``--trace-config opentelemetry,url=...`` takes."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.requests = 0
        self._changed = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                message = ExportTraceServiceRequest.FromString(body)
                receiver._take(message)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}/v1/traces"

    def _take(self, message: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in message.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Received(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[
                                (e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in span.events
                            ],
                            status_code=span.status.code,
                            status_message=span.status.message,
                            resource=resource,
                            scope=scope_spans.scope.name,
                        )
                    )
        with self._changed:
            self.requests += 1
            self.spans.extend(spans[: max(0, MAX_SPANS - len(self.spans))])
            self._changed.notify_all()

    def traces(self) -> dict[str, list[Received]]:
        """The spans received so far, by trace id."""
        with self._changed:
            found: dict[str, list[Received]] = {}
            for span in self.spans:
                found.setdefault(span.trace_id, []).append(span)
            return found

    def roots(self) -> list[Received]:
        """The ``InferRequest`` spans received so far: one per traced request."""
        with self._changed:
            return [s for s in self.spans if s.name == "InferRequest"]

    def wait(self, predicate: Any, timeout: float = 30.0) -> bool:
        """Wait until ``predicate(self)`` holds (checked at each arrival)."""
        end = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def clear(self) -> None:
        with self._changed:
            self.spans.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def traceparent() -> tuple[str, str, str]:
    """A traced client's W3C ``traceparent`` header, new: (the header, its trace id, its span
    id), the ids as the receiver's spans write them."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id
