"""What of Triton's CUDA shared memory path runs without a GPU (issue 49 item 5): the CUDA Array
Interface of a client's memory (``plugins/cuda_array.py``), the allocation bounds a registration
is checked against (``server/plane/cuda_shm.py``), the marker of an output a device wrote itself
and the writer that skips it (``server/plane/shm.py``), and the input checks a ``CudaArray``
passes. The copies themselves need a GPU: tests/gpu/gpuops_check.py (``gpuops.cuda_shm``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from plugserve.plugins.api import InvalidArgument, InvalidInput, TensorSpec, check_inputs
from plugserve.plugins.cuda_array import (
    CudaArray,
    CudaSink,
    is_written,
    takes_cuda_inputs,
    typestr,
    written,
)
from plugserve.plugins.run_context import RunContext, for_batch, for_piece
from plugserve.server.plane.cuda_shm import Copies, check_allocation
from plugserve.server.plane.shm import OutputWriter, SharedMemory, cuda_device_of


def test_interface_describes_the_clients_memory_as_version_3():
    array = CudaArray(0x7F0000001000, (2, 3), np.float32, 1)
    face = array.__cuda_array_interface__
    assert face == {
        "shape": (2, 3),
        "typestr": "<f4",
        "data": (0x7F0000001000, False),  # writable: an output's region is written
        "strides": None,  # C-contiguous, as Triton's regions are laid out
        "version": 3,
        "stream": None,  # the client wrote it before it sent the request
    }
    assert (array.ndim, array.size, array.nbytes, array.device) == (2, 6, 24, 1)
    assert array.dtype == np.float32
    assert np.shape(array) == (2, 3)  # what the server's shape checks read, with no copy


@pytest.mark.parametrize(
    ("dtype", "text"),
    [
        (np.bool_, "|b1"), (np.int8, "|i1"), (np.uint8, "|u1"), (np.int16, "<i2"),
        (np.int32, "<i4"), (np.int64, "<i8"), (np.float16, "<f2"), (np.float32, "<f4"),
        (np.float64, "<f8"), (np.dtype(">f4"), "<f4"),
    ],
)  # fmt: skip
def test_typestr_is_little_endian_for_the_types_torch_takes(dtype, text):
    assert typestr(dtype) == text


@pytest.mark.parametrize("dtype", [object, np.uint16, np.uint32, np.uint64, np.complex64, "V2"])
def test_types_outside_the_interface_take_the_host_path(dtype):
    assert typestr(dtype) is None
    with pytest.raises(ValueError, match="not an element type"):
        CudaArray(1, (1,), dtype, 0)


def test_a_reader_that_is_not_the_device_gets_a_host_copy_and_the_device_is_counted_once():
    calls = []
    values = np.arange(6, dtype=np.float32)
    array = CudaArray(
        4096, (2, 3), np.float32, 0,
        host=lambda: (calls.append("host"), values.view(np.uint8).copy())[1],
        taken=lambda: calls.append("device"),
    )  # fmt: skip
    assert np.array_equal(np.asarray(array), values.reshape(2, 3))
    assert np.asarray(array, dtype=np.float64).dtype == np.float64
    first, again = array.__cuda_array_interface__, array.__cuda_array_interface__
    assert first == again
    assert calls == ["host", "host", "device"]
    with pytest.raises(TypeError, match="no host copy"):
        np.asarray(CudaArray(4096, (1,), np.float32, 0))


def test_check_inputs_takes_a_cuda_array_as_it_is_and_checks_type_and_shape():
    specs = [TensorSpec("x", np.dtype(np.float32), (-1, 4))]
    array = CudaArray(4096, (2, 4), np.float32, 0)
    assert check_inputs("n", specs, {"x": array})[0] is array  # never np.asarray: no copy
    with pytest.raises(InvalidInput, match="element type int32, expected float32"):
        check_inputs("n", specs, {"x": CudaArray(4096, (2, 4), np.int32, 0)})
    with pytest.raises(InvalidInput, match="dimension 1 must be 4"):
        check_inputs("n", specs, {"x": CudaArray(4096, (2, 5), np.float32, 0)})


@pytest.mark.parametrize(
    ("pointer", "byte_size", "base", "size", "fits"),
    [
        (0x1000, 4096, 0x1000, 4096, True),  # the whole allocation
        (0x1000, 4097, 0x1000, 4096, False),  # one byte past it
        (0x1800, 2048, 0x1000, 4096, True),  # a pointer inside it: the rest of it
        (0x1800, 2049, 0x1000, 4096, False),
        (0x3000, 1, 0x1000, 4096, False),  # a pointer outside the allocation reported
        (0x1000, 2**63, 0x1000, 4096, False),
    ],
)
def test_a_region_must_lie_within_the_allocation_its_handle_opens(
    pointer, byte_size, base, size, fits
):
    if fits:
        check_allocation("r", pointer, byte_size, base, size)
        return
    with pytest.raises(InvalidArgument) as refused:
        check_allocation("r", pointer, byte_size, base, size)
    message = str(refused.value)
    assert message.startswith("failed to register shared memory region 'r': invalid args")
    assert f"byte_size {byte_size}" in message and f"{size} in the allocation" in message


def test_sink_refuses_an_output_larger_than_its_place_in_the_hosts_words():
    sink = CudaSink(4096, 16, 0, lambda n: None)
    assert sink.too_small(16) is None
    assert "byte size 16 is too small for the output's 17 bytes" in sink.too_small(17)


def test_a_written_output_has_its_shape_and_type_and_no_memory_of_its_size():
    marker = written((1024, 1024), np.float32)
    assert marker.shape == (1024, 1024) and marker.dtype == np.float32
    assert marker.nbytes == 4 * 2**20  # what a response reports as its byte size
    assert marker.strides == (0, 0)  # one element underneath
    assert is_written(marker) and not is_written(np.zeros(3))


def test_the_writer_skips_what_the_device_wrote_and_writes_the_rest(tmp_path):
    """Through a real system region (a file in /dev/shm): the written marker is left alone
    (its zeros never reach the region), a plain output is written."""
    key = f"/plugserve-test-cuda-array-{os.getpid()}"
    path = f"/dev/shm/{key[1:]}"
    with open(path, "wb") as f:
        f.write(b"\xff" * 64)
    try:
        shm = SharedMemory()
        shm.register("r", key, 0, 64)
        first = shm.of("").target({"shared_memory_region": "r", "shared_memory_byte_size": 32}, "a")
        second = shm.of("").target(
            {"shared_memory_region": "r", "shared_memory_byte_size": 32,
             "shared_memory_offset": 32}, "b",
        )  # fmt: skip
        writer = OutputWriter({"a": first, "b": second})
        assert writer.cuda_outputs is None  # system regions: nothing for a device to write
        out = {"a": written((8,), np.float32), "b": np.ones(8, np.float32)}
        assert writer(out) is out
        with open(path, "rb") as f:
            data = f.read()
        assert data[:32] == b"\xff" * 32  # left as it was
        assert np.array_equal(np.frombuffer(data[32:], np.float32), np.ones(8))
        shm.unregister("r")
    finally:
        os.unlink(path)


def test_only_a_network_that_says_so_gets_cuda_arrays(core):
    from models import add_sub

    plain = core.load_network(add_sub(), "NUMPY")  # every device but torch's on CUDA

    class OnGpu:
        def cuda_inputs(self):
            return 1

    class Entry:
        def __init__(self, network, sequences=None):
            self.network, self.sequences = network, sequences

    assert takes_cuda_inputs(plain) is None
    assert takes_cuda_inputs(OnGpu()) == 1
    assert cuda_device_of(Entry(OnGpu())) == 1
    assert cuda_device_of(Entry(OnGpu(), sequences=object())) is None  # rows joined on host


def test_sinks_reach_the_request_only():
    """A HETERO piece and a BATCH run do not produce the request's answer: told no sinks."""
    sink = CudaSink(4096, 16, 0, lambda n: None)
    run = RunContext(network="n", cuda_outputs={"y": sink})
    assert for_piece(run, ["y"], ["y"]).cuda_outputs is None
    assert for_batch([run], run.token).cuda_outputs is None
    assert for_batch([run, RunContext()], run.token).cuda_outputs is None


