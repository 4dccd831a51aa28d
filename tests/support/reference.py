"""onnxruntime as the reference every device is compared with (optimizations off, so its
results are the ops' own, not a fused rewrite's)."""

from __future__ import annotations

import numpy as np
import pytest


def ort_run(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def ort_outputs(model, feeds, optimized: bool = False) -> dict[str, np.ndarray]:
    """A zoo model's outputs by name (``model.path()`` is its file, maybe with external data)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(model.path()), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))
