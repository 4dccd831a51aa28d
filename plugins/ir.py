"""The network IR: an ONNX graph as plain Python objects that passes can rewrite.

ONNX protobufs are awkward to edit in place, and every pass needs the same few things: nodes in
topological order, who produces and who consumes a value, initializers as numpy arrays, and per
node runtime info (affinity, the original node names a fused node came from). A :class:`Graph`
is built from a validated ``ModelProto`` by :func:`load_model` and turned back into one by
:meth:`Graph.to_model` (export, debugging, handing a subgraph to another backend).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import AttributeProto, GraphProto, ModelProto, TensorProto, helper, numpy_helper

from plugserve.plugins import (
    cancel,
    reading,
    schemas,  # noqa: F401  (onnxruntime's ONNX-domain ops, for the checker)
)
from plugserve.plugins.api import InvalidModel, PlugserveError, TensorSpec, Unsupported
from plugserve.plugins.model_copies import checked_form, without_weights

__all__ = [
    "NARROW_FLOATS",
    "NARROW_INTS",
    "Graph",
    "Node",
    "is_narrow",
    "load_model",
    "narrow_value",
    "np_dtype",
    "onnx_dtype",
    "refuse_external_data",
    "refuse_narrow_io",
    "value_spec",
    "zip_archive",
]


#: Element types numpy lacks, as ml_dtypes carries them (what ``np_dtype`` gives for bfloat16,
#: the float8 family, float4e2m1, int4/uint4 and int2/uint2); the ints map to the numpy type
#: they are computed in.
NARROW_FLOATS = frozenset(
    np.dtype(t)
    for t in (
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float8_e8m0fnu,
        ml_dtypes.float4_e2m1fn,
    )
)
NARROW_INTS = {
    np.dtype(ml_dtypes.int4): np.dtype(np.int8),
    np.dtype(ml_dtypes.uint4): np.dtype(np.uint8),
    np.dtype(ml_dtypes.int2): np.dtype(np.int8),
    np.dtype(ml_dtypes.uint2): np.dtype(np.uint8),
}


def is_narrow(dtype: Any) -> bool:
    if dtype is None:
        return False
    dtype = np.dtype(dtype)
    return dtype in NARROW_FLOATS or dtype in NARROW_INTS


def refuse_narrow_io(
    graph: Graph, device: str, keep: Iterable[str] = (), everywhere: bool = False
) -> None:
    """Raise Unsupported when an input or output of ``graph`` (with ``everywhere``, any value)
    has a narrow type but those named in ``keep``: for backends whose Python binding cannot
    hand such arrays over, or that compute them differently from the spec, which would
    otherwise fail at the first request or return wrong numbers. AUTO then takes another
    device."""
    values = graph.value_info.values() if everywhere else (*graph.inputs, *graph.outputs)
    for spec in values:
        if is_narrow(spec.dtype) and spec.dtype.name not in keep:
            raise Unsupported(
                f"model {graph.name!r}: {spec.name!r} is {spec.dtype}, which device {device} "
                "does not carry as the ONNX spec says; NUMPY does"
            )


def narrow_value(graph: Graph, node: Node, keep: Iterable[str] = ()) -> str:
    """The first narrow-typed value (but those in ``keep``) ``node`` reads or writes, as
    'name (dtype)', or '' (QueryNetwork leaves such nodes to NUMPY)."""
    for name in (*node.inputs, *node.outputs):
        spec = graph.value_info.get(name) if name else None
        if spec is not None and is_narrow(spec.dtype) and spec.dtype.name not in keep:
            return f"{name!r} ({spec.dtype})"
    return ""


def np_dtype(elem_type: int) -> np.dtype | None:
    """The numpy dtype of an ONNX element type (strings are ``object``), None if unknown."""
    if elem_type == TensorProto.UNDEFINED:
        return None
    if elem_type == TensorProto.STRING:
        return np.dtype(object)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return None


def onnx_dtype(dtype: np.dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype == np.dtype(object) or dtype.kind in "US":
        return TensorProto.STRING
    return helper.np_dtype_to_tensor_dtype(dtype)


def value_spec(value_info: onnx.ValueInfoProto) -> TensorSpec:
    """A ``ValueInfoProto`` as a :class:`TensorSpec` (the one reader of them: graph inputs,
    outputs, value infos and the outputs of subgraph attributes)."""
    t = value_info.type
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        shape = None
        if tt.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim
            )
        return TensorSpec(value_info.name, np_dtype(tt.elem_type), shape)
    kind = (t.WhichOneof("value") or "tensor").removesuffix("_type")
    return TensorSpec(value_info.name, None, None, kind)  # sequences, optionals, maps


@dataclasses.dataclass
class Node:
    """One operation. ``attrs`` keeps ONNX attributes; ``fused_names`` the original nodes."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    name: str = ""
    domain: str = ""
    attrs: dict[str, AttributeProto] = dataclasses.field(default_factory=dict)
    fused_names: list[str] = dataclasses.field(default_factory=list)
    affinity: str = ""
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)

    def attr(self, name: str, default: Any = None) -> Any:
        proto = self.attrs.get(name)
        if proto is None:
            return default
        return decode_attr(proto)

    def set_attr(self, name: str, value: Any, attr_type: int | None = None) -> None:
        self.attrs[name] = helper.make_attribute(name, value, attr_type=attr_type)

    def to_proto(self) -> onnx.NodeProto:
        node = helper.make_node(
            self.op_type, self.inputs, self.outputs, name=self.name, domain=self.domain or None
        )
        node.attribute.extend(self.attrs.values())
        meta = dict(self.metadata)
        meta["fused_names"] = ",".join(self.fused_names)
        if self.affinity:
            meta["affinity"] = self.affinity
        for key, value in meta.items():
            entry = node.metadata_props.add()
            entry.key, entry.value = key, value
        return node


