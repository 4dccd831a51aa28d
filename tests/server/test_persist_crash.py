"""SIGKILL in the middle of a persisted load: after a restart the network is whole or absent.

The server's devices come from a third-party package (entry points, as pip installs them): GATED
(see test_server_load.py) plus test hooks that hold the repository write at a chosen step. The
test waits until the server reports it reached that step (a marker file), kills it with SIGKILL
there, restarts it on the same repository and checks what it finds. Nothing depends on timing.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
from models import mlp
from serving import RunningServer, wait_for
from test_server_load import GATED_DEVICES

from plugserve.client import Client
from plugserve.server import Core

HOOKS = '''
import plugserve.server.control.repository as _repository


def _step(name):
    """Mark that the write reached step ``name``; hold there while the "hold" file exists."""
    if not os.path.exists(os.path.join(GATES, "hold-" + name)):
        return
    open(os.path.join(GATES, "at-" + name), "w").close()
    wait_for_gate("never")  # killed here by the test


_write_synced = _repository._write_synced
_write_settings = _repository.Repository._write_settings
_replace = _repository.os.replace


def write_synced(path, data):
    if path.name == "model.onnx":  # half the model on disk, then stop
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        _step("model")
    _write_synced(path, data)


def write_settings(self, folder, settings):
    _step("settings")
    _write_settings(self, folder, settings)
    _step("settings-written")


class _Os:
    def __getattr__(self, attribute):
        return getattr(os, attribute)

    @staticmethod
    def replace(source, target):
        if not os.path.isdir(source):
            return _replace(source, target)
        _step("rename")  # the version folder's rename
        _replace(source, target)
        _step("renamed")


_repository._write_synced = write_synced
_repository.Repository._write_settings = write_settings
_repository.os = _Os()


class CompilingPlugin(GatedPlugin):
    """GATED whose loads mark that they started compiling."""

    def load_network(self, model, config=None):
        _step("compile")
        return super().load_network(model, config)
'''


@pytest.fixture(scope="module")
def crash_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("crash_site")
    (site / "crash_devices.py").write_text(textwrap.dedent(GATED_DEVICES) + HOOKS)
    dist = site / "crash_devices-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: crash-devices\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\nGATED = crash_devices:CompilingPlugin\n"
    )
    return site


def server(site: Path, repo: Path, gates: Path, *args: str) -> RunningServer:
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
        "PLUGSERVE_TEST_GATES": str(gates),
    }
    return RunningServer("--model-repository", str(repo), *args, env=env)


MODEL = mlp(seed=21, sizes=(32, 128, 128, 10))
X = np.random.default_rng(21).normal(size=(3, 32)).astype(np.float32)
EXPECTED = Core().load_network(MODEL, "NUMPY").infer({"x": X})["y"]
CONFIG = {"PERF_COUNT": "YES"}


@pytest.mark.parametrize(
    "step", ["compile", "model", "settings", "settings-written", "rename", "renamed"]
)
def test_sigkill_during_a_persisted_load(crash_site, tmp_path, step):
    repo, gates = tmp_path / "models", tmp_path / "gates"
    repo.mkdir()
    gates.mkdir()
    (gates / "load").touch()
    (gates / "kept").touch()  # their requests run at once
    (gates / "fresh").touch()
    data = MODEL.SerializeToString()
    first = server(crash_site, repo, gates).start()
    try:
        with Client(first.target, timeout=60) as client:
            # "kept" persists completely; the load of "fresh" is killed at ``step``
            client.load("kept", data, device="GATED", config=CONFIG, persist=True)
            (gates / f"hold-{step}").touch()
            call = client.stub.LoadNetwork.future(
                _load_request(data), timeout=60
            )  # the client waits while the server holds at the step
            assert wait_for(lambda: (gates / f"at-{step}").exists(), timeout=60), first.log
            first.process.send_signal(signal.SIGKILL)
            assert first.process.wait(60) == -signal.SIGKILL
            with pytest.raises(grpc.RpcError) as info:
                call.result(timeout=60)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        first.stop()
    (gates / f"hold-{step}").unlink()

    with (
        server(crash_site, repo, gates) as second,
        Client(second.target, timeout=60) as client,
    ):
        found = {(n.name, n.version): n for n in client.networks()}
        assert ("kept", 1) in found, second.log  # the model persisted before is untouched
        assert set(found) <= {("kept", 1), ("fresh", 1)}
        for (name, version), network in found.items():  # whatever is there is whole:
            # its device and config too, not a model file that loads with the defaults
            assert network.device == "GATED" and network.config["PERF_COUNT"] == "YES"
            got = client.infer(name, {"x": X}, version=version)["y"]
            np.testing.assert_allclose(got, EXPECTED, rtol=1e-6)
            assert (repo / name / str(version) / "model.onnx").read_bytes() == data
        # a version is published by the rename, so before it there is none, after it all
        assert (("fresh", 1) in found) == (step == "renamed"), (step, sorted(found))
        if ("fresh", 1) not in found:
            assert not (repo / "fresh" / "1").exists()
            # and the name is free again: the same load now completes
            client.load("fresh", data, device="GATED", config=CONFIG, persist=True)
            np.testing.assert_allclose(client.infer("fresh", {"x": X})["y"], EXPECTED, rtol=1e-6)
    assert not [p for p in repo.iterdir() if p.name.startswith(".")]  # leftovers cleaned
    for name in ("kept", "fresh"):  # each version keeps its own settings beside its model
        settings = json.loads((repo / name / "1" / "config.json").read_text())
        assert settings == {"device": "GATED", "config": CONFIG, "max_batch_size": 0}
        assert not (repo / name / "config.json").exists()  # the operator's file is not written
    assert "unexpected error" not in second.log


def _load_request(data: bytes):
    from plugserve.proto import plugserve_pb2 as pb

    return pb.LoadNetworkRequest(
        name="fresh", model=pb.ModelSource(onnx=data), device="GATED", config=CONFIG, persist=True
    )


def test_a_truncated_or_foreign_cache_file_is_recompiled_through_the_server(tmp_path):
    cache = tmp_path / "cache"
    plugins = tmp_path / "plugins.json"
    plugins.write_text(json.dumps({"plugins": {"NUMPY": {"config": {"CACHE_DIR": str(cache)}}}}))
    repo = tmp_path / "models"
    repo.mkdir()
    data = MODEL.SerializeToString()
    with (
        RunningServer("--model-repository", str(repo), "--plugins", str(plugins)) as running,
        Client(running.target, timeout=60) as client,
    ):
        assert not client.load("c1", data).loaded_from_cache
        (entry,) = cache.glob("*.blob")
        assert client.load("c2", data).loaded_from_cache
        good = entry.read_bytes()
        damaged = {
            "truncated": good[: len(good) // 3],
            "empty": b"",
            "foreign": b"PK\x03\x04 a zip file, not a plugserve blob" * 20,
        }
        for i, (kind, content) in enumerate(damaged.items()):
            entry.write_bytes(content)
            response = client.load(f"d{i}", data)
            assert not response.loaded_from_cache, kind  # recompiled ...
            np.testing.assert_allclose(
                client.infer(f"d{i}", {"x": X})["y"], EXPECTED, rtol=1e-6, err_msg=kind
            )
            assert entry.read_bytes() != content, kind  # ... and the entry rewritten
            assert client.load(f"again{i}", data).loaded_from_cache, kind
    assert running.log.count("is unusable") >= 3, running.log
    assert "unexpected error" not in running.log


def test_hooks_hold_only_when_asked(crash_site, tmp_path):
    """The hooks above change nothing unless a hold file exists: a plain persist completes."""
    repo, gates = tmp_path / "models", tmp_path / "gates"
    repo.mkdir()
    gates.mkdir()
    (gates / "load").touch()
    with (
        server(crash_site, repo, gates) as running,
        Client(running.target, timeout=60) as client,
    ):
        client.load("plain", MODEL.SerializeToString(), device="GATED", persist=True)
    assert (repo / "plain" / "1" / "model.onnx").read_bytes() == MODEL.SerializeToString()
