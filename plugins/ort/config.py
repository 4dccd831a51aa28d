"""ORT's configuration: the common keys plus onnxruntime's graph optimization level."""

from __future__ import annotations

from plugserve.plugins.api import ConfigKey, Configuration

__all__ = ["LEVELS", "OrtConfiguration"]

#: GRAPH_OPTIMIZATION_LEVEL values, weakest first.
LEVELS = ("DISABLE_ALL", "BASIC", "EXTENDED", "ALL")


def _level(value: str) -> str:
    text = str(value).strip().upper()
    if text not in LEVELS:
        raise ValueError(f"expected one of {', '.join(LEVELS)}")
    return text


class OrtConfiguration(Configuration):
    KEYS = (
        *Configuration.KEYS,
        ConfigKey(
            "GRAPH_OPTIMIZATION_LEVEL",
            "ALL",
            _level,
            doc="onnxruntime graph optimizations: DISABLE_ALL, BASIC, EXTENDED or ALL; an "
            "export keeps the model optimized at most at EXTENDED so it stays portable",
        ),
    )