def decode_attr(proto: AttributeProto) -> Any:
    """An attribute as a Python value: strings decoded, tensors as numpy arrays."""
    kind = proto.type
    if kind == AttributeProto.STRING:
        return proto.s.decode("utf-8", errors="replace")
    if kind == AttributeProto.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in proto.strings]
    if kind == AttributeProto.TENSOR:
        return tensor_to_array(proto.t)
    if kind == AttributeProto.TENSORS:
        return [tensor_to_array(t) for t in proto.tensors]
    if kind == AttributeProto.INTS:
        return list(proto.ints)
    if kind == AttributeProto.FLOATS:
        return list(proto.floats)
    return helper.get_attribute_value(proto)


#: what a text (STRING) weight holds in the server per string, at most: its Python object
#: (49 bytes and its text) and a pointer, made from onnx's bytes objects (a red team's
#: 16M one-byte strings, a 48 MB model, grew the server 1.9 GB: ~115 bytes each)
STRING_ELEMENT_BYTES = 128


def tensor_to_array(tensor: TensorProto) -> np.ndarray:
    """The tensor's values; one whose data is in a file is refused here, the last line of
    defence (files beside a model on disk are read into it by :func:`read_model` first)."""
    if _external(tensor):
        raise InvalidModel(
            f"tensor {tensor.name!r} keeps its data in an external file, which is not read here"
        )
    if tensor.data_type == TensorProto.STRING:
        array = numpy_helper.to_array(tensor)
        return np.array(
            [
                s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
                for s in array.ravel()
            ],
            dtype=object,
        ).reshape(array.shape)
    return numpy_helper.to_array(tensor)


