"""Cutting a graph into per-device ONNX models, one per subgraph of the partition.

Each piece is a complete ONNX model: its inputs are the values it reads that other pieces (or
the network's inputs) produce, its outputs the values others read or the network returns,
initializers travel with the nodes that read them. Types come from the whole graph's shape
inference, so every boundary value is typed.
"""

from __future__ import annotations

import dataclasses

import onnx
from onnx import helper, numpy_helper

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, onnx_dtype, subgraph_free_names

__all__ = ["Piece", "cut"]


@dataclasses.dataclass
class Piece:
    device: str
    node_names: list[str]  # original node names, in execution order
    inputs: list[str]
    outputs: list[str]
    model: onnx.ModelProto


def _value_info(graph: Graph, name: str) -> onnx.ValueInfoProto:
    spec = graph.spec(name) or TensorSpec(name, None, None)
    for raw in (*graph.raw_inputs, *graph.raw_outputs):
        if raw.name == name:
            return raw
    if spec.dtype is None:
        return helper.make_empty_tensor_value_info(name)
    shape = None if spec.shape is None else list(spec.shape)
    return helper.make_tensor_value_info(name, onnx_dtype(spec.dtype), shape)


def _plain(node) -> onnx.NodeProto:
    """The node as ONNX has it: our runtime info stays out of models handed to other devices."""
    proto = node.to_proto()
    del proto.metadata_props[:]
    return proto


def cut(graph: Graph, subgraphs: list[tuple[str, list[int]]]) -> list[Piece]:
    """One :class:`Piece` per ``(device, node indices)``, in the order given."""
    reads: dict[int, set[str]] = {}
    for index, node in enumerate(graph.nodes):
        reads[index] = {n for n in node.inputs if n} | set(subgraph_free_names(node))
    owner: dict[int, int] = {i: k for k, (_, nodes) in enumerate(subgraphs) for i in nodes}
    outside_reads: dict[int, set[str]] = {k: set() for k in range(len(subgraphs))}
    for index, names in reads.items():
        for k in range(len(subgraphs)):
            if owner[index] != k:
                outside_reads[k] |= names
    graph_outputs = [o.name for o in graph.outputs]
    pieces = []
    for k, (device, indices) in enumerate(subgraphs):
        nodes = [graph.nodes[i] for i in sorted(indices)]
        produced = [o for n in nodes for o in n.outputs if o]
        consumed: list[str] = []
        for i in sorted(indices):
            consumed += [n for n in sorted(reads[i]) if n not in consumed]
        inputs = [n for n in consumed if n not in produced and n not in graph.initializers]
        initializers = [n for n in consumed if n in graph.initializers]
        outputs = [o for o in produced if o in outside_reads[k] or o in graph_outputs]
        model = helper.make_model(
            helper.make_graph(
                [_plain(n) for n in nodes],
                f"{graph.name}/{device}/{k}",
                [_value_info(graph, n) for n in inputs],
                [_value_info(graph, n) for n in outputs],
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
