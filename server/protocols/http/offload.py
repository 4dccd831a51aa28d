"""Decoding and encoding large JSON tensors in a process of their own.

simdjson parses a body, and turns its numbers into arrays, holding the GIL the whole time
(0.55 s and 0.78 s for a 50 MB body of zeros here); orjson writes a large answer the same
way. On a worker thread that still stops the REST event loop, and so every other REST
client, for as long: a 200 MB JSON body held small requests on other connections for 11.9 s.
So a JSON body (or answer) over :data:`PROCESS_BYTES` is decoded (encoded) by a helper
process, which has a GIL of its own: the body goes to it through shared memory, the arrays
come back the same way, and the server's threads only copy, in slices short enough that the
event loop gets the GIL between them. The OpenAI routes' bodies go the same way
(:func:`call`: any module-level function of the body; ``protocols/openai/body.py``).

The helper is started on the first such request (about a second, once) and is replaced if it
dies; it ends with the server, even one killed outright (:func:`_end_with`). One request is
decoded or encoded at a time per helper (:data:`HELPERS`), the rest wait their turn on the REST
worker threads. What a request holds in the helper is charged with it
(server/plane/budget.py counts JSON at its decoding cost wherever that runs).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from plugserve.plugins.api import InferenceError
from plugserve.plugins.threads import start_daemon
from plugserve.proto.tensors import decode_strings, encode_strings
from plugserve.server.protocols.kserve.json_codec import InferCall, encode_infer, parse_infer

__all__ = ["HELPERS", "PROCESS_BYTES", "call", "decode", "encode"]

log = logging.getLogger(__name__)

#: JSON bodies and answers larger than this are decoded and encoded by the helper process
PROCESS_BYTES = 1 << 20
#: helper processes (each decodes or encodes one request at a time)
HELPERS = 1
#: bytes copied at a time between the server's memory and shared memory (~1 ms a slice)
_SLICE = 4 << 20
#: how often a helper looks whether the server that started it is still there
_WATCH_SECONDS = 0.5

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()


def _helpers() -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(
                HELPERS,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_end_with,
                initargs=(os.getpid(),),
            )
        return _pool


def _run(fn: Any, *args: Any) -> Any:
    global _pool
    try:
        return _helpers().submit(fn, *args).result()
    except BrokenProcessPool:
        with _lock:
            _pool = None  # the next request starts a new helper
        raise InferenceError(
            "the process that decodes large JSON bodies died (out of memory?); the request "
            "was not run: retry it, or send large tensors as binary data"
        ) from None


def shutdown() -> None:
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


# --- the server's side


def _to_shared(data: bytes | memoryview) -> shared_memory.SharedMemory:
    source = memoryview(data).cast("B")
    shm = shared_memory.SharedMemory(create=True, size=max(1, source.nbytes))
    for start in range(0, source.nbytes, _SLICE):
        shm.buf[start : start + _SLICE] = source[start : start + _SLICE]
    return shm


def _from_shared(name: str, size: int) -> memoryview:
    """The segment's bytes, copied out in slices and unlinked (``np.empty``, not
    ``bytearray(size)``: that zeroes its memory first, 120 ms for 200 MB with the GIL held)."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        view = memoryview(np.empty(size, np.uint8))
        for start in range(0, size, _SLICE):
            view[start : start + _SLICE] = shm.buf[start : min(size, start + _SLICE)]
        return view
    finally:
        shm.close()
        shm.unlink()


def decode(body: bytes) -> InferCall:
    """``parse_infer`` of a JSON body (no binary part), in the helper. Element types and
    shapes are checked against the network by the caller afterwards."""
    shm = _to_shared(body)
    try:
        meta = _run(_decode_in_helper, shm.name, len(body))
    finally:
        shm.close()
        shm.unlink()
    fields, tensors, out_name, out_size = meta
    packed = _from_shared(out_name, out_size) if out_name else memoryview(b"")
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


def call(fn: Callable[..., Any], body: bytes | memoryview, *args: Any) -> Any:
    """``fn(body, *args)`` in the helper, the body passed through shared memory, and what it
    returns (pickled back: ``fn`` returns something small, as the OpenAI routes' checked
    request is once their body's structure is bounded: ``protocols/openai/body.py``). ``fn``
    is a module-level function, which the helper imports by name."""
    shm = _to_shared(body)
    try:
        return _run(_call_in_helper, fn, shm.name, len(body), args)
    finally:
        shm.close()
        shm.unlink()


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
            flat = memoryview(numeric[name]).cast("B")
            for at in range(0, size, _SLICE):
                shm.buf[start + at : start + min(size, at + _SLICE)] = flat[at : at + _SLICE]
        order = list(outputs)
        bare = dataclasses.replace(call, inputs={})  # the answer needs no inputs: not pickled
        out_name, out_size, header_length = _run(
            _encode_in_helper, model, version, bare, shm.name, layout, objects, order, parameters
        )
    finally:
        shm.close()
        shm.unlink()
    return [_from_shared(out_name, out_size)], header_length


# --- the helper's side


def _end_with(server: int) -> None:
    """A helper ends when the server does. Its pipes do not tell it: it holds both ends of its
    work queue (so a killed server's helper waited on it forever, with multiprocessing's
    resource tracker, whose pipe it keeps open)."""

    def watch() -> None:
        while os.getppid() == server:  # a process whose parent ended has another one
            time.sleep(_WATCH_SECONDS)
        os._exit(1)

    start_daemon("parent-watch", watch)


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


def _call_in_helper(fn: Callable[..., Any], name: str, size: int, args: tuple) -> Any:
    shm = shared_memory.SharedMemory(name=name)
    try:
        body = bytes(shm.buf[:size])
    finally:
        shm.close()
    return fn(body, *args)


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
