"""glibc malloc tuned for a server whose requests carry megabyte tensors.

By default glibc serves an allocation of 128 KiB or more with fresh ``mmap`` pages and hands
them back on ``free``, and trims each thread's heap as soon as its top is free. A request here
allocates several such buffers (the received message, the output array, the serialized reply)
on whichever gRPC thread runs it, so every request paid one page fault per 4 KiB of each
buffer, in the kernel: measured on the identity 1x3x224x224 model, 590 minor faults and
1.8 ms of CPU per request, against 0.57 ms once freed blocks are reused (p50 2.0 -> 0.9 ms).

:func:`reuse_freed_memory` raises both thresholds so blocks up to ``limit`` bytes come from,
and go back to, malloc's heaps. The cost is that up to about twice ``limit`` of freed memory
may stay mapped per malloc arena instead of returning to the system at once; RSS still
follows the real working set, since each arena keeps only blocks its own threads have used,
and the arenas are capped (:data:`ARENAS`) so that what they keep free stays bounded however
many threads a server's loads start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
import weakref

__all__ = [
    "ARENAS",
    "GLIBC_MAX_MMAP_THRESHOLD",
    "freeze_heap",
    "freezes",
    "give_back_freed_memory",
    "refreeze_heap",
    "reuse_freed_memory",
    "thaw_heap",
]

log = logging.getLogger("plugserve.server")

#: glibc refuses an mmap threshold above this on 64-bit (HEAP_MAX_SIZE / 2).
GLIBC_MAX_MMAP_THRESHOLD = 32 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: malloc arenas at most while freed blocks are reused: each keeps up to twice the reuse limit
#: free, and glibc makes up to 8 per core as threads come (a load's, a warm-up's, an engine's).
#: Measured on twenty reloads of an ONNX decoder (optimum's tiny-llama export on ORT, 2 cores):
#: with the generation warm-up, glibc's default kept +158 MiB growing (RSS 422 MiB one load);
#: capped at 2, +3 to +43 MiB, flat; without the warm-up one run in two read +52 MiB at the
#: end against +3..+12 capped (tests/server/test_reload_memory.py). The server's Python work
#: runs under one GIL: more arenas buy little concurrency
ARENAS = 2


def reuse_freed_memory(limit: int) -> bool:
    """Keep freed blocks up to ``limit`` bytes for reuse; False where this is not glibc or
    ``limit`` is 0 (the allocator's defaults stay)."""
    if limit <= 0:
        return False
    libc = _glibc()
    # The option numbers below are glibc's; other C libraries (musl, macOS) differ or lack them.
    if libc is None:
        log.debug("malloc tuning skipped: not glibc")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    limit = min(limit, GLIBC_MAX_MMAP_THRESHOLD)
    ok = mallopt(_M_MMAP_THRESHOLD, limit) == 1 and mallopt(_M_TRIM_THRESHOLD, 2 * limit) == 1
    ok = ok and mallopt(_M_ARENA_MAX, ARENAS) == 1
    if not ok:
        log.warning("malloc tuning refused by the C library (limit %d bytes)", limit)
    return ok


def give_back_freed_memory() -> None:
    """Hand the system back what malloc's heaps hold free (glibc's ``malloc_trim``), after
    a batch of loads: each arena a load ran on kept its scratch memory (parsed and serialized
    models), up to twice the reuse limit, which requests rarely need again (20 ORT MLPs of
    11.5 MB loaded over two threads: 620 MB resident once ready; trimmed, 369 MB)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


#: whether the serving process froze its start's heap (:func:`freeze_heap`)
_frozen = False
#: how many times the heap was frozen: a network made entirely after the last freeze holds
#: no frozen object, and is collected without thawing the heap
_freezes = 0
#: retired networks not yet known to be freed (weak references), under :data:`_thaw_lock`:
#: the heap is frozen again only once all are gone
_retired: list[weakref.ref] = []
_thaw_lock = threading.Lock()


def freeze_heap() -> None:
    """Freeze what the start made out of the cyclic collector's passes (``plugserve serve``
    only: an embedding application's heap is its own). A full pass scanned all of it, ~220k
    objects with tests' tiny-llama: 90-100 ms of GIL on whichever thread allocated then, about
    once per 100k streamed tokens, the HTTP thread's or the engine's (issue 60's 32-stream
    cost, BENCHMARKS.md). Collected first, so no garbage is frozen with it."""
    global _frozen, _freezes
    gc.collect()
    gc.freeze()
    _frozen = True
    _freezes += 1


def freezes() -> int:
    """How many times the heap was frozen so far (a network records it before it is made:
    :func:`thaw_heap`)."""
    return _freezes


def thaw_heap(network: weakref.ref, made_after: int | None = None) -> bool:
    """Let the collector see the frozen heap again: ``network`` (retired: control/retire.py)
    is in it and is to be freed. A no-op where nothing was frozen, and for a network begun
    after the last freeze (``made_after``: :func:`freezes` then; None: not known): none of it
    is frozen, and its cycles are collected with the heap frozen. Thawing made each unload's
    collections scan the whole heap (~220k objects, 90-100 ms of GIL each, two or more of
    them: a health probe beside three loads and unloads waited 100-250 ms). Whether it
    thawed."""
    if not _frozen or (made_after is not None and made_after == _freezes):
        return False
    with _thaw_lock:
        _retired.append(network)
        gc.unfreeze()
    return True


def refreeze_heap() -> None:
    """Freeze the heap again after a retirement's collections, only when every retired
    network is gone: one still held (a request running past --model-unload-timeout, or
    another retirement collecting at the same time) would be frozen with it and its cycles
    never freed. Until then the heap stays thawed, as it was before the freeze existed."""
    if not _frozen:
        return
    global _freezes
    with _thaw_lock:
        _retired[:] = [ref for ref in _retired if ref() is not None]
        if not _retired:
            gc.freeze()
            _freezes += 1
