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


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


@functools.cache
def _source(path: str) -> str | bytes:
    """What onnxruntime loads for the model at ``path``: the file, or the model with its
    integer GEMMs' weights as uint8 (:func:`unsaturated`) when it has such weights."""
    exact = unsaturated(onnx.load(path))
    return exact.SerializeToString() if exact is not None else path


def ort_run(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    exact = unsaturated(_copy(model))
    session = ort.InferenceSession(
        (exact or model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def ort_outputs(model, feeds, optimized: bool = False) -> dict[str, np.ndarray]:
    """A zoo model's outputs by name (``model.path()`` is its file, maybe with external data)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    skip_without_locales(str(model.path()))
    session = ort.InferenceSession(
        _source(str(model.path())), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def unsaturated(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """``model`` with every int8 constant weight of an integer GEMM as uint8, or None when it
    has none: the same op's exact answer, where onnxruntime's int8 kernel saturates on x86
    CPUs without VNNI (``plugins/ort/saturation.py``; the ORT device does the same there).
    NUMPY and OPENVINO, which do not use it, are compared with it: a rewrite that changed an
    answer would show there."""
    from plugserve.plugins.ort.saturation import exact_integer_gemms

    return model if exact_integer_gemms(model) else None
