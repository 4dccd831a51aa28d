"""NUMPY's configuration: the common keys plus the two that steer its transformations."""

from __future__ import annotations

from plugserve.plugins.api import BOOL, ConfigKey, Configuration

__all__ = ["NumpyConfiguration"]


def _precision(value: str) -> str:
    text = str(value).strip().lower()
    if text not in ("f32", "f16"):
        raise ValueError("expected f32 or f16")
    return text


class NumpyConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "DISABLE_TRANSFORMATIONS",
            False,
            **BOOL,
            doc="run the graph as written (no folding or fusion); for debugging",
        ),
        ConfigKey(
            "INFERENCE_PRECISION_HINT",
            "f32",
            _precision,
            doc="f32: compute float16 networks in float32; f16: keep float16",
        ),
    )
