"""The ONNX backend node test cases on NUMPY, through the runner users run by hand."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from plugserve.conformance import load_cases, run_conformance

REQUIRED_FRACTION = 0.99


def test_runner_cli_reports_in_the_documented_format():
    exe = shutil.which("plugserve")
    cmd = [exe] if exe else [sys.executable, "-m", "plugserve.server.process.cli"]
    out = subprocess.run(
        [
            *cmd,
            "conformance",
            "--device",
            "NUMPY",
            "-k",
            "test_relu*",
            "-k",
            "test_conv_*",
            "--min-pass",
            "1.0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        out.stdout.startswith("PASS ") and " / TOTAL " in out.stdout and "% on NUMPY" in out.stdout
    )


def test_a_sample_of_every_tenth_case_passes():
    names = [c.name for c in load_cases()][::10]
    report = run_conformance("NUMPY", [f"^{n}$" for n in names])
    assert report.total > 100
    assert report.fraction >= 0.95, report.render(verbose=True)


@pytest.mark.slow
def test_full_conformance_on_numpy():
    report = run_conformance("NUMPY")
    print(report.render())
    assert report.total == len(load_cases())  # every case counted, none skipped
    assert report.fraction >= REQUIRED_FRACTION, report.render(verbose=True)
