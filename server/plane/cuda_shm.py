"""Triton's CUDA shared memory extension: a client on this machine allocates GPU memory, hands
the server its CUDA IPC handle (``cudaIpcGetMemHandle``: 64 bytes; base64 on REST), the GPU
and the byte size, and then names the region in a request as it names a system one: inputs
are read from the client's GPU memory, outputs written into it. ``tritonclient.utils.
cuda_shared_memory`` works unchanged.

The server opens a handle with ``cudaIpcOpenMemHandle`` of the CUDA runtime torch loaded
(``libcudart``, found among the process's mapped libraries once torch has initialised CUDA;
ctypes, no other dependency). The runtime is reached at the first registration: a server that
never gets one never imports torch (9 s).

How bytes move (each counted by path on ``/metrics``: ``plugserve_cuda_shm_copies``):

- **device to device**, for a network that computes on the region's GPU and says so
  (``cuda_inputs``: TORCH/GPU's converted ONNX networks on CUDA, unbatched): an input is
  handed to it as a :class:`~plugserve.plugins.cuda_array.CudaArray` over the client's memory
  (``__cuda_array_interface__``), which the device wraps without a copy and copies into its
  own input on the request's stream; an output it makes is copied into the client's region
  on that stream (a :class:`~plugserve.plugins.cuda_array.CudaSink` in the run's context),
  and the stream is synchronised before the request is answered, so the client reads it
  complete once it has the response.
- **through the host** otherwise (a network on the CPU, a batched one, a PyTorch program, an
  element type outside ``cuda_array.TYPESTRS``): ``cudaMemcpy`` with ``cudaMemcpyDefault``
  (unified addressing: host or device on either side), an input into a host buffer charged to
  the memory budget, as a system region's is; an output from the request's host result, on the
  thread that ran the request, before the answer leaves.

Bounded as the system regions are: at most :data:`MAX_REGIONS` CUDA regions, each no larger
than its GPU's memory and no larger than the allocation its handle opens (the driver's
``cuMemGetAddressRange`` on the opened pointer, as Triton checks it: a region past its
allocation would let a request read or write memory that is not the client's), every
request's offset and size checked against the region before any byte moves; registering
needs the admin role as every shared memory call. A region
unregistered while a request uses it stays open until that request is done (the request holds
the opened pointer; ``cudaIpcCloseMemHandle`` runs when the last holder lets go).

Without CUDA (no GPU, torch's CPU build, no torch) a registration is refused as Triton built
without GPU support refuses it ("failed to register CUDA shared memory region: '<name>', GPUs
not supported"), with the reason; status and unregister answer success with nothing
registered, as Triton's do (its example clients begin with them).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, NotFound
from plugserve.plugins.cuda_array import CudaArray, CudaSink, typestr
from plugserve.server.plane.budget import charged_buffer

__all__ = [
    "IPC_HANDLE_BYTES",
    "MAX_REGIONS",
    "CudaRegion",
    "CudaRegions",
    "check_allocation",
    "check_span",
    "listed",
]

#: CUDA regions registered at once, at most (each holds an IPC mapping of a client's memory)
MAX_REGIONS = 64
#: sizeof(cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def check_span(kind: str, name: str, size: int, offset: int, byte_size: int, what: str) -> None:
    """``[offset, offset + byte_size)`` lies within the region (``kind``: shared, CUDA
    shared), else INVALID_ARGUMENT naming it, before any byte moves."""
    if offset < 0 or byte_size < 0 or offset + byte_size > size:
        raise InvalidArgument(
            f"{what}: offset {offset} and byte size {byte_size} do not lie within {kind} "
            f"memory region {name!r} ({size} bytes)"
        )


def check_allocation(name: str, pointer: int, byte_size: int, base: int, size: int) -> None:
    """A region of ``byte_size`` bytes from ``pointer`` (the opened handle) lies within the
    allocation ``[base, base + size)`` the driver reports for it, else INVALID_ARGUMENT in
    Triton's words ("failed to register shared memory region '<name>': invalid args") with
    both sizes."""
    room = base + size - pointer if base <= pointer < base + size else 0
    if byte_size > room:
        raise InvalidArgument(
            f"failed to register shared memory region {name!r}: invalid args: byte_size "
            f"{byte_size} is past the end of the CUDA allocation its handle opens ({room} "
            f"bytes from the handle's pointer, {size} in the allocation); register at most "
            f"{room}"
        )


def listed(
    regions: dict[tuple[str, str], Any], lock: threading.Lock, tenant: str, name: str, kind: str
) -> list[Any]:
    """Every region of ``tenant`` by name, or the one named (NOT_FOUND in Triton's words:
    "Unable to find <kind> shared memory region"); another tenant's are not there."""
    with lock:
        if not name:
            mine = [region for (owner, _), region in regions.items() if owner == tenant]
            return sorted(mine, key=lambda r: r.name)
        region = regions.get((tenant, name))
    if region is None:
        raise NotFound(f"Unable to find {kind} shared memory region: {name!r}")
    return [region]


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaUnavailable(InvalidArgument):
    """No CUDA here: what Triton built without GPU support answers a registration with."""


