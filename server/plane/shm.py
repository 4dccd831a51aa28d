"""Triton's system shared memory extension: clients on this machine hand tensors over in POSIX
shared memory instead of in the message.

A client creates a region (``shm_open``, as ``tritonclient.utils.shared_memory`` does),
registers it under a name with its key, offset and size, and then names it in a request: an
input's bytes are read from the region and an output's bytes are written into it, the response
carrying only the output's name, type and shape. Both protocols share this registry.

The server never maps a client's object. The object is the client's: it may shrink it
(``ftruncate``) at any moment, and a page of a mapping past the object's new end faults with
SIGBUS on the next touch, which kills the whole server (no Python code can catch a fault inside
numpy's or a device's memcpy). So a region is the object's open file descriptor, and its bytes
move only through system calls: an input is read with ``preadv`` into a buffer of the
server's (one copy, charged to the memory budget with the request, before it is read), an
output is written with ``pwritev`` (one copy, as the mapped write was). A read that finds the
object shorter than the region (it shrank) returns short, and the request is refused
INVALID_ARGUMENT naming the region; a write checks the object's size first and is refused the
same way (an object that shrinks between that check and the write is grown back by the write,
within the bytes the client registered: still no signal). A shrink while a request runs cannot
reach it: its inputs were copied at admission, and its outputs are written by the calls above.
The copy in costs little beside a request: 588 KiB is read in ~36 us here (15 us as a
copy out of a mapping).

What a client may make the server touch is bounded before it is touched:

* only keys under ``--shared-memory-prefix`` (default ``/plugserve``): a key names a file in
  ``/dev/shm``, and other processes' regions there are not a client's to read or write; with
  tokens, a prefix holding ``{tenant}`` gives each tenant keys of its own
  (``/plugserve_{tenant}_``: tenant ``a`` registers ``/plugserve_a_...`` only);
  the key is one path component (no ``/`` after the first, no NUL), opened without following
  symlinks;
* the region (offset + byte size) must lie within the object as it is when registered, and
  every request's offset and size within the region, checked before any byte is read;
* a region's byte size is charged to the server's memory budget (``--max-inflight-bytes``)
  while it is registered, and the inputs read from it to each request that reads them;
* registering and unregistering need the admin role (from this machine only when the server
  has no tokens, as every admin method); ``--shared-memory off`` turns the extension off.

With ``--auth-tokens`` a region belongs to the tenant whose token registered it (docs/
security.md, *Tenants*): its name is looked up among that tenant's regions only, so another
tenant's status does not list it, its requests cannot read or write it, nor unregister it; two
tenants may each have a region of the same name. An ``infer`` token uses the regions an
``admin`` token of its tenant (``tenant=NAME``) registered. Without tokens the server is one
tenant, as it always was. A red team's infer-only token had read another tenant's region
through an Identity model and overwritten it as its output (both 200).

A region unregistered while a request uses it stays open until that request is done: the
request holds the region's descriptor from its admission (its outputs' targets), and the
descriptor is closed when its last holder is gone.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import re
import stat
import threading
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, NotFound, ResourceExhausted, Unsupported
from plugserve.plugins.cuda_array import CudaArray, CudaSink, is_written, takes_cuda_inputs
from plugserve.proto.tensors import array_payload
from plugserve.server.plane.budget import Charge, MemoryBudget, charged_buffer
from plugserve.server.plane.cuda_shm import CudaRegion, CudaRegions, check_span, listed

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_REGIONS",
    "OutputTarget",
    "OutputWriter",
    "Region",
    "SharedMemory",
    "TenantRegions",
    "cuda_device_of",
    "region_parameters",
    "uses_region",
    "write_outputs",
]

#: keys a client may register unless the operator says otherwise (--shared-memory-prefix)
DEFAULT_PREFIX = "/plugserve"
#: regions registered at once, at most (each holds a file descriptor's worth of mapping)
MAX_REGIONS = 1024
_ROOT = "/dev/shm"
_KEY = re.compile(r"/[A-Za-z0-9._-]{1,250}")
_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


class _Object:
    """A client's shared memory object, open: the descriptor is closed when the last holder
    (its region, a request's output target) lets go of it, so a descriptor number is never
    reused under a request that still writes through it."""

    __slots__ = ("fd", "identity", "key")

    def __init__(self, fd: int, key: str) -> None:
        self.fd = fd
        self.key = key
        #: the object itself (device and inode), whatever key named it
        self.identity: tuple[int, int] = (0, 0)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def __del__(self) -> None:
        os.close(self.fd)


@dataclasses.dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    object: _Object = dataclasses.field(repr=False)
    charge: Charge = dataclasses.field(repr=False)

    def span(self, offset: int, byte_size: int, what: str) -> int:
        """Where ``[offset, offset + byte_size)`` of the region starts in its object, checked
        against the region's size."""
        check_span("shared", self.name, self.byte_size, offset, byte_size, what)
        return self.offset + offset

    def write_at(self, start: int, payload: memoryview, what: str) -> None:
        """``payload`` into the object at ``start``, through its descriptor (never a
        mapping), its size checked first (the module's docstring)."""
        fd, end = self.object.fd, start + payload.nbytes
        if os.fstat(fd).st_size < end:
            raise self.shrunk(what, end)
        done = 0
        while done < payload.nbytes:
            done += os.pwritev(fd, [payload[done:]], start + done)

    def read(self, offset: int, byte_size: int, what: str, budget: MemoryBudget) -> np.ndarray:
        """A copy of the region's bytes ``[offset, offset + byte_size)``, read through the
        descriptor (never a mapping: see the module's docstring). The copy is charged to
        ``budget`` before it is allocated, and released when the last array over it is freed,
        whichever protocol read it."""
        start = self.span(offset, byte_size, what)
        buffer = charged_buffer(
            budget, byte_size, f"{what} from shared memory region {self.name!r}"
        )
        view = memoryview(buffer)
        done = 0
        while done < byte_size:
            n = os.preadv(self.object.fd, [view[done:]], start + done)
            if n <= 0:  # the object ends before the region does: it was shrunk
                raise self.shrunk(what, start + byte_size)
            done += n
        return buffer

    def shrunk(self, what: str, needed: int) -> InvalidArgument:
        return InvalidArgument(
            f"{what}: shared memory region {self.name!r} ({self.key!r}) is now "
            f"{self.object.size()} bytes, too small for offset + byte size {needed}: its "
            "object was made smaller after it was registered; register it again at its size"
        )


class SharedMemory:
    """The registered regions of one server (see the module's docstring)."""

    def __init__(
        self, enabled: bool = True, prefix: str = DEFAULT_PREFIX, budget: MemoryBudget | None = None
    ) -> None:
        self.enabled = enabled
        self.prefix = prefix
        self.budget = budget or MemoryBudget(0)
        #: by (tenant, name): each tenant sees, uses and unregisters its own
        self._regions: dict[tuple[str, str], Region] = {}
        self._lock = threading.Lock()
        self.cuda = CudaRegions()

    def prefix_of(self, tenant: str) -> str:
        """The keys ``tenant`` may register: the prefix, its ``{tenant}`` the tenant's name
        (a token's own tenant, ``#`` and its digest, without the ``#``). Without it, the first
        tenant to register a key holds its object: a red team's admin of another tenant
        registered a key the first tenant had made (mode 0600: the server opens it, not the
        client) before that tenant did, and read its bytes."""
        return self.prefix.replace("{tenant}", tenant.lstrip("#"))

    def overlapping(self, tenants: set[str]) -> str:
        """Why the tenants' prefixes are not each their own ("" when they are): with
        ``{tenant}``, one tenant's prefix must not begin another's (``/p_{tenant}_`` makes
        tenant ``a``'s ``/p_a_`` begin tenant ``a_x``'s ``/p_a_x_``, whose keys ``a`` then
        registered and read: a red team's)."""
        if "{tenant}" not in self.prefix:
            return ""
        prefixes = sorted((self.prefix_of(t), t) for t in tenants)
        for (first, one), (then, other) in itertools.pairwise(prefixes):
            if then.startswith(first):
                return (
                    f"--shared-memory-prefix {self.prefix!r}: tenant {one!r}'s keys "
                    f"({first!r}) begin tenant {other!r}'s ({then!r}); end the prefix with "
                    "text no tenant name continues with, or rename a tenant"
                )
        return ""

    def of(self, tenant: str) -> TenantRegions:
        """What a request of ``tenant`` may name: its tenant's regions."""
        return TenantRegions(self, tenant)

    def _check_on(self) -> None:
        if not self.enabled:
            raise Unsupported(
                "system shared memory is off on this server (--shared-memory off); send "
                "tensors in the request"
            )

    def register(self, name: str, key: str, offset: int, byte_size: int, tenant: str = "") -> None:
        self._check_on()
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        if not _KEY.fullmatch(key or ""):
            raise InvalidArgument(
                f"shared memory key {key!r}: expected '/' and then letters, digits, '.', '_' "
                "or '-' (one name in /dev/shm)"
            )
        prefix = self.prefix_of(tenant)
        if not key.startswith(prefix):
            raise InvalidArgument(
                f"shared memory key {key!r} is not under this server's prefix {prefix!r}"
                + (" (this tenant's)" if prefix != self.prefix else "")
                + ": create the region with a key that starts with it, or start the server "
                "with --shared-memory-prefix (PLUGSERVE_SHARED_MEMORY_PREFIX) set to a prefix "
                "of this key to allow it"
            )
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(
                f"shared memory region {name!r}: offset {offset} and byte size {byte_size} "
                "must be >= 0 and > 0"
            )
        with self._lock:
            if (tenant, name) in self._regions or self.cuda.get(name, tenant) is not None:
                raise InvalidArgument(
                    f"shared memory region {name!r} is already registered; unregister it first"
                )
            if len(self._regions) >= MAX_REGIONS:
                raise InvalidArgument(
                    f"{MAX_REGIONS} shared memory regions are registered; unregister one first"
                )
        opened = _open(key, offset + byte_size, name)
        charge = self.budget.charge(byte_size, f"shared memory region {name!r}")
        region = Region(name, key, offset, byte_size, opened, charge)
        with self._lock:
            if (tenant, name) in self._regions:  # registered meanwhile by another call
                charge.release()
                raise InvalidArgument(f"shared memory region {name!r} is already registered")
            if any(
                owner != tenant and held.object.identity == opened.identity
                for (owner, _), held in self._regions.items()
            ):  # another tenant's object: its regions' names are its, and so is its memory
                charge.release()
                raise InvalidArgument(
                    f"shared memory region {name!r}: {key!r} cannot be registered by this "
                    "token: its object is registered by another tenant's"
                )
            self._regions[(tenant, name)] = region

    def status(self, name: str = "", tenant: str = "") -> list[Region]:
        self._check_on()
        return listed(self._regions, self._lock, tenant, name, "system")

    def unregister(self, name: str = "", tenant: str = "") -> None:
        """Forget one of ``tenant``'s regions (every one of its when ``name`` is empty).
        Requests using it keep its descriptor; it is closed once the last is done."""
        self._check_on()
        with self._lock:
            keys = [(tenant, name)] if name else [k for k in self._regions if k[0] == tenant]
            gone = [self._regions.pop(key) for key in keys if key in self._regions]
        for region in gone:
            region.charge.release()

    # CUDA shared memory (cuda_shm.py): the same names, in the same requests; without CUDA
    # answered as Triton built without GPU support answers (its example clients begin by
    # unregistering every CUDA region and reading the CUDA status, and go on to system shared
    # memory only when both succeed; only a registration is refused)

    def cuda_status(self, name: str = "", tenant: str = "") -> list[CudaRegion]:
        return self.cuda.status(name, tenant)

    def cuda_register(
        self,
        name: str,
        raw_handle: bytes | None,
        device_id: int,
        byte_size: int,
        tenant: str = "",
    ) -> None:
        self._check_on()
        if self._regions.get((tenant, name)) is not None:
            raise InvalidArgument(
                f"shared memory region {name!r} is already registered; unregister it first"
            )
        self.cuda.register(name, raw_handle, device_id, byte_size, tenant)

    def cuda_unregister(self, name: str = "", tenant: str = "") -> None:
        self.cuda.unregister(name, tenant)

    def region(self, name: str, what: str, tenant: str = "") -> Region | CudaRegion:
        """``tenant``'s region ``name``; another tenant's is as one never registered."""
        self._check_on()
        with self._lock:
            region = self._regions.get((tenant, name))
        if region is None:
            region = self.cuda.get(name, tenant)
        if region is None:
            raise InvalidArgument(
                f"{what}: shared memory region {name!r} is not registered; register it first"
            )
        return region


class TenantRegions:
    """One tenant's view of the regions, what a request's tensors may name: the names they
    give are looked up among its tenant's regions only (:meth:`SharedMemory.of`)."""

    __slots__ = ("shm", "tenant")

    def __init__(self, shm: SharedMemory, tenant: str) -> None:
        self.shm = shm
        self.tenant = tenant

    def read(self, parameters: dict[str, Any], what: str) -> np.ndarray:
        """A copy of an input's bytes from the region its parameters name, charged to the
        memory budget while it lives."""
        name, byte_size, offset = region_parameters(parameters, what)
        region = self.shm.region(name, what, self.tenant)
        return region.read(offset, byte_size, what, self.shm.budget)

    def device_input(
        self,
        parameters: dict[str, Any],
        what: str,
        dtype: np.dtype,
        shape: tuple[int, ...],
        device: int | None,
    ) -> CudaArray | None:
        """An input in a CUDA region of GPU ``device`` (the one its network computes on:
        ``cuda_array.takes_cuda_inputs``) as a :class:`CudaArray` over the client's memory,
        for the device to copy device to device; None when it is read as :meth:`read` reads
        it (another region, another GPU, no such network, a type the interface lacks)."""
        if device is None:
            return None
        name, byte_size, offset = region_parameters(parameters, what)
        region = self.shm.region(name, what, self.tenant)
        if not isinstance(region, CudaRegion) or region.device_id != device:
            return None
        return region.device_input(offset, byte_size, dtype, tuple(shape), what, self.shm.budget)

    def target(self, parameters: dict[str, Any], what: str) -> OutputTarget:
        """Where an output goes, resolved when its request is admitted: the request holds the
        region's descriptor (a CUDA region's opened memory) from then on, so unregistering it
        meanwhile changes nothing for it."""
        name, byte_size, offset = region_parameters(parameters, what)
        region = self.shm.region(name, what, self.tenant)
        return OutputTarget(name, region, region.span(offset, byte_size, what), byte_size)


@dataclasses.dataclass
class OutputTarget:
    """An output's place in a region, system or CUDA (its descriptor or opened memory held by
    its request)."""

    region: str
    source: Region | CudaRegion = dataclasses.field(repr=False)
    start: int
    byte_size: int

    def write(self, data: Any, what: str) -> int:
        payload = memoryview(data).cast("B")
        if payload.nbytes > self.byte_size:
            raise InvalidArgument(
                f"{what}: shared memory byte size {self.byte_size} is too small for the "
                f"output's {payload.nbytes} bytes; give it at least that much"
            )
        self.source.write_at(self.start, payload, what)
        return payload.nbytes

    def sink(self) -> CudaSink | None:
        """Where a device may write the output device to device (a CUDA region), else None."""
        if isinstance(self.source, CudaRegion):
            return self.source.sink(self.start, self.byte_size)
        return None


def write_outputs(targets: dict[str, OutputTarget], outputs: dict[str, Any]) -> dict[str, Any]:
    """Write each output that has a target into its region (on the thread that ran the
    request, before it is answered), but those its device wrote there itself
    (``cuda_array.written``); the outputs, unchanged."""
    for name, target in targets.items():
        if name in outputs and not is_written(outputs[name]):
            target.write(array_payload(np.asarray(outputs[name])), f"output {name!r}")
    return outputs


class OutputWriter:
    """A request's ``after``: :func:`write_outputs` into its targets; its CUDA targets are
    told to the device too (:attr:`cuda_outputs`, the run's context), which may write them
    device to device. ``host_only``: outputs the server changes before they are written (a
    classification), which the device must answer as values."""

    __slots__ = ("cuda_outputs", "targets")

    def __init__(self, targets: dict[str, OutputTarget], host_only: Any = ()) -> None:
        self.targets = targets
        sinks = {}
        for name, target in targets.items():
            sink = target.sink() if name not in host_only else None
            if sink is not None:
                sinks[name] = sink
        #: the outputs a device may write into a client's GPU memory itself, or None
        self.cuda_outputs: dict[str, CudaSink] | None = sinks or None

    def __call__(self, outputs: dict[str, Any]) -> dict[str, Any]:
        return write_outputs(self.targets, outputs)


def cuda_device_of(entry: Any) -> int | None:
    """The GPU whose memory a loaded network takes its inputs from without a host copy
    (``cuda_array.takes_cuda_inputs``), None for one of a sequence (its batcher joins rows
    on the host)."""
    if entry.sequences is not None:
        return None
    return takes_cuda_inputs(entry.network)


def region_parameters(parameters: dict[str, Any], what: str) -> tuple[str, int, int]:
    """``(region, byte size, offset)`` from a tensor's parameters, each checked."""
    name = parameters.get("shared_memory_region")
    byte_size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{what}: shared_memory_region must name a registered region")
    if isinstance(byte_size, bool) or not isinstance(byte_size, int):
        raise InvalidArgument(f"{what}: shared_memory_byte_size must be an integer")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise InvalidArgument(f"{what}: shared_memory_offset must be an integer")
    if byte_size < 0 or offset < 0:
        raise InvalidArgument(f"{what}: shared memory offset and byte size must be >= 0")
    return name, byte_size, offset


def uses_region(parameters: Any) -> bool:
    return any(p in parameters for p in _PARAMETERS)


def _open(key: str, length: int, name: str) -> _Object:
    path = os.path.join(_ROOT, key[1:])
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(
            f"Unable to open shared memory region {name!r}: no shared memory object {key!r}"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise ResourceExhausted(
                f"Unable to open shared memory region {name!r}: the server has no file "
                "descriptor free; unregister regions it no longer needs"
            ) from None
        raise InvalidArgument(
            f"Unable to open shared memory region {name!r} ({key!r}): {exc.strerror}"
        ) from None
    opened = _Object(fd, key)  # closes the descriptor if a check below refuses it
    info = os.fstat(fd)
    opened.identity = (info.st_dev, info.st_ino)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidArgument(f"shared memory key {key!r} is not a shared memory object")
    if length > info.st_size:
        raise InvalidArgument(
            f"shared memory region {name!r}: offset + byte size ({length}) is past the end "
            f"of {key!r} ({info.st_size} bytes)"
        )
    return opened
