"""/metrics of a real server: counts match the traffic sent, and the exposition passes promtool."""

from __future__ import annotations

import queue
import shutil
import socket
import subprocess
import urllib.request

import grpc
import numpy as np
import pytest
from models import mlp
from prometheus_client.parser import text_string_to_metric_families
from serving import wait_for

from plugserve.client import Client

SUCCESSES = 7
BAD_INPUTS = [
    {"a": np.zeros(2, np.float64), "b": np.zeros(2, np.float64)},  # element type
    {"b": np.zeros(2, np.float32)},  # missing input
    {"a": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)},  # rank
]


def scrape_text(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str, name: str) -> dict[frozenset, float]:
    """``{frozenset(labels.items()): value}`` for every sample called ``name``."""
    return {
        frozenset(s.labels.items()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def labels(**kw: str) -> frozenset:
    return frozenset(kw.items())


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def traffic(server, client):
    """A known number of successful and failing requests, sent once for the module."""
    rng = np.random.default_rng(0)
    for _ in range(SUCCESSES):
        a, b = rng.normal(size=3).astype(np.float32), rng.normal(size=3).astype(np.float32)
        assert np.array_equal(client.infer("add", {"a": a, "b": b})["sum"], a + b)
    for inputs in BAD_INPUTS:
        with pytest.raises(grpc.RpcError) as info:
            client.infer("add", inputs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:  # an output the network does not have
        client.infer("add", {"a": np.ones(1, np.float32), "b": np.ones(1, np.float32)}, ["nope"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            client.infer("no_such_model", {"a": np.ones(1, np.float32)})
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    return {"success": SUCCESSES, "invalid": len(BAD_INPUTS) + 1}


def test_request_counts_match_what_was_sent(server, traffic):
    text = scrape_text(server)
    requests = samples(text, "plugserve_inference_requests_total")
    add = {
        dict(k)["status"]: v
        for k, v in requests.items()
        if dict(k)["model"] == "add" and dict(k)["device"] == "NUMPY"
    }
    assert add == traffic
    assert all(dict(k)["version"] == "1" for k in requests if dict(k)["model"] == "add")
    # an unknown model is refused before any network is involved: no series for it
    assert not [k for k in requests if dict(k)["model"] == "no_such_model"]
    key = labels(device="NUMPY", model="add", version="1")
    for histogram in ("plugserve_queue_wait_seconds", "plugserve_compute_seconds"):
        assert samples(text, f"{histogram}_count")[key] == traffic["success"]
        buckets = {
            float(dict(k)["le"]): v
            for k, v in samples(text, f"{histogram}_bucket").items()
            if k >= key
        }
        assert buckets[float("inf")] == traffic["success"]
        values = [buckets[le] for le in sorted(buckets)]
        assert values == sorted(values)  # cumulative
        assert samples(text, f"{histogram}_sum")[key] >= 0


def test_device_gauges_and_build_info(server, client, traffic):
    text = scrape_text(server)
    numpy = labels(device="NUMPY")
    loaded = sum(1 for n in client.networks() if n.device == "NUMPY")
    assert samples(text, "plugserve_loaded_networks")[numpy] == loaded
    assert samples(text, "plugserve_streams")[numpy] >= 1
    assert samples(text, "plugserve_queue_depth")[numpy] == 0
    assert samples(text, "plugserve_busy_streams")[numpy] == 0
    (build,) = samples(text, "plugserve_build_info").items()
    from plugserve.plugins.version import plugserve_version

    assert dict(build[0])["version"] == plugserve_version() and build[1] == 1


def test_layer_seconds_per_op_type_with_perf_count(server, client):
    client.load("perf_mlp", mlp().SerializeToString(), config={"PERF_COUNT": "YES"})
    try:
        for _ in range(3):
            client.infer("perf_mlp", {"x": np.ones((2, 32), np.float32)})
        op_types = {c.op_type for c in client.performance_counts("perf_mlp")}
        text = scrape_text(server)
        layers = {
            dict(k)["op_type"]: v
            for k, v in samples(text, "plugserve_layer_seconds_total").items()
            if dict(k)["model"] == "perf_mlp"
        }
        # the MLP's MatMul + Add run as one fused Linear on NUMPY
        assert set(layers) == op_types and op_types & {"MatMul", "Linear"}
        assert all(v >= 0 for v in layers.values()) and sum(layers.values()) > 0
        # networks without PERF_COUNT have no per-layer series
        models = {dict(k)["model"] for k in samples(text, "plugserve_layer_seconds_total")}
        assert "add" not in models
    finally:
        client.unload("perf_mlp")
    # unloading drops every series of the network, per-layer ones included
    text = scrape_text(server)
    assert 'model="perf_mlp"' not in text


def test_promtool_accepts_the_live_exposition(server, client, traffic):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'); .ci/run installs it")
    client.load("perf_mlp2", mlp(1).SerializeToString(), config={"PERF_COUNT": "YES"})
    try:
        client.infer("perf_mlp2", {"x": np.ones((1, 32), np.float32)})
        text = scrape_text(server)
    finally:
        client.unload("perf_mlp2")
    assert "plugserve_layer_seconds_total" in text
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


def _front(server) -> dict[str, float]:
    text = scrape_text(server)
    names = ("http_connections", "http_connections_serving", "http_connections_limit",
             "grpc_streams_open", "grpc_threads")  # fmt: skip
    return {name: samples(text, f"plugserve_{name}")[frozenset()] for name in names}


def test_the_front_door_gauges_follow_connections_and_streams(server):
    """Six idle REST connections and an open gRPC stream show in /metrics as they come, and
    leave it when they close; the REST port's bound is there beside them (256: 4 x the
    default --grpc-workers), and the gRPC handler threads that ran them."""
    before = _front(server)
    assert before["http_connections_limit"] == 256, before
    idle = [socket.create_connection((server.host, server.http_port)) for _ in range(6)]
    channel = grpc.insecure_channel(server.target)
    held: queue.Queue = queue.Queue()
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(
        iter(held.get, None)  # no message until None ends it
    )
    try:
        opened = wait_for(
            lambda: (
                (now := _front(server))["http_connections"] >= before["http_connections"] + 6
                and now["grpc_streams_open"] >= before["grpc_streams_open"] + 1
            )
        )
        assert opened, (before, _front(server))
        now = _front(server)
        assert now["http_connections_serving"] <= now["http_connections"]
        assert now["grpc_threads"] >= 1
    finally:
        for connection in idle:
            connection.close()
        held.put(None)
        stream.cancel()
        channel.close()
    closed = wait_for(
        lambda: (
            (now := _front(server))["http_connections"] <= before["http_connections"]
            and now["grpc_streams_open"] <= before["grpc_streams_open"]
        )
    )
    assert closed, (before, _front(server))


def test_idle_connections_to_the_metrics_port_hold_a_bounded_number_of_threads(tmp_path):
    """The metrics port takes no token, and prometheus_client's server started a thread for
    each connection and read it without a timeout: 500 connections that sent half a request
    line held 500 threads of the server for as long as they stayed. Now at most CONNECTIONS
    are served at once, PEER_CONNECTIONS of one address (one more is closed at once), each
    read waits READ_SECONDS at most, and the port scrapes again once the idle ones are cut
    off, with no traceback logged for each."""
    import os
    import time

    from serving import RunningServer, examples_repository

    from plugserve.server.plane.metrics_http import PEER_CONNECTIONS, READ_SECONDS

    def threads(pid: int) -> int:
        return len(os.listdir(f"/proc/{pid}/task"))

    with RunningServer("--model-repository", str(examples_repository(tmp_path))) as server:
        scrape_text(server)
        before = threads(server.process.pid)
        held = []
        try:
            for _ in range(300):
                sock = socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10)
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
                held.append(sock)
            time.sleep(1.0)
            assert threads(server.process.pid) <= before + PEER_CONNECTIONS + 2
            # the idle connections are cut off after READ_SECONDS; then the port scrapes
            assert wait_for(lambda: _scrapes(server), timeout=READ_SECONDS * 3)
            assert threads(server.process.pid) <= before + PEER_CONNECTIONS + 2
        finally:
            for sock in held:
                sock.close()
        with Client(server.target) as client:  # and the server serves on
            assert client.networks() is not None
        assert "Traceback" not in server.log and "timed out" not in server.log


def _scrapes(server) -> bool:
    try:
        return "plugserve_" in scrape_text(server)
    except OSError:
        return False
