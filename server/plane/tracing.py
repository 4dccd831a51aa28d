"""Which requests are traced, decided as Triton decides it, and the spans the data plane opens.

Triton's trace settings (``src/tracer.cc``, ``docs/protocol/extension_trace.md``): a level
(``OFF``, ``TIMESTAMPS``; ``TENSORS`` is Triton's word for more: here each tensor's name, type
and shape besides the counts and bytes every span has), a rate (1 in N requests is traced; 0:
only requests that carry a W3C ``traceparent``), a count (traces left to take; -1: no end) and
``log_frequency`` (kept and answered as Triton does, though nothing here writes files). The
global setting starts from ``--trace-config``; a model may have its own, each field it does not
set following the global one; ``null`` (REST) or an empty value (gRPC) clears a field back to
the global (a model's) or the startup value (the global's), as Triton's ``TraceManager`` does.
A setting is replaced, never changed, by an update, so its counter restarts: after
``trace_rate`` 2 the second, fourth, ... requests are traced. A request that continues a
client's trace (``traceparent``) is traced whatever the rate and count, when the level is not
OFF (Triton's context propagation).

Cost: an adapter asks :attr:`Tracing.on` (one attribute read) before anything else; only when
some setting's level is not OFF does it call :meth:`Tracing.start`, which takes one lock for
the sampling counters. Bounds: at most :data:`MAX_MODEL_SETTINGS` models with settings of
their own (each named model must be loaded when its setting is made); a client's request id
and model name are kept to :data:`MAX_NAME` characters in attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from time import time_ns
from typing import Any

from plugserve.plugins.api import (
    InvalidArgument,
    ResourceExhausted,
    Unsupported,
    listing,
)
from plugserve.plugins.tracing import MAX_SPANS, Span, Trace
from plugserve.server.plane.response_stream import ResponseStream

__all__ = [
    "LEVELS",
    "MAX_MODEL_SETTINGS",
    "Stage",
    "Tracing",
    "follow",
    "name_request",
    "parse_traceparent",
    "traced",
    "traceparent_in",
]

#: Triton's level names and their bits (OFF alone, or any of the others)
LEVELS = {"TIMESTAMPS": 1, "TENSORS": 2}
#: The fields a client may set (Triton's keys)
FIELDS = ("trace_level", "trace_rate", "trace_count", "log_frequency")
MAX_MODEL_SETTINGS = 1024
MAX_NAME = 256
_UINT32 = 2**32 - 1
#: the request's span, as Triton names it
_ROOT = "InferRequest"
_INT32 = 2**31 - 1

# W3C trace context: version 00 (or a later one, read as 00), 32 + 16 hex digits, flags
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(header: str | bytes | None) -> tuple[int, int] | None:
    """``(trace id, parent span id)`` of a valid W3C ``traceparent``; None otherwise (an
    invalid header is ignored, as the W3C spec asks: the request starts a trace of its own)."""
    if not header:
        return None
    text = header.decode("latin-1") if isinstance(header, bytes) else header
    match = _TRACEPARENT.fullmatch(text.strip())
    if match is None or match[1] == "ff" or (match[1] == "00" and match[5]):
        return None
    trace_id, span_id = int(match[2], 16), int(match[3], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id


@dataclasses.dataclass
class _Setting:
    """One setting in force (the global one or a model's): replaced whole on update."""

    level: int
    rate: int
    count: int
    log_frequency: int
    #: the fields this setting sets itself (a model's others follow the global setting)
    specified: frozenset[str] = frozenset()
    #: requests seen since the setting was made (Triton's ``sample_``), counting from 1
    seen: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))


def _level_names(level: int) -> list[str]:
    return [name for name, bit in LEVELS.items() if level & bit] or ["OFF"]


