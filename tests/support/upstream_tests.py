"""Another project's own test files run unchanged against plugserve (tests/openai_conformance):
pytest in a subprocess over a temporary tree holding their files beside our fixtures, and
each test's outcome read back from its JUnit report."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["outcomes", "run_upstream"]

SUPPORT = Path(__file__).parent


def outcomes(report: Path) -> dict[str, str]:
    """``{"<module or class>::<test id>": "passed" | "failed" | "skipped"}`` of a JUnit
    report."""
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("skipped") is not None:
            found[name] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            found[name] = "failed"
        else:
            found[name] = "passed"
    return found


def run_upstream(root: Path, args: list[str], timeout: float = 1200) -> tuple[dict[str, str], str]:
    """pytest ``args`` run in ``root`` (their files under ``root/tests``, importable as the
    ``tests`` package, with this folder on the path): each test's outcome, and the run's
    output's end (for the assertion's message)."""
    paths = [str(root), str(SUPPORT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    env["PLUGSERVE_TEST_SUPPORT"] = str(SUPPORT)
    report = root / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "asyncio_mode=strict", f"--junitxml={report}", "--rootdir", str(root), *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert report.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    return outcomes(report), run.stdout[-8000:]
