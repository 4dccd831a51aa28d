"""Faults through a real server: a failing kernel, a broken plugin, a failed device, a slow one.

The devices are a third-party package declared by entry points, as pip would install it: GATED
(NUMPY whose loads and requests wait for gate files the test creates), FLAKY (NUMPY that fails
while a ``broken`` file exists, in inference and in closing its networks) and BROKEN (whose
constructor raises). A custom op added to NUMPY through ``--plugins`` raises for inputs over 100.
"""

from __future__ import annotations

import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from models import mlp, small_cnn, with_custom_op
from serving import wait_for
from test_server_load import GATED_DEVICES, add_model_bytes, gated_server, gauge, requests_total

from plugserve.client import Client
from plugserve.server import Core

FAULT_DEVICES = """
import os

from plugserve.plugins.numpy import Extension, NumpyPlugin
from plugserve.plugins.numpy.compiled import NumpyCompiledNetwork
from plugserve.plugins.numpy.request import NumpyInferRequest


def _broken():
    return os.path.exists(os.path.join(GATES, "broken"))


def scale(x):
    if (x > 100).any():
        raise ValueError(f"value {x.max()} is over 100")
    return x * 2.5


SCALE = Extension("com.example", "Scale", scale)


class BrokenPlugin(NumpyPlugin):
    name = "BROKEN"

    def __init__(self):
        raise RuntimeError("no BROKEN accelerator on this machine")


class FlakyRequest(NumpyInferRequest):
    def _infer(self, arrays, run):
        if _broken():
            raise OSError("FLAKY: device lost")
        return super()._infer(arrays, run)


class FlakyNetwork(NumpyCompiledNetwork):
    def create_infer_request(self):
        return FlakyRequest(self)

    def close(self):
        if _broken():
            raise OSError("FLAKY: device lost while closing")
        super().close()


class FlakyPlugin(NumpyPlugin):
    name = "FLAKY"

    def load_network(self, model, config=None):
        if _broken():
            raise OSError("FLAKY: device lost while loading")
        network = super().load_network(model, config)
        network.__class__ = FlakyNetwork
        return network
"""


@pytest.fixture(scope="module")
def fault_site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("fault_site")
    (site / "fault_devices.py").write_text(
        textwrap.dedent(GATED_DEVICES) + textwrap.dedent(FAULT_DEVICES)
    )
    dist = site / "fault_devices-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fault-devices\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\n"
        "GATED = fault_devices:GatedPlugin\n"
        "SECOND = fault_devices:SecondPlugin\n"
        "FLAKY = fault_devices:FlakyPlugin\n"
        "BROKEN = fault_devices:BrokenPlugin\n"
    )
    return site


