"""onnxruntime glue: the guarded import, session options, sessions and error mapping.

Importing this module never fails: when onnxruntime cannot be imported, ``ort`` is None and
``IMPORT_ERROR`` says why, so the plugin constructor can raise BackendUnavailable with it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from plugserve.plugins.ort.config import LEVELS

try:
    import onnxruntime as ort

    IMPORT_ERROR: BaseException | None = None
except Exception as _exc:  # ImportError, or a broken install failing its own imports
    ort = None  # type: ignore[assignment]
    IMPORT_ERROR = _exc

__all__ = [
    "IMPORT_ERROR",
    "PROVIDER",
    "SPIN_BOUNDED",
    "optimized",
    "ort",
    "run_options",
    "session",
    "sessions",
]

PROVIDER = "CPUExecutionProvider"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        parts.append(int(digits or 0))
    return tuple(parts)


#: whether session.intra_op.spin_duration_us bounds the spinning (onnxruntime 1.26+); an older
#: onnxruntime spins a fixed 2**20 pauses (3 to 500 ms by CPU), so there the device never spins
SPIN_BOUNDED = ort is not None and _version(ort.__version__) >= (1, 26)


def _level(name: str) -> Any:
    levels = ort.GraphOptimizationLevel
    return {
        "DISABLE_ALL": levels.ORT_DISABLE_ALL,
        "BASIC": levels.ORT_ENABLE_BASIC,
        "EXTENDED": levels.ORT_ENABLE_EXTENDED,
        "ALL": levels.ORT_ENABLE_ALL,
    }[name]


def options(level: str, threads: int, spin_us: int = 0, profile_prefix: str | None = None) -> Any:
    """``spin_us``: how long an idle intra-op thread busy-waits before it sleeps.

    Spinning is what makes a small network fast at batch 1: without it each parallel section
    of a run waits for a sleeping thread to wake (tens of microseconds on a VM), and the MLP
    benchmark model took 0.21 ms a run instead of 0.12. Unbounded (onnxruntime's default) it
    takes a core from other devices for milliseconds after every run, so it is bounded, and
    off where the bound is unavailable.
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # errors only; warnings would flood the server log
    spin = spin_us > 0 and threads > 1 and SPIN_BOUNDED
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if spin:
        so.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")  # sequential: no pool
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def session(
    model: bytes, level: str, threads: int, spin_us: int = 0, profile_prefix: str | None = None
) -> Any:
    """onnxruntime's Python session keeps the bytes it was made from, for a provider fallback
    that a CPU-only session never takes: dropped, or every session held a whole copy of its
    model beside its weights (an 11 MB MLP: 24 MB RSS per session instead of 14.7)."""
    made = ort.InferenceSession(
        model, options(level, threads, spin_us, profile_prefix), providers=[PROVIDER]
    )
    made.disable_fallback()  # the fallback would remake the session from those bytes
    if getattr(made, "_model_bytes", None) is not None:
        made._model_bytes = None
    return made


def sessions(model: bytes, config: Any) -> list[Any]:
    """One session per stream of an OrtConfiguration, each with its share of the threads."""
    return [
        session(
            model,
            config.get("GRAPH_OPTIMIZATION_LEVEL"),
            config.threads_per_stream(),
            config.get("SPIN_DURATION_US"),
        )
        for _ in range(config.streams())
    ]


def saved_level(level: str) -> str:
    """The level the exported model is optimized at: at most EXTENDED (ALL is not portable)."""
    return LEVELS[min(LEVELS.index(level), LEVELS.index("EXTENDED"))]


def optimized(model: bytes, level: str) -> bytes:
    """The model as onnxruntime optimizes it at ``saved_level(level)``: what an export
    carries. Made when asked for, not at load (a network does not keep it), on a session of
    one thread that is dropped at once."""
    with tempfile.TemporaryDirectory(prefix="plugserve-ort-") as folder:
        path = os.path.join(folder, "optimized.onnx")
        so = options(saved_level(level), 1)
        so.optimized_model_filepath = path
        ort.InferenceSession(model, so, providers=[PROVIDER])
        with open(path, "rb") as f:
            return f.read()


def run_options(token: Any) -> tuple[Any, Any]:
    """RunOptions whose ``terminate`` the run's cancellation token sets, and what unregisters
    it. onnxruntime checks the flag before every node, a Loop's or Scan's body nodes included,
    and the run fails with "Exiting due to terminate flag". A fresh RunOptions per run (about
    a microsecond): a late interrupt of one run can never stop the next."""
    options = ort.RunOptions()
    forget = token.on_cancel(lambda: setattr(options, "terminate", True))
    return options, forget


def message(exc: BaseException) -> str:
    text = str(exc).strip()
    for prefix in ("[ONNXRuntimeError] : ",):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text.splitlines()[0] if text else type(exc).__name__
