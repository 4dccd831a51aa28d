"""NUMPY's configuration: the common keys plus the ones that steer its transformations and
its kernel choices."""

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
        ConfigKey(
            "KERNEL_TUNING",
            True,
            **BOOL,
            doc="time the kernels that can compute a node (conv layouts, Winograd) on this "
            "machine when the network is compiled and keep the fastest; NO: fixed rules",
        ),
    )