class _Runtime:
    """The few CUDA runtime calls the extension makes, on torch's libcudart."""

    def __init__(self, lib: ctypes.CDLL, devices: int) -> None:
        self.lib = lib
        self.devices = devices
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaIpcOpenMemHandle.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            _Handle,
            ctypes.c_uint,
        ]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def check(self, code: int, what: str) -> None:
        if code != 0:
            text = self.lib.cudaGetErrorString(code)
            raise InvalidArgument(f"{what}: CUDA error {code}: {(text or b'').decode()}")

    @contextlib.contextmanager
    def _on(self, device: int, what: str) -> Iterator[None]:
        """``device`` current for the calls inside, the thread's own current device back
        after: these run on request, gRPC and event-loop threads (and a collector's, closing),
        whose current device other code (torch's lanes) relies on."""
        before = ctypes.c_int(-1)
        had = self.lib.cudaGetDevice(ctypes.byref(before)) == 0
        self.check(self.lib.cudaSetDevice(device), what)
        try:
            yield
        finally:
            if had and before.value != device:
                self.lib.cudaSetDevice(before.value)

    def open(self, handle: bytes, device: int, what: str) -> int:
        pointer = ctypes.c_void_p()
        raw = _Handle()
        ctypes.memmove(ctypes.byref(raw), handle, IPC_HANDLE_BYTES)
        with self._on(device, what):
            self.check(
                self.lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, _LAZY_PEER_ACCESS), what
            )
        return int(pointer.value or 0)

    def close(self, pointer: int, device: int) -> None:
        with contextlib.suppress(InvalidArgument), self._on(device, "closing a region"):
            self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer))

    def copy(self, dst: int, src: int, nbytes: int, device: int, what: str) -> None:
        with self._on(device, what):
            self.check(self.lib.cudaMemcpy(dst, src, nbytes, _MEMCPY_DEFAULT), what)


class _Driver:
    """The driver's ``cuMemGetAddressRange`` (libcuda, loaded by the runtime once CUDA is
    initialised), as Triton reaches it: the allocation a pointer lies in."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.range = lib.cuMemGetAddressRange_v2
        self.range.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self.range.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def allocation(self, pointer: int, what: str) -> tuple[int, int]:
        """``(base, size)`` of the allocation ``pointer`` lies in; the thread's current
        context is the runtime's (set by the open just before)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self.range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise InvalidArgument(
                f"{what}: invalid args: the CUDA driver gives no allocation for the opened "
                f"handle (cuMemGetAddressRange: error {code}: {(text.value or b'').decode()})"
            )
        return int(base.value), int(size.value)


@functools.cache
def _driver() -> _Driver | str:
    """The driver's calls, or why they are missing."""
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        return f"the CUDA driver library does not load ({exc})"


@functools.cache
def _runtime() -> tuple[_Runtime | None, str]:
    """torch's CUDA runtime, or None and why there is none."""
    from plugserve.plugins.cuda import start_cuda

    devices, why = start_cuda()
    if not devices:
        return None, why
    path = _loaded_cudart()
    try:
        lib = ctypes.CDLL(path or "libcudart.so")
    except OSError as exc:
        return None, f"the CUDA runtime library is not found ({exc})"
    return _Runtime(lib, devices), ""


