"""The server's malloc tuning: megabyte request buffers stop costing a page fault per page."""

from __future__ import annotations

import platform

import numpy as np
import pytest
from onnx import TensorProto, helper
from serving import RunningServer

from plugserve.client.client import Client
from plugserve.server.allocator import reuse_freed_memory

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt"
)

SHAPE = [1, 3, 224, 224]  # 588 KiB of float32 each way: 147 pages per buffer


def _identity() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _faults_per_request(tmp_path, *flags: str) -> float:
    x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    with RunningServer("--model-repository", str(tmp_path), *flags) as running:
        with Client(running.target, timeout=30) as client:
            client.load("identity", _identity(), "NUMPY")
            for _ in range(20):  # warm: first requests may fault in what is kept
                client.infer("identity", {"x": x})
            before = _minor_faults(running.process.pid)
            for _ in range(100):
                assert np.array_equal(client.infer("identity", {"x": x})["y"], x)
            return (_minor_faults(running.process.pid) - before) / 100


def test_the_server_reuses_request_buffers(tmp_path):
    tuned = _faults_per_request(tmp_path / "a")
    default = _faults_per_request(tmp_path / "b", "--malloc-reuse-bytes", "0")
    # glibc's defaults map fresh pages for some of each request's buffers and unmap them
    # again (hundreds of faults a request); reused, a request faults in almost nothing.
    assert default > 100, default
    assert tuned < 20, (tuned, default)


def test_zero_leaves_the_defaults():
    assert reuse_freed_memory(0) is False
