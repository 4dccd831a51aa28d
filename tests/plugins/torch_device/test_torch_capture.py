"""CUDA graph capture's rules (``plugins/torch/capture.py``, ``plugins/torch/hostreads.py``) as
far as the CPU can show them: a network with a node that reads device values on the host runs
eagerly from its first lane, counted failed once; a shape whose capture failed takes no graph
slot, and is captured again only when it ran out of memory; the capture lock and the per-stream
locks serialise; a capture's memory is charged to the device's budget until it is released;
and the host-read registry covers every converter whose step reads on the host.

The capture sequence itself (:func:`capture.capture`: the stream context restored when
``capture_end`` raises, the allocator's pool ended, an empty graph refused, the reserved bytes
measured, cuBLAS's workspaces cleared around it) runs here against a stand-in for
``torch.cuda`` that records the calls, since torch's CPU build has no graphs; the real one is
the GPU check's (tests/gpu/device_check.py ``graphs_*``)."""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
import time
import types
import warnings

import numpy as np
import pytest
from models import mlp
from onnx import TensorProto, helper

from plugserve.plugins.ir import Node
from plugserve.plugins.torch import capture, devmem
from plugserve.plugins.torch.hostreads import HOST_READS, host_reads
from plugserve.plugins.torch.hostvalues import plan

torch = pytest.importorskip(
    "torch",
    reason="the TORCH device needs torch: pip install torch --index-url "
    "https://download.pytorch.org/whl/cpu",
)


def _nonzero_model():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("NonZero", ["r"], ["y"], name="nz")],
        "nonzero",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "k"])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_network_that_reads_on_the_host_runs_eagerly_counted_failed_once(core):
    network = core.load_network(_nonzero_model(), "TORCH", {"CUDA_GRAPHS": "4"})
    numpy = core.load_network(_nonzero_model(), "NUMPY")
    requests = [network.create_infer_request() for _ in range(2)]  # two lanes
    for seed in range(6):  # each shape seen three times per lane: would capture, then replay
        x = np.random.default_rng(seed % 2).normal(size=8 + seed % 2).astype(np.float32)
        for request in requests:
            np.testing.assert_array_equal(request.infer({"x": x})["y"], numpy.infer({"x": x})["y"])
    counts = network.graph_statistics()
    assert counts == {"captured": 0, "replayed": 0, "evicted": 0, "failed": 1}, counts
    assert all(not r._lane._graphs and not r._lane.limit for r in requests)
    # a network without such nodes is captured as before
    plain = core.load_network(mlp(), "TORCH", {"CUDA_GRAPHS": "4"}).create_infer_request()
    for _ in range(3):
        plain.infer({"x": np.ones((2, 32), np.float32)})
    assert plain._lane.counters.snapshot()["captured"] == 1