@dataclasses.dataclass
class Graph:
    """A graph: nodes in topological order, named values, initializers as arrays."""

    name: str
    nodes: list[Node]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    initializers: dict[str, np.ndarray]
    value_info: dict[str, TensorSpec]
    opsets: dict[str, int]
    ir_version: int = onnx.IR_VERSION
    functions: list[onnx.FunctionProto] = dataclasses.field(default_factory=list)
    #: Original names of nodes a pass removed without a successor (folded or dead).
    absorbed: list[str] = dataclasses.field(default_factory=list)
    raw_inputs: list[onnx.ValueInfoProto] = dataclasses.field(default_factory=list)
    raw_outputs: list[onnx.ValueInfoProto] = dataclasses.field(default_factory=list)
    #: Names in use, collected by the first :meth:`unique_name` (never copied with the graph).
    _taken: set[str] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    # --- queries passes use

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    users.setdefault(name, []).append(node)
            for name in subgraph_free_names(node):
                users.setdefault(name, []).append(node)
        return users

    def output_names(self) -> set[str]:
        return {o.name for o in self.outputs}

    def spec(self, name: str) -> TensorSpec | None:
        return self.value_info.get(name)

    def node_opset(self, node: Node) -> int:
        """The opset a node is resolved at: its own (inlined function bodies) or the graph's."""
        return int(node.metadata.get("opset", 0)) or self.opset(node.domain)

    def refresh_types(self) -> None:
        """Re-run ONNX shape inference to type values that passes created."""
        try:  # bounded as a read is (plugins/reading.py); the weights stay here
            inferred = reading.infer_shapes(without_weights(self.to_model()), self.name)
        except Exception:
            return
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
            spec = value_spec(vi)
            if spec.dtype is not None:
                old = self.value_info.get(vi.name)
                if old is None or old.dtype is None or old.shape is None:
                    self.value_info[vi.name] = spec

    def opset(self, domain: str = "") -> int:
        domain = "" if domain == "ai.onnx" else domain
        return self.opsets.get(domain, 0)

    def original_names(self) -> list[str]:
        return [name for node in self.nodes for name in node.fused_names]

    def unique_name(self, base: str) -> str:
        """A node or value name not used in this graph (nor handed out before).

        The names in use are collected once per graph and grow with every name handed out,
        so a pass asking per node stays linear; passes that add names take them from here.
        """
        taken = self._taken
        if taken is None:
            taken = {n.name for n in self.nodes}
            taken |= {v for n in self.nodes for v in n.outputs}
            taken |= set(self.initializers) | {i.name for i in self.inputs}
            self._taken = taken
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        return name

    def copy(self) -> Graph:
        """A deep enough copy for passes to rewrite (arrays are shared, never mutated)."""
        nodes = [
            dataclasses.replace(
                n,
                inputs=list(n.inputs),
                outputs=list(n.outputs),
                attrs=dict(n.attrs),
                fused_names=list(n.fused_names),
                metadata=dict(n.metadata),
            )
            for n in self.nodes
        ]
        return dataclasses.replace(
            self,
            nodes=nodes,
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            initializers=dict(self.initializers),
            value_info=dict(self.value_info),
            opsets=dict(self.opsets),
            absorbed=list(self.absorbed),
        )

    def toposort(self, outer_scope: bool = False) -> None:
        """Order nodes so every value is produced before use; a cycle or dangling edge raises.

        In a subgraph (``outer_scope``) a name nothing here produces comes from the enclosing
        graph, so it is not an error.
        """
        self.nodes = topological_order(self.name, self.nodes, self.available_names(), outer_scope)

    def available_names(self) -> set[str]:
        return {i.name for i in self.inputs} | set(self.initializers) | {""}

    # --- back to ONNX

    def to_model(self) -> ModelProto:
        initializers = [
            numpy_helper.from_array(
                np.array(v.tolist(), dtype=object) if v.dtype == object else v, name
            )
            if v.dtype != object
            else helper.make_tensor(
                name,
                TensorProto.STRING,
                v.shape,
                [s.encode() if isinstance(s, str) else s for s in v.ravel()],
            )
            for name, v in self.initializers.items()
        ]
        outputs = self.output_names()
        inputs = {i.name for i in self.inputs}
        graph = helper.make_graph(
            [n.to_proto() for n in self.nodes],
            self.name,
            self.raw_inputs or [_value_info(s) for s in self.inputs],
            self.raw_outputs or [_value_info(s) for s in self.outputs],
            initializer=initializers,
            value_info=[
                _value_info(s)
                for s in self.value_info.values()
                if s.dtype is not None and s.name not in outputs and s.name not in inputs
            ],
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid(d, v) for d, v in self.opsets.items()],
            functions=self.functions,
        )
        model.ir_version = self.ir_version
        return model


def _value_info(spec: TensorSpec) -> onnx.ValueInfoProto:
    elem = onnx_dtype(spec.dtype) if spec.dtype is not None else TensorProto.UNDEFINED
    shape = None if spec.shape is None else [d if d is not None else None for d in spec.shape]
    return helper.make_tensor_value_info(spec.name, elem, shape)


