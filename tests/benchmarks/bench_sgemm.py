"""numpy's sgemm rate on this machine, for ResNet-18's and the encoder's GEMM shapes.

Run: ``python tests/benchmarks/bench_sgemm.py``. The figure NUMPY's speed is bounded by: numpy's
OpenBLAS picks its kernels by ``OPENBLAS_CORETYPE`` (this machine pins ``Haswell``, AVX2, and
the project leaves it so); run it once more with another value by hand, e.g.
``OPENBLAS_CORETYPE=SkylakeX python tests/benchmarks/bench_sgemm.py``, to see what AVX-512
kernels would give. Best of 5 blocks of 20 calls each. ``--split [--busy-core]`` compares
OpenBLAS's two threads, one thread and NUMPY's own split (plugins/numpy/parallel.py) per call,
with a spinning process on one core if asked.
"""

from __future__ import annotations

import os
import time

import numpy as np

SHAPES = {
    "square 1024": (1024, 1024, 1024),
    "resnet layer1 conv (64 x 576 x 3136)": (64, 576, 3136),
    "resnet layer2 conv (128 x 1152 x 784)": (128, 1152, 784),
    "resnet layer3 conv (256 x 2304 x 196)": (256, 2304, 196),
    "resnet layer4 conv (512 x 4608 x 49)": (512, 4608, 49),
    "encoder FFN (128 x 256 x 1024)": (128, 256, 1024),
}


def rate(m: int, k: int, n: int, reps: int = 20) -> float:
    rng = np.random.default_rng(0)
    a = rng.random((m, k), dtype=np.float32)
    b = rng.random((k, n), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    np.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            np.matmul(a, b, out=c)
        best = min(best, (time.perf_counter() - start) / reps)
    return 2 * m * k * n / best / 1e9


SPLIT_SHAPES = {
    "MLP layer, batch 8 (8 x 1024 x 1024)": (8, 1024, 1024),
    "encoder FFN (128 x 256 x 1024)": (128, 256, 1024),
    "resnet layer1 conv, channel-last (3136 x 576 x 64)": (3136, 576, 64),
    "resnet layer4 conv (49 x 4608 x 512)": (49, 4608, 512),
}


def split(busy_core: bool, reps: int = 200) -> None:
    """OpenBLAS's own two threads, one thread, and NUMPY's split (parallel.py): median, p90
    and worst of ``reps`` calls each, with a spinning process on one core if asked: how each
    fares when another tenant takes a core."""
    import statistics
    import subprocess
    import sys

    from plugserve.plugins.numpy import blas, parallel

    hog = None
    if busy_core:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)
    try:
        rng = np.random.default_rng(0)
        for label, (m, k, n) in SPLIT_SHAPES.items():
            a = rng.random((m, k), dtype=np.float32)
            b = rng.random((k, n), dtype=np.float32)
            c = np.empty((m, n), np.float32)
            cases = {
                "openblas 2 threads": (2, 1, np.matmul),
                "openblas 1 thread": (1, 1, np.matmul),
                "split over 2": (1, 2, parallel.matmul),
            }
            print(label)
            for name, (threads, width, fn) in cases.items():
                blas.set_thread_count(threads)
                parallel.use_threads(width)
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    fn(a, b, out=c)
                    times.append(time.perf_counter() - start)
                times.sort()
                p90 = times[int(0.9 * len(times))]
                print(
                    f"  {name:20s} p50 {statistics.median(times) * 1e3:7.3f} ms  "
                    f"p90 {p90 * 1e3:7.3f}  worst {times[-1] * 1e3:7.2f}"
                )
    finally:
        if hog is not None:
            hog.kill()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", action="store_true", help="OpenBLAS threads vs NUMPY's split")
    parser.add_argument("--busy-core", action="store_true", help="with --split: a core taken")
    args = parser.parse_args()
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    if args.split:
        split(args.busy_core)
        return
    for label, shape in SHAPES.items():
        print(f"{label:42s} {rate(*shape):6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
