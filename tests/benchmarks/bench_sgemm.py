"""numpy's sgemm rate on this machine, for ResNet-18's and the encoder's GEMM shapes.

Run: ``python tests/benchmarks/bench_sgemm.py``. The figure NUMPY's speed is bounded by: numpy's
OpenBLAS picks its kernels by ``OPENBLAS_CORETYPE`` (this machine pins ``Haswell``, AVX2, and
the project leaves it so); run it once more with another value by hand, e.g.
``OPENBLAS_CORETYPE=SkylakeX python tests/benchmarks/bench_sgemm.py``, to see what AVX-512
kernels would give. Best of 5 blocks of 20 calls each.
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


def main() -> None:
    print(f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    for label, shape in SHAPES.items():
        print(f"{label:42s} {rate(*shape):6.0f} GFLOP/s")


if __name__ == "__main__":
    main()
