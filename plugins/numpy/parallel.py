"""GEMMs split over a request's threads by NUMPY itself, numpy's OpenBLAS at one thread.

OpenBLAS splits a GEMM statically, one part per thread, and its threads spin while they wait:
when another process takes one of the two cores the whole GEMM waits for the part stuck on it.
Measured on this project's shared 2-core machines (``tests/benchmarks/bench_sgemm.py --split
--busy-core``): an MLP layer at batch 8 ((8 x 1024) x (1024 x 1024)) took 0.30 ms at the median
but 4.4 ms at p90 and 24 ms at worst with two OpenBLAS threads while one core was busy, and
ResNet-18's last convs ((49 x 4608) x (4608 x 512)) 22 ms at the median, against 3.0 ms with
one thread. So NUMPY runs OpenBLAS single-threaded and splits a large GEMM into more chunks
than it has threads; the request's thread and the helper threads take chunks until none are
left, so a thread that loses its core delays only the chunk it holds. Unloaded, the split runs
about as fast as OpenBLAS's own threads (1.46 vs 1.27 ms for a ResNet-18 layer-1 conv as one
GEMM, 0.49 vs 0.48 ms for an encoder FFN layer).

numpy releases the GIL inside BLAS, so the threads run in parallel. The helpers are one pool
per process (cores - 1 threads, made on first use): a request starts no threads of its own. A
request's split width is its network's ``threads_per_stream`` (:func:`use_threads`), so
streams x width stays within the cores.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from plugserve.plugins.configuration import available_cores
from plugserve.plugins.numpy.blas import NO_TRANS, ROW_MAJOR, sgemm

__all__ = ["gemm_into", "matmul", "run_jobs", "use_threads", "width"]

#: Below this many multiply-adds a GEMM runs whole on the calling thread: waking a helper
#: (~20 us) costs more than it saves.
MIN_SPLIT_MACS = 1_000_000
#: With fewer rows a GEMM is bound by reading the weight, and column slices of it read
#: slower than the whole (a (1 x 1024) x (1024 x 1024) layer: 83 us whole on one thread, 128 us
#: as four column chunks on two).
MIN_SPLIT_ROWS = 16
#: Chunks per thread, so a stalled thread leaves the others work to take.
CHUNKS_PER_THREAD = 2

_local = threading.local()
_pool: list[ThreadPoolExecutor] = []
_pool_lock = threading.Lock()


def use_threads(threads: int) -> None:
    """The split width of the GEMMs this thread runs from now on (1: no split)."""
    _local.width = max(1, int(threads))


def width() -> int:
    """This thread's split width (see :func:`use_threads`)."""
    return getattr(_local, "width", 1)


def run_jobs(jobs: list) -> None:
    """Callables, each run once, over this thread's width: for kernels that split their own
    work into independent BLAS calls (one slab of output columns each)."""
    if width() <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
    else:
        _run(width(), jobs)


