"""The server's malloc tuning: megabyte request buffers stop costing a page fault per page."""

from __future__ import annotations

import platform
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto, helper
from serving import RunningServer

from plugserve.client.client import Client
from plugserve.server.control.allocator import reuse_freed_memory

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


def _folder(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def _faults_per_request(tmp_path, *flags: str) -> float:
    x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    with (
        RunningServer("--model-repository", str(_folder(tmp_path)), *flags) as running,
        Client(running.target, timeout=30) as client,
    ):
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
    # glibc's defaults varied here from 5 to 800 faults a request (its thresholds adapt to
    # what each arena has freed); the point is that tuned it stays near zero.
    assert tuned < 20, (tuned, default)


_PROBE = """
import ctypes, sys
from plugserve.server.control.allocator import reuse_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
tuned = reuse_freed_memory(int(sys.argv[1]))
before = libc.mallinfo2().hblkhd  # bytes held in blocks mmap'd on their own
block = bytearray(8 << 20)
print(tuned, libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.parametrize(("limit", "expected"), [(32 << 20, "True 0"), (0, "False")])
def test_an_8_mib_block_comes_from_the_heap_only_when_tuned(limit, expected):
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(limit)], capture_output=True, text=True, check=True
    ).stdout.strip()
    if limit:
        assert out == expected
    else:  # glibc's default: a block this size is mapped on its own
        tuned, mapped = out.split()
        assert tuned == expected and int(mapped) >= 8 << 20


def test_zero_leaves_the_defaults():
    assert reuse_freed_memory(0) is False
