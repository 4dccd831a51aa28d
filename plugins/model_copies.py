"""The copies of a model that reading it makes, none of them a copy of its weights in one
call: without its weights (what shape inference and onnx's checker are given) and its bytes a
tensor at a time (what a backend parses).

Why: a load runs beside the server's traffic, and a C call that copies every weight holds the
GIL for all of it (protobuf's ``SerializeToString`` of a 262 MB model: 0.5 s in which no other
request moved; BENCHMARKS.md, "A model's load beside traffic").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from onnx import GraphProto, ModelProto, TensorProto, helper

from plugserve.plugins.api import InvalidModel

__all__ = ["SMALL_INITIALIZER", "checked_form", "serialized", "without_weights"]

#: Initializers up to this many elements keep their values where a model's weights are left
#: out (shape arithmetic reads them: Reshape's shape, Slice's starts).
SMALL_INITIALIZER = 64


def without_weights(proto: ModelProto) -> ModelProto:
    """The model with its large initializers turned into graph inputs of the same type and
    shape, for what reads shapes only (shape inference): inference on it gives the shapes it
    gives on the whole model without copying every weight to C++ and back (two serializations
    and two parses of an 11.5 MB model: a sixth of an ORT load)."""
    light = _all_but_initializers(proto)
    inputs = {i.name for i in proto.graph.input}
    for tensor in proto.graph.initializer:
        if len(tensor.dims) and _elements(tensor.dims) > SMALL_INITIALIZER:
            if tensor.name not in inputs:  # IR < 4 lists initializers as inputs already
                light.graph.input.append(
                    helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
                )
        else:
            light.graph.initializer.add().CopyFrom(tensor)
    return light


#: protobuf's bound on one message's bytes, which readers (onnxruntime, openvino) enforce
_MAX_MESSAGE = 2**31 - 1


def serialized(proto: ModelProto) -> bytes:
    """The model's bytes for a backend that parses them (onnxruntime, openvino, torch's
    converter): ``SerializeToString``'s meaning, in pieces.

    ``SerializeToString`` holds the GIL while it copies every weight (a 262 MB model: 0.5 s in
    which no other request of the server moves). The model is written as its fields but the
    top graph's initializers, then each initializer as a graph fragment of its own: protobuf
    merges a repeated field's elements across fragments of the same message field, so the
    bytes parse to the same model (initializers in their order). Each piece is one tensor's
    copy, and ``bytes.join`` releases the GIL to copy them together: 0.3 s, the longest hold
    one tensor's (BENCHMARKS.md, "A model's load beside traffic"). A model or graph holding
    fields this onnx does not know (a newer exporter's, which a backend may read) is written
    whole, as only protobuf's own writer keeps them. Over protobuf's 2 GiB: InvalidModel."""
    try:
        if UnknownFieldSet(proto) or UnknownFieldSet(proto.graph):
            pieces = [proto.SerializeToString()]
        else:
            pieces = [_all_but_initializers(proto).SerializeToString()]
            for tensor in proto.graph.initializer:
                body = tensor.SerializeToString()
                inner = _INITIALIZER_TAG + _varint(len(body))
                pieces += (_GRAPH_TAG, _varint(len(inner) + len(body)), inner, body)
    except ValueError as exc:  # over protobuf's 2 GiB
        too_large = str(exc)
    else:
        size = sum(map(len, pieces))
        if size <= _MAX_MESSAGE:
            return b"".join(pieces)
        too_large = f"{size:,} bytes"
    raise InvalidModel(
        f"model {proto.graph.name or 'model'!r} cannot be serialized: {too_large}, over "
        "protobuf's 2 GiB for one message (keep its weights as external data beside it)"
    )


def _tag(message: type[Message], field: str) -> bytes:
    """A length-delimited field's key in protobuf's wire format."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_GRAPH_TAG = _tag(ModelProto, "graph")
_INITIALIZER_TAG = _tag(GraphProto, "initializer")


def checked_form(proto: ModelProto) -> ModelProto:
    """What onnx's checker is given: the model with each large initializer whose data is all
    in ``raw_data`` replaced by an empty stand-in of the same name and type.

    The checker takes bytes: given the model, it serializes it, weights and all, and parses it
    again in C++, holding the GIL throughout (a 262 MB model: 0.6 s in which no other request of
    the server moved, and twice the weights' bytes more memory; BENCHMARKS.md, "A model's load
    beside traffic"). Of such a tensor the checker reads only its name (unique; an input too at
    IR 3), its type (set, defined, not STRING), its dims (not negative, no overflow) and the
    length of ``raw_data`` (newer onnx: at least what the shape needs); the stand-in keeps all
    but the length, and ``ir.graph_from_proto`` then reads each one's data whole (too short or
    too long: refused, naming it). A tensor the checker would refuse for any of those stays
    itself, so that the checker says what it says; so do typed fields (``float_data``), external
    data, and every tensor below the top graph's initializers (attributes, subgraphs)."""
    light = _all_but_initializers(proto)
    for tensor in proto.graph.initializer:
        if _stands_in(tensor):
            light.graph.initializer.add(
                name=tensor.name, data_type=tensor.data_type, dims=[0] * len(tensor.dims)
            )
        else:
            light.graph.initializer.add().CopyFrom(tensor)
    return light


#: What a tensor's dims multiply to at most for onnx's checker (an int64, past which it
#: refuses the tensor for overflow)
_MAX_ELEMENTS = 2**63 - 1

#: The element types a stand-in may have: those this onnx knows, which an empty tensor of
#: passes the checker as the whole one with ``raw_data`` would (an unknown type would be
#: refused for itself, where the checker lets it through with ``raw_data``)
_PLAIN_TYPES = frozenset(TensorProto.DataType.values()) - {
    TensorProto.UNDEFINED,
    TensorProto.STRING,
}


def _stands_in(tensor: TensorProto) -> bool:
    """Whether the checker's verdict on ``tensor`` turns on the length of its ``raw_data``
    alone: a large tensor of a defined type whose one value field is ``raw_data`` (read by
    presence and repeated fields' counts; none of its bytes are copied)."""
    if not tensor.HasField("raw_data") or not tensor.HasField("data_type"):
        return False
    if tensor.data_type not in _PLAIN_TYPES:
        return False
    if tensor.data_location == TensorProto.EXTERNAL or tensor.external_data:
        return False  # (a weight read in from beside the model says DEFAULT: it stands in)
    typed = (
        tensor.float_data,
        tensor.int32_data,
        tensor.string_data,
        tensor.int64_data,
        tensor.double_data,
        tensor.uint64_data,
    )
    if any(len(values) for values in typed):
        return False
    return SMALL_INITIALIZER < _elements(tensor.dims) <= _MAX_ELEMENTS


def _elements(dims: Iterable[int]) -> int:
    """What ``dims`` multiply to, or -1 with a negative one; past an int64 no further than
    one past it (a model's dims are a client's bytes: ``math.prod`` of 50,000 dims of 2**62,
    a 500 KB model, held the GIL 6.6 s before the checker refused the tensor for overflow)."""
    total = 1
    for dim in dims:
        if dim < 0:
            return -1
        total *= dim
        if total > _MAX_ELEMENTS:
            return _MAX_ELEMENTS + 1
    return total


def _all_but_initializers(proto: ModelProto) -> ModelProto:
    """The model without its top graph's initializers, built field by field: copying the
    model and deleting them would copy every weight once more."""
    light = ModelProto()
    for field, value in proto.ListFields():
        if field.name != "graph":
            _copy_field(light, field.name, value)
    for field, value in proto.graph.ListFields():
        if field.name != "initializer":
            _copy_field(light.graph, field.name, value)
    return light


def _copy_field(target: Message, name: str, value: Any) -> None:
    if hasattr(value, "extend"):  # a repeated field
        getattr(target, name).extend(value)
    elif isinstance(value, Message):
        getattr(target, name).CopyFrom(value)
    else:
        setattr(target, name, value)