def has_loop(graph: Graph) -> bool:
    """Whether a Loop runs anywhere in ``graph`` (its subgraphs too): a run whose length the
    request decides (a trip count or condition is data), not only its inputs' size."""

    def in_proto(g: onnx.GraphProto) -> bool:
        return any(
            n.op_type == "Loop"
            or any(in_proto(sub) for a in n.attribute for sub in attribute_graphs(a))
            for n in g.node
        )

    return any(
        node.op_type == "Loop"
        or any(in_proto(s) for a in node.attrs.values() for s in attribute_graphs(a))
        for node in graph.nodes
    )


def attribute_graphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    """The subgraphs an attribute holds (If's branches, Loop's and Scan's bodies): none, one
    (GRAPH) or several (GRAPHS)."""
    if attr.type == AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def subgraph_free_names(node: Node) -> list[str]:
    """Names a node's subgraphs read from the enclosing scope (implicit inputs)."""
    free: list[str] = []
    for attr in node.attrs.values():
        for g in attribute_graphs(attr):
            for name in _graph_free_names(g):
                if name not in free:
                    free.append(name)
    return free


def _graph_free_names(graph: GraphProto) -> list[str]:
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    defined |= {i.values.name for i in graph.sparse_initializer}
    free: list[str] = []
    for node in graph.node:
        used = list(node.input)
        for attr in node.attribute:
            subs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                used.extend(_graph_free_names(sub))
        for name in used:
            if name and name not in defined and name not in free:
                free.append(name)
        defined.update(node.output)
    for out in graph.output:
        if out.name not in defined and out.name not in free:
            free.append(out.name)
    return free


def topological_order(
    graph_name: str, nodes: list[Node], available: set[str], outer_scope: bool = False
) -> list[Node]:
    """Kahn's algorithm, stable for already ordered graphs; names what cannot be scheduled."""
    produced_by: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for out in node.outputs:
            if out:
                produced_by[out] = index
    pending: list[int] = []
    waiting: dict[int, int] = {}
    dependents: dict[int, list[int]] = {}
    tick = cancel.checking(f"graph {graph_name!r}: ordering its nodes")
    for index, node in enumerate(nodes):
        tick(index)
        deps = set()
        for name in list(node.inputs) + subgraph_free_names(node):
            if name in available:
                continue
            if name not in produced_by:
                if name in node.inputs and not outer_scope:
                    raise InvalidModel(
                        f"graph {graph_name!r}: node {node.name!r} ({node.op_type}) reads "
                        f"{name!r}, which no node, input or initializer produces"
                    )
                continue  # an outer-scope name of a subgraph; checked by the enclosing graph
            deps.add(produced_by[name])
        waiting[index] = len(deps)
        for dep in deps:
            dependents.setdefault(dep, []).append(index)
        if not deps:
            pending.append(index)
    order: list[int] = []
    heapq.heapify(pending)
    while pending:
        index = heapq.heappop(pending)
        order.append(index)
        for nxt in dependents.get(index, []):
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                heapq.heappush(pending, nxt)
    if len(order) != len(nodes):
        stuck = [nodes[i].name or nodes[i].op_type for i in range(len(nodes)) if waiting[i] > 0]
        raise InvalidModel(f"graph {graph_name!r} has a cycle through node(s) {stuck[:8]}")
    return [nodes[i] for i in order]


# --------------------------------------------------------------------------- loading


def read_model(model: Any) -> tuple[ModelProto, Path | None]:
    """A ModelProto from a path, bytes or ModelProto, with external data read safely."""
    if isinstance(model, ModelProto):
        proto, folder = model, None
    elif isinstance(model, bytes | bytearray | memoryview):
        try:  # bounded before it is made (plugins/reading.py)
            proto = reading.parse_model(bytes(model))
        except InvalidModel:
            raise
        except Exception:  # protobuf raises DecodeError and, for some garbage, others
            raise InvalidModel(
                "the model bytes are not an ONNX model (protobuf parse failed)"
                + _archive_hint(bytes(model[:4]))
            ) from None
        folder = None
        if not proto.graph.node and not proto.graph.input and not proto.graph.output:
            raise InvalidModel("the model bytes are not an ONNX model (no graph found)")
    elif isinstance(model, str | os.PathLike):
        path = Path(model)
        if not path.is_file():
            raise InvalidModel(f"model file {str(path)!r} does not exist")
        # named by its version folder, not the server's folders (a load's temporary one)
        shown = f"model file {f'{path.parent.name}/{path.name}'!r}"
        try:  # bounded as bytes are: a file may be a client's (a load's file overrides)
            proto = reading.parse_model(path.read_bytes(), shown)
        except PlugserveError:  # over a bound of reading it
            raise
        except Exception:
            raise InvalidModel(
                f"{shown} is not an ONNX model" + _archive_hint(_head(path))
            ) from None
        if not proto.graph.node and not proto.graph.input and not proto.graph.output:
            raise InvalidModel(f"{shown} is not an ONNX model (no graph)")
        folder = path.resolve().parent
    else:
        raise InvalidModel(
            f"a model is a path, bytes or onnx.ModelProto, not {type(model).__name__}"
        )
    _load_external_data(proto, folder)
    return proto, folder


