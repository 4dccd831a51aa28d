"""QueryNetwork for ORT: which nodes onnxruntime's CPU provider has a kernel for.

The kernels come from ``onnxruntime.capi._pybind_state.get_all_opkernel_def()`` (op name,
domain, version range, provider, type constraints). A node is supported when a CPU kernel of
its domain and op type covers the opset version that resolves it (the ONNX schema's
``since_version`` at the model's opset) and, when the node's input element types are known,
accepts them under the kernel's type constraints. An op without a kernel is still supported
when its schema has a function body (onnxruntime expands those) whose parts are supported; a
call to a model-local function is supported when its body is, and is reported by the calling
node's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import onnx
import onnx.defs
from onnx import TensorProto

from plugserve.plugins.ir import Graph, Node, attribute_graphs, narrow_value, onnx_dtype
from plugserve.plugins.ort.backend import PROVIDER, ort

__all__ = ["KernelIndex", "unsupported_nodes"]

_ONNX_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training")
_MAX_DEPTH = 8
#: Ops onnxruntime resolves while loading, without a kernel (Constant becomes an initializer).
_NO_KERNEL_NEEDED = {("", "Constant")}

Kernel = tuple[int, int, dict[str, frozenset[str]]]
TypeOf = Callable[[str], str | None]


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


class KernelIndex:
    """The CPU provider's kernels by (domain, op type), and onnxruntime's own schema versions."""

    def __init__(self) -> None:
        from onnxruntime.capi import _pybind_state as C

        self.kernels: dict[tuple[str, str], list[Kernel]] = {}
        for k in C.get_all_opkernel_def():
            if k.provider != PROVIDER:
                continue
            lo, hi = k.version_range
            constraints = {name: frozenset(types) for name, types in k.type_constraints.items()}
            self.kernels.setdefault((_domain(k.domain), k.op_name), []).append(
                (lo, hi, constraints)
            )
        self.ort_versions: dict[tuple[str, str], list[int]] = {}
        try:
            for s in C.get_all_operator_schema():
                self.ort_versions.setdefault((_domain(s.domain), s.name), []).append(
                    s.since_version
                )
        except Exception:  # an older onnxruntime without the schema list
            pass

    def ops(self) -> list[tuple[str, str]]:
        return sorted(self.kernels)

    # --- one node

    def check(
        self,
        node: onnx.NodeProto | Node,
        opsets: Mapping[str, int],
        functions: Mapping[tuple[str, str], onnx.FunctionProto],
        type_of: TypeOf | None = None,
        depth: int = 0,
    ) -> str | None:
        """None when onnxruntime can run ``node``, else why not."""
        domain = _domain(node.domain)
        op = node.op_type
        label = f"{domain or 'ai.onnx'}::{op}"
        if depth > _MAX_DEPTH:
            return f"{label}: functions nest too deep"
        local = functions.get((domain, op))
        if local is not None:
            body_opsets = {_domain(o.domain): o.version for o in local.opset_import}
            for inner in local.node:
                why = self.check(inner, body_opsets or opsets, functions, None, depth + 1)
                if why:
                    return f"model function {label}: {why}"
            return None
        if (domain, op) in _NO_KERNEL_NEEDED:
            return None
        opset = opsets.get(domain, 0)
        schema = None
        if domain in _ONNX_DOMAINS:
            try:
                schema = onnx.defs.get_schema(op, opset or onnx.defs.onnx_opset_version(), domain)
            except onnx.defs.SchemaError:
                return f"{label} is not an ONNX op at opset {opset}"
            version = schema.since_version
        else:
            known = [v for v in self.ort_versions.get((domain, op), []) if v <= opset]
            version = max(known) if known else opset
        candidates = [c for c in self.kernels.get((domain, op), []) if c[0] <= version <= c[1]]
        if candidates:
            types = self._input_types(node, schema, type_of)
            if not types or any(_accepts(c[2], types) for c in candidates):
                return self._subgraphs(node, opsets, functions, depth)
            shown = ", ".join(f"{p}={t}" for p, t in types)
            return f"{label} (opset {version}) has no CPU kernel for input types {shown}"
        if schema is not None:
            body = _function_body(schema, opset, node, type_of)
            if body is not None:
                body_opsets = dict(opsets)
                body_opsets.update({_domain(o.domain): o.version for o in body.opset_import})
                for inner in body.node:
                    why = self.check(inner, body_opsets, functions, None, depth + 1)
                    if why:
                        return f"{label} is a function and {why}"
                return self._subgraphs(node, opsets, functions, depth)
        return f"onnxruntime's CPU provider has no kernel for {label} at opset {version}"

    def _subgraphs(
        self,
        node: onnx.NodeProto | Node,
        opsets: Mapping[str, int],
        functions: Mapping[tuple[str, str], onnx.FunctionProto],
        depth: int,
    ) -> str | None:
        attrs = node.attrs.values() if isinstance(node, Node) else node.attribute
        for attr in attrs:
            for sub in attribute_graphs(attr):
                for inner in sub.node:
                    why = self.check(inner, opsets, functions, None, depth + 1)
                    if why:
                        return f"subgraph {attr.name!r}: {why}"
        return None

    @staticmethod
    def _input_types(
        node: onnx.NodeProto | Node, schema: onnx.defs.OpSchema | None, type_of: TypeOf | None
    ) -> list[tuple[str, str]]:
        """(type parameter, "tensor(...)") for each input whose type is known."""
        if schema is None or type_of is None or not schema.inputs:
            return []
        params = schema.inputs
        known = []
        for i, name in enumerate(node.inputs if isinstance(node, Node) else node.input):
            if not name:
                continue
            if i < len(params):
                param = params[i]
            elif params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
                param = params[-1]
            else:
                continue
            kind = type_of(name)
            if kind is not None:
                known.append((param.type_str, kind))
        return known


def _accepts(constraints: Mapping[str, frozenset[str]], types: list[tuple[str, str]]) -> bool:
    for param, kind in types:
        allowed = constraints.get(param)
        if allowed is None or kind in allowed:
            continue
        # onnxruntime casts float16 to float around a CPU kernel that has no float16 version
        if kind == "tensor(float16)" and "tensor(float)" in allowed:
            continue
        return False
    return True


def _function_body(
    schema: onnx.defs.OpSchema, opset: int, node: onnx.NodeProto | Node, type_of: TypeOf | None
) -> onnx.FunctionProto | None:
    """The function an ONNX op expands to at ``opset``, if its schema has one."""
    try:
        if schema.has_function:
            versions = [v for v in schema.function_opset_versions if v <= opset] or [
                schema.since_version
            ]
            body = onnx.FunctionProto()
            body.ParseFromString(schema.get_function_with_opset_version(max(versions)))
            return body
        if schema.has_context_dependent_function:
            proto = node.to_proto() if isinstance(node, Node) else node
            input_types = []
            for name in proto.input:
                elem = _elem_type(type_of(name)) if type_of and name else None
                tp = onnx.helper.make_tensor_type_proto(elem or TensorProto.FLOAT, None)
                input_types.append(tp.SerializeToString())
            versions = [
                v for v in schema.context_dependent_function_opset_versions if v <= opset
            ] or [schema.since_version]
            raw = schema.get_context_dependent_function_with_opset_version(
                max(versions), proto.SerializeToString(), input_types
            )
            body = onnx.FunctionProto()
            body.ParseFromString(raw)
            return body
    except Exception:
        return None
    return None


def _type_string(dtype: object) -> str | None:
    try:
        elem = onnx_dtype(dtype)  # type: ignore[arg-type]
    except Exception:
        return None
    if not elem:
        return None
    return f"tensor({TensorProto.DataType.Name(elem).lower()})"


def _elem_type(kind: str | None) -> int | None:
    if not kind or not kind.startswith("tensor("):
        return None
    try:
        return TensorProto.DataType.Value(kind[len("tensor(") : -1].upper())
    except ValueError:
        return None


@functools.cache
def kernel_index() -> KernelIndex:
    if ort is None:  # pragma: no cover - the plugin constructor refuses this case first
        raise RuntimeError("onnxruntime is not importable")
    return KernelIndex()


def unsupported_nodes(graph: Graph, index: KernelIndex | None = None) -> dict[str, str]:
    """{node name: why onnxruntime cannot run it} for the graph's unsupported nodes."""
    index = index or kernel_index()
    functions = {(_domain(f.domain), f.name): f for f in graph.functions}

    def type_of(name: str) -> str | None:
        spec = graph.value_info.get(name)
        if spec is None or spec.dtype is None:  # sequences and optionals: unknown
            return None
        return _type_string(spec.dtype)

    failures: dict[str, str] = {}
    for node in graph.nodes:
        narrow = narrow_value(graph, node)
        if narrow:  # HETERO would cut there, and the binding cannot pass such a tensor on
            failures[node.name] = (
                f"reads or writes {narrow}, which onnxruntime's Python binding cannot hand over"
            )
            continue
        why = index.check(node, graph.opsets, functions, type_of)
        if why:
            failures[node.name] = why
    return failures