@pytest.fixture(scope="module")
def faulty(fault_site, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faulty")
    (tmp / "empty").mkdir()
    running, gates = gated_server(
        fault_site,
        tmp,
        "--model-repository",
        str(tmp / "empty"),
        "--queue-size",
        "2",
        plugins={
            "NUMPY": {"config": {"NUM_STREAMS": "1"}, "extensions": ["fault_devices:SCALE"]},
            "SECOND": {"config": {"NUM_STREAMS": "1"}},
            "GATED": {"config": {"NUM_STREAMS": "1"}},
            "FLAKY": {"config": {"NUM_STREAMS": "1"}},
            "BROKEN": {},
        },
    )
    with running:
        running.gates = gates
        yield running
    assert "unexpected error" not in running.log, running.log


def test_a_raising_kernel_fails_only_its_request(faulty):
    model = with_custom_op()
    good = np.array([[1, -2, 3], [4, 5, -6]], np.float32)
    bad = np.array([[1, 2, 3], [4, 500, 6]], np.float32)
    want = np.maximum(good, 0) * 2.5 + 1
    with Client(faulty.target, timeout=60) as client:
        client.load("custom", model.SerializeToString())
        for _ in range(3):  # one stream: the failing and the good requests share it
            with pytest.raises(grpc.RpcError) as info:
                client.infer("custom", {"x": bad})
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "node 'scale' (Scale) failed: ValueError: value 500.0 is over 100" in (
                info.value.details()
            )
            np.testing.assert_array_equal(client.infer("custom", {"x": good})["y"], want)
        # concurrently too: each request gets its own outcome
        with ThreadPoolExecutor(2) as pool:  # never more than the queue (2) holds
            jobs = [
                pool.submit(client.infer, "custom", {"x": bad if i % 2 else good}) for i in range(8)
            ]
            for i, job in enumerate(jobs):
                if i % 2:
                    assert job.exception(timeout=60).code() == grpc.StatusCode.INTERNAL
                else:
                    np.testing.assert_array_equal(job.result(timeout=60)["y"], want)
        assert requests_total(faulty, "NUMPY", "custom") == {"success": 7, "error": 7}
        client.unload("custom")


def test_a_plugin_raising_at_construction_is_skipped(faulty):
    with Client(faulty.target, timeout=60) as client:
        devices = {d.name: d for d in client.devices()}
        assert not devices["BROKEN"].available
        assert devices["BROKEN"].reason == "RuntimeError: no BROKEN accelerator on this machine"
        assert devices["NUMPY"].available and devices["GATED"].available
        with pytest.raises(grpc.RpcError) as info:
            client.load("on_broken", add_model_bytes(), device="BROKEN")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "device 'BROKEN' is unavailable: RuntimeError: no BROKEN" in info.value.details()
    assert "device BROKEN is unavailable: RuntimeError: no BROKEN accelerator" in faulty.log
    assert faulty.log.count("device BROKEN is unavailable") == 1  # logged once


def test_a_network_whose_device_failed_can_be_unloaded_and_reloaded(faulty):
    feeds = {"a": np.ones(2, np.float32), "b": np.full(2, 2, np.float32)}
    broken = faulty.gates.folder / "broken"
    with Client(faulty.target, timeout=60) as client:
        client.load("flaky", add_model_bytes(), device="FLAKY")
        assert client.infer("flaky", feeds)["sum"].tolist() == [3, 3]
        broken.touch()  # the device fails
        try:
            with pytest.raises(grpc.RpcError) as info:
                client.infer("flaky", feeds)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "FLAKY: device lost" in info.value.details()
            client.unload("flaky")  # closing the network fails too: it is unloaded anyway
            assert "flaky" not in {n.name for n in client.networks()}
            with pytest.raises(grpc.RpcError) as info:
                client.load("flaky", add_model_bytes(), device="FLAKY")
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "FLAKY: device lost while loading" in info.value.details()
            assert "flaky" not in {n.name for n in client.networks()}
        finally:
            broken.unlink()
        # the device is back: the same name and version load again and serve
        response = client.load("flaky", add_model_bytes(), device="FLAKY")
        assert response.network.version == 1
        assert client.infer("flaky", feeds)["sum"].tolist() == [3, 3]
        client.unload("flaky")
    assert "FLAKY: device lost while closing" in faulty.log


def test_a_slow_device_cannot_stall_the_others(faulty):
    """GATED's stream and queue are full and a load on it hangs; NUMPY and SECOND serve on."""
    name = "stuck"
    rng = np.random.default_rng(11)
    cnn, net = small_cnn(2), mlp(2)
    reference = {
        "cnn2": Core().load_network(cnn, "NUMPY"),
        "mlp2": Core().load_network(net, "NUMPY"),
    }
    with Client(faulty.target, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        faulty.gates.open("load")
        client.load(name, add_model_bytes(), device="GATED")
        (faulty.gates.folder / "load").unlink()  # the next load on GATED hangs
        try:
            feeds = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
            stuck = [pool.submit(client.infer, name, feeds)]
            assert wait_for(lambda: gauge(faulty, "plugserve_busy_streams", "GATED") == 1)
            stuck += [pool.submit(client.infer, name, feeds) for _ in range(2)]
            assert wait_for(lambda: gauge(faulty, "plugserve_queue_depth", "GATED") == 2)
            hanging = pool.submit(client.load, "stuck_load", add_model_bytes(), "GATED")
            assert not hanging.done()
            # the other devices serve, load and unload while GATED is stuck
            client.load("cnn2", cnn.SerializeToString(), device="SECOND")
            client.load("mlp2", net.SerializeToString(), device="NUMPY")
            for _ in range(5):
                x = rng.normal(size=(1, 3, 16, 16)).astype(np.float32)
                np.testing.assert_allclose(  # two loads may time different conv kernels
                    client.infer("cnn2", {"x": x})["probs"],
                    reference["cnn2"].infer({"x": x})["probs"],
                    rtol=1e-5,
                )
                x = rng.normal(size=(2, 32)).astype(np.float32)
                np.testing.assert_allclose(
                    client.infer("mlp2", {"x": x})["y"],
                    reference["mlp2"].infer({"x": x})["y"],
                    rtol=1e-6,
                )
            client.unload("cnn2")
            client.unload("mlp2")
            assert not any(f.done() for f in stuck) and not hanging.done()
        finally:
            faulty.gates.open_all(name, "load")
        for future in stuck:
            assert future.result(timeout=60)["sum"].tolist() == [2, 2]
        assert hanging.result(timeout=60).network.device == "GATED"
        client.unload(name)
        client.unload("stuck_load")
