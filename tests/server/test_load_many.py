"""Many networks in one server (issue 22): what each costs in memory and threads, and loading
them in parallel (--model-load-threads).

The memory test measures in one process per device (tests/support/load_cost.py): the bare
backend's copies, then plugserve's, held side by side; before, an ORT network held its model
twice beside its session (1.75x a bare InferenceSession) and a NUMPY network its parsed model
beside its weights (1.97x).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from models import mlp
from serving import RunningServer

from plugserve.client import Client
from plugserve.plugins.api import available_cores

SUPPORT = Path(__file__).resolve().parent.parent / "support"
X = {"x": np.ones((1, 32), np.float32)}


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


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_idle_networks_keep_only_the_threads_their_streams_need(tmp_path):
    """An ORT network's stream needs its session's intra-op threads (threads per stream - 1,
    the calling thread is the first); a NUMPY network's, none (its GEMM helpers are shared by
    the process). A stream's own worker thread is started when a request has to queue for it,
    so networks served one request at a time (unary calls run inline) start none."""
    if not _device_available("ORT"):
        pytest.skip("ORT is not available here")
    repo = tmp_path / "models"
    repo.mkdir()
    model = mlp().SerializeToString()
    count = 12
    with (
        RunningServer(
            "--model-repository", str(repo), "--model-control-mode", "explicit"
        ) as server,
        Client(server.target, timeout=60) as client,
    ):
        pid = server.process.pid

        def load_and_serve(names: list[str]) -> None:
            for name in names:
                client.load(name, model, "ORT" if name.startswith("ort") else "NUMPY")
            for name in names:
                assert client.infer(name, X)["y"].shape == (1, 10)

        load_and_serve(["ort-first", "numpy-first"])
        before = _threads(pid)
        load_and_serve([f"{kind}-{i}" for i in range(count) for kind in ("ort", "numpy")])
        after = _threads(pid)
        intra_op = available_cores() - 1  # LATENCY: one stream with every core
        # a few more are the process's own, not per network (a gRPC worker started by a call)
        assert after - before <= count * intra_op + 4, (
            f"{count} ORT and {count} NUMPY networks, idle, added {after - before} threads; "
            f"their streams need {count * intra_op}"
        )
