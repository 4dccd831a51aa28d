"""KServe's typed tensor contents as arrays, at numpy's speed rather than Python's.

A ``ModelInferRequest`` may carry an input's values in a repeated field of
``InferTensorContents`` (``fp32_contents`` and the rest) instead of raw bytes: the KServe Python
SDK, grpcurl's JSON and MLServer's clients send them so. Read through protobuf's Python API,
each value becomes a Python number on its way into the array: 0.8-1.1 s per 10 million values,
all of it holding the GIL, so one such request stopped every other client of the server for as
long (a message of --max-message-bytes, 1 GiB by default, for over a minute).

Serialized, each numeric field of the message is one packed record: its values back to back,
fixed-width (float, double) or varints (the integer types and bool). So the message is
serialized once (upb, in C) and the field's payload read by numpy: fixed-width values with
``np.frombuffer``, varints by a vectorized decode (a pass for each byte of the longest varint, at
most ten) in slices of :data:`SLICE` bytes, so its scratch stays a few times a slice whatever
the tensor's size, and the GIL can pass to another thread between slices.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plugserve.proto import grpc_service_pb2 as pb
from plugserve.server.protocols.grpc.wire import varint as _varint

__all__ = ["FEW", "SLICE", "decode_contents"]

#: bytes of varints decoded at a time: the decode's scratch is ~33 bytes per byte of it, and
#: slices of 16-256 KiB decoded fastest here (2.5-4x protobuf's reading of the same values)
SLICE = 1 << 16

#: fewer varints than this are read through protobuf, which is faster for so few (512 token
#: ids: 23 us against 33) and holds the GIL no longer than the decode's numpy calls would
FEW = 1024

_NUMBERS = {f.name: f.number for f in pb.InferTensorContents.DESCRIPTOR.fields}
_FIXED = {"fp32_contents": np.dtype("<f4"), "fp64_contents": np.dtype("<f8")}


def decode_contents(contents: pb.InferTensorContents, field: str, dtype: np.dtype) -> np.ndarray:
    """The values of ``contents.<field>`` (a numeric field) as a flat array of ``dtype``.

    Raises OverflowError for a value that does not fit ``dtype`` (INT8 and INT16 travel in
    ``int_contents``, UINT8 and UINT16 in ``uint_contents``), as numpy does."""
    values = getattr(contents, field)
    count = len(values)
    fixed = _FIXED.get(field)
    if fixed is None and count < FEW:
        return np.array(values, dtype=dtype)
    payload = _packed(contents.SerializeToString(), _NUMBERS[field])
    if payload is None:  # not one packed record (upb always writes one): read it value by value
        return np.array(values, dtype=dtype)
    if fixed is not None:
        return np.frombuffer(payload, fixed).astype(dtype, copy=False)
    values = _varints(payload, count)
    if field == "bool_contents":
        return values != 0
    if field in ("int_contents", "int64_contents"):
        values = values.view(np.int64)  # two's complement: a negative value is ten bytes
    if values.dtype != dtype:
        info = np.iinfo(dtype)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise OverflowError(f"Python integer {bad} out of bounds for {dtype}")
        values = values.astype(dtype)
    return values


def _packed(data: bytes, number: int) -> memoryview | None:
    """The payload of field ``number``'s length-delimited record in ``data``, or None.

    upb writes fields in the order of their numbers, so the walk passes at most the other
    numeric fields' records (one each) before it."""
    view = memoryview(data)
    at, end = 0, len(data)
    while at < end:
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 2:
            length, at = _varint(data, at)
            if key >> 3 == number:
                return view[at : at + length]
            at += length
        elif kind == 0:
            _, at = _varint(data, at)
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        else:
            return None
    return None


def _varints(payload: Any, count: int) -> np.ndarray:
    """``count`` varints back to back in ``payload``, as uint64 (their low 64 bits)."""
    data = np.frombuffer(payload, np.uint8)
    out = np.empty(count, np.uint64)
    done = start = 0
    step = max(SLICE, 10)  # a slice holds at least one whole varint
    while start < len(data):
        window = data[start : start + step]
        ends = np.flatnonzero(window < 0x80)
        if not len(ends):
            raise ValueError("a varint of contents runs past its field")
        window = window[: ends[-1] + 1]  # whole varints only: the rest starts the next slice
        if done + len(ends) > count:
            raise ValueError("more varints than the field's count")
        if len(ends) == len(window):  # each value one byte (bool, small numbers)
            out[done : done + len(ends)] = window
        else:
            firsts = np.empty_like(ends)
            firsts[0] = 0
            firsts[1:] = ends[:-1] + 1
            lengths = ends - firsts + 1
            values = (window[firsts] & 0x7F).astype(np.uint64)
            for k in range(1, int(lengths.max())):  # the k-th byte of the varints that have one
                longer = np.flatnonzero(lengths > k)
                part = (window[firsts[longer] + k] & 0x7F).astype(np.uint64)
                values[longer] |= part << np.uint64(7 * k)
            out[done : done + len(ends)] = values
        done += len(ends)
        start += len(window)
    if done != count:
        raise ValueError(f"{done} varints where the field holds {count}")
    return out
