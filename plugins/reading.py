"""Reading a model is bounded before anything is built: its nodes, and every value computed
while it is read.

A model is data a client sends (QueryNetwork is open to any ``infer`` client), yet reading one
computes values of a size the model alone decides:

* onnx's shape inference with data propagation (``infer_shapes(..., data_prop=True)``, which
  every read runs to type the graph) keeps the *values* of shape arithmetic as it goes. A
  1 KB model, ``Shape`` of a rank-100 input then 18 ``Concat``\\ s of a value with itself,
  took 3.6 GB and 19 s here (issue 58 measured a 110 KB one at 4.6 GB and 6 s in the
  server, two at once 8.2 GB and 10 s).
  onnx holds the GIL the whole time (a thread ticking every 5 ms saw a 3.9 s gap), so every
  client of the server stalled with it. Each value stays small by itself; only their sum
  is large, and which ops onnx propagates, and how, is onnx's (and changes with it).
* plugserve's own reading: a sparse initializer is held dense (a few bytes on the wire can
  ask for gigabytes), and constant folding (``plugins/passes/folding.py``) computes values
  of up to 64 MiB each, as many as the model has nodes.

So onnx's shape inference runs in a helper process (``plugins/shape_worker.py``) whose data may
grow by :attr:`ReadLimits.max_bytes` (``RLIMIT_DATA``) from what it holds with the model read,
and whose work is bounded in time (:attr:`ReadLimits.seconds`; then it is killed and replaced).
Measured here, it costs a read 1-3 ms more than in the server (the light model, without its
weights, crosses a pipe both ways: 96 KB for a 621-node decoder, whose inference itself takes
3 ms and 4 MB), never holds the server's GIL (its threads wait on a pipe), and bounds whatever
onnx's C++ does, not only the data propagation we know of today. The alternative, our own data
propagation checking each value's size first, would have to follow onnx's rules op by op, and
still leave onnx's own pass (which the checker's and the devices' typing rely on) unbounded.

The values plugserve itself computes while reading are counted against the same bound in the
server (:class:`Allowance`): dense sparse initializers (over it: the model is refused), and
constant folding's outputs (over it: the nodes are left to run time, where a request's room
bounds them); a model's own weights may add eight times their bytes (int4 weights folded to
float32, the largest growth a real model's folding makes), which a small model does not have.

Parsing a client's bytes is bounded before it happens (:func:`parse_model`): protobuf's parse
holds up to ~94x the bytes it reads (a NodeProto of no fields is 2 bytes on the wire and ~140
parsed, one of empty attributes more: 10 MB of empty nodes grew the server 1.07 GB), so a model
whose bytes could parse to more than :attr:`ReadLimits.max_bytes` (over a 128th of it: 2 MiB at
the default) is parsed first in a shape-inference helper whose data may grow by the bytes and
the limit only, and its nodes counted there (below); the server parses it after that has
passed.

The node count, subgraphs and functions included, is checked right after the model is parsed,
before the checker, shape inference or any graph is built (:func:`check_nodes`); so are the
nodes the model's local functions expand to where they are called (each call of a function
that calls another twice doubles them: 40 such functions of 4 KB asked onnx's shape inference
for 2^39 nodes), and the values its attributes list (a packed attribute of 20M small integers
is 20 MB on the wire, 160 MB parsed, and more as Python's).

The server sets the limits from its settings (``--max-read-bytes``, ``--max-read-seconds``,
``--max-model-nodes``: :func:`set_limits`) and charges :attr:`ReadLimits.max_bytes` to its
memory budget before each read (``server/control/model_control.py``); a program using the
Plugin API in-process gets the defaults here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import onnx
from google.protobuf.message import DecodeError
from onnx import ModelProto

from plugserve.plugins.errors import InvalidModel, ResourceExhausted
from plugserve.plugins.workers import Crashed, NoWorker, TooLarge, Workers

__all__ = [
    "Allowance",
    "ReadLimits",
    "allowance",
    "check_nodes",
    "count_nodes",
    "expanded_nodes",
    "infer_shapes",
    "limits",
    "parse_model",
    "read_here",
    "set_limits",
]

log = logging.getLogger(__name__)

#: What a model's own weights may add to its allowance, per byte (int4 folded to float32: 8x).
WEIGHT_GROWTH = 8
#: Helper processes at most: reads beyond them wait their turn (their memory is charged first).
HELPERS = 2
#: what a parse may hold per byte it reads, at most (measured: a node of empty attributes 94x):
#: bytes up to ``max_bytes`` over this are parsed without asking a helper first
PARSE_GROWTH = 128
#: the setting that bounds a read's memory, as refusals name it
READ_BYTES = "--max-read-bytes / PLUGSERVE_MAX_READ_BYTES"
#: the setting that bounds a read's time, as refusals name it
READ_SECONDS = "--max-read-seconds / PLUGSERVE_MAX_READ_SECONDS"
#: what "no time limit" (--max-read-seconds 0) waits: a year
_FOREVER = 365 * 86400.0


@dataclasses.dataclass(frozen=True)
class ReadLimits:
    """The bounds of one read of a model (the server's flags; these defaults otherwise)."""

    #: bytes of values one read may compute (--max-read-bytes): shape inference's own data
    #: (its helper's data beyond onnx), dense sparse initializers, folded constants.
    #: Real exporter models need little: a 621-node Llama decoder's shape inference took 4 MB,
    #: an 873-node Qwen2's 5 MB; folding a causal mask of 2,048 positions (2,048² float32) 16 MiB.
    max_bytes: int = 256 << 20
    #: seconds shape inference may take (--max-read-seconds); real models take milliseconds
    #: (17 ms for the 873-node Qwen2 decoder)
    seconds: float = 30.0
    #: nodes a model may have, its subgraphs' and functions' included (--max-model-nodes);
    #: the largest exporter graphs have tens of thousands. Parsing costs ~340 bytes a node
    #: (2M one-input nodes: 28 MB on the wire, 674 MB parsed)
    max_nodes: int = 250_000


_limits = ReadLimits()


def set_limits(value: ReadLimits) -> None:
    """The process's bounds (one server per process: its settings decide them at start)."""
    global _limits
    _limits = value


def limits() -> ReadLimits:
    return _limits


# ----------------------------------------------------------------- nodes


def _calls_in(
    nodes: Any, functions: dict[tuple[str, str, str], Any]
) -> tuple[int, list[tuple[str, str, str]]]:
    """How many ``nodes`` there are with their subgraphs' (any depth), and the calls among them
    of ``functions`` (by key, once a call)."""
    names = {name for _, name, _ in functions}
    count, calls = 0, []
    pending: list[Any] = [nodes]
    while pending:
        level = pending.pop()
        count += len(level)
        for node in level:
            if node.op_type in names:
                key = _key(node.domain, node.op_type, node.overload)
                if key in functions:
                    calls.append(key)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    pending.append(attr.g.node)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    pending.extend(g.node for g in attr.graphs)
    return count, calls


@dataclasses.dataclass
class _Tally:
    """One walk's counts: the nodes, the values their attributes list, and the attribute
    that lists the most (for the refusal's message)."""

    nodes: int = 0
    listed: int = 0
    most: tuple[int, str, str, str] = (0, "", "", "")


def _tally(proto: ModelProto) -> _Tally:
    """Every node of the model (its graph's, its subgraphs' at any depth, its functions')
    counted, with what their attributes list, in one walk: a node without attributes costs
    one look (50,000 nodes: ~30 ms; a generator per level cost 180 ms)."""
    tally = _Tally()
    pending: list[Any] = [proto.graph.node, *(f.node for f in proto.functions)]
    while pending:
        nodes = pending.pop()
        tally.nodes += len(nodes)
        for node in nodes:
            attributes = node.attribute
            if not attributes:
                continue
            for attr in attributes:
                kind = attr.type
                if kind == onnx.AttributeProto.GRAPH:
                    pending.append(attr.g.node)
                elif kind == onnx.AttributeProto.GRAPHS:
                    pending.extend(g.node for g in attr.graphs)
                listed = _listed(attr)
                tally.listed += listed
                if listed > tally.most[0]:
                    tally.most = (listed, node.name, node.op_type, attr.name)
    return tally


def count_nodes(proto: ModelProto) -> int:
    """Nodes of the model: its graph's, its subgraphs' (any depth) and its functions'."""
    return _tally(proto).nodes


def _key(domain: str, name: str, overload: str) -> tuple[str, str, str]:
    return ("" if domain == "ai.onnx" else domain, name, overload)


def expanded_nodes(proto: ModelProto, most: int) -> int:
    """Nodes of the model's graph (subgraphs included) once each call of a local function is
    expanded into the function's body, and those bodies' calls in turn: what onnx's shape
    inference and the devices' inlining walk. Counted without expanding anything, and at most
    ``most + 1`` (each function's size once, its callees' first). InvalidModel when the
    functions call each other in a circle (ONNX forbids it; onnx's checker says so too)."""
    functions = {_key(f.domain, f.name, f.overload): f for f in proto.functions}
    calls: dict[tuple[str, str, str], list[tuple[str, str, str]]] = {}
    own: dict[tuple[str, str, str], int] = {}
    for key, function in functions.items():
        own[key], calls[key] = _calls_in(function.node, functions)
    callers: dict[tuple[str, str, str], list[tuple[str, str, str]]] = {k: [] for k in functions}
    waiting = {key: len(set(callees)) for key, callees in calls.items()}
    for key, callees in calls.items():
        for callee in set(callees):
            callers[callee].append(key)
    ready = [key for key, count in waiting.items() if not count]
    size: dict[tuple[str, str, str], int] = {}
    while ready:
        key = ready.pop()
        size[key] = min(most + 1, own[key] + sum(size[c] for c in calls[key]))
        for caller in callers[key]:
            waiting[caller] -= 1
            if not waiting[caller]:
                ready.append(caller)
    if len(size) < len(functions):
        circle = sorted(f"{k[0]}::{k[1]}" for k in functions if k not in size)
        raise InvalidModel(
            f"model-local functions call each other in a circle (among {', '.join(circle[:4])}"
            f"{', ...' if len(circle) > 4 else ''}); a function may not call itself"
        )
    count, called = _calls_in(proto.graph.node, functions)
    return min(most + 1, count + sum(size[c] for c in called))


#: what one value an attribute lists may hold once read: 8 bytes parsed, as many in onnx's
#: checker, a Python object of 28-32 bytes and its list's slot when a device reads it
ATTRIBUTE_VALUE_BYTES = 64


def _listed(attr: onnx.AttributeProto) -> int:
    """The values ``attr`` lists, a string of a text tensor counting twice (a Python object of
    ~115 bytes each once read, as a text weight's: ``ir.STRING_ELEMENT_BYTES``)."""
    strings = len(attr.t.string_data) + sum(len(t.string_data) for t in attr.tensors)
    return (
        2 * strings
        + len(attr.ints)
        + len(attr.floats)
        + len(attr.strings)
        + len(attr.tensors)
        + len(attr.graphs)
        + len(attr.sparse_tensors)
        + len(attr.type_protos)
    )


def check_nodes(proto: ModelProto, label: str) -> None:
    """Refuse a model with more nodes than a read may take, its local functions expanded where
    they are called, or whose attributes list more values than a read may hold, before
    anything else reads it."""
    most = _limits.max_nodes
    flag = "--max-model-nodes / PLUGSERVE_MAX_MODEL_NODES"
    count = len(proto.graph.node) + sum(len(f.node) for f in proto.functions)
    tally = _tally(proto) if not most or count <= most else None  # a walk when it has room
    if most and (tally is None or tally.nodes > most):
        count = count if tally is None else tally.nodes
        raise InvalidModel(
            f"model {label!r} has {count:,} nodes (its subgraphs and functions included), "
            f"over this server's limit of {most:,} ({flag}); send a smaller model, or "
            "raise the limit"
        )
    assert tally is not None
    try:
        expanded = expanded_nodes(proto, most) if proto.functions else 0
    except InvalidModel as exc:
        raise InvalidModel(f"model {label!r}: {exc}") from None
    if most and expanded > most:
        raise InvalidModel(
            f"model {label!r}: its local functions, expanded where they are called, make more "
            f"than {most:,} nodes, this server's limit ({flag}); send a smaller model, or raise "
            "the limit"
        )
    room = _limits.max_bytes // ATTRIBUTE_VALUE_BYTES
    if room and tally.listed > room:
        listed, node, op, attr = tally.most
        raise InvalidModel(
            f"model {label!r}: its attributes list {tally.listed:,} values, more than "
            f"{room:,} (node {node!r}, {op}, attribute {attr!r}: {listed:,}); a value costs "
            f"about {ATTRIBUTE_VALUE_BYTES} bytes read, and a read may hold "
            f"{_limits.max_bytes:,} ({READ_BYTES}); keep large values in tensors "
            "(initializers), or raise the limit"
        )


def parse_model(data: bytes, label: str = "the model") -> ModelProto:
    """A ModelProto from a client's bytes; a parse that would hold more than
    :attr:`ReadLimits.max_bytes` beyond the bytes themselves is refused (InvalidModel) before
    it is made (see the module's docstring). Bytes that do not parse raise protobuf's
    DecodeError (or, for some garbage, another exception), as ``ParseFromString`` does."""
    bound = _limits.max_bytes
    if bound and len(data) * PARSE_GROWTH > bound and not _here.is_set():
        _probe_parse(data, label)
    proto = ModelProto()
    proto.ParseFromString(data)
    return proto


# ----------------------------------------------------------------- values plugserve computes


class Allowance:
    """What one read may still compute in the server, in bytes (0 at start: no bound)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return not self.total or self.used + nbytes <= self.total

    def take(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` about to be allocated for ``what``; InvalidModel when over."""
        if not self.fits(nbytes):
            raise InvalidModel(
                f"{what} would hold {nbytes:,} bytes, and reading the model has computed "
                f"{self.used:,} of the {self.total:,} bytes one read may (--max-read-bytes / "
                "PLUGSERVE_MAX_READ_BYTES, plus 8x the model's own weights); send a smaller "
                "model, or raise the limit"
            )
        self.used += nbytes

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` computed (its size was not known before: the caller checked)."""
        self.used += nbytes


def allowance(weights: int = 0) -> Allowance:
    """A fresh allowance for one read (one model's graph built, or one run of its passes):
    :attr:`ReadLimits.max_bytes`, plus ``weights`` (the bytes of the model's own
    initializers) times :data:`WEIGHT_GROWTH`; no bound when the process sets none."""
    bound = _limits.max_bytes
    return Allowance(bound + WEIGHT_GROWTH * weights if bound else 0)


# ----------------------------------------------------------------- shape inference


_helpers = Workers("plugserve.plugins.shape_worker", HELPERS, "shape-inference", READ_SECONDS)
#: set once the fallback without a helper has been logged
_warned = threading.Event()
#: set in a helper process that is bounded itself (``openvino/query_process.py``): shape
#: inference runs in it
_here = threading.Event()


def read_here() -> None:
    """Run shape inference in this process from now on: it is a bounded helper already."""
    _here.set()


#: what the inferred model may add to the model sent, as a share of --max-read-bytes: parsing
#: it back and reading its shapes took ~18x its size here (20 values of rank 65,536 from a
#: 1 KB model: 5.2 MB back, the server 95 MB larger), so a thirty-second keeps that within the
#: bound. Real models add ~65 bytes a node (96 KB sent, 136 KB back for a 621-node decoder):
#: the default's 8 MiB is room for 120,000
ANSWER_SHARE = 32


def _inferred(data: bytes, label: str, **flags: bool) -> bytes:
    bound = _limits
    seconds = bound.seconds or _FOREVER
    most = len(data) + bound.max_bytes // ANSWER_SHARE if bound.max_bytes else 0
    try:
        with _helpers.one(seconds, (str(bound.max_bytes),)) as helper:
            answer, body = helper.ask(flags, data, seconds, most, f"model {label!r}")
    except TooLarge as exc:
        raise InvalidModel(
            f"model {label!r}: shape inference's answer is {exc.args[0]:,} bytes, more than "
            f"{most:,} (the model and a thirty-second of --max-read-bytes / "
            "PLUGSERVE_MAX_READ_BYTES for the shapes it adds); send a smaller model, or raise "
            "the limit"
        ) from None
    except TimeoutError:
        raise ResourceExhausted(
            f"model {label!r}: shape inference took more than {bound.seconds:g} s, this "
            "server's limit (--max-read-seconds / PLUGSERVE_MAX_READ_SECONDS); send a smaller "
            "model, or raise the limit"
        ) from None
    except (Crashed, OSError, ValueError):
        answer, body = {"error": "MemoryError"}, b""  # the helper died: out of memory
    error = answer.get("error")
    if error == "MemoryError":
        raise InvalidModel(
            f"model {label!r}: shape inference needs more than {bound.max_bytes:,} bytes, "
            "the most reading a model may take (--max-read-bytes / PLUGSERVE_MAX_READ_BYTES); "
            "send a smaller model, or raise the limit"
        )
    if error == "InferenceError":
        raise onnx.shape_inference.InferenceError(answer.get("message", ""))
    if error:
        raise RuntimeError(f"{error}: {answer.get('message', '')}")
    return body


def _probe_parse(data: bytes, label: str) -> None:
    """Parse ``data`` in a helper whose data may grow by its bytes and the read's limit, and
    check its nodes there (:func:`check_nodes`): past the room or a count, InvalidModel; bytes
    that do not parse, DecodeError (the server need not try)."""
    bound = _limits
    seconds = bound.seconds or _FOREVER
    try:
        with _helpers.one(seconds, (str(bound.max_bytes),)) as helper:
            header = {"parse": True, "limits": dataclasses.asdict(bound)}
            answer, _ = helper.ask(header, data, seconds, 0, label)
    except NoWorker as exc:  # as infer_shapes: the server parses it, unbounded
        if not _warned.is_set():
            _warned.set()
            log.warning("a model's parse runs in this process, unbounded: no helper (%s)", exc)
        return
    except TimeoutError:
        raise ResourceExhausted(
            f"{label}: parsing it took more than {bound.seconds:g} s, this server's limit "
            f"({READ_SECONDS}); send a smaller model, or raise the limit"
        ) from None
    except (Crashed, OSError, ValueError):
        answer = {"error": "MemoryError"}
    error = answer.get("error")
    if error == "InvalidModel":  # check_nodes' refusal, made in the helper
        raise InvalidModel(answer.get("message", ""))
    if error == "MemoryError":
        raise InvalidModel(
            f"{label}: parsing its {len(data):,} bytes would hold more than {bound.max_bytes:,} "
            f"bytes beyond them ({READ_BYTES}): its messages are many and small (protobuf "
            "holds an empty node, 2 bytes sent, in ~140); send a smaller model, or raise the "
            "limit"
        )
    if error:
        raise DecodeError(f"{label}: {error}")


def infer_shapes(
    model: ModelProto | bytes,
    label: str = "model",
    *,
    strict: bool = False,
    data_prop: bool = False,
    check_type: bool = False,
) -> ModelProto:
    """onnx's ``infer_shapes`` on ``model``, in a bounded helper process (see the module's
    docstring): onnx's own errors raise as they would in the server (``InferenceError`` and
    others); InvalidModel past :attr:`ReadLimits.max_bytes`, ResourceExhausted past
    :attr:`ReadLimits.seconds`. Pass the model without its weights
    (``model_copies.without_weights``): they are copied to the helper and back."""
    data = model if isinstance(model, bytes) else model.SerializeToString()
    if _here.is_set():
        return onnx.shape_inference.infer_shapes(
            data, check_type=check_type, strict_mode=strict, data_prop=data_prop
        )
    try:
        body = _inferred(data, label, strict=strict, data_prop=data_prop, check_type=check_type)
    except NoWorker as exc:  # a sandbox without fork, a Python that cannot import us
        if not _warned.is_set():
            _warned.set()
            log.warning("shape inference runs in this process, unbounded: no helper (%s)", exc)
        return onnx.shape_inference.infer_shapes(
            data, check_type=check_type, strict_mode=strict, data_prop=data_prop
        )
    inferred = ModelProto()
    inferred.ParseFromString(body)
    return inferred
