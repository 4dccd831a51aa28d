"""Function inlining: an op the device has no kernel for is replaced by its ONNX function body.

Many ONNX ops are defined as functions of simpler ones (Elu, Softplus, LayerNormalization,
Attention, ...), as are a model's own local functions. Expanding them here means a device
supports them as soon as it supports their parts, with the numerics the standard defines. The
expanded nodes keep the caller's original name in ``fused_names`` and record the opset their
body was written for, which may differ from the model's.
"""

from __future__ import annotations

import itertools

import onnx
from onnx import AttributeProto, FunctionProto, GraphProto, NodeProto

from plugserve.plugins.api import InvalidModel
from plugserve.plugins.ir import Graph, Node, onnx_dtype
from plugserve.plugins.passes.manager import PassContext

__all__ = ["inline_functions"]

_MAX_ROUNDS = 8
#: Most nodes inlining may make. Local functions calling each other can multiply a graph's size
#: with every round (a 2 KB model could ask for billions of nodes); real models stay far below.
MAX_INLINED_NODES = 250_000


def inline_functions(graph: Graph, context: PassContext) -> bool:
    changed = False
    counter = itertools.count()
    local: dict[tuple[str, str], FunctionProto] = {}
    for function in graph.functions:
        local.setdefault((function.name, function.domain), function)  # the first one wins
    for _ in range(_MAX_ROUNDS):
        new_nodes: list[Node] = []
        round_changed = False
        for node in graph.nodes:
            body = None if context.supports(node, graph) else _function_for(node, graph, local)
            if body is None:
                new_nodes.append(node)
                continue
            if len(new_nodes) + len(body.node) > MAX_INLINED_NODES:
                raise InvalidModel(
                    f"model {graph.name!r}: expanding its functions would make more than "
                    f"{MAX_INLINED_NODES} nodes (node {node.name!r}, {node.op_type})"
                )
            new_nodes.extend(_expand(node, body, graph, f"{node.name}/", counter))
            round_changed = True
        graph.nodes = new_nodes
        changed |= round_changed
        if not round_changed:
            break
    if changed:
        graph.toposort()
        graph.refresh_types()
    return changed


def _function_for(
    node: Node, graph: Graph, local: dict[tuple[str, str], FunctionProto]
) -> FunctionProto | None:
    function = local.get((node.op_type, node.domain))
    if function is not None:
        return function
    opset = graph.node_opset(node)
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    try:
        if schema.has_function:
            versions = [v for v in schema.function_opset_versions if v <= opset]
            version = max(versions) if versions else min(schema.function_opset_versions)
            raw = schema.get_function_with_opset_version(version)
        elif schema.has_context_dependent_function:
            versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
            if not versions:
                versions = [min(schema.context_dependent_function_opset_versions)]
            types = _input_types(node, graph)
            if types is None:
                return None
            proto = node.to_proto()
            del proto.metadata_props[:]
            raw = schema.get_context_dependent_function_with_opset_version(
                max(versions), proto.SerializeToString(), [t.SerializeToString() for t in types]
            )
        else:
            return None
    except Exception:  # onnx refuses to build the body for these inputs: keep the node
        return None
    if not raw:
        return None
    function = FunctionProto()
    function.ParseFromString(raw)
    return function if function.node else None


def _input_types(node: Node, graph: Graph) -> list[onnx.TypeProto] | None:
    types = []
    for name in node.inputs:
        spec = graph.spec(name) if name else None
        if name and (spec is None or spec.dtype is None):
            return None
        if not name:
            types.append(onnx.TypeProto())
            continue
        shape = (
            None if spec.shape is None else [d if isinstance(d, int) else None for d in spec.shape]
        )
        types.append(onnx.helper.make_tensor_type_proto(onnx_dtype(spec.dtype), shape))
    return types


def _expand(
    node: Node, function: FunctionProto, graph: Graph, prefix: str, counter: itertools.count
) -> list[Node]:
    uid = next(counter)
    mapping: dict[str, str] = {}
    for i, formal in enumerate(function.input):
        mapping[formal] = node.inputs[i] if i < len(node.inputs) else ""
    for i, formal in enumerate(function.output):
        mapping[formal] = node.outputs[i] if i < len(node.outputs) else ""

    def rename(name: str) -> str:
        if not name:
            return ""
        if name in mapping:
            return mapping[name]
        return f"{prefix}{uid}/{name}"

    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in function.opset_import}
    caller_attrs = node.attrs
    schema_defaults = _schema_defaults(node, graph)
    expanded = []
    for index, inner in enumerate(function.node):
        attrs = {}
        for attr in inner.attribute:
            resolved = _resolve_attr(attr, caller_attrs, schema_defaults, rename)
            if resolved is not None:
                attrs[resolved.name] = resolved
        domain = "" if inner.domain == "ai.onnx" else inner.domain
        meta = {}
        if domain in opsets:
            meta["opset"] = str(opsets[domain])
        expanded.append(
            Node(
                op_type=inner.op_type,
                inputs=[rename(n) for n in inner.input],
                outputs=[rename(n) for n in inner.output],
                name=f"{node.name}/{inner.name or inner.op_type}_{index}",
                domain=domain,
                attrs=attrs,
                fused_names=list(node.fused_names),
                affinity=node.affinity,
                metadata=meta,
            )
        )
    return expanded


def _schema_defaults(node: Node, graph: Graph) -> dict[str, AttributeProto]:
    try:
        schema = onnx.defs.get_schema(node.op_type, graph.node_opset(node), node.domain)
    except onnx.defs.SchemaError:
        return {}
    return {
        name: a.default_value
        for name, a in schema.attributes.items()
        if a.default_value is not None and a.default_value.type != AttributeProto.UNDEFINED
    }


def _resolve_attr(
    attr: AttributeProto,
    caller: dict[str, AttributeProto],
    defaults: dict[str, AttributeProto],
    rename,
) -> AttributeProto | None:
    if attr.ref_attr_name:
        source = caller.get(attr.ref_attr_name) or defaults.get(attr.ref_attr_name)
        if source is None:
            return None
        resolved = AttributeProto()
        resolved.CopyFrom(source)
        resolved.name = attr.name
        return resolved
    if attr.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
        resolved = AttributeProto()
        resolved.CopyFrom(attr)
        for g in [resolved.g] if attr.type == AttributeProto.GRAPH else resolved.graphs:
            _rename_graph(g, caller, defaults, rename)
        return resolved
    return attr


def _rename_graph(g: GraphProto, caller, defaults, rename) -> None:
    for vi in itertools.chain(g.input, g.output, g.value_info):
        vi.name = rename(vi.name)
    for t in g.initializer:
        t.name = rename(t.name)
    for n in g.node:
        _rename_node(n, caller, defaults, rename)


def _rename_node(n: NodeProto, caller, defaults, rename) -> None:
    n.input[:] = [rename(x) for x in n.input]
    n.output[:] = [rename(x) for x in n.output]
    attrs = []
    for attr in n.attribute:
        resolved = _resolve_attr(attr, caller, defaults, rename)
        if resolved is not None:
            attrs.append(resolved)
    del n.attribute[:]
    n.attribute.extend(attrs)
