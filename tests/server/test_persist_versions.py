"""Persisted versions come back after a restart exactly as their loads were acknowledged
(issue 13, items 5 and 6): each version with its own device and config, versions validated in
one place, and ListNetworks never broken by one entry. Real server processes on a repository
folder, restarted between the steps.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from models import mlp
from serving import RunningServer

from plugserve.client import Client
from plugserve.proto import plugserve_pb2 as pb

MODEL = mlp(seed=13).SerializeToString()
X = np.random.default_rng(13).normal(size=(2, 32)).astype(np.float32)


def serve(repo) -> RunningServer:
    return RunningServer("--model-repository", str(repo))


def found(client: Client) -> dict[tuple[str, int], pb.NetworkInfo]:
    return {(n.name, n.version): n for n in client.networks()}


def devices_here() -> set[str]:
    with serve_nothing() as running, Client(running.target, timeout=60) as client:
        return {d.name for d in client.devices() if d.available}


def serve_nothing() -> RunningServer:
    return RunningServer()


@pytest.fixture(scope="module")
def second_device() -> str:
    """A device other than NUMPY to persist a version on (ORT if it is here)."""
    available = devices_here()
    return "ORT" if "ORT" in available else "BATCH:NUMPY(2)"


def test_each_persisted_version_keeps_its_own_device_and_config(tmp_path, second_device):
    repo = tmp_path / "models"
    repo.mkdir()
    with serve(repo) as first, Client(first.target, timeout=60) as client:
        one = client.load("net", MODEL, "NUMPY", {"PERF_COUNT": "YES"}, persist=True)
        two = client.load("net", MODEL, second_device, {"PERFORMANCE_HINT": "THROUGHPUT"}, True)
        acknowledged = {(1, one.network.device), (2, two.network.device)}
        expected = client.infer("net", {"x": X}, version=1)["y"]
    assert one.network.persisted and two.network.persisted
    for _ in range(2):  # twice: a restart writes nothing that changes the next one
        with serve(repo) as again, Client(again.target, timeout=60) as client:
            networks = found(client)
            assert {(v, n.device) for (_, v), n in networks.items()} == acknowledged, again.log
            assert networks[("net", 1)].config["PERF_COUNT"] == "YES"
            assert networks[("net", 2)].config["PERFORMANCE_HINT"] == "THROUGHPUT"
            for version in (1, 2):
                got = client.infer("net", {"x": X}, version=version)["y"]
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert not (repo / "net" / "config.json").exists()
    assert json.loads((repo / "net" / "1" / "config.json").read_text())["device"] == "NUMPY"


def test_a_repository_of_the_old_layout_keeps_working(tmp_path, second_device):
    """Before, persisted settings lived only in the model's config.json: its versions go on
    using it, and persisting a new version no longer rewrites it."""
    repo = tmp_path / "models"
    (repo / "old" / "1").mkdir(parents=True)
    (repo / "old" / "1" / "model.onnx").write_bytes(MODEL)
    settings = json.dumps({"device": "NUMPY", "config": {"PERF_COUNT": "YES"}}).encode()
    (repo / "old" / "config.json").write_bytes(settings)
    with serve(repo) as first, Client(first.target, timeout=60) as client:
        assert found(client)[("old", 1)].config["PERF_COUNT"] == "YES"
        client.load("old", MODEL, second_device, persist=True)
    with serve(repo) as again, Client(again.target, timeout=60) as client:
        networks = found(client)
        assert networks[("old", 1)].device == "NUMPY"
        assert networks[("old", 1)].config["PERF_COUNT"] == "YES"
        assert networks[("old", 2)].device == second_device
    assert (repo / "old" / "config.json").read_bytes() == settings


@pytest.mark.parametrize("version", [-5, 10**18, 2**63 - 1])
def test_a_version_the_repository_could_not_read_back_is_refused_up_front(tmp_path, version):
    repo = tmp_path / "models"
    repo.mkdir()
    with serve(repo) as running, Client(running.target, timeout=60) as client:
        for persist in (True, False):
            with pytest.raises(grpc.RpcError) as info:
                client.load("odd", MODEL, persist=persist, version=version)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(version) in info.value.details()
        assert ("odd", version) not in found(client)  # and ListNetworks answers
        assert not (repo / "odd").exists()


def test_the_largest_version_has_no_successor_and_listing_keeps_working(tmp_path):
    largest = 10**18 - 1
    repo = tmp_path / "models"
    repo.mkdir()
    with serve(repo) as running, Client(running.target, timeout=60) as client:
        client.load("top", MODEL, version=largest, persist=True)
        with pytest.raises(grpc.RpcError) as info:
            client.load("top", MODEL)  # the next free version would be 10**18
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(largest) in info.value.details()
        assert list(found(client)) == [("top", largest)]  # ListNetworks still answers
    with serve(repo) as again, Client(again.target, timeout=60) as client:
        assert ("top", largest) in found(client), again.log
        np.testing.assert_allclose(
            client.infer("top", {"x": X})["y"], client.infer("top", {"x": X}, version=largest)["y"]
        )


def test_a_config_that_could_not_be_sent_back_does_not_break_listing(tmp_path):
    """A lone surrogate in config.json would load, then fail to encode in every ListNetworks
    answer: the scan refuses that model, names its file, and serves the others."""
    repo = tmp_path / "models"
    for name in ("good", "bad"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(MODEL)
    (repo / "bad" / "config.json").write_text('{"config": {"DEVICE_ID": "x\\ud800"}}')
    serving = RunningServer("--model-repository", str(repo), "--exit-on-error", "0")
    with serving as running, Client(running.target, timeout=60) as client:
        assert list(found(client)) == [("good", 1)]
        assert str(repo / "bad" / "config.json") in running.log
