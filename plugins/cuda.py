"""The CUDA runtime the GPU device runs on, as the server's CUDA shared memory asks for it
(``server/plane/cuda_shm.py``, Triton's extension: it opens a client's handles with the
runtime library torch loads). The device's face for that: the server imports this module,
never the torch device's inside (tests/test_house.py)."""

from __future__ import annotations

from plugserve.plugins.errors import PlugserveError
from plugserve.plugins.torch import backend

__all__ = ["card_memory", "start_cuda"]


def start_cuda() -> tuple[int, str]:
    """CUDA started through torch (its runtime library then mapped into the process):
    ``(cards torch sees, "")``, or ``(0, why not)``. Imports torch (seconds): the server asks
    at the first CUDA shared-memory registration, not at start."""
    try:
        if backend.cuda_build() is None:
            return 0, "torch is not installed, or is its CPU-only build"
        if not backend.driver_present():
            return 0, "no NVIDIA GPU or driver here"
        torch = backend.torch_module()
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not devices:
            return 0, "torch sees no CUDA device"
        torch.cuda.init()
    except (PlugserveError, RuntimeError, OSError) as exc:
        return 0, f"CUDA does not start ({type(exc).__name__}: {exc})"
    return devices, ""


def card_memory(index: int) -> int:
    """Card ``index``'s memory in bytes (after :func:`start_cuda`)."""
    return int(backend.torch_module().cuda.get_device_properties(index).total_memory)