def zip_archive(model: Any) -> bool:
    """Whether ``model`` (a path or bytes) is a zip archive, as PyTorch programs are (an ONNX
    model is a protobuf, never one): devices that read graphs leave such a model alone."""
    if isinstance(model, bytes | bytearray | memoryview):
        return bytes(model[:4]) == b"PK\x03\x04"
    if isinstance(model, str | os.PathLike) and Path(model).is_file():
        return _head(Path(model)) == b"PK\x03\x04"
    return False


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def _archive_hint(head: bytes) -> str:
    """What to do with a zip archive given as a graph: a PyTorch program (TorchScript or
    torch.export's .pt2) loads whole on TORCH or GPU (``plugins/torch/programs.py``) only."""
    if head != b"PK\x03\x04":
        return ""
    return (
        "; it is a zip archive: a PyTorch program (TorchScript, torch.export .pt2) loads on "
        "TORCH or GPU, whole"
    )


def _tensors_with_external_data(proto: ModelProto) -> Iterable[TensorProto]:
    """Every tensor of the model that keeps its data in a file: initializers, sparse ones,
    attribute tensors, in subgraphs and function bodies too (onnx's own walk skips the sparse
    ones, which numpy_helper would then read relative to the working directory)."""
    found: list[TensorProto] = []

    def graph_tensors(graph: GraphProto) -> None:
        tensors = list(graph.initializer)
        for sparse in graph.sparse_initializer:
            tensors += [sparse.values, sparse.indices]
        found.extend(t for t in tensors if _external(t))
        nodes(graph.node)

    def nodes(items: Iterable[onnx.NodeProto]) -> None:
        for node in items:
            for attr in node.attribute:
                tensors = [attr.t] if attr.HasField("t") else []
                tensors += list(attr.tensors)
                for sparse in [attr.sparse_tensor, *attr.sparse_tensors]:
                    tensors += [sparse.values, sparse.indices]
                found.extend(t for t in tensors if _external(t))
                for sub in [attr.g] if attr.HasField("g") else []:
                    graph_tensors(sub)
                for sub in attr.graphs:
                    graph_tensors(sub)

    graph_tensors(proto.graph)
    for function in proto.functions:
        nodes(function.node)
    return found


def _external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL or bool(tensor.external_data)


def refuse_external_data(proto: ModelProto, what: str) -> None:
    """A model or blob given as bytes is bytes: it may not name files to read."""
    tensors = _tensors_with_external_data(proto)
    if tensors:
        raise InvalidModel(
            f"{what}: tensor {tensors[0].name!r} keeps its data in an external file; a model "
            "or blob given as bytes cannot read files: inline the data (or load the model from "
            "its path in the model repository)"
        )


