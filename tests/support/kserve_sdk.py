"""The KServe Python SDK (``kserve`` on PyPI), run as its users get it: in a cached virtual
environment of its own (``venvs.py``), as perf_analyzer is."""

from __future__ import annotations

from pathlib import Path

from venvs import cached_venv

VERSION = "0.21.0"


def python() -> Path:
    """The python of a virtual environment with ``kserve`` installed (made on first use)."""
    return cached_venv(f"kserve-{VERSION}", [f"kserve=={VERSION}"]) / "bin" / "python"
