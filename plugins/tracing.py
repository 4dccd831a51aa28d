"""A traced request's spans as the request path records them, and the hook a device opens its
own under: what a stage of a traced request writes down, with nothing of OpenTelemetry in it.

**Why records of our own.** OpenTelemetry's SDK makes a span in 25-45 us here
(``Tracer.start_span`` + ``end``: its sampler, attribute cleaning, a lock per span, a processor
call per span; 2-core EPYC, measured with a null exporter), and a tiny KServe request is
answered in about 500 us: the four spans of a traced request (``InferRequest``, the model, its
queue wait, its run) would add a fifth to a third to it. So a stage here only records: a
:class:`Span` is a small object holding a name, its start and end (``time.time_ns``, what
OpenTelemetry stamps with), attributes, events and an error's text. When its request's root
span ends, the whole :class:`Trace` goes to its ``sink`` in one call (the server's exporter,
``server/process/tracing.py``), which makes OpenTelemetry's spans from it on the exporter's own
thread, ids included. A request that is not traced has no trace at all (``None``): checking
for that is all tracing costs it.

**Who opens what.** A protocol adapter opens the root (``InferRequest``, Triton's name) when
its settings sample the request (``server/plane/tracing.py``), continuing the client's W3C
``traceparent`` when it sent one; the data plane opens the model's span under it (named after
the model, as Triton names it) and under that the device run (``server/plane/dataplane.py``;
the exporter adds the wait in the queue of a request that waited, from the two). The run's
span is handed to the device in its run context (``RunContext.trace``, ``plugins/run_context.py``:
the one channel a trace travels by; there is no context variable of spans), so a device that
runs pieces opens one span per piece under it with :func:`child` (HETERO's subgraphs, the
device a MULTI request ran on, a BATCH request's wait for its batch) and hands the piece's
span to the nested device as the ``trace`` of the piece's context. Work handed to another
thread takes its span along in the context it is handed, as it takes its cancellation token.

**Applications fit the same calls**:

* Ensemble and DAG steps (``server/apps/pipelines/ensemble.py``): each step is a span under
  the ensemble's model span, and the step's request is a data plane request that carries the
  step's span as its ``trace``, so the step's model span (and its queue and run)
  open under it, as Triton nests a composing model's spans under its ensemble.
* Python models (built: ``server/apps/pipelines/python/``): the server opens an ``execute``
  span under the run and sends it into the model's process as a W3C header
  (:meth:`Span.traceparent`, a few bytes in the request's JSON header); the process times
  ``execute`` and sends the times back with its answer, which become the span's start and end.
  A BLS call from ``execute`` carries that header, so the server opens its ``bls`` span under
  it and the called model's spans under that: BLS children are child spans.
* Generation: the request's model span is open from admission to its last event; the engine
  records its waiting as a ``queue`` span, each prompt chunk as a ``prefill`` span and the
  decoding as one ``decode`` span with an event per token batch (:meth:`Span.event`, at most
  :data:`MAX_EVENTS` a span: a long answer keeps its first ones and counts the rest).

Bounds: a trace keeps at most :data:`MAX_SPANS` spans (later ones are made, so callers need no
check, but not kept; the root counts them), a span at most :data:`MAX_EVENTS` events (likewise
counted). An error is kept as its type's name and message, never the exception, whose frames
hold the request's arrays.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MAX_EVENTS", "MAX_SPANS", "Span", "Trace", "child"]

#: Spans one trace keeps (a HETERO network of many pieces, a long ensemble): past them, spans
#: are still made and ended but not exported; ``plugserve.dropped_spans`` on the root says how
#: many.
MAX_SPANS = 256
#: Events one span keeps (OpenTelemetry's default span limit): the rest are counted in the
#: span's ``plugserve.dropped_events``.
MAX_EVENTS = 128

_clock = time.time_ns
_bits = random.getrandbits


class Span:
    """One stage of a traced request: from its making to :meth:`end`.

    Any thread may open children of a span; a span itself is written by the thread running
    its stage. Ending twice ends once, so a stage's failure path may end what its success path
    already did."""

    __slots__ = (
        "attributes",
        "end_ns",
        "error",
        "events",
        "name",
        "parent",
        "span_id",
        "start_ns",
        "trace",
    )

    def __init__(
        self,
        name: str,
        trace: Trace | None,
        parent: Span | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        #: the request's root (``self`` for the root itself)
        self.trace: Trace = trace if trace is not None else self  # type: ignore[assignment]
        self.parent = parent
        #: None until the first is set (a span of the request path often has none of its own)
        self.attributes: dict[str, Any] | None = attributes
        self.events: list[tuple[str, int, Mapping[str, Any] | None]] | None = None
        #: ``"Type: message"`` of the error that ended the stage (None: it succeeded)
        self.error: str | None = None
        #: OpenTelemetry's 64-bit span id, made when first needed (0: not yet)
        self.span_id = 0
        self.end_ns = 0
        self.start_ns = _clock()
        if trace is not None:  # Trace.keep, inline: a traced request makes a few per stage
            spans = trace.spans
            if len(spans) < MAX_SPANS:
                spans.append(self)
            else:
                trace.dropped += 1

    def span(self, name: str, attributes: dict[str, Any] | None = None) -> Span:
        """A child stage, started now."""
        return Span(name, self.trace, self, attributes)

    def set(self, key: str, value: Any) -> None:
        """An attribute (str, bool, int, float, or a list of one of them)."""
        if self.attributes is None:
            self.attributes = {key: value}
        else:
            self.attributes[key] = value

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        """A moment within the stage (a token batch of a generation)."""
        events = self.events
        if events is None:
            self.events = events = []
        if len(events) < MAX_EVENTS:
            events.append((name, _clock(), attributes))
        else:
            dropped = (self.attributes or {}).get("plugserve.dropped_events", 0)
            self.set("plugserve.dropped_events", dropped + 1)

    def fail(self, error: BaseException | str) -> None:
        """Record what failed the stage (the first error stays)."""
        if self.error is None:
            self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = _clock()

    def ids(self) -> int:
        """This span's id, made now if it has none."""
        if not self.span_id:
            self.span_id = _bits(64) or 1
        return self.span_id

    def traceparent(self) -> str:
        """The W3C ``traceparent`` header naming this span as the parent, for work that goes
        on in another process (a Python model's execute, its BLS calls)."""
        return f"00-{self.trace.ids_of_trace():032x}-{self.ids():016x}-01"

    def __enter__(self) -> Span:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if error is not None:
            self.fail(error)
        self.end()