def _load_external_data(proto: ModelProto, folder: Path | None) -> None:
    """Read each tensor's external data from beside the model. Its fields are the model's
    (a client's, for a load with file overrides): a bad one is an InvalidModel naming it, and
    messages name files as the model does, not by the server's folder (a temporary one)."""
    if folder is None:
        refuse_external_data(proto, "the model")
        return
    tensors = list(_tensors_with_external_data(proto))
    files: dict[Path, int] = {}  # the files read, and their sizes
    taken = 0  # the bytes read from them, all tensors together
    for tensor in tensors:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if "\x00" in location:
            raise InvalidModel(
                f"tensor {tensor.name!r}: external data location {location!r} holds a NUL byte"
            )
        target = (folder / location).resolve()
        if not location or os.path.isabs(location) or not target.is_relative_to(folder):
            raise InvalidModel(
                f"tensor {tensor.name!r} points at external data {location!r} outside the "
                "model's folder; external data must live beside the model"
            )
        if not target.is_file():
            raise InvalidModel(
                f"tensor {tensor.name!r}: external data file {location!r} does not exist"
            )
        offset = _external_field(tensor, info, "offset") or 0
        length = _external_field(tensor, info, "length")
        size = target.stat().st_size
        if offset + (length or 0) > size:
            raise InvalidModel(
                f"tensor {tensor.name!r}: external data at offset {offset:,}, length "
                f"{length or 0:,} runs past the end of {location!r} ({size:,} bytes)"
            )
        files[target] = size
        taken += length if length else size - offset
        if taken > sum(files.values()):  # (500 tensors naming one 1 MB range: +2.2 GB)
            raise InvalidModel(
                f"tensor {tensor.name!r}: the model's tensors read {taken:,} bytes of external "
                f"data from files of {sum(files.values()):,}: tensors may not share bytes"
            )
        with open(target, "rb") as f:
            f.seek(offset)
            data = f.read(length) if length else f.read()
        tensor.raw_data = data
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


def _external_field(tensor: TensorProto, info: dict[str, str], key: str) -> int | None:
    """External data's ``offset`` or ``length``: a count of bytes in decimal digits, or
    absent (None)."""
    text = info.get(key)
    if not text:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        raise InvalidModel(
            f"tensor {tensor.name!r}: external data {key} {text[:32]!r} is not a count of "
            "bytes (decimal digits, at most 19)"
        )
    return int(text)


def load_model(model: Any, name: str | None = None) -> Graph:
    """Read, validate and convert a model; every problem is an :class:`InvalidModel`."""
    proto, _ = read_model(model)
    label = name or proto.graph.name or "model"
    reading.check_nodes(proto, label)
    _check_opsets(proto, label)
    _sort_nodes(proto.graph, label)
    _drop_contradicted_value_info(proto.graph)
    cancel.check(f"model {label!r}: reading it")  # each step below is a walk of the graph
    try:
        onnx.checker.check_model(checked_form(proto))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
        raise InvalidModel(f"model {label!r} does not validate: {first}") from None
    except Exception as exc:
        raise InvalidModel(f"model {label!r} does not validate: {exc}") from None
    try:
        inferred = _infer_shapes(without_weights(proto), label)
    except PlugserveError:  # the model is invalid, or over a bound of reading it
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise InvalidModel(
            f"model {label!r}: shape inference failed: {text[-1] if text else exc}"
        ) from None
    cancel.check(f"model {label!r}: reading it")
    return graph_from_proto(proto.graph, proto, label, inferred=inferred.graph)


def _check_opsets(proto: ModelProto, label: str) -> None:
    """Refuse an opset of a standard domain newer than the onnx package knows: its ops would be
    checked and run by the newest rules known, which are not the model's (ONNX Runtime and
    OpenVINO refuse such models too)."""
    known = onnx.defs.C.schema_version_map()  # {domain: (first, last)}
    for opset in proto.opset_import:
        domain = "" if opset.domain == "ai.onnx" else opset.domain
        if domain in known and opset.version > known[domain][1]:
            raise InvalidModel(
                f"model {label!r} imports opset {opset.version} of domain "
                f"{opset.domain or 'ai.onnx'!r}; this server's onnx {onnx.__version__} knows "
                f"it up to opset {known[domain][1]}: export the model for that opset or older"
            )


#: ONNX's report of one node's failed shape inference: its op type, node name and the reason.
_NODE_FAILURE = re.compile(
    r"^\[ShapeInferenceError\] Inference error\(s\): \(op_type:(?P<op>[^,)]+)"
    r"(?:, node name: (?P<node>[^)]*))?\): \[\w+\] (?P<reason>.+)$",
    re.DOTALL,
)


