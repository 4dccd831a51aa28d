"""The prepared GPU check's CPU path (tests/gpu/gpu_check.py --cpu): the script a GPU session
runs, run here on the CPU device TORCH at tiny sizes so that it cannot rot between GPU runs.
It must finish, write results.json and results.txt, record every check with pass, fail or skip
and a reason for each fail and skip, and pass the checks the CPU can do (the decoder's greedy
ids equal transformers', the server streams OpenAI completions) while the GPU-only ones skip
saying why. Slow: the script starts two servers and runs transformers (about 30-90 s on two
busy cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the check's CPU path runs on torch's CPU device")
pytest.importorskip("transformers", reason="the greedy reference is transformers'")
pytest.importorskip("safetensors")
pytest.importorskip("openai")

SCRIPT = Path(__file__).with_name("gpu_check.py")

#: every check the script records, whatever the machine
CHECKS = {
    "info",
    "gen.folder",
    "gen.f32",
    "gen.bf16",
    "gen.serve",
    "gen.anchors",
    "gen.targets",
    "vision.export",
    "vision.f32",
    "vision.f16",
    "vision.serve",
    "vision.metrics",
    "vision.cuda_shm",
    "vision.anchors",
    "vision.targets",
}


@pytest.mark.slow
def test_the_cpu_path_records_every_check(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--cpu", "--budget-s", "420",
         "--work", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=540, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    text = (out / "results.txt").read_text()
    checks = results["checks"]
    assert set(checks) == CHECKS, sorted(set(checks) ^ CHECKS)
    for name, entry in checks.items():
        assert entry["status"] in ("pass", "fail", "skip"), (name, entry)
        if entry["status"] != "pass":
            assert entry["reason"], (name, entry)
        assert name in text
    assert results["info"]["path"] == "cpu" and results["info"]["torch"]
    # what the CPU can do passes: transformers' greedy ids, the served streams' figures
    assert checks["gen.f32"]["status"] == "pass", checks["gen.f32"]
    assert checks["gen.f32"]["agree"] == checks["gen.f32"]["prompts"] == 12
    serve = checks["gen.serve"]
    assert serve["status"] == "pass", serve
    for streams in ("b1", "b2"):
        assert serve[streams]["tok_per_s"] > 0 and serve[streams]["ttft_ms"] > 0
    # what needs a GPU or the anchors skips and says so
    assert checks["gen.targets"]["status"] == "skip"
    assert "anchors" in checks["gen.anchors"]["reason"]
    assert checks["vision.cuda_shm"]["status"] == "skip"
    # the vision part runs where the TORCH device exists (the torch device plugin), else every
    # vision check skips naming why
    if "TORCH" in results["info"].get("devices", {}):
        for name in ("vision.export", "vision.f32", "vision.serve"):
            assert checks[name]["status"] == "pass", (name, checks[name])
        assert checks["vision.serve"]["shm_b1"]["ms"] > 0
    else:
        assert "no GPU plugin" in checks["vision.export"]["reason"]
