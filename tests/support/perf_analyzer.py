"""Triton's perf_analyzer, run exactly as its users get it: the ``tritonclient==2.51.0`` wheel's
binary in a virtual environment of its own, with ``nvidia-cuda-runtime-cu12``'s ``libcudart`` on
``LD_LIBRARY_PATH`` and Debian's ``libb64-0d`` (newer wheels need a newer glibc than Debian 12's).

The environment is made once and cached under ``~/.cache/plugserve-tests``; .ci/run installs
``libb64-0d``.
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

from venvs import cached_venv

VERSION = "2.51.0"


def missing() -> str | None:
    """Why perf_analyzer cannot run on this machine, or None."""
    if ctypes.util.find_library("b64") is None:
        return "perf_analyzer needs Debian's libb64-0d (apt-get install libb64-0d)"
    return None


def environment() -> tuple[Path, dict[str, str]]:
    """The perf_analyzer binary and the environment it runs with, made on first use."""
    venv = cached_venv(
        f"perf-analyzer-{VERSION}", [f"tritonclient[all]=={VERSION}", "nvidia-cuda-runtime-cu12"]
    )
    cudart = next(venv.glob("lib/python*/site-packages/nvidia/cuda_runtime/lib"))
    env = {**os.environ, "LD_LIBRARY_PATH": f"{cudart}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    return venv / "bin" / "perf_analyzer", env
