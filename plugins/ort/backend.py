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

__all__ = ["IMPORT_ERROR", "PROVIDER", "optimize", "ort", "session"]

PROVIDER = "CPUExecutionProvider"


def _level(name: str) -> Any:
    levels = ort.GraphOptimizationLevel
    return {
        "DISABLE_ALL": levels.ORT_DISABLE_ALL,
        "BASIC": levels.ORT_ENABLE_BASIC,
        "EXTENDED": levels.ORT_ENABLE_EXTENDED,
        "ALL": levels.ORT_ENABLE_ALL,
    }[name]


def options(level: str, threads: int, profile_prefix: str | None = None) -> Any:
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # errors only; warnings would flood the server log
    # no busy-waiting: an idle ORT network must not steal CPU from other devices
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def session(model: bytes, level: str, threads: int, profile_prefix: str | None = None) -> Any:
    return ort.InferenceSession(
        model, options(level, threads, profile_prefix), providers=[PROVIDER]
    )


def saved_level(level: str) -> str:
    """The level the exported model is optimized at: at most EXTENDED (ALL is not portable)."""
    return LEVELS[min(LEVELS.index(level), LEVELS.index("EXTENDED"))]


def optimize(model: bytes, level: str, threads: int) -> tuple[bytes, Any]:
    """The model as onnxruntime optimized it at ``saved_level(level)``, and that session."""
    with tempfile.TemporaryDirectory(prefix="plugserve-ort-") as folder:
        path = os.path.join(folder, "optimized.onnx")
        so = options(saved_level(level), threads)
        so.optimized_model_filepath = path
        sess = ort.InferenceSession(model, so, providers=[PROVIDER])
        with open(path, "rb") as f:
            return f.read(), sess


def message(exc: BaseException) -> str:
    text = str(exc).strip()
    for prefix in ("[ONNXRuntimeError] : ",):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text.splitlines()[0] if text else type(exc).__name__
