"""A copy of the checkout as a fresh clone has it, for tests that must not write into it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def copy_checkout(folder: Path) -> Path:
    """The checkout's files (``git ls-files``: tracked ones, and new ones git does not ignore)
    copied into ``folder``; skips the test where there is no git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (git ls-files names the files a clone has)")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    return folder
