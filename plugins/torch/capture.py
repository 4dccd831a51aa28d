"""CUDA graph capture, done one way for every capturer: a lane's per-shape graphs
(:mod:`.graphs`) and the torch decoder's decode steps (:mod:`.decoder`).
Each rule here answers a way a capture goes wrong on a real card (the CUDA review of
2026-11-26, its findings in brackets):

- **One capture at a time in the process** (:data:`CAPTURE_LOCK`) [8, 12]: torch's own rule
  ("only one capture may be underway at a time"), and the cuBLAS clear below is process-wide.
- **cuBLAS workspaces cleared before and after each warm-up and capture** [8]: torch keeps one
  cuBLAS workspace per (handle, stream), and a graph bakes its address into its GEMM nodes;
  since pytorch#175276 destroying a graph frees its capture stream's workspace, which other
  live graphs captured on that stream still use (pytorch#193402: an illegal address on their
  next replay, which kills the CUDA context). Cleared around the capture, each graph allocates
  its workspace inside its own pool, and destroying it frees only that; inductor's
  cudagraph_trees does the same.
- **On the network's device, on an explicit stream** [7]: under ``torch.cuda.device`` of the
  stream's device, so a network on ``cuda:1`` is not "captured" on ``cuda:0``'s stream while
  its kernels run eagerly on its own (an empty graph, stale outputs on every replay); a graph
  torch reports empty is a failed capture, not a cached one.
- **Thread-local capture mode** [12]: another thread's cudaMalloc, pinned allocation or sync
  (other models, loads, the shared-memory plane) neither fails nor invalidates this capture.
- **The low-level API** [11, 13]: ``capture_begin``/``capture_end`` inside ``torch.cuda.stream``,
  so the stream context is restored on every exit (``torch.cuda.graph``'s ``__exit__`` leaves
  the thread on the capture stream when ``capture_end`` raises), and without
  ``torch.cuda.graph``'s device-wide synchronize, ``empty_cache`` and host-cache flush, which
  stall every other lane at each first capture of a shape. A capture that fails is ended with
  the allocator told so: in torch <= 2.12 ``capture_end`` raises before it ends the pool's
  allocation, leaving a capture "underway" for the process's life (``empty_cache`` then does
  nothing, pytorch#180395).
- **Dedicated streams** (:func:`new_stream`) [9]: ``torch.cuda.Stream()`` hands out one of 32
  pooled streams per device round robin, so the 33rd lane shares a stream with the first: while
  one captures, the other's kernels land in its graph. A stream here is the driver's own
  (``cuStreamCreate``, non-blocking) wrapped as ``torch.cuda.ExternalStream``, destroyed after
  its owner goes (at the next capture or new stream, when no capture is underway); where the
  driver cannot be reached, torch's pooled stream, and :func:`stream_lock` (one lock per
  underlying stream) keeps two owners of one stream from interleaving.
- **Memory** (:class:`Captured`'s ``nbytes``) [16]: what ``torch.cuda.memory_reserved`` grew by
  during the capture, the graph's private pool, which stays reserved while the graph lives: the
  capturer charges it to the device's budget (``devmem``) until the graph goes. (Another
  thread's cache growth meanwhile counts too: an overestimate, on the budget's safe side.)
- **Failures** (:func:`out_of_memory`) [22]: a capture that ran out of memory is worth another
  try later; the capturers keep such failures apart from their graphs and retry after
  :data:`RETRY_AFTER` uses.

On the CPU nothing here runs but :func:`stream_lock` (a no-op without a stream) and
:class:`RetryPolicy`: the CPU twins never capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "CAPTURE_LOCK",
    "RETRY_AFTER",
    "Captured",
    "EmptyCapture",
    "RetryPolicy",
    "capture",
    "capturing",
    "new_stream",
    "out_of_memory",
    "stream_lock",
]

log = logging.getLogger(__name__)

#: one capture (with its warm-up) at a time in the process
CAPTURE_LOCK = threading.RLock()
#: uses of a capturer (a lane's requests, a decoder's decode steps) after which a shape whose
#: capture ran out of memory is captured again
RETRY_AFTER = 256
#: cuStreamCreate's flag: no implicit wait on the legacy default stream (as torch's own)
_CU_STREAM_NON_BLOCKING = 1


class EmptyCapture(RuntimeError):
    """torch captured no work: the steps ran somewhere other than the capture stream."""


@dataclasses.dataclass
class Captured:
    """A graph, what its body returned (its static outputs), and the bytes its capture added
    to the device's reserved memory (its pool, held while the graph lives)."""

    graph: Any
    outputs: Any
    nbytes: int


def _clear_cublas_workspaces(torch: Any) -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:  # (in torch since 2.1; absent: nothing to clear)
        clear()


