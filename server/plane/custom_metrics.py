"""Metrics a model declares itself (Triton's custom metrics: a Python model's
``pb_utils.MetricFamily`` and ``Metric``), exposed on ``/metrics`` beside plugserve's own.

A family is known by its name across the server, as in Triton: a second declaration with the
same name and kind is the same family (the first description stays), with another kind it is
refused. A series is a family's label set: the same labels are the same series, whichever
instance or model made them (Triton's custom_metrics example has three instances add to one
counter). Counters only go up (``increment`` by a non-negative amount), gauges are set or
incremented either way, histograms observe into the buckets their series was made with.

Each family and series remembers who declared it (an owner: one load of one model); when a
load ends (unload, a reload replacing it) its owner is dropped, and what no owner holds any
more leaves ``/metrics``. Series live until then: a model's ``del metric`` does not remove one.

Bounds, each refused (InvalidArgument, naming the model, the name and the limit) before
anything is allocated, so a model cannot grow the server's memory or the scrape without end:

- :data:`MAX_FAMILIES` families per owner;
- :data:`MAX_SERIES` label sets per family (all owners together);
- :data:`MAX_LABELS` labels per series, label names as Prometheus spells them (not ``__*``,
  not ``le`` on a histogram), label values up to :data:`MAX_LABEL_VALUE` characters;
- :data:`MAX_BUCKETS` buckets per histogram series, finite and increasing;
- names as Prometheus spells them, up to :data:`MAX_NAME` characters, never ``plugserve_*``
  (the server's own), descriptions up to :data:`MAX_DESCRIPTION` characters.

The exposition is written here, in Prometheus' text format, rather than by prometheus_client:
its text writer names a counter ``NAME_total``, where Triton's (prometheus-cpp) writes ``NAME``
as the model declared it, and Triton's example clients look for that line. A scrape that asks
for OpenMetrics gets the families through prometheus_client's own writer, whose format demands
the ``_total`` sample names.
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from plugserve.plugins.api import InvalidArgument, Unsupported

__all__ = ["KINDS", "CustomMetrics"]

#: families one owner (one load of a model) may declare
MAX_FAMILIES = 64
#: label sets (series) one family may hold, from every owner
MAX_SERIES = 1024
#: labels per series
MAX_LABELS = 16
#: characters of a label value
MAX_LABEL_VALUE = 256
#: buckets of a histogram series
MAX_BUCKETS = 64
#: characters of a family's name
MAX_NAME = 200
#: characters of a family's description
MAX_DESCRIPTION = 1024

#: Triton's MetricFamily kinds, by the number pb_utils gives them
KINDS = ("COUNTER", "GAUGE", "HISTOGRAM")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_RESERVED = "plugserve_"

_Labels = tuple[tuple[str, str], ...]


class _Series:
    """One label set's value (counter, gauge), or its buckets' counts, sum and count."""

    __slots__ = ("buckets", "count", "counts", "labels", "owners", "total", "value")

    def __init__(self, labels: _Labels, buckets: tuple[float, ...] | None) -> None:
        self.labels = labels
        self.buckets = buckets
        self.value = 0.0
        self.counts = [0] * (len(buckets) + 1) if buckets is not None else []
        self.total = 0.0
        self.count = 0
        self.owners: set[int] = set()


class _Family:
    __slots__ = ("description", "kind", "name", "owners", "series")

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.owners: set[int] = set()
        self.series: dict[_Labels, _Series] = {}


class CustomMetrics:
    """Every family models declared, under one lock (a model's metric calls are short)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        #: handle -> (family, series): what a model's Metric object names in its calls
        self._handles: dict[int, tuple[_Family, _Series]] = {}
        #: owner -> its handles (by family and labels: one per series) and its families
        self._owned: dict[int, tuple[dict[tuple[str, _Labels], int], set[str]]] = {}
        self._ids = itertools.count(1)

    # --- what models declare

    def owner(self) -> int:
        """A new owner: one load of one model, dropped with :meth:`drop`."""
        owner = next(self._ids)
        with self._lock:
            self._owned[owner] = ({}, set())
        return owner

    def family(self, owner: int, where: str, name: Any, description: Any, kind: Any) -> str:
        """Declare (or join) family ``name``; returns its kind. ``where`` names the model in
        errors."""
        kind = _kind(kind, where, name)
        name = _family_name(name, where)
        if not isinstance(description, str):
            raise InvalidArgument(f"{where}: MetricFamily {name!r}: description must be a string")
        if len(description) > MAX_DESCRIPTION:
            raise InvalidArgument(
                f"{where}: MetricFamily {name!r}: its description is over {MAX_DESCRIPTION} "
                "characters"
            )
        with self._lock:
            _, families = self._owner(owner, where)
            family = self._families.get(name)
            if family is not None and family.kind != kind:
                raise InvalidArgument(
                    f"{where}: MetricFamily {name!r} already exists as a {family.kind}, not a "
                    f"{kind}: a name has one kind; pick another name"
                )
            if name not in families and len(families) >= MAX_FAMILIES:
                raise InvalidArgument(
                    f"{where}: MetricFamily {name!r} would be its {MAX_FAMILIES + 1}th; a model "
                    f"may declare at most {MAX_FAMILIES} metric families"
                )
            if family is None:
                family = self._families[name] = _Family(name, description, kind)
            family.owners.add(owner)
            families.add(name)
        return kind

    def metric(self, owner: int, where: str, name: str, labels: Any, buckets: Any = None) -> int:
        """A series of family ``name`` (made, or the one with these labels); returns the
        handle its operations name."""
        with self._lock:
            family = self._families.get(name)
        if family is None:
            raise InvalidArgument(f"{where}: no MetricFamily {name!r}; declare it first")
        pairs = _labels(labels, where, name, family.kind)
        bounds = _buckets(buckets, where, name, family.kind)
        with self._lock:
            handles, families = self._owner(owner, where)
            if name not in families or self._families.get(name) is not family:
                raise InvalidArgument(f"{where}: MetricFamily {name!r} is not its own")
            series = family.series.get(pairs)
            if series is None:
                if len(family.series) >= MAX_SERIES:
                    raise InvalidArgument(
                        f"{where}: MetricFamily {name!r} holds {MAX_SERIES} label sets, its "
                        "limit; reuse a Metric rather than making one per request"
                    )
                series = family.series[pairs] = _Series(pairs, bounds)
            series.owners.add(owner)
            handle = handles.get((name, pairs))
            if handle is None:  # one per series and owner, however many Metric objects
                handle = handles[name, pairs] = next(self._ids)
                self._handles[handle] = (family, series)
        return handle

    def operate(self, owner: int, where: str, handle: Any, op: str, value: Any = 0.0) -> float:
        """``increment``, ``set``, ``observe`` or ``value`` on a series; returns its value."""
        number = _number(value, where, op)
        with self._lock:
            handles, _ = self._owner(owner, where)
            found = self._handles.get(handle)
            if found is not None and handles.get((found[0].name, found[1].labels)) != handle:
                found = None
            if found is None:
                raise InvalidArgument(f"{where}: no such Metric (it was not made by this model)")
            family, series = found
            kind = family.kind
            if op == "increment" and kind != "HISTOGRAM":
                if kind == "COUNTER" and number < 0:
                    raise InvalidArgument(
                        f"{where}: metric {family.name!r}: a COUNTER only goes up; increment "
                        f"it by a non-negative value, not {number!r}"
                    )
                series.value += number
                return series.value
            if op == "set" and kind == "GAUGE":
                series.value = number
                return series.value
            if op == "observe" and kind == "HISTOGRAM":
                assert series.buckets is not None
                series.counts[bisect.bisect_left(series.buckets, number)] += 1
                series.total += number
                series.count += 1
                return series.total
            if op == "value" and kind != "HISTOGRAM":
                return series.value
        doing = {"increment": "increment", "set": "set", "observe": "observe", "value": "value"}
        if op not in doing:
            raise InvalidArgument(f"{where}: unknown metric operation {op!r}")
        able = {"COUNTER": "increment, value", "GAUGE": "increment, set, value",
                "HISTOGRAM": "observe"}[kind]  # fmt: skip
        raise Unsupported(
            f"{where}: metric {family.name!r} is a {kind}, which does not support {op}; a "
            f"{kind} supports {able}"
        )

    def drop(self, owner: int) -> None:
        """An owner's load ended: what no other owner holds leaves ``/metrics``."""
        with self._lock:
            handles, families = self._owned.pop(owner, ({}, set()))
            for handle in handles.values():
                self._handles.pop(handle, None)
            for name in families:
                family = self._families.get(name)
                if family is None:
                    continue
                family.owners.discard(owner)
                for labels, series in list(family.series.items()):
                    series.owners.discard(owner)
                    if not series.owners:
                        del family.series[labels]
                if not family.owners:
                    del self._families[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._families)

    def _owner(self, owner: int, where: str) -> tuple[dict[tuple[str, _Labels], int], set[str]]:
        owned = self._owned.get(owner)
        if owned is None:
            raise InvalidArgument(f"{where}: the model is unloaded; its metrics are gone")
        return owned

    # --- the exposition

    def _snapshot(self, names: Sequence[str] | None) -> list[tuple[str, str, str, list[Any]]]:
        with self._lock:
            chosen = [f for n, f in sorted(self._families.items()) if not names or n in names]
            return [
                (
                    f.name,
                    f.description,
                    f.kind,
                    [
                        (s.labels, s.buckets, s.value, list(s.counts), s.total, s.count)
                        for s in f.series.values()
                    ],
                )
                for f in chosen
            ]

    def text(self, names: Sequence[str] | None = None) -> bytes:
        """The families in Prometheus' text format (0.0.4), as Triton writes them."""
        lines: list[str] = []
        for name, description, kind, series in self._snapshot(names):
            lines.append(f"# HELP {name} {_help(description)}")
            lines.append(f"# TYPE {name} {kind.lower()}")
            for labels, buckets, value, counts, total, count in series:
                if kind != "HISTOGRAM":
                    lines.append(f"{name}{_label_text(labels)} {floatToGoString(value)}")
                    continue
                cumulative = 0
                for bound, n in zip([*buckets, math.inf], counts):
                    cumulative += n
                    le = (*labels, ("le", floatToGoString(bound)))
                    lines.append(f"{name}_bucket{_label_text(le)} {cumulative}")
                lines.append(f"{name}_sum{_label_text(labels)} {floatToGoString(total)}")
                lines.append(f"{name}_count{_label_text(labels)} {count}")
        return ("\n".join(lines) + "\n").encode() if lines else b""

    def collect(self) -> Iterator[Any]:
        """The families as prometheus_client's (for its OpenMetrics writer)."""
        for name, description, kind, series in self._snapshot(None):
            keys = sorted({k for labels, *_ in series for k, _ in labels})
            if kind == "HISTOGRAM":
                family: Any = HistogramMetricFamily(name, description, labels=keys)
            elif kind == "COUNTER":
                family = CounterMetricFamily(name, description, labels=keys)
            else:
                family = GaugeMetricFamily(name, description, labels=keys)
            for labels, buckets, value, counts, total, _ in series:
                named = dict(labels)
                values = [named.get(k, "") for k in keys]
                if kind != "HISTOGRAM":
                    family.add_metric(values, value)
                    continue
                cumulative, pairs = 0, []
                for bound, n in zip([*buckets, math.inf], counts):
                    cumulative += n
                    pairs.append((floatToGoString(bound), cumulative))
                family.add_metric(values, pairs, total)
            yield family


# --- checks (before anything is allocated)


def _kind(kind: Any, where: str, name: Any) -> str:
    if isinstance(kind, int) and not isinstance(kind, bool) and 0 <= kind < len(KINDS):
        return KINDS[kind]
    if isinstance(kind, str) and kind.upper() in KINDS:
        return kind.upper()
    raise InvalidArgument(
        f"{where}: MetricFamily {name!r}: kind {kind!r} is not a metric kind; use "
        "pb_utils.MetricFamily.COUNTER, GAUGE or HISTOGRAM"
    )


def _family_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME:
        raise InvalidArgument(
            f"{where}: MetricFamily name {name!r} is not a Prometheus metric name (letters, "
            f"digits, '_' and ':', not starting with a digit, at most {MAX_NAME} characters)"
        )
    if name.startswith(_RESERVED):
        raise InvalidArgument(
            f"{where}: MetricFamily name {name!r} starts with {_RESERVED!r}, which the "
            "server's own metrics use; pick another name"
        )
    return name


def _labels(labels: Any, where: str, name: str, kind: str) -> _Labels:
    if labels is None:
        return ()
    if not isinstance(labels, Mapping):
        raise InvalidArgument(
            f"{where}: metric {name!r}: labels must be a dictionary of strings, not "
            f"{type(labels).__name__}"
        )
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(
            f"{where}: metric {name!r} has {len(labels)} labels; at most {MAX_LABELS}"
        )
    pairs = []
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL.fullmatch(key) or key.startswith("__"):
            raise InvalidArgument(
                f"{where}: metric {name!r}: label name {key!r} is not a Prometheus label name "
                "(letters, digits and '_', not starting with a digit or '__')"
            )
        if kind == "HISTOGRAM" and key == "le":
            raise InvalidArgument(f"{where}: metric {name!r}: a histogram's buckets are 'le'")
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE:
            raise InvalidArgument(
                f"{where}: metric {name!r}: label {key!r} must be a string of at most "
                f"{MAX_LABEL_VALUE} characters"
            )
        pairs.append((key, value))
    return tuple(sorted(pairs))


def _buckets(buckets: Any, where: str, name: str, kind: str) -> tuple[float, ...] | None:
    if kind != "HISTOGRAM":
        if buckets is not None:
            raise InvalidArgument(
                f"{where}: metric {name!r} is a {kind}: buckets are for a HISTOGRAM only"
            )
        return None
    if not isinstance(buckets, list | tuple) or not buckets:
        raise InvalidArgument(
            f"{where}: metric {name!r} is a HISTOGRAM: give its buckets, a list of increasing "
            "upper bounds (Metric(labels, buckets=[...]))"
        )
    if len(buckets) > MAX_BUCKETS:
        raise InvalidArgument(
            f"{where}: metric {name!r} has {len(buckets)} buckets; at most {MAX_BUCKETS}"
        )
    bounds = []
    for bound in buckets:
        if (
            isinstance(bound, bool)
            or not isinstance(bound, int | float)
            or not math.isfinite(bound)
        ):
            raise InvalidArgument(
                f"{where}: metric {name!r}: bucket {bound!r} is not a finite number"
            )
        bounds.append(float(bound))
    if any(b >= a for b, a in itertools.pairwise(bounds)):
        raise InvalidArgument(f"{where}: metric {name!r}: buckets must be increasing: {bounds}")
    return tuple(bounds)


def _number(value: Any, where: str, op: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise InvalidArgument(f"{where}: metric {op} takes a number, not {value!r}")
    return float(value)


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _label_text(labels: Sequence[tuple[str, str]]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"
