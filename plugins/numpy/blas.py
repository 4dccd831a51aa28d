"""The OpenBLAS numpy runs on, for what numpy itself does not expose: its thread count, its
kernel family and a raw ``sgemm`` with beta.

NUMPY runs OpenBLAS on one thread and splits large GEMMs over its own threads (parallel.py):
OpenBLAS's workers spin while they wait and its split is static, so two callers on one pool
(two streams), or one busy core, stall every GEMM (measured: 4 async requests on 2 streams ran
41 requests/s against 7,600/s with one OpenBLAS thread per stream; an MLP layer took 24 ms
instead of 0.5 ms with a core taken by another process). OpenBLAS has one thread count per
process: :func:`set_thread_count` changes it only when it differs from what it set last.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import numpy as np

__all__ = [
    "NO_TRANS",
    "ROW_MAJOR",
    "core_name",
    "library_name",
    "openblas",
    "set_thread_count",
    "sgemm",
    "thread_count",
]


def _load() -> ctypes.CDLL | None:
    """numpy's bundled scipy-openblas (the ILP64 build numpy wheels ship), or None."""
    try:
        if np.__config__.CONFIG["Build Dependencies"]["blas"]["name"] != "scipy-openblas":
            return None
    except (AttributeError, KeyError, TypeError):
        return None
    root = os.path.dirname(np.__file__)
    paths = glob.glob(os.path.join(root, os.pardir, "numpy.libs", "libscipy_openblas64_*"))
    paths += glob.glob(os.path.join(root, ".dylibs", "libscipy_openblas64_*"))
    if len(paths) != 1:
        return None
    try:
        return ctypes.CDLL(paths[0])
    except OSError:
        return None


#: The library, or None where numpy runs on another BLAS (the fast paths then step aside).
openblas = _load()


def _function(*names: str) -> Any:
    """The first of ``names`` the library exports (the symbol names depend on its build)."""
    for name in names:
        fn = getattr(openblas, name, None)
        if fn is not None:
            return fn
    return None


_set_threads = _function(
    "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"
)
if _set_threads is not None:
    _set_threads.argtypes = [ctypes.c_int]
    _set_threads.restype = None
_get_threads = _function(
    "scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"
)
if _get_threads is not None:
    _get_threads.argtypes = []
    _get_threads.restype = ctypes.c_int
_last = [0]  # the count this module set last (0: none yet)
_corename = _function(
    "scipy_openblas_get_corename64_", "openblas_get_corename64_", "openblas_get_corename"
)
if _corename is not None:
    _corename.argtypes = []
    _corename.restype = ctypes.c_char_p


def core_name() -> str:
    """The kernel family OpenBLAS picked for this CPU (``SkylakeX``, ``Haswell``, ...; it
    follows ``OPENBLAS_CORETYPE``), or "" where numpy does not run on OpenBLAS."""
    if _corename is None:
        return ""
    try:
        return (_corename() or b"").decode(errors="replace").strip()
    except (OSError, ValueError):
        return ""


def library_name() -> str:
    """numpy's BLAS and its version, as numpy's build configuration names them."""
    try:
        config = np.show_config(mode="dicts")
        lib = config["Build Dependencies"]["blas"]
        return f"{lib.get('name', 'BLAS')} {lib.get('version', '')}".strip()
    except Exception:
        return "BLAS"


def thread_count() -> int:
    """OpenBLAS's current thread count (0 where numpy does not run on OpenBLAS)."""
    return _get_threads() if _get_threads is not None else 0


def set_thread_count(threads: int) -> None:
    """Run OpenBLAS with ``threads`` threads from now on, unless that is what was set last."""
    if _set_threads is not None and threads != _last[0]:
        _set_threads(threads)
        _last[0] = threads


ROW_MAJOR, NO_TRANS = 101, 111  # CBLAS enum values


def _find_sgemm() -> Any:
    """``cblas_sgemm`` through ctypes, or None.

    numpy's matmul has no beta, so accumulating GEMMs into an output (one per kernel tap
    straight from a padded image, or onto a bias already in place) needs BLAS itself. A
    self-test guards the call convention of the ILP64 build; anything else leaves the
    pure-numpy paths.
    """
    fn = _function("scipy_cblas_sgemm64_")
    if fn is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, f32, ptr, i64]
    fn.argtypes += [ptr, i64, f32, ptr, i64]
    fn.restype = None
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)
    c = np.ones((2, 4), np.float32)
    args = (a.ctypes.data, 3, b.ctypes.data, 4, 1.0, c.ctypes.data, 4)
    fn(ROW_MAJOR, NO_TRANS, NO_TRANS, 2, 4, 3, 1.0, *args)
    return fn if np.array_equal(c, a @ b + 1) else None


#: C = alpha A B + beta C on raw pointers (row-major, int64 sizes), or None.
sgemm = _find_sgemm()
