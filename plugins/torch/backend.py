"""torch, imported lazily (it is not a dependency of plugserve: ``pip install plugserve[torch]``),
and what the devices read of it: the CUDA cards torch sees, their names, memory and compute
capability, and which precisions each computes.

Nothing here imports torch at module import, nor when a device is made: importing torch takes
9 s and 190 MB on a loaded 2-core machine (measured here), which every server start and every
``Core()`` would pay whether or not a model uses the device. :func:`installed` and
:func:`cuda_build` read torch's installed files instead; :func:`torch_module` imports it at a
device's first load, query or CUDA metric, once, and remembers why it could not.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

from plugserve.plugins.api import BackendUnavailable, cpu_name

__all__ = [
    "CudaCard",
    "cards",
    "cpu_capabilities",
    "cuda_capabilities",
    "ieee_fp32",
    "require_cuda",
    "torch_module",
]

INSTALL_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
INSTALL_CUDA = "pip install torch (PyPI's Linux wheel is the CUDA build)"


def installed() -> str:
    """torch's installed version, without importing it; :class:`BackendUnavailable` saying
    how to install it when it is not."""
    hidden = "torch" in sys.modules and sys.modules["torch"] is None  # import torch would fail
    try:
        spec = None if hidden else importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise BackendUnavailable(
            f"torch cannot be imported (it is not installed); install it: {INSTALL_CPU} (CPU), "
            f"or {INSTALL_CUDA}"
        )
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cuda_build() -> str | None:
    """The CUDA version torch was built with (its ``torch/version.py``), None for a CPU-only
    build; read from the file, not imported."""
    spec = importlib.util.find_spec("torch")
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    try:
        text = (origin.parent / "version.py").read_text() if origin else ""
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("cuda") and "=" in line:
            value = line.split("=", 1)[1].strip().strip("'\"")
            return None if value in ("None", "") else value
    return None


def driver_present() -> bool:
    """Whether an NVIDIA driver shows a GPU here (its device files), without CUDA calls."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/proc/driver/nvidia/gpus").is_dir()


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


def ieee_fp32(torch: Any) -> None:
    """float32 computes in IEEE float32 on CUDA (TF32 off for matmuls and for cuDNN's
    convolutions and RNNs), process-wide: what f32 (``EXECUTION_MODE_HINT=ACCURACY``) promises.
    TF32 would lose precision silently (7.7e-2 on a detector, issue 49); a user who wants speed
    asks for f16 or bf16.

    Matmuls: torch >= 2.9's ``fp32_precision = "ieee"`` where it exists, else the legacy
    ``allow_tf32``; and ``set_float32_matmul_precision("highest")``, torch's default, which a
    library that lowered it to "high" would otherwise leave turning TF32 on for our GEMMs.
    cuDNN: the legacy ``cudnn.allow_tf32 = False``, on every version. Measured on torch 2.13:
    the new API's ``cudnn.conv/rnn.fp32_precision = "ieee"`` leaves the legacy flag at its
    default (True), after which torch's own legacy getter (read by ``cudnn.flags()`` and by
    inductor's convolution lowering) raises "a mix of the legacy and new APIs"; the legacy
    setter sets the conv and RNN precisions with it, so both APIs read IEEE and neither raises
    (tests/plugins/torch_device/test_device_failure.py)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9
        matmul.fp32_precision = "ieee"
    else:
        matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


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
    """OPTIMIZATION_CAPABILITIES of the CPU under torch: FP32 and INT8 always; FP16 and BF16
    (which torch computes on any CPU) listed, as OPENVINO lists them, where this CPU has the
    instructions that make them fast (AVX512-FP16 or AMX-FP16; AVX512-BF16 or AMX-BF16)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    found = ["FP32"]
    if flags & {"avx512_fp16", "amx_fp16"}:
        found.append("FP16")
    if flags & {"avx512_bf16", "amx_bf16"} or platform.machine() in ("arm64", "aarch64"):
        found.append("BF16")
    return [*found, "INT8", "EXPORT_IMPORT"]


def cpu_full_name() -> str:
    return f"{cpu_name()} (torch {installed()} CPU)"
