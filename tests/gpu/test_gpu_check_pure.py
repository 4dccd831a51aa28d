"""The prepared GPU check's pure parts, which need neither a GPU nor torch: the CUDA IPC
handle torch gives (gpuops_check._ipc_handle), the offline environment the run sets, the
order of the checks (the anchors last), and the budget numbers agreeing between gpu_check.py's
defaults and README.md's device command."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ipc_handle_is_the_64_bytes_in_each_form_torch_writes():
    """torch < 2.4: the bare 64-byte cudaIpcMemHandle_t; torch 2.4-2.12: version 2, type 'c',
    then the handle (66 bytes); torch 2.13: version 3. Another type (expandable segments'
    'e') or length is refused naming what it got."""
    ops = _load("gpuops_check")
    handle = bytes(range(64))
    assert ops._ipc_handle(handle) == handle
    assert ops._ipc_handle(b"\x02c" + handle) == handle  # torch 2.11 on the GPU machine
    assert ops._ipc_handle(b"\x03c" + handle) == handle  # torch 2.13
    assert ops._ipc_handle(b"c" + handle) == handle
    with pytest.raises(RuntimeError, match="66 bytes, beginning b'\\\\x02e'"):
        ops._ipc_handle(b"\x02e" + handle)
    with pytest.raises(RuntimeError, match="70 bytes"):
        ops._ipc_handle(b"\x02c" + handle + b"xxxx")


def test_the_run_is_offline_and_keeps_an_operators_setting(monkeypatch):
    g = _load("gpu_check")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_TELEMETRY", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    g.offline()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert os.environ["TRANSFORMERS_OFFLINE"] == "0"


def test_the_pass_fail_checks_come_before_the_anchors():
    """The anchors (figures, capped by what is left) run after every pass/fail check, the
    gpuops part included, and the generation anchor's static batches run 8 and 32 first."""
    g = _load("gpu_check")
    order = list(g.CHECKS)
    assert order[-4:] == ["vision.anchors", "vision.targets", "gen.anchors", "gen.targets"]
    assert max(order.index(n) for n in order if n.startswith("gpuops.")) < order.index(
        "vision.anchors"
    )
    source = (HERE / "gpu_check.py").read_text()
    assert '"--batches", "8,32,1"' in source


def test_the_budget_fits_the_device_command():
    """README's device command: its ``timeout N`` on gpu_check.py outlasts the budget and
    the grace (the run stops itself, saving, before it is killed), and the device call's
    timeout_s leaves the wheels' install time beside it."""
    g = _load("gpu_check")
    readme = (HERE / "README.md").read_text()
    timeout = int(re.search(r"timeout (\d+) python3 tests/gpu/gpu_check\.py", readme)[1])
    timeout_s = int(re.search(r"`timeout_s` (\d+)", readme)[1])
    assert timeout >= g.BUDGET_S + g.GRACE_S + 10, (g.BUDGET_S, g.GRACE_S, timeout)
    assert timeout + 60 <= timeout_s <= 600, (timeout, timeout_s)
    assert f"--budget-s {g.BUDGET_S:.0f}" in readme and f"--grace-s {g.GRACE_S:.0f}" in readme


def test_wheels_sh_shadows_none_of_the_images_cuda_or_build_packages():
    """The image's cuda-bindings, cuda-pathfinder, nvidia-ml-py and setuptools stay in
    charge (wheels installed to /tmp/site come first on PYTHONPATH); tritonclient.http's own
    needs travel (gevent's family), and setuptools goes to the build folder only."""
    text = (HERE / "wheels.sh").read_text()
    pinned = set(re.findall(r"([A-Za-z0-9_.-]+)==", text))
    for shadowing in ("cuda-bindings", "cuda-pathfinder", "nvidia-ml-py"):
        assert shadowing not in pinned
    for needed in ("geventhttpclient", "gevent", "greenlet", "zope.event", "zope.interface",
                   "brotli", "tritonclient"):  # fmt: skip
        assert needed in pinned
    assert re.search(r'-d "\$DEST/build" setuptools==', text)