class Tracing:
    """The trace settings in force and the sampling of requests by them.

    ``known(name)``: whether a model of that name is loaded (a model's setting needs one, as
    Triton asks for a ready model). ``open_sink()``: the exporter's sink, made the first time a
    setting turns tracing on (it may raise: the OpenTelemetry packages are an optional extra);
    ``options``: what ``--trace-config`` set for the exporter, answered beside the settings
    (Triton's ``url``, ``resource``, ``bsp_*``), read-only."""

    def __init__(
        self,
        level: int = 0,
        rate: int = 1000,
        count: int = -1,
        log_frequency: int = 0,
        open_sink: Callable[[], Callable[[Trace], object]] | None = None,
        options: Mapping[str, list[str]] | None = None,
        known: Callable[[str], bool] = lambda name: False,
    ) -> None:
        #: whether any setting's level is not OFF: the one thing an adapter reads per request
        self.on = False
        self.options = dict(options or {})
        self.known = known
        self._open_sink = open_sink
        self._sink: Callable[[Trace], object] | None = None
        self._lock = threading.Lock()
        self._opening = threading.Lock()
        self._default = _Setting(level, rate, count, log_frequency)
        self._global = _Setting(level, rate, count, log_frequency)
        self._models: dict[str, _Setting] = {}
        if level:  # may raise (no exporter to be had): the caller decides
            self._ensure_sink()
            self.on = self._sink is not None

    # --- per request

    def start(
        self,
        model: str,
        request_id: str,
        traceparent: str | bytes | None,
        protocol: str,
    ) -> Trace | None:
        """The root span of a request to ``model``, or None when its setting does not sample
        it. ``protocol``: Triton's names (``GRPC``, ``HTTP``). The model's version and device
        join its attributes once the data plane has looked it up (:class:`Stage`)."""
        setting = self._models.get(model, self._global) if self._models else self._global
        if not setting.level:
            return None
        remote = parse_traceparent(traceparent) if traceparent else None
        if not setting.rate:
            hit = False
        elif setting.count < 0:  # no count to keep: the counter alone (atomic under the GIL)
            hit = next(setting.seen) % setting.rate == 0
        else:
            with self._lock:
                if remote is None and not setting.count:
                    return None
                hit = next(setting.seen) % setting.rate == 0
                if hit and setting.count > 0:
                    setting.count -= 1
                elif hit:  # the count is spent
                    hit = False
        sink = self._sink
        if not (hit or remote is not None) or sink is None:
            return None
        # (positional: a traced request makes one, and keywords cost it more)
        return Trace(
            sink, remote, setting.level > 1, request_id[:MAX_NAME], _ROOT, model[:MAX_NAME],
            protocol,
        )  # fmt: skip

    # --- the trace-setting routes (KServe's TraceSetting, REST /v2[/models/M]/trace/setting)

    def setting(self, model: str = "") -> dict[str, list[str]]:
        """What the routes answer: Triton's keys, each value a list of strings."""
        self._check_model(model)
        setting = self._models.get(model, self._global) if model else self._global
        return {
            "trace_level": _level_names(setting.level),
            "trace_rate": [str(setting.rate)],
            "trace_count": [str(setting.count)],
            "trace_mode": ["opentelemetry"],
            **self.options,
        }

    def update(self, model: str, changes: Mapping[str, list[str] | None]) -> dict[str, list[str]]:
        """Apply ``changes`` (a field: its new values, or None to clear it) to the global
        setting (``model`` empty) or to ``model``'s; answers :meth:`setting` after it. Checked
        whole before anything changes, with Triton's messages."""
        self._check_model(model)
        new = _parse_changes(changes)
        if new.get("trace_level"):  # the exporter first: without it nothing changes
            self._ensure_sink()
        with self._lock:
            if model:
                self._update_model(model, new)
            else:
                self._global = _merged(self._global, self._default, new, specified=False)
                # the models' settings follow the global one where they set nothing
                for name, own in list(self._models.items()):
                    self._models[name] = _merged(own, self._global, {}, specified=True)
            level = self._global.level or any(s.level for s in self._models.values())
        self.on = bool(level) and self._sink is not None
        return self.setting(model)

    def _update_model(self, model: str, new: dict[str, Any]) -> None:
        current = self._models.get(model)
        if current is None and len(self._models) >= MAX_MODEL_SETTINGS:
            raise ResourceExhausted(
                f"{MAX_MODEL_SETTINGS} models have trace settings of their own already; clear "
                "one (set its fields to null) before giving another model its own"
            )
        base = current if current is not None else _Setting(0, 0, 0, 0)
        merged = _merged(base, self._global, new, specified=True)
        if merged.specified:
            self._models[model] = merged
        else:  # every field cleared: the model follows the global setting again
            self._models.pop(model, None)

    def _check_model(self, model: str) -> None:
        if model and not self.known(model):
            raise InvalidArgument(
                f"Request for unknown model : {model}: no version of it is loaded (a model's "
                "trace settings need the model loaded)"
            )

    def _ensure_sink(self) -> None:
        with self._opening:
            if self._sink is None and self._open_sink is not None:
                self._sink = self._open_sink()

    def close(self) -> None:
        """No request is traced from now on (the server stops its exporter after this)."""
        self.on = False
        self._sink = None


