"""onnxruntime as the reference every device is compared with (optimizations off, so its
results are the ops' own, not a fused rewrite's)."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest


@functools.cache
def _missing_locales(path: str) -> tuple[str, ...]:
    from plugserve.plugins.ort import locales

    return tuple(locales.missing(onnx.load(path, load_external_data=False)))


def skip_without_locales(path: str) -> None:
    """onnxruntime fails to load a StringNormalizer whose locale (default en_US.UTF-8) the
    machine has not generated (a fresh Debian or Ubuntu has only C.UTF-8); the reference cannot
    run then, so the test skips saying what to install. (The ORT device itself falls back to
    C.UTF-8: plugins/ort/locales.py.)"""
    missing = _missing_locales(path)
    if missing:
        from plugserve.plugins.ort import locales

        pytest.skip(
            f"onnxruntime, the reference, cannot load this model's StringNormalizer: the "
            f"{', '.join(missing)} locale is missing; {locales.INSTALL}"
        )


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
    skip_without_locales(str(model.path()))
    session = ort.InferenceSession(str(model.path()), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))