def _infer_shapes(proto: ModelProto, label: str) -> ModelProto:
    """Shape inference that refuses a node whose attributes cannot be right; it runs bounded,
    in a helper process (``plugins/reading.py``).

    The checker does not look at attribute *values* (``Softmax(axis=9)`` on a rank-2 input);
    strict shape inference does. A model it rejects for one of its own named nodes is refused
    here, naming the node, instead of loading and failing every inference. Strict inference
    also fails some valid models inside ONNX's own function bodies (1 of the 1,884 backend
    test models: MeanVarianceNormalization): such nested failures, or any report not in the
    form above, fall back to the lenient inference.
    """
    data = proto.SerializeToString()
    try:
        return reading.infer_shapes(data, label, check_type=True, data_prop=True, strict=True)
    except onnx.shape_inference.InferenceError as exc:
        found = _NODE_FAILURE.match(str(exc).strip())
        ours = {(n.op_type, n.name) for n in proto.graph.node}
        if (
            found
            and (found["op"], found["node"] or "") in ours
            and "Inference error(s)" not in found["reason"]
        ):
            node = f"node {found['node']!r}" if found["node"] else "a node"
            raise InvalidModel(
                f"model {label!r}: {node} ({found['op']}): {found['reason'].strip()}"
            ) from None
    return reading.infer_shapes(data, label, check_type=True, data_prop=True)


def _drop_contradicted_value_info(graph: GraphProto) -> None:
    """Forget the ``value_info`` shapes that a Constant node's own value contradicts.

    ``value_info`` is a hint about intermediate values; the node that makes the value is the
    truth. onnxruntime-genai's model builder declares its shape constants as scalars (a
    ``[1]`` tensor written with rank 0, a ``[320, 32]`` Reshape shape too), which onnxruntime
    ignores and onnx's strict shape inference refuses ("Inferred shape and existing shape
    differ in rank"), so every decoder it exports failed to load. Only Constant outputs are
    judged here (their shape is in the node itself); the value_info of every other value
    stays as the model gives it.
    """
    made: dict[str, tuple[int, ...]] = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    made[node.output[0]] = tuple(attr.t.dims)
    if not made:
        return
    keep = []
    for info in graph.value_info:
        dims = made.get(info.name)
        declared = info.type.tensor_type
        if dims is not None and declared.HasField("shape"):
            shown = [d.dim_value if d.HasField("dim_value") else None for d in declared.shape.dim]
            if len(shown) != len(dims) or any(
                d is not None and d != real for d, real in zip(shown, dims)
            ):
                continue
        keep.append(info)
    if len(keep) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(keep)


def _sort_nodes(graph: GraphProto, label: str) -> None:
    """Put nodes in topological order (ONNX requires it; exporters do not always comply).

    A cycle or a dangling edge raises here, naming the nodes, before the checker's less
    specific message.
    """
    nodes = [
        Node(
            n.op_type,
            list(n.input),
            list(n.output),
            name=n.name or f"{n.op_type}_{i}",
            attrs={a.name: a for a in n.attribute},
        )
        for i, n in enumerate(graph.node)
    ]
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    available |= {t.values.name for t in graph.sparse_initializer}
    ordered = topological_order(label, nodes, available)
    index = {id(n): i for i, n in enumerate(nodes)}
    if [index[id(n)] for n in ordered] != list(range(len(nodes))):
        protos = [graph.node[index[id(n)]] for n in ordered]
        copies = [onnx.NodeProto() for _ in protos]
        for copy, proto in zip(copies, protos):
            copy.CopyFrom(proto)
        del graph.node[:]
        graph.node.extend(copies)


_MAX_DENSE_BYTES = 2**31 - 1


_Message = TypeVar("_Message", bound=Message)


def _own(message: _Message) -> _Message:
    """A copy standing alone: a part of a parsed model (an attribute, a value info) keeps the
    whole model's memory alive while it is referenced, initializers' bytes included. A Graph
    kept by a network (its kernels' attributes) held its model's proto that way: 11.5 MB per
    NUMPY network of an 11.5 MB MLP, beside the weights themselves."""
    copy = type(message)()
    copy.CopyFrom(message)
    return copy


