"""Checking that openvino computes an op as ONNX says before QueryNetwork claims it.

openvino's own query answers which ops it *can* run, not whether it runs them right: 2026.4
computes ``ReduceLogSumExp(axes=[1], keepdims=1)`` of a [2, 3] input as a [1, 1] tensor, and a
HETERO network that gave it that node answered a scikit-learn pipeline's probabilities as
1e-16. So each node openvino claims is also run alone, on made-up data of its input types and
shapes (its constant inputs as they are), on openvino and on the reference device (NUMPY), and
a node whose outputs disagree in shape, element type or value is not claimed: HETERO leaves it
to the next device, with the reason in ``plugserve query``.

One verdict per op signature (op, attributes, input types and shapes, small constants' values,
openvino's version and the precision asked for), kept for the process: a model's 50 Convs of
four shapes cost four checks, and loading it again costs none. A node that cannot be checked
(an input of unknown rank, a string, a subgraph, a random op, data the reference refuses,
inputs or outputs over :data:`MOST_BYTES`) keeps openvino's word; at run time HETERO still
checks every value a piece hands on (``plugins/outputcheck.py``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import onnx

from plugserve.plugins import cancel
from plugserve.plugins.api import CompiledNetwork, PlugserveError
from plugserve.plugins.ir import Graph, Node, attribute_graphs
from plugserve.plugins.openvino.query import single_node_models
from plugserve.plugins.outputcheck import DIM, compare_outputs, made_up_inputs

__all__ = ["wrong_nodes"]

log = logging.getLogger(__name__)

#: ops whose result is random by definition: nothing to compare
_RANDOM = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)  # fmt: skip
#: constant inputs up to this many elements are part of the signature by value
_SMALL = 4096
#: the most bytes a node's made-up inputs or its outputs may take to be checked: a larger
#: node keeps openvino's word (a 76-byte model declaring a [16000, 16000] input took 5.3 GB
#: to check; a real model's largest activations, a 224x224 image's 64 channels, are 13 MB)
MOST_BYTES = 64 << 20
#: most signatures remembered (a process serving many models stays bounded)
_MOST = 16384

_verdicts: dict[tuple, str] = {}
_lock = threading.Lock()


def wrong_nodes(
    graph: Graph,
    proto: onnx.ModelProto,
    claimed: Iterable[str],
    run_openvino: Callable[[onnx.ModelProto], Callable[[dict[str, np.ndarray]], list[Any]]],
    reference: Callable[[onnx.ModelProto], CompiledNetwork],
    version: str,
    precision: str,
) -> dict[str, str]:
    """``{node: why}`` for the ``claimed`` nodes openvino computes otherwise than ``reference``
    does. ``run_openvino(model)`` compiles a single-node model and returns its runner;
    ``precision``: what openvino computes in (f32, bf16, f16), which sets the tolerance."""
    claimed = set(claimed)
    found: dict[str, str] = {}
    for node, single in single_node_models(graph, proto):
        if node.name not in claimed or not _checkable(node):
            continue
        cancel.check(f"checking node {node.name!r} on openvino")
        try:
            verdict = _verdict(node, single, graph, run_openvino, reference, version, precision)
        except Exception:  # a check that cannot be made gives no verdict, never a failure
            log.debug("checking %s (%s) on openvino failed", node.name, node.op_type, exc_info=True)
            verdict = ""
        if verdict:
            found[node.name] = verdict
    return found


def _verdict(
    node: Node,
    single: onnx.ModelProto,
    graph: Graph,
    run_openvino: Callable[[onnx.ModelProto], Callable[[dict[str, np.ndarray]], list[Any]]],
    reference: Callable[[onnx.ModelProto], CompiledNetwork],
    version: str,
    precision: str,
) -> str:
    typed = _typed_outputs(single, graph)
    if typed is None or _output_bytes(typed) > MOST_BYTES:
        return ""
    feeds = made_up_inputs(single, most_bytes=MOST_BYTES)
    if feeds is None:
        return ""
    key = _signature(node, graph, feeds, version, precision)
    with _lock:
        verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _compare(node, single, typed, feeds, run_openvino, reference, precision)
        with _lock:
            if len(_verdicts) >= _MOST:
                _verdicts.clear()
            _verdicts[key] = verdict
    return verdict


def _output_bytes(typed: onnx.ModelProto) -> int:
    """The most bytes the typed single-node model's outputs declare (unknown dims as
    ``outputcheck.DIM``, 8 bytes an element)."""
    total = 0
    for value in typed.graph.output:
        elements = 1
        for d in value.type.tensor_type.shape.dim:
            elements *= d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else DIM
            if elements > 1 << 62:
                break
        total += 8 * elements
    return total


def _checkable(node: Node) -> bool:
    if node.op_type in _RANDOM or node.domain not in ("", "ai.onnx"):
        return False
    return not any(attribute_graphs(a) for a in node.attrs.values())


def _typed_outputs(single: onnx.ModelProto, graph: Graph) -> onnx.ModelProto | None:
    """The single-node model with its outputs typed as the whole graph's inference says (ONNX's
    checker, which the reference runs, wants them typed), or None if one is not known."""
    typed = onnx.ModelProto()
    typed.CopyFrom(single)
    del typed.graph.output[:]
    for name in (o for o in single.graph.output):
        spec = graph.spec(name.name)
        if spec is None or spec.kind != "tensor" or spec.dtype is None or spec.dtype == object:
            return None
        shape = (
            None
            if spec.shape is None
            else [d if isinstance(d, int) and d >= 0 else None for d in spec.shape]
        )
        typed.graph.output.append(
            onnx.helper.make_tensor_value_info(
                name.name, onnx.helper.np_dtype_to_tensor_dtype(spec.dtype), shape
            )
        )
    return typed


def _signature(
    node: Node,
    graph: Graph,
    feeds: dict[str, np.ndarray],
    version: str,
    precision: str,
) -> tuple:
    attrs = tuple(sorted((k, a.SerializeToString()) for k, a in node.attrs.items()))
    constants = []
    for name in node.inputs:
        value = graph.initializers.get(name) if name else None
        if value is None:
            continue
        array = np.asarray(value)
        digest = (
            hashlib.blake2b(array.tobytes(), digest_size=16).digest()
            if array.size <= _SMALL
            else b""
        )
        constants.append((array.dtype.str, array.shape, digest))
    inputs = tuple((a.dtype.str, a.shape) for a in feeds.values())
    opset = graph.node_opset(node)
    return (node.domain, node.op_type, opset, attrs, inputs, tuple(constants), version, precision)


def _compare(
    node: Node,
    single: onnx.ModelProto,
    typed: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    run_openvino: Callable[[onnx.ModelProto], Callable[[dict[str, np.ndarray]], list[Any]]],
    reference: Callable[[onnx.ModelProto], CompiledNetwork],
    precision: str,
) -> str:
    """'' when openvino agrees with the reference (or either cannot run the check), else why
    it does not."""
    try:
        want = reference(typed).infer(feeds)
    except PlugserveError:
        return ""  # the reference refuses the made-up data: no verdict
    try:
        got = run_openvino(single)(feeds)
    except Exception as exc:  # openvino fails on data the reference takes: no verdict
        log.debug("openvino check of %s (%s) failed to run: %s", node.name, node.op_type, exc)
        return ""
    names = [o for o in node.outputs if o]
    problem = compare_outputs(dict(zip(names, got)), want, precision)
    return f"openvino computes {node.op_type} here wrongly: {problem}" if problem else ""