def test_host_reads_name_the_nodes_and_follow_optional_inputs():
    def graph(*protos, initializers=None):
        nodes = [Node(p.op_type, list(p.input), list(p.output), p.name,
                      attrs={a.name: a for a in p.attribute}) for p in protos]  # fmt: skip
        return types.SimpleNamespace(nodes=nodes, initializers=initializers or {})

    found = host_reads(graph(
        helper.make_node("Reshape", ["x", "shape"], ["y"], name="r"),
        helper.make_node("ReduceSum", ["y"], ["s"], name="no_axes"),
        helper.make_node("ReduceSum", ["y", "axes"], ["t"], name="axes"),
        helper.make_node("ScatterND", ["a", "i", "u"], ["b"], name="set"),
        helper.make_node("ScatterND", ["a", "i", "u"], ["c"], name="mul", reduction="mul"),
        helper.make_node("Relu", ["c"], ["d"], name="relu"),
    ))  # fmt: skip
    assert found == ["r (Reshape)", "axes (ReduceSum)", "mul (ScatterND)"]
    # a shape known at load, or computed from a Shape (shape values live on the host: review
    # finding 17), is read for nothing; one computed from the data is a device value
    shapes = graph(
        helper.make_node("Reshape", ["x", "fixed"], ["a"], name="constant_shape"),
        helper.make_node("Shape", ["a"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="first"),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"], name="n1"),
        helper.make_node("Concat", ["n1", "minus1"], ["flat"], name="flat", axis=0),
        helper.make_node("Reshape", ["a", "flat"], ["b"], name="computed_shape"),
        helper.make_node("Cast", ["b"], ["dims"], name="dims", to=TensorProto.INT64),
        helper.make_node("Reshape", ["b", "dims"], ["c"], name="data_shape"),
        initializers={"fixed": np.array([2, -1]), "zero": np.array(0), "axes": np.array([0]),
                      "minus1": np.array([-1])},
    )  # fmt: skip
    assert host_reads(shapes, plan(shapes).host) == ["data_shape (Reshape)"]


#: calls in a converter's step that read a device value on the host, or copy host values in
_HOST_CALL = re.compile(
    r"\bints\(|\.tolist\(\)|\.item\(\)|torch\.tensor\(|new_tensor\(|as_tensor\(|nonzero|"
    r"torch\.unique|float\(scale\)"
)


def test_the_registry_covers_every_converter_that_reads_on_the_host():
    """Each registered converter whose source calls a host read in a nested step (the step
    functions are closures inside the converter) is in HOST_READS, so a new converter that
    syncs cannot silently make a graph's capture fail."""
    from plugserve.plugins.torch.ops.registry import converters

    flagged = set()
    for op in converters.ops():
        for entry in converters._entries[op]:
            convert = inspect.getclosurevars(entry.convert).nonlocals.get("convert")
            source = inspect.getsource(convert or entry.convert)
            steps = source.split("\n    def ", 1)[-1] if "\n    def " in source else ""
            lambdas = re.findall(r"lambda [^:]*:.*", source)
            if _HOST_CALL.search(steps) or any(_HOST_CALL.search(s) for s in lambdas):
                flagged.add(op)
    missing = sorted(flagged - set(HOST_READS))
    assert missing == [], f"converters reading on the host, not in hostreads.HOST_READS: {missing}"
    unknown = sorted(set(HOST_READS) - set(converters.ops()))
    assert unknown == [], f"HOST_READS names ops no converter registers: {unknown}"


def test_a_failed_capture_takes_no_slot_and_only_out_of_memory_is_retried():
    policy = capture.RetryPolicy(bound=3, retry_after=5)
    policy.failed("sync", oom=False)
    policy.failed("oom", oom=True)
    assert policy.eager("sync") and policy.eager("oom") and not policy.eager("other")
    for _ in range(4):
        policy.use()
    assert policy.eager("oom")  # 4 uses: not yet
    policy.use()
    assert not policy.eager("oom") and not policy.eager("oom")  # due: forgotten, captured again
    for _ in range(100):
        policy.use()
    assert policy.eager("sync")  # a capture that syncs fails the same way every time
    for key in ("a", "b", "c"):  # bounded: the oldest forgotten
        policy.failed(key, oom=False)
    assert len(policy) == 3 and not policy.eager("sync")
    assert capture.out_of_memory(torch, torch.OutOfMemoryError("CUDA out of memory"))
    assert capture.out_of_memory(torch, RuntimeError("CUDA error: out of memory"))
    assert not capture.out_of_memory(torch, RuntimeError("operation not permitted when stream "
                                                         "is capturing"))  # fmt: skip


def test_a_lane_runs_a_failed_shape_eagerly_and_captures_it_again_when_due(core):
    """A shape whose capture failed (recorded as the capture path records it) runs eagerly
    without a graph slot, the other shapes keeping theirs; out of memory: captured again after
    the retry interval."""
    plain = core.load_network(mlp(), "TORCH")
    network = core.load_network(mlp(), "TORCH", {"CUDA_GRAPHS": "1"})
    request = network.create_infer_request()
    lane = request._lane
    lane._failures.retry_after = 4
    one, two = np.ones((1, 32), np.float32), np.ones((2, 32), np.float32)
    request.infer({"x": two})
    request.infer({"x": two})  # captured: the one slot
    assert network.graph_statistics()["captured"] == 1
    lane._failures.failed(lane._key([one]), oom=True)
    for _ in range(3):  # eager: no capture, no eviction of shape 2
        np.testing.assert_array_equal(request.infer({"x": one})["y"], plain.infer({"x": one})["y"])
    counts = network.graph_statistics()
    assert counts["captured"] == 1 and counts["evicted"] == 0, counts
    assert list(lane._graphs) == [lane._key([two])]
    request.infer({"x": one})  # the retry is due: captured (evicting shape 2)
    counts = network.graph_statistics()
    assert counts["captured"] == 2 and counts["evicted"] == 1, counts
    assert list(lane._graphs) == [lane._key([one])]


def test_the_capture_lock_and_stream_locks_serialise():
    calls = []
    fake = types.SimpleNamespace(
        _C=types.SimpleNamespace(_cuda_clearCublasWorkspaces=lambda: calls.append("clear")),
        cuda=types.SimpleNamespace(device=lambda d: contextlib.nullcontext()),
    )
    inside, most = [0], [0]

    def capturer() -> None:
        for _ in range(20):
            with capture.capturing(fake, "cuda:0"):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.001)
                inside[0] -= 1

    threads = [threading.Thread(target=capturer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert most[0] == 1 and calls == ["clear"] * 120  # before and after each of 60
    without = types.SimpleNamespace(_C=types.SimpleNamespace(), cuda=fake.cuda)
    with capture.capturing(without, "cuda:0"):  # a torch without the clear: none
        pass
    a, b = types.SimpleNamespace(cuda_stream=7), types.SimpleNamespace(cuda_stream=8)
    assert capture.stream_lock(a) is capture.stream_lock(types.SimpleNamespace(cuda_stream=7))
    assert capture.stream_lock(a) is not capture.stream_lock(b)
    assert isinstance(capture.stream_lock(None), contextlib.nullcontext)


class _FakeCuda:
    """A stand-in for ``torch.cuda`` (torch's CPU build has no graphs): it records the
    current stream, the capture calls, and reports reserved memory as set."""

    def __init__(self, end_error=None, warn=None, grow=0):
        self.current = "default"
        self.reserved = 1000
        self.log = []
        self.end_error, self.warn, self.grow = end_error, warn, grow
        cuda = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                cuda.log.append(("begin", cuda.current, pool, capture_error_mode))

            def capture_end(self):
                cuda.log.append(("end", cuda.current))
                cuda.reserved += cuda.grow
                if cuda.warn:
                    warnings.warn(cuda.warn, UserWarning, stacklevel=1)
                if cuda.end_error:
                    raise cuda.end_error

        self.CUDAGraph = Graph

    def graph_pool_handle(self):
        return (0, 5)

    def memory_reserved(self, device):
        return self.reserved

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream.name
        try:
            yield
        finally:
            self.current = before

    def current_device(self):
        return 0


def _fake_torch(**kw):
    cuda = _FakeCuda(**kw)
    ended = []
    c = types.SimpleNamespace(
        _cuda_clearCublasWorkspaces=lambda: cuda.log.append(("clear",)),
        _cuda_endAllocateToPool=lambda device, pool: ended.append(("end", device, pool)),
        _cuda_releasePool=lambda device, pool: ended.append(("release", device, pool)),
    )
    stream = types.SimpleNamespace(name="lane", device=torch.device("cuda", 1))
    return types.SimpleNamespace(cuda=cuda, _C=c), stream, ended


def test_a_capture_restores_the_stream_ends_the_pool_and_measures_its_memory():
    fake, stream, ended = _fake_torch(grow=3 * 2**20)
    got = capture.capture(fake, stream, lambda: "outputs", pool=(0, 9))
    assert (got.outputs, got.nbytes) == ("outputs", 3 * 2**20)
    assert fake.cuda.log == [("clear",), ("begin", "lane", (0, 9), "thread_local"),
                             ("end", "lane"), ("clear",)]  # fmt: skip
    assert fake.cuda.current == "default" and ended == []
    # the body syncs: the capture is ended (capture_end raises too), the stream restored, and
    # the allocator's pool ended (torch <= 2.12 skips that when capture_end raises)
    fake, stream, ended = _fake_torch(end_error=RuntimeError("capture invalidated"))

    def syncs():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        capture.capture(fake, stream, syncs)
    assert fake.cuda.current == "default"
    assert ended == [("end", 1, (0, 5)), ("release", 1, (0, 5))]  # a pool of its own, named
    # capture_end itself raises: the same, on the pool given
    fake, stream, ended = _fake_torch(end_error=RuntimeError("cudaErrorStreamCaptureInvalidated"))
    with pytest.raises(RuntimeError, match="Invalidated"):
        capture.capture(fake, stream, lambda: "outputs", pool=(0, 9))
    assert fake.cuda.current == "default"
    assert ended == [("end", 1, (0, 9)), ("release", 1, (0, 9))]
    # a torch that ended the pool itself (its end says "not recording"): nothing released twice
    fake, stream, ended = _fake_torch(end_error=RuntimeError("cudaErrorStreamCaptureInvalidated"))

    def not_recording(device, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    fake._C._cuda_endAllocateToPool = not_recording
    with pytest.raises(RuntimeError, match="Invalidated"):
        capture.capture(fake, stream, lambda: "outputs")
    assert fake.cuda.current == "default" and ended == []
    # capture_begin fails after torch routed the pool's allocations: that routing ended too
    fake, stream, ended = _fake_torch()

    def refused(self, pool=None, capture_error_mode="global"):
        raise RuntimeError("operation not permitted when stream is capturing")

    fake.cuda.CUDAGraph.capture_begin = refused
    with pytest.raises(RuntimeError, match="not permitted"):
        capture.capture(fake, stream, lambda: "outputs")
    assert fake.cuda.current == "default"
    assert ended == [("end", 1, (0, 5)), ("release", 1, (0, 5))]
    # torch says the graph is empty (its steps ran on another device's stream): a failure
    fake, stream, ended = _fake_torch(warn="The CUDA Graph is empty. This usually means ...")
    with pytest.raises(capture.EmptyCapture, match="cuda:1"):
        capture.capture(fake, stream, lambda: "outputs")
    assert fake.cuda.current == "default"


def test_a_held_charge_leaves_less_room_until_released():
    memory = devmem.DeviceMemory("GPU.0", 10 * 2**20)
    graph = memory.hold(6 * 2**20)  # a graph's pool: held without a check
    assert memory.free() == 4 * 2**20
    with pytest.raises(devmem.DeviceOutOfMemory):
        memory.charge_request(5 * 2**20, "a request", wait_s=0.05)
    graph.release()
    graph.release()  # once only
    assert memory.free() == 10 * 2**20
    memory.charge_request(5 * 2**20, "a request", wait_s=0.05).release()
    assert memory.hold(-5).nbytes == 0 and memory.free() == 10 * 2**20


class _FakeDriver:
    """A stand-in for libcuda's stream calls: hands out handles, records the calls."""

    def __init__(self, code=0):
        self.code, self.calls, self.next = code, [], 0x1000

    def cuStreamCreate(self, out, flags):  # (the driver's names)
        self.next += 0x10
        out._obj.value = self.next
        self.calls.append(("create", self.next, flags))
        return self.code

    def cuStreamSynchronize(self, handle):
        self.calls.append(("sync", handle))
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, out, card):
        out._obj.value = 0xC0 + card
        self.calls.append(("retain", card))
        return 0

    def cuCtxSetCurrent(self, context):
        self.calls.append(("current", context.value))
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, card):
        self.calls.append(("release", card))
        return 0

    def cuStreamDestroy_v2(self, handle):
        self.calls.append(("destroy", handle))
        return 0


def test_own_streams_are_the_drivers_and_are_destroyed_after_their_owner(monkeypatch):
    import gc

    driver = _FakeDriver()
    monkeypatch.setattr(capture, "_driver_lib", [driver])
    made = []
    fake = types.SimpleNamespace(
        _C=types.SimpleNamespace(),
        cuda=types.SimpleNamespace(
            device=lambda d: contextlib.nullcontext(),
            current_device=lambda: 1,
            ExternalStream=lambda ptr, device: made.append(("external", ptr)) or ptr,
            Stream=lambda device: made.append(("pooled", device)) or "pooled",
        ),
    )

    class Owner:
        pass

    owner = Owner()
    handle = capture.new_stream(fake, "cuda:1", owner)
    # the card's primary context is made current on this thread before the stream is made
    # (a stream executor's fresh thread has none: cuStreamCreate would answer 201)
    assert made == [("external", handle)]
    assert driver.calls == [("retain", 1), ("current", 0xC1), ("release", 1),
                            ("create", handle, 1)]  # fmt: skip
    driver.calls.clear()
    del owner
    gc.collect()
    assert ("destroy", handle) not in driver.calls  # not from the collector: at the next turn
    with capture.capturing(fake, "cuda:1"):
        assert driver.calls[-2:] == [("sync", handle), ("destroy", handle)]
    # the driver refuses: torch's pooled stream
    monkeypatch.setattr(capture, "_driver_lib", [_FakeDriver(code=201)])
    assert capture.new_stream(fake, "cuda:1", Owner()) == "pooled"
    monkeypatch.setattr(capture, "_driver_lib", [None])  # no libcuda at all
    assert capture.new_stream(fake, "cuda:1", Owner()) == "pooled"


def test_a_graph_pool_is_kept_only_where_the_budget_holds_it():
    """The GPU check's gpuops.memory on an H100 (2026-11-26): a captured graph's pool (with its
    own cuBLAS workspace, 32 MiB there) held past a 16 MiB budget left "-18.0 MiB free", and
    every later request, even one of no activations, was refused for 10 s. A pool that does
    not fit is refused, freed by the lane, and the shape runs eagerly."""
    memory = devmem.DeviceMemory("GPU.0", 16 * 2**20)
    kept = memory.try_hold(6 * 2**20)
    assert kept is not None and memory.free() == 10 * 2**20
    assert memory.try_hold(32 * 2**20) is None and memory.free() == 10 * 2**20
    memory.charge_request(0, "a request", wait_s=0.05).release()  # served at once
    kept.release()
    assert memory.free() == 16 * 2**20
    assert devmem.DeviceMemory("GPU.0", 0).try_hold(2**40) is not None  # no budget set


def test_a_safetensors_folder_goes_to_the_device_its_name_says():
    """AUTO takes the first of its devices the Core has (GPU, then TORCH); a named device is
    the device's own to resolve (``GPU.1``: the GPU plugin's card 1, its one name parser, and
    ``cuda:N`` its key for memory charges and failure marks); a device that runs graphs only
    refuses the folder through the Plugin API's default ``load_decoder``."""
    from pathlib import Path

    from plugserve.plugins.api import InvalidArgument
    from plugserve.server import Core
    from plugserve.server.apps.generate.network import weights_device

    core = Core()
    gpu = "GPU" in core.available_devices
    assert weights_device(core, "AUTO") == ("GPU" if gpu else "TORCH")
    assert weights_device(core, "AUTO:TORCH") == "TORCH"
    assert weights_device(core, "AUTO:-GPU") == "TORCH"
    assert weights_device(core, "GPU.1") == "GPU.1"
    with pytest.raises(InvalidArgument, match="not NUMPY"):
        core.plugin("NUMPY").load_decoder(Path("folder"), {}, None, 16, lambda per_slot: 1)