class Trace(Span):
    """A traced request's root span (``InferRequest``) and every span under it.

    ``sink`` receives the trace once the root ends (the exporter's queue: it never blocks).
    ``remote`` is the client's ``traceparent`` as ``(trace id, parent span id)``: the trace
    continues the client's. ``detail``: the setting asked for Triton's TENSORS level (more
    attributes: each tensor's name, type and shape). ``model`` and ``protocol`` name what the
    request asked for and how it came (the root's ``triton.model_name`` and
    ``plugserve.protocol``, written at export: the request path only keeps them, as it keeps
    the sizes on the wire in :attr:`request_bytes` and :attr:`response_bytes`)."""

    __slots__ = (
        "detail",
        "dropped",
        "model",
        "parent_span_id",
        "protocol",
        "request_bytes",
        "request_id",
        "response_bytes",
        "sink",
        "spans",
        "stage",
        "trace_id",
    )

    def __init__(
        self,
        sink: Callable[[Trace], object],
        remote: tuple[int, int] | None = None,
        detail: bool = False,
        request_id: str = "",
        name: str = "InferRequest",
        model: str = "",
        protocol: str = "",
    ) -> None:
        # Span.__init__ written out: this runs once per traced request
        self.name = name
        self.trace = self
        self.parent = None
        self.attributes = None
        self.events = None
        self.error = None
        self.span_id = 0
        self.end_ns = 0
        self.start_ns = _clock()
        self.spans: list[Span] = [self]
        self.dropped = 0
        self.sink = sink
        self.detail = detail
        #: the client's id for the request (KServe's ``id``), for the spans' attributes
        self.request_id = request_id
        self.model = model
        self.protocol = protocol
        #: the request's and its answer's bytes on the wire, set by the adapter (-1: unknown;
        #: ``plugserve.request_bytes``, ``plugserve.response_bytes`` at export)
        self.request_bytes = self.response_bytes = -1
        #: the first model span opened under the root (``server/plane/tracing.py``'s
        #: ``Stage``): the root's version and device at export are its
        self.stage: Span | None = None
        self.trace_id, self.parent_span_id = remote if remote is not None else (0, 0)

    def keep(self, span: Span) -> None:
        """Keep ``span`` for export (list appends are atomic: children may come from any
        thread), or count it past :data:`MAX_SPANS`."""
        if len(self.spans) < MAX_SPANS:
            self.spans.append(span)
        else:
            self.dropped += 1

    def ids_of_trace(self) -> int:
        """The 128-bit trace id: the client's, or one made now."""
        if not self.trace_id:
            self.trace_id = _bits(128) or 1
        return self.trace_id

    def release(self) -> None:
        """Let go of the spans once the trace is exported (or dropped): a span points at its
        parent and the trace at every span, so without this a finished trace would wait for
        the cycle collector, whose collections of the whole heap it would bring about (they
        cost a tiny request ~14 us of CPU at rate 1). Each span is freed by its last
        reference instead. A span still open may still be ended, and open children."""
        spans, self.spans = self.spans, []
        for span in spans:
            span.parent = None
        self.stage = None

    def end(self) -> None:
        """End the request: the trace goes to its sink (once). A span still open is exported
        as ending with the root."""
        if self.end_ns:
            return
        self.end_ns = _clock()
        if self.dropped:
            self.set("plugserve.dropped_spans", self.dropped)
        self.sink(self)


def child(parent: Span | None, name: str, attributes: dict[str, Any] | None = None) -> Span | None:
    """A span under ``parent`` (a run's :attr:`RunContext.trace`), started now; None when the
    run is not traced (``parent`` None: a device's one check)."""
    return None if parent is None else Span(name, parent.trace, parent, attributes)