def test_copies_are_counted_by_direction_and_path():
    copies = Copies()
    copies.add("input", "device")
    copies.add("output", "host")
    copies.add("output", "host")
    assert copies.snapshot() == {
        ("input", "device"): 1, ("input", "host"): 0,
        ("output", "device"): 0, ("output", "host"): 2,
    }  # fmt: skip


@pytest.mark.parametrize("graphs", ["0", "2"])
def test_a_network_on_the_cpu_answers_values_for_a_cuda_sink(core, graphs):
    """TORCH on the CPU (the lane's CPU twin, and the plain program) is told an output's
    CUDA sink and answers the output as values: the server writes it through the host."""
    pytest.importorskip("torch")
    from models import mlp

    network = core.load_network(mlp(), "TORCH", {"CUDA_GRAPHS": graphs})
    assert network.cuda_inputs() is None  # a CPU network takes no client GPU memory
    request = network.create_infer_request()
    wrote = []
    sink = CudaSink(4096, 40, 0, wrote.append)
    x = np.random.default_rng(0).normal(size=(1, 32)).astype(np.float32)
    want = request.infer({"x": x})["y"]
    for _ in range(3):  # eager, captured (the twin), replayed
        got = request.infer_checked([x], RunContext(network="mlp", cuda_outputs={"y": sink}))
        assert not is_written(got["y"]) and not wrote
        np.testing.assert_array_equal(got["y"], want)


class _Fn:
    """A ctypes function's stand-in: callable, and takes argtypes and restype."""

    def __init__(self, call) -> None:
        self.call = call

    def __call__(self, *args):
        return self.call(*args)


class _Cudart:
    """libcudart's calls that cuda_shm's runtime makes, recorded: the GPU machine's library
    is the real one (the GPU check); here what the thread's current device becomes."""

    def __init__(self, current: int) -> None:
        self.current = current
        self.calls: list[tuple[str, int]] = []
        self.cudaSetDevice = _Fn(self._set)
        self.cudaGetDevice = _Fn(self._get)
        self.cudaGetErrorString = _Fn(lambda code: b"error")
        for name in ("cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaMemcpy"):
            setattr(self, name, _Fn(lambda *args, name=name: self._record(name)))

    def _record(self, name: str) -> int:
        self.calls.append((name, self.current))
        return 0

    def _set(self, device: int) -> int:
        self.current = device
        return 0

    def _get(self, out) -> int:
        out._obj.value = self.current
        return 0


def test_cuda_calls_run_on_the_regions_device_and_leave_the_threads_own_current():
    """A registration, a copy and a close run with the region's device current, and the
    calling thread (a request's, the event loop's) gets its own current device back."""
    from plugserve.server.plane.cuda_shm import _Runtime

    lib = _Cudart(current=1)
    runtime = _Runtime(lib, devices=2)
    runtime.open(bytes(64), 0, "registering 'r'")
    runtime.copy(1, 2, 8, 0, "reading 'r'")
    runtime.close(3, 0)
    assert [device for _name, device in lib.calls] == [0, 0, 0]
    assert lib.current == 1
