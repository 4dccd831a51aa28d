"""README's two set-up commands, resolved as on a fresh machine that reads PyPI directly, bring
no GPU wheel: ``pip install --dry-run --report`` of ``-e .`` and ``-e '.[test]'`` against PyPI
alone (this machine's pip configuration, whose wheel folder holds torch's CPU build, left out),
and no resolved distribution is an ``nvidia-*`` wheel, a ``+cu`` build, torch or its triton.

PyPI's Linux torch wheel is the CUDA build (17 ``nvidia-*`` wheels with it, issue 45), and
PyPI's ``xgboost`` requires ``nvidia-nccl-cu12``: the test extras name neither (pyproject.toml).
Needs PyPI (skips when it does not answer); slow (a resolution of ~107 distributions from
metadata only, 15-35 s each here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from checkout import copy_checkout

INDEX = "https://pypi.org/simple"


def _pypi_answers() -> bool:
    try:
        with urllib.request.urlopen(f"{INDEX}/pip/", timeout=10) as answer:
            return answer.status == 200
    except OSError:
        return False


def _gpu(name: str, version: str) -> bool:
    name = name.lower()
    return name.startswith("nvidia-") or "+cu" in version or name in ("torch", "triton")


@pytest.mark.slow
@pytest.mark.parametrize("target", [".", ".[test]"], ids=["install", "install-test"])
def test_readme_installs_resolve_to_no_gpu_wheel(target, tmp_path):
    if not _pypi_answers():
        pytest.skip(f"{INDEX} does not answer here: the check needs PyPI")
    # pip writes plugserve.egg-info beside pyproject.toml: a copy's, not the checkout's
    clone = copy_checkout(tmp_path / "clone")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), "--index-url", INDEX, "-e", f"{clone}{target[1:]}"],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    resolved = [
        (item["metadata"]["name"], item["metadata"]["version"])
        for item in json.loads(report.read_text())["install"]
    ]
    assert any(name == "plugserve" for name, _ in resolved), resolved
    if target == ".[test]":
        names = {name.lower() for name, _ in resolved}
        assert {"onnxruntime", "openvino", "tritonclient", "xgboost-cpu"} <= names, names
    gpu = [f"{name}=={version}" for name, version in resolved if _gpu(name, version)]
    assert not gpu, f"pip install -e '{target}' would download GPU wheels: {gpu}"
