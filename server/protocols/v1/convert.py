"""plugserve.v1 messages <-> arrays and plugserve's objects: tensors in (the element type
checked before the data is decoded), responses out (composed as wire bytes, see
``proto.tensors``), network descriptions and metric values. The service is
:mod:`plugserve.server.protocols.v1.servicer`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidInput, listing
from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto.tensors import (
    DTYPES,
    Pieces,
    TensorFormatError,
    array_payload,
    dtype_name,
    field_pieces,
    spec_to_proto,
)
from plugserve.proto.tensors import from_tensor as _from_tensor
from plugserve.server.plane.budget import decoded_nbytes
from plugserve.server.plane.networks import LoadedNetwork
from plugserve.server.plane.sequences import Step, sequence_step
from plugserve.server.protocols.status import status_of

__all__ = [
    "decoding_nbytes",
    "infer_response",
    "metric_json",
    "network_info",
    "request_inputs",
    "respond",
    "sequence_of",
    "stream_error",
    "stream_response",
]

# Field numbers of the composed messages (plugserve.proto).
_RESPONSE_OUTPUTS = pb.InferResponse.DESCRIPTOR.fields_by_name["outputs"].number
_TENSOR_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_STREAM_RESPONSE = pb.InferStreamResponse.DESCRIPTOR.fields_by_name["response"].number


def sequence_of(request: pb.InferRequest) -> Step | None:
    """The request's place in a sequence, checked as KServe's sequence parameters are."""
    if not request.HasField("sequence"):
        return None
    sequence = request.sequence
    return sequence_step(
        {
            "sequence_id": sequence.name
            if sequence.WhichOneof("id") == "name"
            else sequence.number,
            "sequence_start": sequence.start,
            "sequence_end": sequence.end,
        }
    )


def network_info(message: pb.NetworkInfo, entry: LoadedNetwork) -> pb.NetworkInfo:
    message.name = entry.name
    message.version = entry.version
    message.device = entry.device
    message.persisted = entry.persisted
    message.max_batch_size = entry.max_batch_size
    message.precision = entry.network.precision
    for spec in entry.inputs:
        spec_to_proto(message.inputs.add(), spec)
    for spec in entry.outputs:
        spec_to_proto(message.outputs.add(), spec)
    message.config.update(entry.network.config.to_strings())
    return message


def infer_response(
    request_id: str, network: str, version: int, outputs: Mapping[str, Any]
) -> Pieces:
    """An ``InferResponse`` as wire pieces (see ``proto.tensors``): the data is not copied
    until the pieces are joined."""
    head = pb.InferResponse(id=request_id, network=network, version=version)
    pieces: Pieces = [head.SerializeToString()]
    for name, array in outputs.items():
        array = np.asarray(array)
        meta = pb.Tensor(name=name, dtype=dtype_name(array.dtype), shape=array.shape)
        tensor: Pieces = [meta.SerializeToString()]
        payload = array_payload(array)
        if len(payload):  # proto3 leaves an empty bytes field out
            tensor += field_pieces(_TENSOR_DATA, [payload])
        pieces += field_pieces(_RESPONSE_OUTPUTS, tensor)
    return pieces


def respond(request: pb.InferRequest, entry: LoadedNetwork, outputs: Mapping[str, Any]) -> Pieces:
    """The ``InferResponse`` to ``request``, named by the network that ran it."""
    return infer_response(request.id, entry.name, entry.version, outputs)


def stream_response(request: pb.InferRequest, entry: LoadedNetwork, outputs: dict) -> bytes:
    head = pb.InferStreamResponse(id=request.id).SerializeToString()
    pieces = respond(request, entry, outputs)
    return b"".join([head, *field_pieces(_STREAM_RESPONSE, pieces)])


def stream_decoupled(
    request: pb.InferRequest, entry: LoadedNetwork, response: Any, final: bool
) -> bytes:
    """One response of a decoupled request: its outputs (none for a bare final flag), with
    ``more`` set while others follow."""
    if response is not None and response.error is not None:  # this one failed; more may come
        failed = stream_error(request, response.error)
        failed.more = not final
        return failed.SerializeToString()
    head = pb.InferStreamResponse(id=request.id, more=not final).SerializeToString()
    if response is None:
        return head
    pieces = respond(request, entry, response.outputs)
    return b"".join([head, *field_pieces(_STREAM_RESPONSE, pieces)])


def stream_error(request: pb.InferRequest, exc: BaseException) -> pb.InferStreamResponse:
    code, message = status_of(exc)
    return pb.InferStreamResponse(
        id=request.id, error=pb.Status(code=code.value[0], message=message)
    )


def from_tensor(tensor: pb.Tensor, data: bytes | None = None):
    try:
        return _from_tensor(tensor, data=data)
    except TensorFormatError as exc:
        raise InvalidInput(str(exc)) from None
    except ValueError as exc:  # numpy refuses the shape (a 0-size tensor with huge dims)
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(tensor.shape)} cannot be held: {exc}"
        ) from None


def metric_json(value: Any) -> str:
    return json.dumps(value, default=lambda v: list(v) if isinstance(v, tuple | set) else str(v))


def decoding_nbytes(request: pb.InferRequest) -> int:
    """What decoding the request's inputs allocates beyond the message: an object per string
    (numbers are read as views of the message)."""
    strings = np.dtype(object)
    return sum(
        decoded_nbytes(math.prod(max(d, 0) for d in t.shape), strings)
        for t in request.inputs
        if t.dtype == "string"
    )


def request_inputs(request: pb.InferRequest, entry: LoadedNetwork) -> dict[str, Any]:
    """The request's tensors as arrays, each element type checked against the network's
    before its data is decoded (each tensor's data read once: a read copies it out of the
    message); an input sent twice is refused, as KServe refuses it."""
    for tensor in request.inputs:
        if tensor.dtype in DTYPES:
            entry.expect(tensor.name, DTYPES[tensor.dtype])
    inputs = {tensor.name: from_tensor(tensor, data=tensor.data) for tensor in request.inputs}
    if len(inputs) != len(request.inputs):
        raise InvalidInput(f"input(s) sent more than once: {_repeated(request.inputs)}")
    return inputs


def _repeated(tensors: Any) -> str:
    names = [t.name for t in tensors]
    return listing(sorted({n for n in names if names.count(n) > 1}))
