"""f16 to f32 precision conversion (the seed's ConvertPrecision, INFERENCE_PRECISION_HINT=f32).

numpy computes float16 through float32 conversions element by element, which is slow and, over
a chain of ops, rounds at every step. This pass makes the network compute in float32: float16
initializers become float32, each float16 input is cast up on entry and each float16 output
cast back down on exit, so the network's inputs and outputs keep their declared types.

Graphs that create float16 values from other types (a Cast or CastLike to float16, or ops with
a dtype attribute) or that hold subgraphs are left alone: rewriting those would change where
rounding happens, which is the model's intent rather than an implementation detail.
"""

from __future__ import annotations

import numpy as np
from onnx import AttributeProto, TensorProto

from plugserve.plugins.api import TensorSpec
from plugserve.plugins.ir import Graph, Node
from plugserve.plugins.passes.manager import PassContext

__all__ = ["convert_f16_to_f32"]

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_TYPE_CREATING = {
    "Cast",
    "CastLike",
    "ConstantOfShape",
    "EyeLike",
    "RandomUniform",
    "RandomNormal",
    "RandomUniformLike",
    "RandomNormalLike",
    "Multinomial",
    "Bernoulli",
    "Constant",
    "HannWindow",
    "HammingWindow",
    "BlackmanWindow",
    "MelWeightMatrix",
}


def convert_f16_to_f32(graph: Graph, context: PassContext) -> bool:
    if not context.f16_to_f32 or not _uses_f16(graph):
        return False
    for node in graph.nodes:
        if node.op_type in _TYPE_CREATING or any(
            a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attrs.values()
        ):
            return False
    for name, value in list(graph.initializers.items()):
        if value.dtype == _F16:
            graph.initializers[name] = value.astype(_F32)
    for name, spec in list(graph.value_info.items()):
        if spec.dtype == _F16:
            graph.value_info[name] = TensorSpec(name, _F32, spec.shape)
    # Every renaming is decided first and applied in one scan of the nodes: per-value scans
    # would cost nodes x inputs.
    renamed: dict[str, str] = {}  # an f16 input or output -> the f32 value nodes read instead
    for spec in graph.inputs:
        if spec.dtype == _F16:
            renamed[spec.name] = graph.unique_name(f"{spec.name}__f32")
    producers = graph.producers()
    produced: dict[str, tuple[Node, str]] = {}  # f16 output -> its producer, the f32 value
    for spec in graph.outputs:
        if spec.dtype == _F16 and spec.name not in renamed:
            producer = producers.get(spec.name)
            if producer is None:  # an output that is an input or initializer
                if spec.name in graph.initializers:
                    graph.initializers[spec.name] = graph.initializers[spec.name].astype(_F16)
                continue
            inner = graph.unique_name(f"{spec.name}__f32")
            renamed[spec.name] = inner
            produced[spec.name] = (producer, inner)
    readers: dict[str, list[Node]] = {}
    for node in graph.nodes:
        node.inputs = [renamed.get(n, n) for n in node.inputs]
        node.outputs = [renamed.get(n, n) if n in produced else n for n in node.outputs]
        for n in node.inputs:
            readers.setdefault(n, []).append(node)
    prologue = [
        _cast(spec.name, renamed[spec.name], TensorProto.FLOAT, readers.get(renamed[spec.name], []))
        for spec in graph.inputs
        if spec.dtype == _F16
    ]
    epilogue = [
        _cast(produced[spec.name][1], spec.name, TensorProto.FLOAT16, [produced[spec.name][0]])
        for spec in graph.outputs
        if spec.name in produced
    ]
    for spec in graph.inputs + graph.outputs:
        if spec.dtype == _F16 and spec.name in renamed:
            inner = renamed[spec.name]
            graph.value_info[inner] = TensorSpec(inner, _F32, spec.shape)
            graph.value_info[spec.name] = spec
    graph.nodes = prologue + graph.nodes + epilogue
    return True


def _uses_f16(graph: Graph) -> bool:
    return any(s.dtype == _F16 for s in graph.value_info.values()) or any(
        v.dtype == _F16 for v in graph.initializers.values()
    )


def _cast(src: str, dst: str, to: int, serves: list[Node]) -> Node:
    names = [name for node in serves for name in node.fused_names]
    node = Node("Cast", [src], [dst], name=f"{dst}__cast", fused_names=list(dict.fromkeys(names)))
    node.set_attr("to", to)
    return node
