"""OPENVINO's QueryNetwork answered by a helper process (its program: :mod:`.query_helper`).

QueryNetwork is open to any ``infer`` client, and answering it runs openvino's native code on
the client's model: its ONNX frontend (``read_model``), ``query_model``, which folds constants
(a 213-byte model, ``ConstantOfShape`` of a shape computed from constants, had it fold a
4.9 GB constant over 99 s), and, for each node openvino claims, a compile and a run of that
node alone on inputs of its declared sizes (:mod:`.verify`: a 76-byte model with a
[16000, 16000] input took 5.3 GB; 2,000 distinct nodes took 82 s of compiles, which went on
after the caller had gone). And openvino 2026.4 dies of SIGSEGV folding a ``CumSum`` whose
constant axis is out of range: one 221-byte model took the whole server down.

So the server reads the model itself first (bounded as every read is: ``plugins/reading.py``;
the constants it would fold checked: ``passes/sizes.py``), then hands the bytes it read to a
helper (``plugins/workers.py``) that runs :meth:`OpenvinoPlugin.answer_query` on them: its
data bounded by ``--max-read-bytes`` plus 8x the model's bytes (openvino's copy of the weights
and its folding), its time by ``--max-read-seconds``, its life by the caller (a QueryNetwork
whose client is gone kills it); a crash is that model's refusal (``Unsupported``: HETERO and
AUTO go on without OPENVINO). The answer names the same nodes as the server's read: the helper
reads the same bytes the same way.

Cost: a helper imports openvino and plugserve's NUMPY device once (about a second), and stays
for the next query, keeping its verdicts of node signatures (:mod:`.verify`); a query sends the
model over a pipe once more than before. Without a helper (a sandbox without fork) the query
runs in the server, as before.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import onnx

from plugserve.plugins import errors, reading
from plugserve.plugins.errors import InvalidModel, PlugserveError, ResourceExhausted, Unsupported
from plugserve.plugins.workers import Crashed, NoWorker, Workers

__all__ = ["HELPERS", "MAX_NESTING", "ask", "check_nesting"]

log = logging.getLogger(__name__)

#: helper processes at most: queries beyond them wait their turn
HELPERS = 2
#: what "no time limit" (--max-read-seconds 0) waits: a year
_FOREVER = 365 * 86400.0
#: subgraphs (If, Loop, Scan bodies) nested deeper than this are not given to openvino: its
#: conversion of them takes time that grows ~1.8x a level (If in If: 12 deep 0.17 s, 16 deep
#: 1.2 s, 20 deep 13 s, 22 deep past --max-read-seconds: two such 3.8 KB queries held both
#: helpers, and every other client's OPENVINO query waited); real models nest a few deep
MAX_NESTING = 10

_helpers = Workers(
    "plugserve.plugins.openvino.query_helper", HELPERS, "OPENVINO query", reading.READ_SECONDS
)
_warned = threading.Event()


def ask(
    data: bytes, config: dict[str, str], label: str, verify: bool
) -> tuple[set[str], dict[str, str]] | None:
    """The helper's ``(supported, why)`` for the model ``data`` (read and checked by the
    server) under ``config`` (the merged configuration's strings); None when no helper can
    start here (the caller answers in its own process)."""
    bound = reading.limits()
    seconds = bound.seconds or _FOREVER
    most = bound.max_bytes + reading.WEIGHT_GROWTH * len(data) if bound.max_bytes else 0
    limits = dataclasses.asdict(bound)
    header = {"config": config, "verify": verify, "max_bytes": most, "limits": limits}
    try:
        with _helpers.one(seconds) as helper:
            answer, _ = helper.ask(header, data, seconds, 0, f"QueryNetwork of {label!r}")
            if answer.get("error"):  # raised within: the helper is replaced
                raise _error(answer, label, most)
    except NoWorker as exc:
        if not _warned.is_set():
            _warned.set()
            log.warning("OPENVINO queries run in this process, unbounded: no helper (%s)", exc)
        return None
    except Crashed as exc:
        log.warning("model %r: OPENVINO's query process ended (%s)", label, exc.args[0])
        raise Unsupported(
            f"model {label!r}: openvino failed on it (its query process ended with "
            f"{_ended(exc.args[0])}); the OPENVINO device takes none of its nodes"
        ) from None
    except TimeoutError:
        raise ResourceExhausted(
            f"model {label!r}: OPENVINO's query took more than {bound.seconds:g} s, this "
            "server's limit (--max-read-seconds / PLUGSERVE_MAX_READ_SECONDS); send a smaller "
            "model, or raise the limit"
        ) from None
    return set(answer["supported"]), dict(answer["why"])


def check_nesting(proto: onnx.ModelProto, label: str) -> None:
    """Unsupported (OPENVINO takes none of the model) when its subgraphs nest deeper than
    :data:`MAX_NESTING`; counted without building anything."""
    pending = [(proto.graph, 0)]
    while pending:
        graph, depth = pending.pop()
        for node in graph.node:
            for attr in node.attribute:
                inner = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs
                for sub in inner:
                    if depth + 1 > MAX_NESTING:
                        raise Unsupported(
                            f"model {label!r}: its subgraphs nest more than {MAX_NESTING} deep "
                            f"(node {node.name!r}, {node.op_type}); openvino's conversion of "
                            "them takes time that doubles every level or so: the OPENVINO "
                            "device takes none of its nodes"
                        )
                    pending.append((sub, depth + 1))


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        import signal

        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _error(answer: dict, label: str, most: int) -> PlugserveError:
    name, message = answer["error"], str(answer.get("message", ""))
    if name == "MemoryError":
        return InvalidModel(
            f"model {label!r}: OPENVINO's query needs more than {most:,} bytes, the most a "
            "query may take (--max-read-bytes / PLUGSERVE_MAX_READ_BYTES, plus 8x the "
            "model's bytes); send a smaller model, or raise the limit"
        )
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, PlugserveError):
        return kind(message)
    return Unsupported(f"model {label!r}: openvino's query failed: {message}")
