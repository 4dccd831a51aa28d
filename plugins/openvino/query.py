"""Glue between openvino's graph and the ONNX graph: who made which openvino op.

openvino's ONNX frontend names the last op of an ONNX node after the node (or after its output
when the node has no name) and gives its output tensors the ONNX value names; ops it adds while
decomposing a node get names of their own (``ShapeOf_20``) or the node's name plus a suffix
(``conv1/WithoutBiases``). :func:`owners` maps every openvino op back to the ONNX node(s) it
came from: by tensor name, then by name, and an op with neither belongs to the node its
results flow into. QueryNetwork and the performance counters report through this map.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import onnx
from onnx import helper, numpy_helper

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, onnx_dtype, subgraph_free_names

__all__ = [
    "Names",
    "cut_model",
    "frontend_unsupported",
    "owners",
    "single_node_models",
    "supported_nodes",
]

#: openvino op types that stand for an ONNX node the frontend could not convert
FRAMEWORK_TYPES = ("NotSupportedONNXNode", "ONNXFrameworkNode", "FrameworkNode")
_UNOWNED_TYPES = ("Parameter", "Result")


class Names:
    """What an ONNX graph calls its nodes and values, for matching openvino's names."""

    def __init__(self, graph: Graph, proto: onnx.ModelProto) -> None:
        self.graph = graph
        self.proto = proto
        self.nodes = [n.name for n in graph.nodes]
        #: value name -> the node (load_model's name) that produces it
        self.produced = {out: n.name for n in graph.nodes for out in n.outputs if out}
        #: graph inputs and initializers: values no node produces
        self.boundary = {i.name for i in graph.inputs} | set(graph.initializers)
        #: names written in the ONNX file -> load_model's name (unnamed nodes have none here:
        #: their made-up names could collide with openvino's made-up ``Add_14``)
        self.written: dict[str, str] = {}
        for proto_node in proto.graph.node:
            outputs = [o for o in proto_node.output if o]
            if proto_node.name and outputs and outputs[0] in self.produced:
                self.written.setdefault(proto_node.name, self.produced[outputs[0]])

    def by_name(self, name: str) -> str | None:
        for candidate in (name, name.split("/", 1)[0]):
            if candidate in self.written:
                return self.written[candidate]
            if candidate in self.produced:
                return self.produced[candidate]
        return None


def _tensor_names(op: Any) -> set[str]:
    names: set[str] = set()
    for output in op.outputs():
        names |= set(output.get_names())
    return names


def owners(model: Any, names: Names) -> dict[str, tuple[str, ...]]:
    """``{openvino op friendly name: ONNX node names}`` for every op of ``model``."""
    ops = list(model.get_ordered_ops())
    owned: dict[int, set[str]] = {}
    anonymous: list[Any] = []
    for op in ops:
        if op.get_type_name() in _UNOWNED_TYPES:
            owned[id(op)] = set()
            continue
        tensors = _tensor_names(op)
        own = {names.produced[t] for t in tensors if t in names.produced}
        if not own and tensors & names.boundary:
            owned[id(op)] = set()  # an initializer or graph input made into a Constant
            continue
        if not own:
            node = names.by_name(op.get_friendly_name())
            if node is not None:
                own = {node}
        if own:
            owned[id(op)] = own
        else:
            anonymous.append(op)
    # an op the frontend made up belongs to the node(s) its results flow into
    resolved: dict[int, set[str]] = {}
    pending = {id(op) for op in anonymous}
    for op in reversed(ops):
        if id(op) not in pending:
            continue
        result: set[str] = set()
        for output in op.outputs():
            for target in output.get_target_inputs():
                user = target.get_node()
                key = id(user)
                result |= owned.get(key) if key in owned else resolved.get(key, set())
        resolved[id(op)] = result
    mapping: dict[str, set[str]] = {}
    for op in ops:
        nodes = owned.get(id(op)) if id(op) in owned else resolved.get(id(op), set())
        mapping.setdefault(op.get_friendly_name(), set()).update(nodes or ())
    return {name: tuple(sorted(nodes)) for name, nodes in mapping.items()}


def frontend_unsupported(core: Any, proto_bytes: bytes, names: Names) -> dict[str, str]:
    """``{ONNX node: op}`` for the nodes openvino's ONNX frontend has no conversion for."""
    from openvino.frontend import FrontEndManager

    frontend = FrontEndManager().load_by_framework("onnx")
    partial = frontend.convert_partially(frontend.load(io.BytesIO(proto_bytes)))
    by_node = {n.name: n for n in names.graph.nodes}
    found: dict[str, str] = {}
    mapping = owners(partial, names)
    for op in partial.get_ordered_ops():
        if op.get_type_name() in FRAMEWORK_TYPES:
            for node_name in mapping.get(op.get_friendly_name(), ()):
                node = by_node[node_name]
                found[node_name] = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    return found


