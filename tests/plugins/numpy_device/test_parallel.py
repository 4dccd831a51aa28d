"""NUMPY's own GEMM split (plugins/numpy/parallel.py): every shape class it splits, the ones it
hands to numpy whole, ``out=`` buffers, and several requests splitting at once, against plain
numpy in float64."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from plugserve.plugins.numpy import parallel


@pytest.fixture
def two_threads():
    parallel.use_threads(2)
    yield
    parallel.use_threads(1)


def _check(a, b, out=None):
    ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
    got = parallel.matmul(a, b, out=out)
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-4)
    if out is not None:
        assert got is out
    return got


SHAPES = [
    ((3136, 576), (576, 64)),  # many rows: split by rows
    ((49, 4608), (4608, 512)),  # few rows, wide weight: split by columns
    ((8, 1024), (1024, 1000)),  # columns not a multiple of the chunk alignment
    ((36, 36), (36, 50_000)),  # a small transform over a wide operand
    ((2, 64, 256), (256, 300)),  # a 3-D input against a 2-D weight
    ((36, 196, 64), (36, 64, 64)),  # one batch of GEMMs: split by batch
    ((2, 4, 128, 64), (2, 4, 64, 128)),  # attention scores: batch dims flattened
    ((3, 40, 50), (3, 50, 70)),  # a batch smaller than the chunks
    ((4, 4), (4, 4)),  # too small to split
]


@pytest.mark.parametrize(("a_shape", "b_shape"), SHAPES)
def test_the_split_matches_numpy(two_threads, a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) + a_shape[-1])
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    _check(a, b)
    out = np.full(
        (*np.broadcast_shapes(a_shape[:-2], b_shape[:-2]), a_shape[-2], b_shape[-1]),
        np.nan,
        np.float32,
    )
    _check(a, b, out)


def test_what_it_does_not_split_is_still_right(two_threads):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((512, 256)).astype(np.float32)
    b = rng.standard_normal((256, 512)).astype(np.float32)
    _check(a.T.copy().T, b)  # not C-ordered input (a transposed view)
    _check(a, b, out=np.empty((512, 1024), np.float32)[:, ::2])  # a strided out=
    _check(a.astype(np.float64).astype(np.float32), b.astype(np.float64).astype(np.float32))
    np.testing.assert_allclose(parallel.matmul(a.astype(np.float64), b), a.astype(np.float64) @ b)
    batch = rng.standard_normal((1, 64, 64)).astype(np.float32)
    _check(rng.standard_normal((4, 64, 64)).astype(np.float32), batch)  # broadcast batch


def test_requests_split_at_the_same_time(two_threads):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((1024, 512)).astype(np.float32)
    weights = [rng.standard_normal((512, 256)).astype(np.float32) for _ in range(4)]
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []

    def request(i):
        try:
            parallel.use_threads(2)
            for _ in range(5):
                results[i] = parallel.matmul(a, weights[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors
    for i, w in enumerate(weights):
        np.testing.assert_allclose(results[i], a @ w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    ("m", "k", "n"), [(128, 256, 1024), (1024, 64, 96), (20, 300, 40), (3, 8, 8)]
)
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_into_accumulates_like_numpy(two_threads, m, k, n, beta):
    from plugserve.plugins.numpy import blas

    if blas.sgemm is None:
        pytest.skip("numpy does not run on its bundled OpenBLAS here")
    rng = np.random.default_rng(m + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    out = rng.standard_normal((m, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b + beta * out
    assert parallel.gemm_into(a, b, out, beta) is out
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize(("m", "n"), [(128, 1024), (128, 256), (512, 64)])
def test_gemm_into_runs_a_row_wise_epilogue_on_every_row_once(two_threads, m, n):
    """A fused layer's LayerNormalization after the product, applied per block of rows on the
    thread that computed it: the result equals the product normalised row by row."""
    from plugserve.plugins.numpy import blas
    from plugserve.plugins.numpy.kernels.reduce import layer_norm_rows_inplace

    if blas.sgemm is None:
        pytest.skip("numpy does not run on its bundled OpenBLAS here")
    rng = np.random.default_rng(m * n)
    a = rng.standard_normal((m, 256)).astype(np.float32)
    b = rng.standard_normal((256, n)).astype(np.float32)
    seen = np.zeros(m, int)

    def epilogue(rows):
        seen[
            rows[:, :1].ctypes.data // (4 * n) - out.ctypes.data // (4 * n) + np.arange(len(rows))
        ] += 1
        layer_norm_rows_inplace(rows, None, None, 1e-5)

    out = np.zeros((m, n), np.float32)
    parallel.gemm_into(a, b, out, 0.0, epilogue)
    ref = a.astype(np.float64) @ b
    ref = (ref - ref.mean(1, keepdims=True)) / np.sqrt(ref.var(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert (seen == 1).all()