def traceparent_in(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The W3C ``traceparent`` among a call's metadata (gRPC's ``(key, value)`` pairs,
    lowercase keys), None when it has none."""
    for key, value in metadata or ():
        if key == "traceparent":
            return value
    return None


def traced(
    tracing: Tracing,
    model: str,
    request_id: str,
    metadata: Iterable[tuple[str, Any]] | None,
    size: int,
    streaming: bool,
    admit: Callable[[Trace | None], tuple[Any, Any]],
) -> tuple[Any, Any]:
    """A gRPC adapter's admission of a request (``admit(trace)``), within the request's span
    when the trace settings sample it (:meth:`Tracing.start`, continuing the ``traceparent``
    of the call's ``metadata``; :func:`follow`), else untraced (``admit(None)``). The caller
    asks :attr:`Tracing.on` first, so that an untraced server pays no call for it."""
    trace = tracing.start(model, request_id, traceparent_in(metadata), "GRPC")
    if trace is None:
        return admit(None)
    return follow(trace, size, streaming, lambda: admit(trace))


def follow(
    trace: Trace,
    size: int,
    streaming: bool,
    admit: Callable[[], tuple[Any, Any]],
) -> tuple[Any, Any]:
    """``admit()`` (an adapter's admission of a request, ``-> (entry, answer)``) within the
    request's span ``trace``, which counts the request's ``size`` on the wire and ends when
    its answer is ready: at once when admission fails; when the stream ends for a stream of
    responses (a :class:`ResponseStream`); when the future is done for a request of a gRPC
    stream (``streaming``). A unary call's span is its caller's to end, once the answer is
    composed (``grpc/handlers.py``'s ``Inference.unary``)."""
    trace.request_bytes = size
    try:
        entry, answer = admit()
    except BaseException as exc:
        trace.fail(exc)
        trace.end()
        raise
    if isinstance(answer, ResponseStream):
        answer.when_ended(functools.partial(_ended, trace))
    elif streaming:
        answer.add_done_callback(lambda f: _ended(trace, None if f.cancelled() else f.exception()))
    return entry, answer


def _ended(trace: Span, error: BaseException | None) -> None:
    if error is not None:
        trace.fail(error)
    trace.end()


def name_request(trace: Trace, request_id: str) -> None:
    """The client's id for a traced request, once its adapter has read it (REST's is in the
    body): the root and the spans the data plane opens carry it."""
    if request_id:
        trace.request_id = request_id[:MAX_NAME]


def _parse_changes(changes: Mapping[str, list[str] | None]) -> dict[str, Any]:
    """Triton's checks of a trace-setting request: field -> new value, or None (clear)."""
    if "trace_file" in changes:
        raise Unsupported(
            "trace file location can not be updated through network protocol (plugserve "
            "exports traces over OTLP; --trace-config opentelemetry,url=... names the collector)"
        )
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
        raise InvalidArgument(
            f"unknown trace setting(s) {listing(unknown)}; a client may set "
            f"{listing(list(FIELDS))} (the exporter's options are set at startup with "
            "--trace-config)"
        )
    new: dict[str, Any] = {}
    for field, values in changes.items():
        if values is None:
            new[field] = None
        elif field == "trace_level":
            new[field] = _parse_level(values)
        else:
            if len(values) != 1:
                raise InvalidArgument(f"expect only 1 value for '{field}'")
            new[field] = _parse_number(field, values[0])
    return new


def _parse_level(values: list[str]) -> int:
    if "OFF" in values:
        if len(values) != 1:
            raise InvalidArgument("Expect only one trace level 'OFF' is specified")
        return 0
    level = 0
    for value in values:
        if value not in LEVELS:
            raise InvalidArgument(
                f"unknown trace level {value!r}; the levels are OFF, TIMESTAMPS and TENSORS"
            )
        level |= LEVELS[value]
    return level


def _parse_number(field: str, text: str) -> int:
    low, high = (-1, _INT32) if field == "trace_count" else (0, _UINT32)
    try:
        value = int(str(text).strip())
    except ValueError:
        raise InvalidArgument(f"Unable to parse '{field}', got: {text}") from None
    if not low <= value <= high:
        raise InvalidArgument(
            f"Unable to parse '{field}', value is out of range [ {low}, {high} ], got: {text}"
        )
    return value


_KEYS = {
    "trace_level": "level",
    "trace_rate": "rate",
    "trace_count": "count",
    "log_frequency": "log_frequency",
}


def _merged(
    current: _Setting, fallback: _Setting, new: dict[str, Any], specified: bool
) -> _Setting:
    """A new setting: each field from ``new``, else from ``current`` where it was set there,
    else from ``fallback`` (Triton's ``UpdateTraceSettingInternal``). ``specified``: track
    which fields are set (a model's setting); the global one's fields always are."""
    values = {}
    kept = set()
    for field, key in _KEYS.items():
        if field in new and new[field] is not None:
            values[key] = new[field]
            kept.add(field)
        elif field not in new and (not specified or field in current.specified):
            values[key] = getattr(current, key)
            kept.add(field)
        else:  # cleared, or never set by this model
            values[key] = getattr(fallback, key)
    return _Setting(**values, specified=frozenset(kept) if specified else frozenset())


class Stage(Span):
    """The model's span of one admitted request (Triton's, named after the model), under the
    request's span, with the device's run (``compute``) under it, and what the exporter makes
    of it: its wait in the network's queue.

    It records as little as a request can pay for: the model's name, version and device and
    the request's id are the exporter's to write (from :attr:`entry` and the root, on its own
    thread; the spans under this one inherit them there, ``server/process/tracing.py``); the
    inputs' and outputs' counts and bytes are four integers; and the queue wait is no span of
    its own here but :attr:`queued` and two timestamps this span has anyway (its start, the
    run's start): the exporter writes a ``queue`` span for a request that waited in the queue
    (:attr:`queued`, set by the data plane when it hands the request to the network's streams;
    a request run at once on its caller's thread waited for nothing and has none).

    Each Python call counts: on the tiny REST request a call of these costs ~3x what it costs
    in a loop (its code and data are cold by the time the next request comes), so the
    request pays one per stage: made (the span's fields written out), :meth:`running` (which
    hands back the run's span, the device's run context's ``trace``), :meth:`ran` and
    :meth:`finished`."""

    __slots__ = (
        "compute",
        "entry",
        "input_bytes",
        "inputs",
        "output_bytes",
        "outputs",
        "queued",
    )

    def __init__(
        self, parent: Span, entry: Any, arrays: list[Any] | None = None, queued: bool = False
    ) -> None:
        """``queued``: the request waits in the network's queue before its run (the data
        plane sets it when it does; a stream of responses from another producer has the
        model's span only)."""
        root = parent.trace
        # Span.__init__ written out (a call less)
        self.name = entry.name
        self.trace = root
        self.parent = parent
        self.attributes = self.events = self.error = None
        self.span_id = self.end_ns = 0
        self.start_ns = time_ns()
        spans = root.spans
        if len(spans) < MAX_SPANS:
            spans.append(self)
        else:
            root.dropped += 1
        #: the network that runs it (its name, version and device, read at export)
        self.entry = entry
        self.queued = queued
        #: the device's run (None: it has not started)
        self.compute: Span | None = None
        #: inputs and outputs and their bytes (-1: not known, not written)
        self.outputs = self.output_bytes = -1
        if arrays is not None:
            total = 0
            for array in arrays:
                total += getattr(array, "nbytes", 0)
            self.inputs, self.input_bytes = len(arrays), total
            if root.detail:
                _shapes(self, "input", [s.name for s in entry.network.inputs], arrays)
        else:
            self.inputs = self.input_bytes = -1
        if parent is root and root.stage is None:  # the request's own span learns its lookup
            root.stage = self

    @property
    def model(self) -> Span:
        """The model's span (this one): what a producer opens its spans under."""
        return self

    def running(self) -> Span:
        """The request left the queue and its run starts now: the run's span, which the data
        plane hands the device as its run context's ``trace`` (devices open their spans
        under it)."""
        self.compute = compute = Span("compute", self.trace, self)
        return compute

    def ran(self, outputs: Mapping[str, Any] | None) -> None:
        """The run succeeded with ``outputs`` (None: a decoupled run returned, its responses
        sent or still to come: its span counts them when they end)."""
        compute = self.compute
        if compute is not None and not compute.end_ns:
            compute.end_ns = time_ns()
        if outputs is None:
            return
        total = 0
        for array in outputs.values():
            total += getattr(array, "nbytes", 0)
        self.outputs, self.output_bytes = len(outputs), total
        if self.trace.detail:
            _shapes(self, "output", list(outputs), list(outputs.values()))

    def finished(self, error: BaseException | None) -> None:
        """The request is over (answered, failed, or cancelled queued or running); ``error``
        is recorded on the spans it ended."""
        now = time_ns()
        compute = self.compute
        if compute is not None and not compute.end_ns:
            if error is not None:
                compute.fail(error)
            compute.end_ns = now
        if not self.end_ns:
            if error is not None:
                self.fail(error)
            self.end_ns = now


def _shapes(span: Span, kind: str, names: list[str], arrays: list[Any]) -> None:
    """Triton's TENSORS level, without the values: each tensor's name, type and shape."""
    span.set(f"plugserve.{kind}_names", names)
    span.set(
        f"plugserve.{kind}_types", [str(getattr(a, "dtype", type(a).__name__)) for a in arrays]
    )
    span.set(
        f"plugserve.{kind}_shapes",
        ["x".join(map(str, getattr(a, "shape", ()))) for a in arrays],
    )
