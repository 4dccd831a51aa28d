"""Attacks on the server through system shared memory: a client registers a region, then
shrinks its object (``ftruncate``) before a request reads an input from it, before one writes
an output into it, and while a request that uses it runs. A mapped region faults (SIGBUS) on
the first touch past the object's new end and kills the server; plugserve never maps a
client's object (server/plane/shm.py), so each answers INVALID_ARGUMENT / 400 naming the region, and
the server keeps serving everyone."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from serving import wait_for
from test_server_load import busy_streams

shm = pytest.importorskip(
    "tritonclient.utils.shared_memory", reason="pip install 'tritonclient[grpc,http]'"
)
grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

A = np.arange(16, dtype=np.float32)
B = np.full(16, 0.5, dtype=np.float32)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """A server of this module's own: if an attack kills it, only these tests fail."""
    import onnx
    from models import spin_loop
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    spin = repo / "spin" / "1"
    spin.mkdir(parents=True)
    onnx.save(spin_loop(), spin / "model.onnx")
    (repo / "spin" / "config.json").write_text('{"device": "NUMPY"}')
    with RunningServer("--model-repository", str(repo)) as server:
        yield server


def client_for(protocol: str, running):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(running.target)
    return httpclient, httpclient.InferenceServerClient(running.http_target)


def shrink(key: str, size: int = 0) -> None:
    """What a hostile (or careless) client does to its own object."""
    fd = os.open("/dev/shm" + key, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def assert_refused_naming(refused, name: str, protocol: str) -> None:
    message = str(refused.value)
    assert f"shared memory region {name!r}" in message, message
    assert "made smaller after it was registered" in message, message
    status = str(refused.value.status())
    assert ("INVALID_ARGUMENT" in status) if protocol == "grpc" else status == "400", status


def assert_serving(running) -> None:
    """The server process is alive and answers another client's plain request."""
    assert running.process.poll() is None, f"the server died ({running.process.returncode})"
    other = grpcclient.InferenceServerClient(running.target)
    try:
        a = grpcclient.InferInput("a", [16], "FP32")
        a.set_data_from_numpy(A)
        b = grpcclient.InferInput("b", [16], "FP32")
        b.set_data_from_numpy(B)
        np.testing.assert_array_equal(other.infer("add", [a, b]).as_numpy("sum"), A + B)
    finally:
        other.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_input_region_shrunk_after_registering_is_refused(running, regions, protocol):
    module, client = client_for(protocol, running)
    name, key, handle = regions(128)
    shm.set_shared_memory_region(handle, [A])
    shm.set_shared_memory_region(handle, [B], offset=64)
    try:
        client.register_system_shared_memory(name, key, 128)
        shrink(key, 0)
        a = module.InferInput("a", [16], "FP32")
        a.set_shared_memory(name, 64)
        b = module.InferInput("b", [16], "FP32")
        b.set_shared_memory(name, 64, offset=64)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("add", [a, b])
        assert_refused_naming(refused, name, protocol)
        assert_serving(running)
        shrink(key, 96)  # part of it: b's bytes now end past the object
        with pytest.raises(InferenceServerException) as refused:
            client.infer("add", [a, b])
        assert_refused_naming(refused, name, protocol)
        assert_serving(running)
    finally:
        client.unregister_system_shared_memory()
        client.close()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_an_output_region_shrunk_after_registering_is_refused(running, regions, protocol):
    module, client = client_for(protocol, running)
    name, key, _ = regions(64)
    try:
        client.register_system_shared_memory(name, key, 64)
        shrink(key, 0)
        a = module.InferInput("a", [16], "FP32")
        a.set_data_from_numpy(A)
        b = module.InferInput("b", [16], "FP32")
        b.set_data_from_numpy(B)
        output = module.InferRequestedOutput("sum")
        output.set_shared_memory(name, 64)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("add", [a, b], outputs=[output])
        assert_refused_naming(refused, name, protocol)
        assert_serving(running)
        # the client grows its object back: the same registration serves again
        fd = os.open("/dev/shm" + key, os.O_RDWR)
        os.ftruncate(fd, 64)
        os.close(fd)
        client.infer("add", [a, b], outputs=[output])
        with open("/dev/shm" + key, "rb") as grown:
            np.testing.assert_array_equal(np.frombuffer(grown.read(), np.float32), A + B)
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_a_shrink_while_a_request_runs_cannot_fault_the_server(running, regions):
    """A slow request (a Loop of M additions on NUMPY) has its input in one region and its
    output due in another; the client shrinks both to nothing while it runs. The request reads
    the input it was given at admission, and its output is refused for the shrunk region."""
    in_name, in_key, in_handle = regions(16)
    out_name, out_key, _ = regions(16)
    x = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    shm.set_shared_memory_region(in_handle, [x])
    client = grpcclient.InferenceServerClient(running.target)
    try:
        client.register_system_shared_memory(in_name, in_key, 16)
        client.register_system_shared_memory(out_name, out_key, 16)
        tensor = grpcclient.InferInput("x", [4], "FP32")
        tensor.set_shared_memory(in_name, 16)
        trips = grpcclient.InferInput("M", [], "INT64")
        trips.set_data_from_numpy(np.array(300_000, np.int64))
        output = grpcclient.InferRequestedOutput("y")
        output.set_shared_memory(out_name, 16)
        outcome = {}

        def run():
            try:
                outcome["answer"] = client.infer("spin", [tensor, trips], outputs=[output])
            except InferenceServerException as exc:
                outcome["refused"] = exc

        worker = threading.Thread(target=run)
        worker.start()
        # admitted, and running its Loop
        assert wait_for(lambda: busy_streams(running, "NUMPY")), "it did not start"
        shrink(in_key, 0)
        shrink(out_key, 0)
        worker.join(120)
        assert "refused" in outcome, outcome
        message = str(outcome["refused"])
        assert f"shared memory region {out_name!r}" in message, message
        assert "INVALID_ARGUMENT" in str(outcome["refused"].status())
        assert_serving(running)
    finally:
        client.unregister_system_shared_memory()
        client.close()
