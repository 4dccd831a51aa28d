"""ORT's configuration: the common keys plus onnxruntime's graph optimization level, how
long its idle intra-op threads spin, and which runs hold the GIL."""

from __future__ import annotations

from collections.abc import Callable

from plugserve.plugins.api import ConfigKey, Configuration

__all__ = ["LEVELS", "MAX_HOLD_US", "MAX_SPIN_US", "OrtConfiguration"]

#: GRAPH_OPTIMIZATION_LEVEL values, weakest first.
LEVELS = ("DISABLE_ALL", "BASIC", "EXTENDED", "ALL")

#: SPIN_DURATION_US at most: a client's config must not keep a core busy for long after each
#: of its runs.
MAX_SPIN_US = 100_000

#: HOLD_GIL_UNDER_US at most: a run holding the GIL stops every other Python thread.
MAX_HOLD_US = 1000


def _level(value: str) -> str:
    text = str(value).strip().upper()
    if text not in LEVELS:
        raise ValueError(f"expected one of {', '.join(LEVELS)}")
    return text


def _microseconds(most: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        number = int(str(value).strip())
        if not 0 <= number <= most:
            raise ValueError(f"expected microseconds from 0 to {most}")
        return number

    return parse


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
            _microseconds(MAX_SPIN_US),
            doc="how long an idle intra-op thread of a session busy-waits for more work "
            "before it sleeps (onnxruntime 1.26+; older ones never spin); 0: never spin. "
            "Spinning spares a batch-1 request the threads' wake-ups; an idle network stops "
            "using CPU this long after its last run",
        ),
        ConfigKey(
            "HOLD_GIL_UNDER_US",
            100,
            _microseconds(MAX_HOLD_US),
            doc="a run of a small fixed-shape network that took less than this at load is "
            "made without releasing Python's GIL, which spares a short request a thread "
            "hand-off (its runs cannot be cancelled once started); 0: every run releases it. "
            f"At most {MAX_HOLD_US}",
        ),
    )
