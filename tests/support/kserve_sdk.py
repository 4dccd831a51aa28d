"""The KServe Python SDK (``kserve`` on PyPI), run as its users get it: in a virtual environment
of its own (it pins its own dependencies), made once and cached under
``~/.cache/plugserve-tests`` (``PLUGSERVE_TEST_CACHE``), as tests/support/perf_analyzer.py does.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.21.0"
ROOT = Path(os.environ.get("PLUGSERVE_TEST_CACHE", Path.home() / ".cache" / "plugserve-tests"))


def python() -> Path:
    """The virtual environment's python, with ``kserve`` installed (made on first use; a
    lock serializes concurrent runs, a marker written last tells a finished one)."""
    venv = ROOT / f"kserve-{VERSION}"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".kserve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", "--quiet", f"kserve=={VERSION}"],
                check=True,
                timeout=900,
            )
            (venv / ".complete").touch()
    return venv / "bin" / "python"
