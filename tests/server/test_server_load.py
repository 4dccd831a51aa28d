"""The server under load: startup health, many requests in flight, order, a full queue, deadlines.

Every test talks to a real ``plugserve serve`` on 127.0.0.1. Nothing here depends on how fast
the machine is: "slow" work is a network on the third-party ``GATED`` device whose requests wait
until the test opens their gate (a file named after the network), and slow startup is a
repository model on ``GATED`` whose loading waits for the ``load`` gate. The test decides when
work may finish, so every assertion is about order and outcome, never about time.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from models import mlp, small_cnn
from prometheus_client.parser import text_string_to_metric_families
from serving import RunningServer, examples_repository, wait_for

from plugserve.client import AsyncClient, Client
from plugserve.proto import plugserve_pb2 as pb
from plugserve.server import Core

GATED_DEVICES = '''
import os
import time

from plugserve.plugins.numpy import NumpyPlugin
from plugserve.plugins.numpy.compiled import NumpyCompiledNetwork
from plugserve.plugins.numpy.request import NumpyInferRequest

GATES = os.environ["PLUGSERVE_TEST_GATES"]


def wait_for_gate(name):
    """Block until the test creates GATES/name (bounded: the test opens every gate it uses)."""
    path = os.path.join(GATES, name)
    for _ in range(120_000):
        if os.path.exists(path):
            return
        time.sleep(0.001)
    raise TimeoutError(f"gate {name} never opened")


class GatedRequest(NumpyInferRequest):
    def _infer(self, arrays, run):
        wait_for_gate(self.network.name)
        return super()._infer(arrays, run)


class GatedNetwork(NumpyCompiledNetwork):
    def create_infer_request(self):
        return GatedRequest(self)


class GatedPlugin(NumpyPlugin):
    """NUMPY, except loading waits for the "load" gate and inference for the network's gate."""

    name = "GATED"

    def load_network(self, model, config=None):
        wait_for_gate("load")
        network = super().load_network(model, config)
        network.__class__ = GatedNetwork
        return network


class SecondPlugin(NumpyPlugin):
    name = "SECOND"