def _loaded_cudart() -> str | None:
    """The libcudart torch mapped into this process (its wheel's nvidia/cuda_runtime), else
    one beside torch's wheel (a torch that loads it later), else None (the system's)."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "/libcudart.so" in path:
                return path
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        site = Path(spec.origin).parent.parent
        found = sorted(site.glob("nvidia/cu*/lib/libcudart.so*")) + sorted(
            (site / "torch" / "lib").glob("libcudart*.so*")
        )
        if found:
            return str(found[-1])
    return None


class _Opened:
    """A client's memory opened in this process: closed when its last holder (its region, a
    request's output target) lets go, so an unregistration never pulls memory from under a
    request still writing to it."""

    def __init__(self, runtime: _Runtime, pointer: int, device: int) -> None:
        self.runtime, self.pointer, self.device = runtime, pointer, device
        #: ``(base, size)`` of the client's allocation (the driver's), set when it is opened
        self.allocation = (pointer, 0)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the library may be gone
            self.runtime.close(self.pointer, self.device)


class Copies:
    """How many inputs and outputs moved by each path (``plugserve_cuda_shm_copies``):
    ``(direction, path)``: ``input``/``output``, ``device`` (device to device) or ``host``."""

    KEYS = (("input", "device"), ("input", "host"), ("output", "device"), ("output", "host"))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.KEYS, 0)

    def add(self, direction: str, path: str) -> None:
        with self._lock:
            self._counts[direction, path] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


@dataclasses.dataclass
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    opened: _Opened = dataclasses.field(repr=False)
    copies: Copies = dataclasses.field(default_factory=Copies, repr=False)

    def span(self, offset: int, byte_size: int, what: str) -> int:
        check_span("CUDA shared", self.name, self.byte_size, offset, byte_size, what)
        return offset

    def write_at(self, start: int, payload: memoryview, what: str) -> None:
        """``payload`` (host bytes) into the client's GPU memory at ``start``."""
        if payload.nbytes:
            source = np.frombuffer(payload, np.uint8)
            opened = self.opened
            opened.runtime.copy(
                opened.pointer + start, source.ctypes.data, payload.nbytes, opened.device, what
            )
        self.copies.add("output", "host")

    def read(self, offset: int, byte_size: int, what: str, budget: Any) -> np.ndarray:
        """A host copy of the region's bytes, charged to ``budget`` before it is made."""
        start = self.span(offset, byte_size, what)
        buffer = charged_buffer(
            budget, byte_size, f"{what} from CUDA shared memory region {self.name!r}"
        )
        if byte_size:
            self.opened.runtime.copy(
                buffer.ctypes.data, self.opened.pointer + start, byte_size, self.device_id, what
            )
        self.copies.add("input", "host")
        return buffer

    def device_input(
        self,
        offset: int,
        byte_size: int,
        dtype: np.dtype,
        shape: tuple[int, ...],
        what: str,
        budget: Any,
    ) -> CudaArray | None:
        """The input as a :class:`CudaArray` over the client's memory (no copy: the device
        copies it device to device; counted so), or None when it must go through the host (an
        element type the interface does not carry, an empty tensor). Its size is checked
        against the shape first, as the host path checks the bytes it read."""
        start = self.span(offset, byte_size, what)
        count = 1
        for d in shape:
            count *= d
        if byte_size != count * dtype.itemsize:
            raise InvalidArgument(
                f"{what}: {byte_size} bytes in CUDA shared memory region {self.name!r}, but "
                f"shape {list(shape)} of {dtype} needs {count * dtype.itemsize}"
            )
        if typestr(dtype) is None or not count:
            return None
        opened, copies = self.opened, self.copies

        def host() -> np.ndarray:  # a reader that is not the device: correct, counted
            return self.read(offset, byte_size, what, budget)

        def taken() -> None:
            copies.add("input", "device")

        return CudaArray(opened.pointer + start, shape, dtype, self.device_id, opened, host, taken)

    def sink(self, start: int, byte_size: int) -> CudaSink:
        """Where a device writes an output device to device (``start``: checked by
        :meth:`span`); the request holds the opened memory through it."""
        copies = self.copies

        def wrote(_nbytes: int) -> None:
            copies.add("output", "device")

        return CudaSink(self.opened.pointer + start, byte_size, self.device_id, wrote, self.opened)


