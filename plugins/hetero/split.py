"""Cutting a graph into per-device ONNX models, one per subgraph of the partition.

Each piece is a complete ONNX model: its inputs are the values it reads that other pieces (or
the network's inputs) produce, its outputs the values others read or the network returns,
initializers travel with the nodes that read them. Types come from the whole graph's shape
inference and :mod:`.typing`'s rules; a boundary value neither can type fails the cut with
an error saying what to pin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import onnx
from onnx import helper, numpy_helper

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.hetero.typing import untyped_boundary
from plugserve.plugins.ir import Graph, onnx_dtype, subgraph_free_names

__all__ = ["Piece", "cut", "untyped_crossings"]


@dataclasses.dataclass
class Piece:
    device: str
    node_names: list[str]  # original node names, in execution order
    inputs: list[str]
    outputs: list[str]
    model: onnx.ModelProto


def _value_info(
    graph: Graph, name: str, declared: dict[str, onnx.ValueInfoProto]
) -> onnx.ValueInfoProto:
    """``declared``: the graph's own input and output declarations by name (used as they are)."""
    spec = graph.spec(name) or TensorSpec(name, None, None)
    if name in declared:
        return declared[name]
    if spec.dtype is None:
        return helper.make_empty_tensor_value_info(name)
    shape = None if spec.shape is None else list(spec.shape)
    return helper.make_tensor_value_info(name, onnx_dtype(spec.dtype), shape)


def _plain(node) -> onnx.NodeProto:
    """The node as ONNX has it: our runtime info stays out of models handed to other devices."""
    proto = node.to_proto()
    del proto.metadata_props[:]
    return proto


def _reads(graph: Graph) -> dict[int, list[str]]:
    """The values each node reads: its inputs and the outer-scope names its subgraphs use."""
    return {
        index: sorted(set([n for n in node.inputs if n] + subgraph_free_names(node)))
        for index, node in enumerate(graph.nodes)
    }


def _untyped(
    graph: Graph, reads: dict[int, list[str]], owner: dict[int, int]
) -> Iterator[tuple[str, int, int]]:
    """``(value, making piece, reading piece)`` for each value one piece hands to another
    without an element type and rank (ONNX's checker wants them on each piece's inputs and
    outputs), in node order."""
    producer = {o: owner[i] for i, n in enumerate(graph.nodes) for o in n.outputs if o}
    for index, names in reads.items():
        for name in names:
            source = producer.get(name)
            if source is None or source == owner[index]:
                continue
            spec = graph.spec(name)
            if spec is None or spec.dtype is None or spec.shape is None:
                yield name, source, owner[index]


def _owners(subgraphs: list[tuple[str, list[int]]]) -> dict[int, int]:
    return {i: k for k, (_, nodes) in enumerate(subgraphs) for i in nodes}


def untyped_crossings(graph: Graph, subgraphs: list[tuple[str, list[int]]]) -> dict[str, str]:
    """``{value: device of the piece making it}`` for the values :func:`cut` cannot type."""
    owner = _owners(subgraphs)
    found = _untyped(graph, _reads(graph), owner)
    return {name: subgraphs[source][0] for name, source, _ in found}


def _check_typed(graph: Graph, subgraphs: list[tuple[str, list[int]]], owner, reads) -> None:
    """Name the first value handed between pieces that has no type and rank."""
    for name, source, target in _untyped(graph, reads, owner):
        readers = [
            graph.nodes[i].name
            for i, other in reads.items()
            if name in other and owner[i] == target
        ]
        raise untyped_boundary(graph, name, subgraphs[source][0], subgraphs[target][0], readers)


def cut(graph: Graph, subgraphs: list[tuple[str, list[int]]]) -> list[Piece]:
    """One :class:`Piece` per ``(device, node indices)``, in the order given.

    Linear in the graph: who reads each value is collected once, not per piece.
    """
    reads = _reads(graph)
    owner = _owners(subgraphs)
    _check_typed(graph, subgraphs, owner, reads)
    readers: dict[str, set[int]] = {}  # value -> the pieces reading it
    for index, names in reads.items():
        for name in names:
            readers.setdefault(name, set()).add(owner[index])
    graph_outputs = {o.name for o in graph.outputs}
    declared: dict[str, onnx.ValueInfoProto] = {}
    for raw in (*graph.raw_inputs, *graph.raw_outputs):
        declared.setdefault(raw.name, raw)
    pieces = []
    for k, (device, indices) in enumerate(subgraphs):
        nodes = [graph.nodes[i] for i in sorted(indices)]
        produced = [o for n in nodes for o in n.outputs if o]
        made = set(produced)
        consumed = list(dict.fromkeys(n for i in sorted(indices) for n in reads[i]))
        inputs = [n for n in consumed if n not in made and n not in graph.initializers]
        initializers = [n for n in consumed if n in graph.initializers]
        outputs = [o for o in produced if readers.get(o, set()) - {k} or o in graph_outputs]
        model = helper.make_model(
            helper.make_graph(
                [_plain(n) for n in nodes],
                f"{graph.name}/{device}/{k}",
                [_value_info(graph, n, declared) for n in inputs],
                [_value_info(graph, n, declared) for n in outputs],
                initializer=[
                    numpy_helper.from_array(graph.initializers[n], n) for n in initializers
                ],
            ),
            opset_imports=[helper.make_opsetid(d, v) for d, v in graph.opsets.items()],
            functions=graph.functions,
        )
        model.ir_version = graph.ir_version
        pieces.append(Piece(device, [n.name for n in nodes], inputs, outputs, model))
    return pieces
