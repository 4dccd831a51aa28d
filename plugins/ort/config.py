"""ORT's configuration: the common keys plus onnxruntime's graph optimization level and how
long its idle intra-op threads spin."""

from __future__ import annotations

from plugserve.plugins.api import ConfigKey, Configuration

__all__ = ["LEVELS", "MAX_SPIN_US", "OrtConfiguration"]

#: GRAPH_OPTIMIZATION_LEVEL values, weakest first.
LEVELS = ("DISABLE_ALL", "BASIC", "EXTENDED", "ALL")

#: SPIN_DURATION_US at most: a client's config must not keep a core busy for long after each
#: of its runs.
MAX_SPIN_US = 100_000


def _level(value: str) -> str:
    text = str(value).strip().upper()
    if text not in LEVELS:
        raise ValueError(f"expected one of {', '.join(LEVELS)}")
    return text


def _spin(value: str) -> int:
    number = int(str(value).strip())
    if not 0 <= number <= MAX_SPIN_US:
        raise ValueError(f"expected microseconds from 0 to {MAX_SPIN_US}")
    return number


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
        ConfigKey(
            "SPIN_DURATION_US",
            500,
            _spin,
            doc="how long an idle intra-op thread of a session busy-waits for more work "
            "before it sleeps (onnxruntime 1.26+; older ones never spin); 0: never spin. "
            "Spinning spares a batch-1 request the threads' wake-ups; an idle network stops "
            "using CPU this long after its last run",
        ),
    )