@contextlib.contextmanager
def capturing(torch: Any, device: Any) -> Iterator[None]:
    """Around one warm-up and capture: the process's capture lock held, ``device`` current,
    cuBLAS's workspaces cleared before and after (the module's docstring)."""
    with CAPTURE_LOCK, torch.cuda.device(device):
        _reap()  # (no capture underway in the process now)
        _clear_cublas_workspaces(torch)
        try:
            yield
        finally:
            _clear_cublas_workspaces(torch)


def capture(torch: Any, stream: Any, body: Callable[[], Any], pool: Any = None) -> Captured:
    """``body``'s CUDA work captured as a graph on ``stream`` (inside :func:`capturing`, the
    warm-up done before: cuBLAS's workspaces are cleared again between the two, else the graph
    would bake in the warm-up's workspace, a block of the general pool freed after). Raises
    what the body or the capture raised (the stream context restored, the allocator's capture
    ended), or :class:`EmptyCapture`."""
    graph = torch.cuda.CUDAGraph()
    device = stream.device
    if pool is None:  # a pool of its own, named here (torch's graph.pool() needs a success)
        pool = torch.cuda.graph_pool_handle()
    # the warm-up's workspace forgotten: the capture allocates its own, inside its pool
    _clear_cublas_workspaces(torch)
    before = torch.cuda.memory_reserved(device)
    with torch.cuda.stream(stream):  # restored on every exit
        try:  # (torch routes the pool's allocations before it begins the stream's capture)
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        except BaseException:
            _end_pool(torch, graph, device, pool)
            raise
        try:
            outputs = body()
        except BaseException:
            _abandon(torch, graph, device, pool)
            raise
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                graph.capture_end()
            except BaseException:
                _end_pool(torch, graph, device, pool)
                raise
    _clear_cublas_workspaces(torch)  # (before any eager GEMM on the stream reuses it)
    nbytes = max(0, int(torch.cuda.memory_reserved(device)) - int(before))
    empty = [w for w in seen if "graph is empty" in str(w.message).lower()]
    if empty:
        raise EmptyCapture(
            f"the CUDA graph captured on {device} is empty (its steps ran on another device "
            f"or stream): {empty[0].message}"
        )
    for w in seen:  # torch's other warnings, as they would have been
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return Captured(graph, outputs, nbytes)


def _abandon(torch: Any, graph: Any, device: Any, pool: Any) -> None:
    """End a capture whose body raised (the capture is invalid or the request ended)."""
    try:
        graph.capture_end()
    except Exception:  # invalidated by the body's sync: expected
        _end_pool(torch, graph, device, pool)


#: graphs whose capture_end raised, kept alive: torch <= 2.12 leaves allocator filters (the
#: pinned-host allocator's among them, which nothing here can end) that point at the graph
_failed_graphs: list[Any] = []


def _end_pool(torch: Any, graph: Any, device: Any, pool: Any) -> None:
    """After ``capture_end`` raised: end the allocator's allocation to the graph's pool, which
    torch <= 2.12 skips (its ``capture_end`` checks ``cudaStreamEndCapture`` first), else the
    allocator counts a capture underway for ever (``empty_cache`` then does nothing), and give
    back the capture's hold on the pool (the graph, never destroyed, will not). Where torch
    ended it already, the end raises "not currently recording" and nothing more is done."""
    _failed_graphs.append(graph)
    index = device.index if device.index is not None else torch.cuda.current_device()
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None:
        return
    try:
        end(index, pool)
    except Exception:
        return
    if release is not None:
        with contextlib.suppress(Exception):
            release(index, pool)


