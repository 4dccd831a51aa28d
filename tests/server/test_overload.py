"""Overload through a real server: a full queue is RESOURCE_EXHAUSTED, nothing admitted is lost.

The work is on the third-party ``GATED`` device (see test_server_load.py): its requests wait until
the test opens their gate, so which requests are admitted is decided by counting, never by time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from serving import wait_for
from test_server_load import add_model_bytes, code_of, gated_server, gauge, requests_total, site

from plugserve.client import Client
from plugserve.client.client import infer_request

tc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as kpb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as kgrpc  # noqa: E402

__all__ = ["site"]  # the fixture, re-used from test_server_load

STREAMS, QUEUE = 2, 4
CAPACITY = STREAMS + QUEUE


@pytest.fixture(scope="module")
def crowded(site, tmp_path_factory):
    """GATED has 2 streams and every device queue holds 4 requests."""
    tmp = tmp_path_factory.mktemp("crowded")
    running, gates = gated_server(
        site,
        tmp,
        "--queue-size",
        str(QUEUE),
        "--model-repository",
        str(tmp / "empty"),
        plugins={"NUMPY": {}, "GATED": {"config": {"NUM_STREAMS": str(STREAMS)}}},
    )
    (tmp / "empty").mkdir()
    gates.open("load")
    with running:
        running.gates = gates
        yield running
    assert "unexpected error" not in running.log, running.log


def busy(server) -> float | None:
    return gauge(server, "plugserve_busy_streams", "GATED")


def depth(server) -> float | None:
    return gauge(server, "plugserve_queue_depth", "GATED")


def feeds(i: int) -> dict[str, np.ndarray]:
    return {"a": np.full(3, i, np.float32), "b": np.arange(3, dtype=np.float32)}


def test_four_times_capacity_admitted_get_their_own_result_others_exhausted(crowded):
    name = "over_a"
    n = 4 * CAPACITY
    start = threading.Barrier(n - STREAMS)  # the flood, once the streams are taken
    with (
        Client(crowded.target, timeout=60) as client,
        tc.InferenceServerClient(crowded.target) as triton,
    ):
        client.load(name, add_model_bytes(), device="GATED")

        def ours(i: int):
            if i >= STREAMS:
                start.wait()
            return client.infer(name, feeds(i))["sum"]

        def theirs(i: int):
            inputs = [tc.InferInput("a", [3], "FP32"), tc.InferInput("b", [3], "FP32")]
            inputs[0].set_data_from_numpy(feeds(i)["a"])
            inputs[1].set_data_from_numpy(feeds(i)["b"])
            if i >= STREAMS:
                start.wait()
            return triton.infer(name, inputs, client_timeout=60).as_numpy("sum")

        with ThreadPoolExecutor(n) as pool:
            try:
                # The first requests take the streams (and wait there on the closed gate), so
                # the queue's places are all that is left for the flood: admission is exact.
                futures = [pool.submit(ours if i % 2 else theirs, i) for i in range(STREAMS)]
                assert wait_for(lambda: busy(crowded) == STREAMS)
                futures += [pool.submit(ours if i % 2 else theirs, i) for i in range(STREAMS, n)]
                # The gate is closed: admitted requests stay admitted, so the others must be
                # refused; wait until every refusal came back and the streams and queue are full.
                assert wait_for(
                    lambda: sum(f.done() for f in futures) == n - CAPACITY, timeout=60
                ), [f.exception() for f in futures if f.done()]
                assert busy(crowded) == STREAMS and depth(crowded) == QUEUE
            finally:
                crowded.gates.open(name)
            outcomes = {i: (f.exception(timeout=60), f) for i, f in enumerate(futures)}
        admitted = [i for i, (exc, _) in outcomes.items() if exc is None]
        refused = [exc for exc, _ in outcomes.values() if exc is not None]
        assert len(admitted) == CAPACITY, refused[:3]
        for exc in refused:
            status = code_of(exc) or grpc.StatusCode[exc.status().split(".")[-1]]
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            message = exc.details() if code_of(exc) else exc.message()
            assert f"queue full ({QUEUE} requests waiting)" in message
        for i in admitted:  # each its own result, not a neighbour's
            np.testing.assert_array_equal(outcomes[i][1].result(), feeds(i)["a"] + feeds(i)["b"])
        assert requests_total(crowded, "GATED", name) == {
            "success": CAPACITY,
            "overloaded": n - CAPACITY,
        }
        assert wait_for(lambda: busy(crowded) == 0 and depth(crowded) == 0)
        client.unload(name)


def _fill_streams(client: Client, name: str, pool: ThreadPoolExecutor, server) -> list:
    """Occupy both streams with requests that wait on the (closed) gate."""
    holders = [pool.submit(client.infer, name, feeds(100 + i)) for i in range(STREAMS)]
    assert wait_for(lambda: busy(server) == STREAMS)
    return holders


def test_deadlines_and_cancellations_free_their_slots(crowded):
    name = "over_b"
    with Client(crowded.target, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        client.load(name, add_model_bytes(), device="GATED")
        try:
            holders = _fill_streams(client, name, pool, crowded)
            # 1. deadlines: fill the queue with requests whose deadline passes while queued
            short = [pool.submit(client.infer, name, feeds(i), timeout=1.0) for i in range(QUEUE)]
            for future in short:
                with pytest.raises(grpc.RpcError) as info:
                    future.result(timeout=60)
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert wait_for(lambda: depth(crowded) == 0), depth(crowded)
            # 2. cancellations: fill it again and have the clients give up
            calls = [
                client.stub.Infer.future(infer_request(name, feeds(i)), timeout=60)
                for i in range(QUEUE)
            ]
            assert wait_for(lambda: depth(crowded) == QUEUE)
            with pytest.raises(grpc.RpcError) as info:  # really full now
                client.infer(name, feeds(0))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in calls:
                call.cancel()
            assert wait_for(lambda: depth(crowded) == 0), depth(crowded)
            # 3. a stream call that ends takes its queued requests with it (both protocols)
            requests = iter([infer_request(name, feeds(i), request_id=str(i)) for i in range(2)])
            stream = client.stub.InferStream(requests, timeout=60)
            assert wait_for(lambda: depth(crowded) == 2)
            stream.cancel()
            assert wait_for(lambda: depth(crowded) == 0), depth(crowded)
            with grpc.insecure_channel(crowded.target) as channel:
                stub = kgrpc.GRPCInferenceServiceStub(channel)
                hold = threading.Event()
                kstream = stub.ModelStreamInfer(_kserve_requests(name, 3, hold), timeout=60)
                assert wait_for(lambda: depth(crowded) == 3)
                kstream.cancel()
                hold.set()
                assert wait_for(lambda: depth(crowded) == 0), depth(crowded)
            # every freed slot can be used again: the queue admits QUEUE new requests
            again = [pool.submit(client.infer, name, feeds(i)) for i in range(QUEUE)]
            assert wait_for(lambda: depth(crowded) == QUEUE)
        finally:
            crowded.gates.open(name)
        for i, future in enumerate(again):
            want = feeds(i)["a"] + feeds(i)["b"]
            np.testing.assert_array_equal(future.result(timeout=60)["sum"], want)
        for i, future in enumerate(holders):
            assert (
                future.result(timeout=60)["sum"].tolist()
                == (feeds(100 + i)["a"] + feeds(100 + i)["b"]).tolist()
            )
        statuses = requests_total(crowded, "GATED", name)
        assert statuses["success"] == STREAMS + QUEUE, statuses
        assert statuses.get("deadline", 0) + statuses.get("cancelled", 0) == 2 * QUEUE + 5
        assert wait_for(lambda: busy(crowded) == 0 and depth(crowded) == 0)
        client.unload(name)


def _kserve_requests(name: str, n: int, hold: threading.Event):
    """KServe stream requests; then the stream stays open until ``hold`` is set."""
    for i in range(n):
        request = kpb.ModelInferRequest(model_name=name, id=str(i))
        for input_name, array in feeds(i).items():
            request.inputs.add(name=input_name, datatype="FP32", shape=[3])
            request.raw_input_contents.append(array.tobytes())
        yield request
    hold.wait(60)


def test_rest_gets_503_when_the_queue_is_full(crowded):
    """The same admission over KServe v2 REST: a full queue is 503 with Triton's words for it
    ("Exceeds maximum queue size", which Triton's HTTP answer and its QA tests use), then the
    queue's own."""
    import json
    import urllib.error
    import urllib.request

    name = "over_rest"
    body = json.dumps(
        {
            "inputs": [
                {"name": "a", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]},
                {"name": "b", "shape": [3], "datatype": "FP32", "data": [1, 1, 1]},
            ]
        }
    ).encode()
    url = f"{crowded.http_url}/v2/models/{name}/infer"
    with Client(crowded.target, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        client.load(name, add_model_bytes(), device="GATED")
        try:
            held = _fill_streams(client, name, pool, crowded)
            held += [pool.submit(client.infer, name, feeds(i)) for i in range(QUEUE)]
            assert wait_for(lambda: depth(crowded) == QUEUE)
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(urllib.request.Request(url, body), timeout=30)
            assert info.value.code == 503
            message = json.load(info.value)["error"]
            assert message.startswith("Exceeds maximum queue size"), message
            assert f"queue full ({QUEUE} requests waiting)" in message
        finally:
            crowded.gates.open(name)
        for future in held:
            future.result(timeout=60)
        with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as response:
            assert json.load(response)["outputs"][0]["data"] == [2.0, 3.0, 4.0]
        client.unload(name)
