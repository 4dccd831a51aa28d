"""KServe's JSON infer bodies decoded, and answers encoded, in the REST port's helper process
(``protocols/http/offload.py``): simdjson's parse of a large body, and orjson's write of a large
answer, hold the GIL for as long as they run (0.55 s for a 50 MB body), so past
``offload.PROCESS_BYTES`` they run there, their arrays passed both ways through shared memory.
The functions the helper runs are this module's, imported there by name.
"""

from __future__ import annotations

import dataclasses
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from plugserve.proto.tensors import decode_strings, encode_strings
from plugserve.server.protocols.http import offload
from plugserve.server.protocols.kserve.json_codec import InferCall, encode_infer, parse_infer

__all__ = ["decode", "encode"]


def decode(body: bytes) -> InferCall:
    """``parse_infer`` of a JSON body (no binary part), in the helper. Element types and
    shapes are checked against the network by the caller afterwards."""
    shm = offload.to_shared(body)
    try:
        meta = offload.run(_decode_in_helper, shm.name, len(body))
    finally:
        shm.close()
        shm.unlink()
    fields, tensors, out_name, out_size = meta
    packed = offload.from_shared(out_name, out_size) if out_name else memoryview(b"")
    inputs: dict[str, np.ndarray] = {}
    for name, dtype, shape, offset, size, objects in tensors:
        if objects is not None:
            inputs[name] = objects
            continue
        array = np.frombuffer(packed, dtype=np.dtype(dtype), count=size // np.dtype(dtype).itemsize
                              if size else 0, offset=offset).reshape(shape)  # fmt: skip
        inputs[name] = array
    return InferCall(
        fields[0], inputs, fields[1], fields[2], fields[3], fields[4], step=fields[5],
        priority=fields[6],
    )  # fmt: skip


def encode(
    model: str,
    version: int,
    call: InferCall,
    outputs: dict[str, np.ndarray],
    parameters: dict[str, Any] | None = None,
) -> tuple:
    """``encode_infer`` in the helper: the answer's pieces and JSON length, as it gives them
    (``parameters``: the response's own, an ensemble's sequence flags)."""
    numeric = {k: np.ascontiguousarray(v) for k, v in outputs.items() if v.dtype != object}
    # BYTES go packed (their length-prefixed bytes, written a piece at a time): pickling
    # millions of str objects held the GIL 1-2 s (REST health p99 2.6 s, 4M elements)
    objects = {k: (encode_strings(v), v.shape) for k, v in outputs.items() if v.dtype == object}
    layout, offset = [], 0
    for name, array in numeric.items():
        layout.append((name, array.dtype.str, array.shape, offset, array.nbytes))
        offset += array.nbytes
    shm = shared_memory.SharedMemory(create=True, size=max(1, offset))
    try:
        for name, _, _, start, size in layout:
            offload.copy_bytes(shm.buf[start : start + size], memoryview(numeric[name]).cast("B"))
        order = list(outputs)
        bare = dataclasses.replace(call, inputs={})  # the answer needs no inputs: not pickled
        out_name, out_size, header_length = offload.run(
            _encode_in_helper, model, version, bare, shm.name, layout, objects, order, parameters
        )
    finally:
        shm.close()
        shm.unlink()
    return [offload.from_shared(out_name, out_size)], header_length


# --- the helper's side


def _decode_in_helper(name: str, size: int) -> tuple:
    shm = shared_memory.SharedMemory(name=name)
    try:
        body = bytes(shm.buf[:size])
    finally:
        shm.close()
    call = parse_infer(body, None, lambda *_: None)
    del body
    numeric = {k: np.ascontiguousarray(v) for k, v in call.inputs.items() if v.dtype != object}
    total = sum(a.nbytes for a in numeric.values())
    out = shared_memory.SharedMemory(create=True, size=max(1, total)) if numeric else None
    tensors, offset = [], 0
    for key, array in call.inputs.items():
        if array.dtype == object:
            tensors.append((key, "O", array.shape, 0, 0, array))
            continue
        out.buf[offset : offset + array.nbytes] = memoryview(array).cast("B")  # type: ignore[union-attr]
        tensors.append((key, array.dtype.str, array.shape, offset, array.nbytes, None))
        offset += array.nbytes
    fields = (
        call.id, call.outputs, call.binary, call.binary_default, call.timeout, call.step,
        call.priority,
    )  # fmt: skip
    if out is None:
        return fields, tensors, "", 0
    out.close()  # the server unlinks it once copied
    return fields, tensors, out.name, total


def _encode_in_helper(
    model: str,
    version: int,
    call: InferCall,
    name: str,
    layout: list,
    objects: dict[str, tuple[bytes, tuple[int, ...]]],
    order: list[str],
    parameters: dict[str, Any] | None = None,
) -> tuple[str, int, int | None]:
    shm = shared_memory.SharedMemory(name=name)
    try:
        arrays = {
            key: np.frombuffer(bytes(shm.buf[start : start + size]), dtype=np.dtype(dtype)).reshape(
                shape
            )
            for key, dtype, shape, start, size in layout
        }
    finally:
        shm.close()
    for key, (packed, shape) in objects.items():
        count = int(np.prod(shape, dtype=np.int64))
        arrays[key] = decode_strings(packed, count, key, bounded=False).reshape(shape)
    ordered = {k: arrays[k] for k in order}
    pieces, header_length = encode_infer(model, version, call, ordered, parameters=parameters)
    body = b"".join(pieces)
    out = shared_memory.SharedMemory(create=True, size=max(1, len(body)))
    out.buf[: len(body)] = body
    out.close()
    return out.name, len(body), header_length