def out_of_memory(torch: Any, exc: BaseException) -> bool:
    """Whether a capture failed for want of memory (worth another try later)."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(
        getattr(torch, "cuda", None), "OutOfMemoryError", None
    )
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()


class RetryPolicy:
    """Shapes whose capture failed, kept apart from the graphs (a failure takes no graph's
    slot): one that ran out of memory is tried again after :data:`RETRY_AFTER` uses, any other
    stays eager (a capture that syncs fails the same way every time). At most ``bound``
    failures are remembered, the oldest forgotten (then captured again at a second sight)."""

    def __init__(self, bound: int, retry_after: int = RETRY_AFTER) -> None:
        self.bound = max(1, int(bound))
        self.retry_after = int(retry_after)
        self.uses = 0
        self._failed: dict[Any, tuple[int, bool]] = {}

    def use(self) -> None:
        """Count one use of the capturer (a request, a decode step)."""
        self.uses += 1

    def failed(self, key: Any, oom: bool) -> None:
        self._failed.pop(key, None)
        self._failed[key] = (self.uses, oom)
        while len(self._failed) > self.bound:
            self._failed.pop(next(iter(self._failed)))

    def eager(self, key: Any) -> bool:
        """Whether ``key`` runs eagerly now (it failed, and no retry is due); a due retry
        forgets the failure (the caller captures again)."""
        found = self._failed.get(key)
        if found is None:
            return False
        at, oom = found
        if oom and self.uses - at >= self.retry_after:
            del self._failed[key]
            return False
        return True

    def __len__(self) -> int:
        return len(self._failed)


# --- streams

_stream_locks: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_stream_locks_lock = threading.Lock()


class _Lock:
    """A lock a weak dictionary can hold (``threading.Lock`` takes no weak reference)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def stream_lock(stream: Any) -> Any:
    """The lock of the CUDA stream underneath ``stream`` (keyed by its handle, so two owners of
    one pooled stream share it); a no-op context without a stream. Hold it around a run on the
    stream; the capture lock is taken inside it, never the other way round."""
    if stream is None:
        return contextlib.nullcontext()
    key = int(stream.cuda_stream)
    with _stream_locks_lock:
        lock = _stream_locks.get(key)
        if lock is None:
            lock = _stream_locks[key] = _Lock()
    return lock


_driver_lib: list[Any] = []


def _driver() -> Any:
    """libcuda (the driver API), or None where it cannot be loaded."""
    if not _driver_lib:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuStreamCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cuStreamCreate.restype = ctypes.c_int
            lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
            lib.cuStreamSynchronize.restype = ctypes.c_int
            lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
            lib.cuStreamDestroy_v2.restype = ctypes.c_int
            lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            lib.cuDeviceGet.restype = ctypes.c_int
            lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.restype = ctypes.c_int
            lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
            lib.cuDevicePrimaryCtxRelease_v2.restype = ctypes.c_int
            lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            lib.cuCtxSetCurrent.restype = ctypes.c_int
        except (OSError, AttributeError) as exc:
            log.info("libcuda not loaded (%s): CUDA streams come from torch's pool", exc)
            lib = None
        _driver_lib.append(lib)
    return _driver_lib[0]


def _bind_context(lib: Any, index: int) -> int:
    """Make card ``index``'s primary context current on this thread; the driver's CUresult.

    ``torch.cuda.current_stream(device)`` does not do it: torch skips ``cudaSetDevice`` when
    the device already is its current one, so a stream executor's fresh thread has no current
    context and ``cuStreamCreate`` answers 201 (CUDA_ERROR_INVALID_CONTEXT). The primary
    context is the one torch's runtime uses; retaining it and releasing it at once leaves its
    count where it was (torch holds it for the process's life)."""
    card, context = ctypes.c_int(), ctypes.c_void_p()
    code = lib.cuDeviceGet(ctypes.byref(card), index)
    if code != 0:
        return code
    code = lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), card.value)
    if code != 0:
        return code
    try:
        return lib.cuCtxSetCurrent(context)
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(card.value)


def new_stream(torch: Any, device: Any, owner: Any) -> Any:
    """A CUDA stream of ``owner``'s own on ``device``: the driver's, destroyed when ``owner``
    is collected (after its work is done); torch's pooled stream where the driver's cannot be
    made (see :func:`stream_lock`)."""
    lib = _driver()
    handle = ctypes.c_void_p()
    code = -1
    with CAPTURE_LOCK:
        _reap()
    if lib is not None:
        with torch.cuda.device(device):
            index = torch.cuda.current_device()  # (device "cuda" alone: torch's current card)
            code = _bind_context(lib, index)
            if code == 0:
                code = lib.cuStreamCreate(ctypes.byref(handle), _CU_STREAM_NON_BLOCKING)
    if code != 0 or not handle.value:
        if lib is not None:
            log.warning("cuStreamCreate on %s failed (CUresult %s): a pooled torch stream "
                        "instead", device, code)  # fmt: skip
        return torch.cuda.Stream(device=device)
    stream = torch.cuda.ExternalStream(handle.value, device=device)
    finalizer = weakref.finalize(owner, _retired.append, (lib, handle.value))
    finalizer.atexit = False  # at exit the context goes with the process
    return stream


#: streams whose owners were collected, destroyed at the next capture or new stream: the
#: collector may run inside a capture, where a stream call of the capturing thread is not safe
_retired: list[tuple[Any, int]] = []


def _reap() -> None:
    """Destroy the retired streams (under the capture lock: no capture of ours is underway)."""
    while _retired:
        lib, handle = _retired.pop()
        lib.cuStreamSynchronize(handle)  # its work done: its blocks are reused by a new stream
        lib.cuStreamDestroy_v2(handle)  # that may get the same handle