'''


def add_model_bytes() -> bytes:
    from plugserve.server.control.examples import add

    return add().SerializeToString()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A third-party package declaring GATED and SECOND by entry point, as pip would install it."""
    site = tmp_path_factory.mktemp("site")
    (site / "gated_devices.py").write_text(textwrap.dedent(GATED_DEVICES))
    dist = site / "gated_devices-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: gated-devices\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[plugserve.plugins]\n"
        "GATED = gated_devices:GatedPlugin\n"
        "SECOND = gated_devices:SecondPlugin\n"
    )
    return site


class Gates:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def open(self, name: str) -> None:
        (self.folder / name).touch()

    def open_all(self, *names: str) -> None:
        for name in names:
            self.open(name)


def gated_server(site: Path, tmp: Path, *args: str, plugins: dict | None = None):
    gates = Gates(tmp / "gates")
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
        "PLUGSERVE_TEST_GATES": str(gates.folder),
    }
    # --plugins leaves BATCH out, so the examples' mlp cannot load: serve the others
    extra = ["--exit-timeout", "5", "--exit-on-error", "0", *args]
    if plugins is not None:
        path = tmp / "plugins.json"
        path.write_text(json.dumps({"plugins": plugins}))
        extra += ["--plugins", str(path)]
    return RunningServer(*extra, env=env), gates


def scrape(server: RunningServer) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gauge(server: RunningServer, name: str, device: str) -> float | None:
    return scrape(server).get((name, (("device", device),)))


def busy_streams(server: RunningServer, device: str) -> int:
    """Streams of ``device``'s networks running a request now (or holding one that waits for
    its batch)."""
    return int(gauge(server, "plugserve_busy_streams", device) or 0)


def held(server: RunningServer, device: str) -> int:
    """Requests ``device``'s networks hold now: waiting for a stream, and on one (a request
    that waits for its batch holds a stream too)."""
    found = scrape(server)
    names = ("plugserve_queue_depth", "plugserve_busy_streams")
    return int(sum(found.get((name, (("device", device),))) or 0 for name in names))


def requests_total(server: RunningServer, device: str, model: str) -> dict[str, float]:
    """``plugserve_inference_requests_total`` of one network, by status."""
    return {
        dict(labels)["status"]: value
        for (metric, labels), value in scrape(server).items()
        if metric == "plugserve_inference_requests_total"
        and dict(labels)["device"] == device
        and dict(labels)["model"] == model
    }


def code_of(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


# --------------------------------------------------------------------------- (a) health


def test_health_is_not_serving_until_startup_loading_finished(site, tmp_path):
    repo = examples_repository(tmp_path)
    for name, seed in (("big_a", 1), ("big_b", 2)):  # models whose loading waits for a gate
        (repo / name / "1").mkdir(parents=True)
        model = mlp(seed, sizes=(256, 512, 512, 10))
        (repo / name / "1" / "model.onnx").write_bytes(model.SerializeToString())
        (repo / name / "config.json").write_text(json.dumps({"device": "GATED"}))
    running, gates = gated_server(site, tmp_path, "--model-repository", str(repo))
    running.start(wait_ready=False)
    try:
        with running.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def check() -> int | grpc.StatusCode:
                try:
                    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
                except grpc.RpcError as exc:
                    return exc.code()

            # Loading waits for the "load" gate, so the server cannot be ready yet.
            seen = [check() for _ in range(5)]
            NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
            assert set(seen) <= {NOT_SERVING, grpc.StatusCode.UNAVAILABLE}, seen
            assert wait_for(lambda: check() == NOT_SERVING, timeout=30)
            assert "server ready:" not in running.log
            with Client(running.target) as client:
                assert "big_a" not in {n.name for n in client.networks()}
            gates.open("load")
            SERVING = health_pb2.HealthCheckResponse.SERVING
            assert wait_for(lambda: check() == SERVING, timeout=60), running.log
            running.wait_ready(30)
            with Client(running.target) as client:
                names = {n.name: n.device for n in client.networks()}
            assert names["big_a"] == names["big_b"] == "GATED" and "add" in names
    finally:
        gates.open("load")
        running.stop()


# --------------------------------------------------------------------------- (b), (c)


@pytest.fixture(scope="module")
def busy(site, tmp_path_factory):
    """A server with NUMPY, the third-party SECOND and GATED; room for 64 queued requests."""
    tmp = tmp_path_factory.mktemp("busy")
    repo = examples_repository(tmp)
    running, gates = gated_server(
        site,
        tmp,
        "--model-repository",
        str(repo),
        "--queue-size",
        "64",
        plugins={
            "NUMPY": {"config": {"NUM_STREAMS": "2"}},
            "SECOND": {"config": {"NUM_STREAMS": "2"}},
            "GATED": {"config": {"NUM_STREAMS": "1"}},
        },
    )
    gates.open("load")
    with running:
        running.gates = gates
        yield running


def test_64_requests_in_flight_across_two_devices(busy):
    models = {"mlp_numpy": (mlp(3), "NUMPY"), "cnn_second": (small_cnn(4), "SECOND")}
    rng = np.random.default_rng(5)
    jobs = []
    for i in range(64):
        if i % 2:
            jobs.append(("cnn_second", {"x": rng.normal(size=(1, 3, 16, 16)).astype(np.float32)}))
        else:
            jobs.append(("mlp_numpy", {"x": rng.normal(size=(i % 5 + 1, 32)).astype(np.float32)}))
    reference = {name: Core().load_network(model, "NUMPY") for name, (model, _) in models.items()}
    expected = [reference[name].infer(feeds) for name, feeds in jobs]

    async def run() -> list:
        async with AsyncClient(busy.target, timeout=60) as client:
            for name, (model, device) in models.items():
                response = await client.load(name, model.SerializeToString(), device=device)
                assert response.network.device == device
            try:
                return await asyncio.gather(
                    *(client.infer(name, feeds) for name, feeds in jobs), return_exceptions=True
                )
            finally:
                for name in models:
                    await client.stub.UnloadNetwork(pb.UnloadNetworkRequest(name=name))

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    for (name, _), got, want in zip(jobs, results, expected):
        key = "probs" if name == "cnn_second" else "y"
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7)


def test_infer_stream_completes_out_of_order_paired_by_id(busy):
    with Client(busy.target, timeout=60) as client:
        client.load("slow_c", add_model_bytes(), device="GATED")
        try:
            rng = np.random.default_rng(6)
            requests = []
            for i in range(4):  # the slow ones first: they wait on GATED's single stream
                a, b = rng.normal(size=3).astype(np.float32), rng.normal(size=3).astype(np.float32)
                requests.append((f"slow{i}", "slow_c", {"a": a, "b": b}))
            for i in range(8):
                a, b = rng.normal(size=5).astype(np.float32), rng.normal(size=5).astype(np.float32)
                requests.append((f"fast{i}", "add", {"a": a, "b": b}))
            sent = {rid: (net, inputs) for rid, net, inputs in requests}
            order: list[str] = []
            results = {}
            for rid, out, message in client.infer_stream(requests, timeout=60):
                assert message == "", (rid, message)
                order.append(rid)
                results[rid] = out
                if sum(r.startswith("fast") for r in order) == 8:
                    busy.gates.open("slow_c")  # only now may the slow ones finish
        finally:
            busy.gates.open("slow_c")
            client.unload("slow_c")
    assert sorted(order) == sorted(sent) and len(order) == len(sent)
    for rid, (_, inputs) in sent.items():
        np.testing.assert_array_equal(results[rid]["sum"], inputs["a"] + inputs["b"])
    # every fast request (sent later) completed before every slow one (sent earlier)
    assert all(r.startswith("fast") for r in order[:8]), order
    assert order.index("fast0") < order.index("slow0")


# --------------------------------------------------------------------------- (d), (e)


@pytest.fixture(scope="module")
def tight(site, tmp_path_factory):
    """A server whose GATED device has one stream and every queue holds one request."""
    tmp = tmp_path_factory.mktemp("tight")
    running, gates = gated_server(
        site,
        tmp,
        "--model-repository",
        str(examples_repository(tmp)),
        "--queue-size",
        "1",
        plugins={"NUMPY": {}, "GATED": {"config": {"NUM_STREAMS": "1"}}},
    )
    gates.open("load")
    with running:
        running.gates = gates
        yield running


def test_full_queue_is_resource_exhausted_at_once(tight):
    name = "slow_d"
    n = 12
    rng = np.random.default_rng(7)
    jobs = [
        {"a": rng.normal(size=4).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
        for _ in range(n)
    ]
    with Client(tight.target, timeout=60) as client:
        client.load(name, add_model_bytes(), device="GATED")
        assert gauge(tight, "plugserve_streams", "GATED") == 1
        with ThreadPoolExecutor(n) as pool:
            try:
                # The first request takes the only stream and waits there on its gate.
                first = pool.submit(client.infer, name, jobs[0])
                assert wait_for(lambda: gauge(tight, "plugserve_busy_streams", "GATED") == 1)
                # The flood: one more fits in the queue (size 1), the others are refused.
                flood = [pool.submit(client.infer, name, feeds) for feeds in jobs[1:]]
                # Nothing admitted can finish while the gate is shut, so the first n - 2
                # answers are the refusals: a full queue answers at once.
                refused = []
                for future in as_completed(flood, timeout=60):
                    refused.append(future)
                    if len(refused) == n - 2:
                        break
                codes = [code_of(f.exception()) for f in refused]
                assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (n - 2), codes
                assert "queue full" in refused[0].exception().details()
            finally:
                tight.gates.open(name)
            outcomes = [first, *flood]
            for feeds, future in zip(jobs, outcomes):
                try:
                    out = future.result(timeout=60)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                else:
                    np.testing.assert_array_equal(out["sum"], feeds["a"] + feeds["b"])
        succeeded = [f for f in outcomes if f.exception() is None]
        assert len(succeeded) == 2 and first in succeeded
        assert requests_total(tight, "GATED", name) == {"success": 2, "overloaded": n - 2}
        client.unload(name)


def test_deadline_passing_in_the_queue_and_the_server_keeps_serving(tight):
    name = "slow_e"
    feeds = {"a": np.ones(2, np.float32), "b": np.full(2, 2, np.float32)}
    with Client(tight.target, timeout=60) as client:
        client.load(name, add_model_bytes(), device="GATED")
        with ThreadPoolExecutor(2) as pool:
            try:
                first = pool.submit(client.infer, name, feeds)
                assert wait_for(lambda: gauge(tight, "plugserve_busy_streams", "GATED") == 1)
                # Queued behind the blocked stream: its deadline passes before a stream is free.
                with pytest.raises(grpc.RpcError) as info:
                    client.infer(name, feeds, timeout=0.5)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                # The abandoned request leaves the queue while the stream is still blocked ...
                assert wait_for(lambda: gauge(tight, "plugserve_queue_depth", "GATED") == 0)
                # ... so its place is free again: this one is admitted, not RESOURCE_EXHAUSTED.
                second = pool.submit(client.infer, name, feeds)
                assert wait_for(lambda: gauge(tight, "plugserve_queue_depth", "GATED") == 1)
            finally:
                tight.gates.open(name)
            assert first.result(timeout=60)["sum"].tolist() == [3, 3]
            assert second.result(timeout=60)["sum"].tolist() == [3, 3]
        # the server keeps serving, on both devices
        assert client.infer(name, feeds)["sum"].tolist() == [3, 3]
        assert client.infer("add", feeds)["sum"].tolist() == [3, 3]
        statuses = requests_total(tight, "GATED", name)
        assert statuses.get("success") == 3
        assert statuses.get("cancelled", 0) + statuses.get("deadline", 0) == 1, statuses
        client.unload(name)
    assert "unexpected error" not in tight.log, tight.log
