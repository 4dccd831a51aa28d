"""The prepared GPU check's device part (tests/gpu/device_check.py) runs here on TORCH, the GPU
device's code on the CPU: every check passes and both files are written, so the script that
waits for a GPU machine is known to work before it gets one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)

SCRIPT = Path(__file__).resolve().parents[3] / "tests" / "gpu" / "device_check.py"


@pytest.mark.slow
def test_the_gpu_check_passes_on_torch(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--device", "TORCH", "--budget", "0.05",
         "--resnet-batch", "4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["checks"] and all(c["pass"] for c in result["checks"].values()), result
    assert {"torch_eager_b4", "TORCH_b4", "torch_eager_b1", "TORCH_b1"} <= set(result["figures"])
    # issue 49's graphs, through the CPU twin
    graphs = {"graphs_replayed", "graphs_fallback", "graphs_program_replayed",
              "graphs_shape_values", "graphs_shape_floats_f16", "graphs_replay_charge"}  # fmt: skip
    assert graphs <= set(result["checks"])
    assert not result["checks"]["graphs_shape_floats_f16"].get("skip")  # f16 on the CPU too
    assert result["checks"]["graphs_replay_charge"].get("skip")  # no graph pools on the CPU
    assert {"eager", "replayed", "speedup"} <= set(result["figures"]["TORCH_b1_graphs"])
    assert "graphs_eviction" in result["checks"]  # (a canary run in a subprocess)
    assert "PASS listed" in (tmp_path / "gpu_check.txt").read_text()
    # an index out of range refused naming the node (on a GPU: the bounds flag, no assert)
    assert "node 'lookup' (Gather)" in result["checks"]["index_out_of_range"]["detail"]
