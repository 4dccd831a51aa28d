"""Many networks in one server (issue 22): what each costs in memory and threads, and loading
them in parallel (--model-load-threads).

The memory test measures in one process per device (tests/support/load_cost.py): the bare
backend's copies, then plugserve's, held side by side; before, an ORT network held its model
twice beside its session (1.75x a bare InferenceSession) and a NUMPY network its parsed model
beside its weights (1.97x).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent.parent / "support"


def _device_available(device: str) -> bool:
    from plugserve.server import Core

    return device in Core().available_devices


@pytest.mark.parametrize("device", ["ORT", "NUMPY", "OPENVINO"])
def test_a_loaded_network_costs_what_its_backend_costs(device):
    """One more loaded 11.5 MB MLP adds at most 1.2x the resident memory one more bare
    backend copy adds (in the same process, measured the same way: see load_cost.py)."""
    if not _device_available(device):
        pytest.skip(f"{device} is not available here")
    done = subprocess.run(
        [sys.executable, str(SUPPORT / "load_cost.py"), device, "10"],
        capture_output=True,
        text=True,
        cwd=SUPPORT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    cost = json.loads(done.stdout.strip().splitlines()[-1])
    assert cost["bare"] > 0.5 * cost["model_mb"], f"the bare backend holds no model? {cost}"
    assert cost["plugserve"] <= 1.2 * cost["bare"], (
        f"{device}: {cost['plugserve']:.1f} MB per loaded network against "
        f"{cost['bare']:.1f} MB per bare copy of the same model: {cost}"
    )
