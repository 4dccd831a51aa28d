"""torch, imported lazily (it is not a dependency of plugserve: ``pip install plugserve[torch]``),
and what the devices read of it: the CUDA cards torch sees, their names, memory and compute
capability, and which precisions each computes.

Nothing here imports torch at module import; :func:`torch_module` does, once, and remembers why
it could not.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
from typing import Any

from plugserve.plugins.api import BackendUnavailable, cpu_name

__all__ = [
    "CudaCard",
    "cards",
    "cpu_capabilities",
    "cuda_capabilities",
    "require_cuda",
    "torch_module",
]

INSTALL_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
INSTALL_CUDA = "pip install torch (PyPI's Linux wheel is the CUDA build)"


@functools.cache
def _imported() -> tuple[Any, BaseException | None]:
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install's OSError on its libraries
        return None, exc
    return torch, None


def torch_module() -> Any:
    """The torch module; :class:`BackendUnavailable` saying why and how to install it when it
    cannot be imported."""
    torch, error = _imported()
    if torch is None:
        raise BackendUnavailable(
            f"torch cannot be imported ({type(error).__name__}: {error}); install it: "
            f"{INSTALL_CPU} (CPU), or {INSTALL_CUDA}"
        )
    return torch


@dataclasses.dataclass(frozen=True)
class CudaCard:
    """One CUDA device as torch sees it."""

    index: int
    name: str
    total_memory: int  # bytes
    capability: tuple[int, int]  # (major, minor): 8.0 Ampere, 9.0 Hopper
    uuid: str = ""

    @property
    def architecture(self) -> str:
        """What an exported network must match to be imported: the card's compute capability
        (kernels torch picks differ between them) and torch's major version."""
        major, minor = self.capability
        return f"cuda-sm{major}{minor}"


def require_cuda() -> list[CudaCard]:
    """The CUDA cards torch sees; :class:`BackendUnavailable` saying why there are none."""
    torch = torch_module()
    if torch.version.cuda is None:
        raise BackendUnavailable(
            f"torch {torch.__version__} is a CPU-only build (no CUDA); for GPUs: {INSTALL_CUDA}"
        )
    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:  # a driver too old for this torch's CUDA
        raise BackendUnavailable(f"CUDA does not work here: {exc}") from exc
    if not count:
        raise BackendUnavailable(
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
            "(no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"
        )
    return cards()


def cards() -> list[CudaCard]:
    torch = torch_module()
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(
            CudaCard(
                index,
                props.name,
                int(props.total_memory),
                (int(props.major), int(props.minor)),
                str(getattr(props, "uuid", "") or ""),
            )
        )
    return found


def cuda_capabilities(card: CudaCard) -> list[str]:
    """OPTIMIZATION_CAPABILITIES of a card by what it computes fast: FP16 and INT8 tensor
    cores from Volta/Turing (7.x), BF16 from Ampere (8.0)."""
    major, _ = card.capability
    found = ["FP32"]
    if major >= 6:
        found.append("FP16")
    if major >= 8:
        found.append("BF16")
    if major >= 7:
        found.append("INT8")
    return [*found, "EXPORT_IMPORT"]


def cpu_capabilities() -> list[str]:
    """OPTIMIZATION_CAPABILITIES of the CPU under torch: f32 always; bf16 and f16 run (torch
    has CPU kernels for both), and are listed, as OPENVINO lists them, when this CPU has the
    instructions that make them fast (AVX512-BF16/AMX, AVX512-FP16)."""
    torch = torch_module()
    found = ["FP32", "FP16", "BF16", "INT8"]
    try:
        level = torch.backends.cpu.get_cpu_capability()
    except Exception:
        level = ""
    if "AVX512" not in str(level) and platform.machine() in ("x86_64", "AMD64"):
        found = ["FP32", "INT8"]  # f16 and bf16 run, emulated: slower than f32
    return [*found, "EXPORT_IMPORT"]


def cpu_full_name() -> str:
    torch = torch_module()
    return f"{cpu_name()} (torch {torch.__version__} CPU)"
