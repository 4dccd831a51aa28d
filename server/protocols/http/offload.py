"""Decoding and encoding large JSON tensors in a process of their own.

This module is the plumbing: a helper process, shared memory, and :func:`run` /
:func:`call` of a module-level function there. What runs there is the faces' (KServe's infer
bodies: ``protocols/kserve/json_offload.py``; the OpenAI routes' bodies:
``protocols/openai/body.py``), so the plumbing imports no adapter.

simdjson parses a body, and turns its numbers into arrays, holding the GIL the whole time
(0.55 s and 0.78 s for a 50 MB body of zeros here); orjson writes a large answer the same
way. On a worker thread that still stops the REST event loop, and so every other REST
client, for as long: a 200 MB JSON body held small requests on other connections for 11.9 s.
So a JSON body (or answer) over :data:`PROCESS_BYTES` is decoded (encoded) by a helper
process, which has a GIL of its own: the body goes to it through shared memory, the arrays
come back the same way, and the server's threads only copy, with numpy, which lets go of the
GIL while it copies (:func:`copy_bytes`). The OpenAI routes' bodies go the same way
(:func:`call`: any module-level function of the body; ``protocols/openai/body.py``).

The helper is started on the first such request (about a second, once) and is replaced if it
dies; it ends with the server, even one killed outright (:func:`_end_with`). One request is
decoded or encoded at a time per helper (:data:`HELPERS`), the rest wait their turn on the REST
worker threads. What a request holds in the helper is charged with it
(server/plane/budget.py counts JSON at its decoding cost wherever that runs).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
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

__all__ = [
    "HELPERS",
    "PROCESS_BYTES",
    "call",
    "copy_bytes",
    "from_shared",
    "run",
    "shutdown",
    "to_shared",
]

#: JSON bodies and answers larger than this are decoded and encoded by the helper process
PROCESS_BYTES = 1 << 20
#: helper processes (each decodes or encodes one request at a time)
HELPERS = 1
#: results of :func:`call` larger than this come back through shared memory, not the pipe
_PIPE_BYTES = 1 << 16
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


def run(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in the helper (``fn`` a module-level function, which the helper imports by
    name; its arguments and result pickled): a face's own decoding or encoding
    (``protocols/kserve/json_offload.py``), which this module does not know."""
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


def copy_bytes(target: Any, source: Any) -> None:
    """``source``'s bytes into ``target`` (buffers of one size), by numpy, which copies without
    holding the GIL. A memoryview's slice assignment holds it: 4 MB slices, which first touch
    their pages on both sides, held it 16 ms each beside a 200 MB answer (52 ms at worst on a
    busy machine), so each small request on the event loop waited that long for each of its
    turns (REST p95 40-60 ms); numpy's copy leaves the loop its turns within ~1 ms."""
    into = np.frombuffer(target, np.uint8)
    try:
        np.copyto(into, np.frombuffer(source, np.uint8))
    finally:
        del into  # a shared memory segment refuses to close while an array is over it


def to_shared(data: bytes | memoryview) -> shared_memory.SharedMemory:
    source = memoryview(data).cast("B")
    shm = shared_memory.SharedMemory(create=True, size=max(1, source.nbytes))
    copy_bytes(shm.buf[: source.nbytes], source)
    return shm


def from_shared(name: str, size: int) -> memoryview:
    """The segment's bytes, copied out and unlinked (``np.empty``, not ``bytearray(size)``:
    that zeroes its memory first, 120 ms for 200 MB with the GIL held)."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        view = memoryview(np.empty(size, np.uint8))
        copy_bytes(view, shm.buf[:size])
        return view
    finally:
        shm.close()
        shm.unlink()


def call(fn: Callable[..., Any], body: bytes | memoryview, *args: Any) -> Any:
    """``fn(body, *args)`` in the helper, the body passed through shared memory, and what it
    returns: pickled, through the pipe when small, else through shared memory too (a KServe
    generate body's 50 MB text came back through the pipe, whose reader takes the GIL back
    for every 64 KB it reads: three at once held the REST loop 0.3 s). ``fn`` is a
    module-level function, which the helper imports by name."""
    shm = to_shared(body)
    try:
        result = run(_call_in_helper, fn, shm.name, len(body), args)
    except BaseException:  # a helper that died writing its result leaves that segment
        with contextlib.suppress(OSError):
            shared_memory.SharedMemory(name=_result_name(shm.name)).unlink()
        raise
    finally:
        shm.close()
        shm.unlink()
    if isinstance(result, bytes):
        return pickle.loads(result)
    name, size = result
    shm = shared_memory.SharedMemory(name=name)
    try:
        with shm.buf[:size] as view:
            return pickle.loads(view)
    finally:
        shm.close()
        shm.unlink()


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


def _call_in_helper(fn: Callable[..., Any], name: str, size: int, args: tuple) -> Any:
    shm = shared_memory.SharedMemory(name=name)
    try:
        body = bytes(shm.buf[:size])
    finally:
        shm.close()
    data = pickle.dumps(fn(body, *args), pickle.HIGHEST_PROTOCOL)
    del body
    if len(data) <= _PIPE_BYTES:
        return data
    out = shared_memory.SharedMemory(name=_result_name(name), create=True, size=len(data))
    try:  # unlinked by the server (call), which reads it, or knows its name if we die
        copy_bytes(out.buf[: len(data)], data)
    finally:
        out.close()
    return out.name, len(data)


def _result_name(name: str) -> str:
    """The segment of the result of the call whose body is in segment ``name``."""
    return name.lstrip("/") + "r"