def _helpers() -> ThreadPoolExecutor:
    with _pool_lock:
        if not _pool:
            workers = max(1, available_cores() - 1)
            _pool.append(ThreadPoolExecutor(workers, thread_name_prefix="numpy-gemm"))
        return _pool[0]


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.matmul(a, b, out=out)``, split over this thread's width when it is large enough.

    Split: a 2-D ``b`` (a weight) with ``a`` of any rank, by rows of ``a`` or columns of ``b``,
    whichever are more (a chunk reads the other operand whole); or operands of one batch shape,
    by batch.
    Anything else (broadcast batches, float64, integers) is numpy's own matmul.
    """
    width = getattr(_local, "width", 1)
    if width <= 1 or a.dtype != np.float32 or b.dtype != np.float32:
        return np.matmul(a, b, out=out)
    if b.ndim == 2 and a.ndim >= 2 and a.shape[-1] == b.shape[0]:
        rows = a.size // a.shape[-1] if a.shape[-1] else 0
        if (
            rows < MIN_SPLIT_ROWS
            or rows * b.shape[0] * b.shape[1] < MIN_SPLIT_MACS
            or not a.flags.c_contiguous
        ):
            return np.matmul(a, b, out=out)
        if out is None:
            out = np.empty((*a.shape[:-1], b.shape[1]), np.float32)
        elif not out.flags.c_contiguous:
            return np.matmul(a, b, out=out)
        a2 = a.reshape(rows, a.shape[-1])  # a view for a C-ordered a (a copy otherwise)
        o2 = out.reshape(rows, b.shape[1])
        chunks = width * CHUNKS_PER_THREAD
        if rows >= b.shape[1] and rows >= 8 * chunks:  # split the larger side
            bounds = _bounds(rows, chunks, 8)
            _run(width, [(a2[lo:hi], b, o2[lo:hi]) for lo, hi in bounds])
        else:
            bounds = _bounds(b.shape[1], chunks, 16)
            _run(width, [(a2, b[:, lo:hi], o2[:, lo:hi]) for lo, hi in bounds])
        return out
    if a.ndim == b.ndim >= 3 and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2]:
        batch = a.size // (a.shape[-2] * a.shape[-1]) if a.size else 0
        if batch < width or batch * a.shape[-2] * a.shape[-1] * b.shape[-1] < MIN_SPLIT_MACS:
            return np.matmul(a, b, out=out)
        if out is None:
            out = np.empty((*a.shape[:-1], b.shape[-1]), np.float32)
        elif not out.flags.c_contiguous:
            return np.matmul(a, b, out=out)
        a3 = a.reshape(batch, *a.shape[-2:])
        b3 = b.reshape(batch, *b.shape[-2:])
        o3 = out.reshape(batch, *out.shape[-2:])
        bounds = _bounds(batch, min(batch, width * CHUNKS_PER_THREAD), 1)
        _run(width, [(a3[lo:hi], b3[lo:hi], o3[lo:hi]) for lo, hi in bounds])
        return out
    return np.matmul(a, b, out=out)


def gemm_into(
    a: np.ndarray,
    b: np.ndarray,
    out: np.ndarray,
    beta: float,
    epilogue: Callable[[np.ndarray], Any] | None = None,
) -> np.ndarray:
    """``out = a @ b + beta * out`` for C-ordered 2-D float32 operands, through OpenBLAS's
    ``sgemm`` (numpy's matmul has no beta: a fused layer accumulates onto its bias and residual
    already in ``out``), split like :func:`matmul`. ``epilogue`` (in place, row-wise: a GELU, a
    LayerNormalization) then runs on each block of rows as soon as its product is done, on the
    thread that made it, while the block is still in cache; with one, the split is by rows."""
    assert sgemm is not None
    m, k = a.shape
    n = b.shape[1]
    pa, pb, pc = a.ctypes.data, b.ctypes.data, out.ctypes.data

    def job(rows: tuple[int, int], cols: tuple[int, int]):
        (r0, r1), (c0, c1) = rows, cols

        def run() -> None:
            sgemm(
                ROW_MAJOR, NO_TRANS, NO_TRANS, r1 - r0, c1 - c0, k, 1.0, pa + 4 * r0 * k, k,
                pb + 4 * c0, n, beta, pc + 4 * (r0 * n + c0), n,
            )  # fmt: skip
            if epilogue is not None:
                epilogue(out[r0:r1])

        return run

    width = getattr(_local, "width", 1)
    chunks = width * CHUNKS_PER_THREAD
    if width <= 1 or m < MIN_SPLIT_ROWS or m * k * n < MIN_SPLIT_MACS:
        job((0, m), (0, n))()
    elif (epilogue is not None or m >= n) and m >= 8 * chunks:
        _run(width, [job(r, (0, n)) for r in _bounds(m, chunks, 8)])
    elif epilogue is None:
        _run(width, [job((0, m), c) for c in _bounds(n, chunks, 16)])
    else:
        _run(width, [job(r, (0, n)) for r in _bounds(m, width, 8)])
    return out


def _bounds(n: int, chunks: int, align: int) -> list[tuple[int, int]]:
    """``chunks`` ranges covering ``range(n)``, inner bounds multiples of ``align``."""
    step = max(align, -(-n // chunks // align) * align)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _run(width: int, jobs: list) -> None:
    """Each job, ``(a, b, out)`` for ``np.matmul(a, b, out=out)`` or a callable, taken in turn
    by this thread and ``width - 1`` helpers."""
    taken = itertools.count()  # next() is atomic under the GIL

    def work() -> None:
        for i in iter(taken.__next__, None):
            if i >= len(jobs):
                return
            job = jobs[i]
            if callable(job):
                job()
            else:
                np.matmul(job[0], job[1], out=job[2])

    helpers = min(width, len(jobs)) - 1
    pool = _helpers()
    futures = [pool.submit(work) for _ in range(helpers)]
    error: BaseException | None = None
    try:
        work()
    finally:
        for future in futures:
            # A helper still busy with another request's chunk has not started this work:
            # cancel it rather than wait for it (the chunks are all done by now). Every other
            # is waited for, even after an error: its job may write into this call's arrays.
            if not future.cancel():
                error = error or future.exception()
    if error is not None:
        raise error
