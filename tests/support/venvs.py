"""Tools tests run as their users get them, each in a virtual environment of its own (they pin
their own dependencies), made once and cached under ``~/.cache/plugserve-tests``
(``PLUGSERVE_TEST_CACHE``)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("PLUGSERVE_TEST_CACHE", Path.home() / ".cache" / "plugserve-tests"))


def cached_venv(
    name: str, packages: list[str], uninstall: tuple[str, ...] = (), timeout: float = 900
) -> Path:
    """The virtual environment ``name`` with ``packages`` installed (within ``timeout``
    seconds), made on first use, then ``uninstall`` removed (a dependency a package declares
    but that breaks it here). A lock
    serializes concurrent test runs; a marker written last tells a finished environment from
    one a killed run left half made."""
    venv = ROOT / name
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", "--quiet", *packages],
                check=True,
                timeout=timeout,
            )
            if uninstall:
                subprocess.run(
                    [str(venv / "bin" / "pip"), "uninstall", "--quiet", "--yes", *uninstall],
                    check=True,
                    timeout=300,
                )
            (venv / ".complete").touch()
    return venv