def cut_model(proto: onnx.ModelProto, names: Names, removed: Iterable[str]) -> onnx.ModelProto:
    """``proto`` without the ``removed`` nodes: what they made becomes graph inputs, what they
    read becomes graph outputs, so the rest keeps its types and is not dropped as dead."""
    removed = set(removed)
    graph = names.graph
    by_name = {n.name: n for n in graph.nodes}
    cut_values = [o for name in removed for o in by_name[name].outputs if o]
    read_values = [
        i
        for name in removed
        for i in by_name[name].inputs
        if i and i in names.produced and names.produced[i] not in removed
    ]
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    kept = [
        n
        for n in model.graph.node
        if not (n.output and names.produced.get(next((o for o in n.output if o), "")) in removed)
    ]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    outputs = [o for o in model.graph.output if o.name not in cut_values]
    seen = {o.name for o in outputs}
    for value in read_values:
        if value not in seen:
            seen.add(value)
            outputs.append(_value_info(graph.spec(value), value, None))
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    for name in removed:
        node = by_name[name]
        first = graph.spec(node.inputs[0]) if node.inputs and node.inputs[0] else None
        for value in node.outputs:
            if value:
                model.graph.input.append(_value_info(graph.spec(value), value, first))
    return model


def _value_info(
    spec: TensorSpec | None, name: str, guess: TensorSpec | None
) -> onnx.ValueInfoProto:
    """A typed value; an output of a custom op ONNX cannot type takes its first input's
    element type and rank."""
    known = spec is not None and spec.dtype is not None and spec.shape is not None
    dtype = spec.dtype if known else None
    shape = spec.shape if known else None
    if not known and guess is not None:
        # openvino's CPU device refuses ops on tensors of unknown rank: keep the input's rank
        dtype = guess.dtype
        shape = None if guess.shape is None else tuple(None for _ in guess.shape)
    elem = onnx_dtype(dtype) if dtype is not None else onnx.TensorProto.FLOAT
    dims = None if shape is None else list(shape)
    return helper.make_tensor_value_info(name, elem, dims)


def single_node_models(
    graph: Graph, proto: onnx.ModelProto
) -> Iterable[tuple[Any, onnx.ModelProto]]:
    """Each node of ``graph`` as a model of its own, for asking openvino node by node: its
    inputs typed from the whole graph's inference (unknown ones keep their rank if known,
    else stay unranked: openvino only reads these, ONNX's checker never sees them), the
    initializers it reads, its outputs untyped for openvino to infer."""
    opsets = list(proto.opset_import)
    for node in graph.nodes:
        if node.op_type == "Constant" and not node.domain:
            continue  # housekeeping places Constants with their readers
        reads = [n for n in [*node.inputs, *subgraph_free_names(node)] if n]
        inputs = [n for n in dict.fromkeys(reads) if n not in graph.initializers]
        initializers = [n for n in dict.fromkeys(reads) if n in graph.initializers]
        single = helper.make_model(
            helper.make_graph(
                [node.to_proto()],
                node.name or "node",
                [_value_info(graph.spec(n), n, None) for n in inputs],
                [helper.make_empty_tensor_value_info(o) for o in node.outputs if o],
                initializer=[
                    numpy_helper.from_array(graph.initializers[n], n) for n in initializers
                ],
            ),
            opset_imports=opsets,
            functions=graph.functions,
        )
        single.ir_version = proto.ir_version
        yield node, single


def supported_nodes(
    model: Any, names: Names, supported_ops: Iterable[str], refused: Iterable[str] = ()
) -> set[str]:
    """ONNX nodes every op of which openvino supports (a node that became no op at all, say an
    Identity folded away, is supported unless ``refused``)."""
    supported_ops = set(supported_ops)
    refused = set(refused)
    mapping = owners(model, names)
    unsupported: set[str] = set(refused)
    for op_name, nodes in mapping.items():
        if op_name not in supported_ops:
            unsupported.update(nodes)
    return {n for n in names.nodes if n not in unsupported}


def runtime_names(
    compiled: Any, mapping: dict[str, tuple[str, ...]], graph: Graph | None
) -> dict[str, tuple[str, ...]]:
    """``{compiled (runtime) node name: ONNX node names}`` for the performance counters.

    A runtime node lists the openvino ops it was made from (``originalLayersNames``); ops the
    CPU device's own transformations created are unknown to :func:`owners`, so an ONNX node no
    runtime node names is counted with its first consumer (it was fused into it), or failing
    that with its producer.
    """
    names: dict[str, set[str]] = {}
    try:
        runtime = compiled.get_runtime_model()
    except Exception:
        return {}
    for op in runtime.get_ordered_ops():
        try:
            original = str(op.get_rt_info()["originalLayersNames"].astype(str))
        except Exception:
            original = op.get_friendly_name()
        found: set[str] = set()
        for layer in filter(None, original.split(",")):
            found.update(mapping.get(layer, ()))
        names[op.get_friendly_name()] = found
    if graph is not None:
        _place_missing(graph, names)
    return {k: tuple(sorted(v)) for k, v in names.items()}


def _place_missing(graph: Graph, names: dict[str, set[str]]) -> None:
    where: dict[str, set[str]] = {}
    for runtime_name, nodes in names.items():
        for node in nodes:
            where.setdefault(node, set()).add(runtime_name)
    users = graph.consumers()
    producers = graph.producers()
    for node in reversed(graph.nodes):
        if node.name in where:
            continue
        for out in node.outputs:
            for user in users.get(out, []):
                if user.name in where:
                    where[node.name] = {sorted(where[user.name])[0]}
                    break
            if node.name in where:
                break
    for node in graph.nodes:
        if node.name in where:
            continue
        for name in node.inputs:
            producer = producers.get(name)
            if producer is not None and producer.name in where:
                where[node.name] = {sorted(where[producer.name])[0]}
                break
    for node_name, runtime in where.items():
        for runtime_name in runtime:
            names[runtime_name].add(node_name)