class CudaRegions:
    """The CUDA regions of one server (see the module's docstring)."""

    def __init__(self) -> None:
        #: by (tenant, name): each tenant sees, uses and unregisters its own (``shm.py``)
        self._regions: dict[tuple[str, str], CudaRegion] = {}
        #: each client allocation opened once, shared by the regions naming it (torch's
        #: caching allocator hands out one IPC handle for a block of many tensors; CUDA
        #: counts a second open of a handle, older drivers refused it)
        self._opened: weakref.WeakValueDictionary[tuple[bytes, int], _Opened] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()
        #: inputs and outputs moved, by path (every region's: ``/metrics``)
        self.copies = Copies()

    def register(
        self, name: str, raw_handle: bytes | None, device_id: int, byte_size: int, tenant: str = ""
    ) -> None:
        """``raw_handle`` None: REST's ``raw_handle.b64`` was missing or not base64 (refused
        after the CUDA check, which Triton answers first)."""
        if not name:
            raise InvalidArgument("a CUDA shared memory region needs a name")
        runtime, why = _runtime()
        if runtime is None:
            raise CudaUnavailable(
                f"failed to register CUDA shared memory region: {name!r}, GPUs not supported "
                f"({why}: use system shared memory)"
            )
        if raw_handle is None:
            raise InvalidArgument(
                f"CUDA shared memory region {name!r}: the register request needs 'raw_handle': "
                "{'b64': <the base64 of a cudaIpcMemHandle_t>}"
            )
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(
                f"CUDA shared memory region {name!r}: raw_handle is {len(raw_handle)} bytes; "
                f"a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES}"
            )
        if not 0 <= device_id < runtime.devices:
            raise InvalidArgument(
                f"CUDA shared memory region {name!r}: device_id {device_id}: this server sees "
                f"GPUs 0 to {runtime.devices - 1}"
            )
        total = _device_memory(device_id)
        if byte_size <= 0 or byte_size > total:
            raise InvalidArgument(
                f"CUDA shared memory region {name!r}: byte_size {byte_size} must be > 0 and at "
                f"most GPU {device_id}'s memory ({total} bytes)"
            )
        with self._lock:
            if (tenant, name) in self._regions:
                raise InvalidArgument(
                    f"shared memory region {name!r} is already registered; unregister it first"
                )
            if len(self._regions) >= MAX_REGIONS:
                raise InvalidArgument(
                    f"{MAX_REGIONS} CUDA shared memory regions are registered; unregister one first"
                )
        where = f"failed to register CUDA shared memory region {name!r}"
        key = (bytes(raw_handle), device_id)
        with self._lock:
            opened = self._opened.get(key)
        if opened is None:
            opened = _Opened(runtime, runtime.open(key[0], device_id, where), device_id)
            driver = _driver()
            if isinstance(driver, str):
                raise InvalidArgument(f"{where}: invalid args: its size is not known: {driver}")
            opened.allocation = driver.allocation(opened.pointer, where)
            with self._lock:
                opened = self._opened.setdefault(key, opened)
        check_allocation(name, opened.pointer, byte_size, *opened.allocation)
        with self._lock:
            if (tenant, name) in self._regions:
                raise InvalidArgument(f"shared memory region {name!r} is already registered")
            self._regions[(tenant, name)] = CudaRegion(
                name, device_id, byte_size, opened, self.copies
            )

    def status(self, name: str = "", tenant: str = "") -> list[CudaRegion]:
        return listed(self._regions, self._lock, tenant, name, "cuda")

    def unregister(self, name: str = "", tenant: str = "") -> None:
        """Forget one of ``tenant``'s regions (every one of its when ``name`` is empty); one
        not held: success, as Triton answers."""
        with self._lock:
            if name:
                self._regions.pop((tenant, name), None)
            else:
                for key in [key for key in self._regions if key[0] == tenant]:
                    del self._regions[key]

    def get(self, name: str, tenant: str = "") -> CudaRegion | None:
        with self._lock:
            return self._regions.get((tenant, name))


def _device_memory(device_id: int) -> int:
    from plugserve.plugins.cuda import card_memory

    return card_memory(device_id)