def graph_from_proto(
    graph: GraphProto,
    model: ModelProto | None,
    label: str,
    outer_scope: bool = False,
    inferred: GraphProto | None = None,
) -> Graph:
    """``inferred``: the same graph as shape inference returned it without its weights (see
    load_model): its nodes (subgraphs carry their inferred value infos), value infos and
    outputs are taken, ``graph``'s inputs and initializers."""
    typed = graph if inferred is None else inferred
    opsets: dict[str, int] = {}
    if model is not None:
        for op in model.opset_import:
            opsets["" if op.domain == "ai.onnx" else op.domain] = op.version
    initializers: dict[str, np.ndarray] = {}
    # what the model does not hold itself: a sparse one's dense bytes, a text one's objects
    allowance = reading.allowance()
    for tensor in graph.initializer:
        if tensor.data_type == TensorProto.STRING:
            allowance.take(
                STRING_ELEMENT_BYTES * len(tensor.string_data),
                f"model {label!r}: text initializer {tensor.name!r} of "
                f"{len(tensor.string_data):,} strings",
            )
        try:
            initializers[tensor.name] = tensor_to_array(tensor)
        except Exception as exc:
            raise InvalidModel(f"model {label!r}: initializer {tensor.name!r}: {exc}") from None
    for sparse in graph.sparse_initializer:
        dense = tensor_to_array(sparse.values)
        size = math.prod(max(0, d) for d in sparse.dims) * dense.dtype.itemsize
        if size > _MAX_DENSE_BYTES:  # a few bytes on the wire could ask for terabytes here
            raise InvalidModel(
                f"model {label!r}: sparse initializer {sparse.values.name!r} is {size:,} bytes "
                f"dense; initializers are held dense, up to {_MAX_DENSE_BYTES:,} bytes (ONNX's "
                "own limit for a tensor)"
            )
        allowance.take(size, f"model {label!r}: sparse initializer {sparse.values.name!r}")
        full = np.zeros(tuple(sparse.dims), dtype=dense.dtype)
        idx = tensor_to_array(sparse.indices)
        if idx.ndim == 1:
            full.ravel()[idx] = dense
        else:
            full[tuple(idx.T)] = dense
        initializers[sparse.values.name] = full
    value_info: dict[str, TensorSpec] = {}
    for vi in [*typed.value_info, *graph.input, *typed.output]:
        value_info[vi.name] = value_spec(vi)
    for name, array in initializers.items():
        value_info.setdefault(name, TensorSpec(name, array.dtype, tuple(array.shape)))
    nodes: list[Node] = []
    seen: set[str] = set()
    tick = cancel.checking(f"model {label!r}: reading its nodes")
    for index, proto_node in enumerate(typed.node):
        tick(index)
        node_name = proto_node.name or f"{proto_node.op_type}_{index}"
        if node_name in seen:
            node_name = f"{node_name}_{index}"
        seen.add(node_name)
        meta = {e.key: e.value for e in proto_node.metadata_props}
        fused = meta.pop("fused_names", None)
        node = Node(
            op_type=proto_node.op_type,
            inputs=list(proto_node.input),
            outputs=list(proto_node.output),
            name=node_name,
            domain="" if proto_node.domain == "ai.onnx" else proto_node.domain,
            attrs={a.name: _own(a) for a in proto_node.attribute},
            fused_names=fused.split(",") if fused else [node_name],
            affinity=meta.pop("affinity", ""),
            metadata=meta,
        )
        if fused == "":
            node.fused_names = []
        nodes.append(node)
    initializer_names = set(initializers)
    inputs = [value_spec(i) for i in graph.input if i.name not in initializer_names]
    result = Graph(
        name=label,
        nodes=nodes,
        inputs=inputs,
        outputs=[value_spec(o) for o in typed.output],
        initializers=initializers,
        value_info=value_info,
        opsets=opsets,
        ir_version=model.ir_version if model is not None else onnx.IR_VERSION,
        functions=[_own(f) for f in model.functions] if model is not None else [],
        raw_inputs=[_own(i) for i in graph.input if i.name not in initializer_names],
        raw_outputs=[_own(o) for o in typed.output],
    )
    result.toposort(outer_scope)
    return result


def keep_constants_with_readers(graph: Graph, supported: set[str]) -> None:
    """The seed's steps 5 and 6 for ONNX (QueryNetwork's housekeeping): a Constant read by a
    supported node is supported (added if a pass had dropped it); one whose first reader is not
    supported is pruned, so no device is handed a subgraph made of constants only."""
    users = graph.consumers()
    for node in graph.nodes:
        if node.op_type != "Constant" or node.domain:
            continue
        readers = users.get(node.outputs[0], [])
        if readers and readers[0].name in supported:
            supported.add(node.name)
        elif readers:
            supported.discard(node.name)
