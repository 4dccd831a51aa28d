"""Many networks in one server (issue 22): what each costs in memory and threads, and loading
them in parallel (--model-load-threads).

The memory test measures as users see it (tests/support/load_cost.py): the RSS 10 copies add
in a fresh process, the bare backend's in one and plugserve's in another, nothing trimmed by
the measurement. Before, an ORT network held its model twice beside its session (1.75x a bare
InferenceSession) and a NUMPY network its parsed model beside its weights (1.97x); then, with
nothing more held alive, an ORT network's RSS still grew 1.41-1.6x a session's, the load's
freed scratch copies kept by the heap (issue 42; plugins/memory.py gives them back).
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
from serving import RunningServer, wait_for

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
    backend copy adds (RSS over 10 copies in a fresh process each: see load_cost.py)."""
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


def _model_folder(repo: Path, name: str, device: str, versions: tuple[int, ...] = (1,)) -> None:
    for version in versions:
        folder = repo / name / str(version)
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(mlp(seed=version).SerializeToString())
    (repo / name / "config.json").write_text(json.dumps({"device": device}))


def _repository(root: Path, count: int, prefix: str = "m") -> dict[str, str]:
    """``count`` small MLPs, alternately on NUMPY and ORT; returns name -> device."""
    devices = {}
    for i in range(count):
        name, device = f"{prefix}{i:02d}", ("NUMPY", "ORT")[i % 2]
        _model_folder(root, name, device)
        devices[name] = device
    return devices


def _broken(repo: Path, name: str) -> Path:
    folder = repo / name / "1"
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(b"\x08\x07 not an onnx model")
    return folder / "model.onnx"


def test_parallel_startup_loads_every_model_and_reports_the_broken_one(tmp_path):
    if not _device_available("ORT"):
        pytest.skip("ORT is not available here")
    repo = tmp_path / "models"
    names = _repository(repo, 38)
    _model_folder(repo, "two", "ORT", versions=(1, 2))
    broken = _broken(repo, "broken")
    with (
        RunningServer(
            "--model-repository", str(repo), "--model-load-threads", "4", "--exit-on-error", "0"
        ) as server,
        Client(server.target, timeout=60) as client,
    ):
        loaded = {(n.name, n.version): n.device for n in client.networks()}
        assert loaded == {
            **{(name, 1): device for name, device in names.items()},
            ("two", 1): "ORT",
            ("two", 2): "ORT",
        }
        for name in [*names, "two"]:
            assert client.infer(name, X)["y"].shape == (1, 10)
    assert any(f"model repository: {broken}: " in line for line in server.lines), server.log
    assert "server not ready: 40 model version(s)" in server.log  # broken: --exit-on-error 0


def test_parallel_startup_exits_on_a_broken_model_after_loading_the_others(tmp_path):
    """--exit-on-error 1 (the default): the broken model is reported, and the others loaded
    (they were not cancelled by it) before the server exits with status 1."""
    repo = tmp_path / "models"
    _repository(repo, 8)
    broken = _broken(repo, "broken")
    server = RunningServer("--model-repository", str(repo), "--model-load-threads", "4")
    with pytest.raises(RuntimeError):
        server.start()
    assert server.process is not None and server.process.wait(30) == 1
    assert any(f"model repository: {broken}: " in line for line in server.lines), server.log
    assert sum(" ready on " in line for line in server.lines) == 8, server.log


def test_repository_poll_loads_new_models_in_parallel(tmp_path):
    repo = tmp_path / "models"
    _repository(repo, 2)
    with (
        RunningServer(
            "--model-repository", str(repo), "--model-control-mode", "poll",
            "--repository-poll-secs", "0.2", "--model-load-threads", "4",
        ) as server,
        Client(server.target, timeout=60) as client,
    ):  # fmt: skip
        staging = tmp_path / "staging"
        added = _repository(staging, 12, prefix="new")
        broken = _broken(staging, "broken")
        for folder in staging.iterdir():
            folder.rename(repo / folder.name)
        expected = {("m00", 1), ("m01", 1), *((name, 1) for name in added)}
        assert wait_for(
            lambda: {(n.name, n.version) for n in client.networks()} == expected, timeout=60
        ), [(n.name, n.version) for n in client.networks()]
        for name in added:
            assert client.infer(name, X)["y"].shape == (1, 10)
        where = repo / "broken" / broken.relative_to(staging / "broken")
        assert wait_for(
            lambda: any(f"repository poll: {where}: " in line for line in server.lines)
        ), server.log


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


def test_loads_of_the_next_free_version_at_once_each_take_their_own(tmp_path):
    """A load of version 0 takes the next free version. Two at once both took the same one
    (the loading ones were not counted), and one was refused "already loaded" (a red team's
    5 of 280 plugserve.v1 loads): each now takes its own."""
    import threading

    model = mlp().SerializeToString()
    with RunningServer("--model-repository", str(tmp_path)) as server:
        versions: list[int] = []
        errors: list[BaseException] = []

        def load() -> None:
            try:
                with Client(server.target, timeout=120) as client:
                    versions.append(client.load("many", model, device="NUMPY").network.version)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=load) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert not errors, errors[:2]
        assert sorted(versions) == [1, 2, 3, 4, 5, 6]
