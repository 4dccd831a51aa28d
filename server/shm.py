"""Triton's system shared memory extension: clients on this machine hand tensors over in POSIX
shared memory instead of in the message.

A client creates a region (``shm_open``, as ``tritonclient.utils.shared_memory`` does),
registers it under a name with its key, offset and size, and then names it in a request: an
input's bytes are read from the region (a view, not a copy, for numeric tensors: the device
reads them in place) and an output's bytes are written into it, the response carrying only
the output's name, type and shape. Both protocols share this registry.

What a client may make the server map is bounded before it is mapped:

* only keys under ``--shared-memory-prefix`` (default ``/plugserve``): a key names a file in
  ``/dev/shm``, and other processes' regions there are not a client's to read or write;
  the key is one path component (no ``/`` after the first, no NUL), opened without following
  symlinks;
* the region (offset + byte size) must lie within the object as it is when registered, and
  every request's offset and size within the region, checked before any byte is touched;
* a region's byte size is charged to the server's memory budget (``--max-inflight-bytes``)
  while it is registered;
* registering and unregistering need the admin role (from this machine only when the server
  has no tokens, as every admin method); ``--shared-memory off`` turns the extension off.

A region unregistered while a request uses it stays mapped until that request is done: the
request holds views of it from its admission (its inputs' and its outputs'), the mapping is only
let go, and it is unmapped when its last view is gone.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import stat
import threading
from typing import Any

import numpy as np

from plugserve.plugins.api import InvalidArgument, NotFound, Unsupported
from plugserve.proto.tensors import array_payload
from plugserve.server.budget import Charge, MemoryBudget

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_REGIONS",
    "OutputTarget",
    "Region",
    "SharedMemory",
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


@dataclasses.dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap = dataclasses.field(repr=False)
    charge: Charge = dataclasses.field(repr=False)

    def view(self, offset: int, byte_size: int, what: str) -> memoryview:
        """The region's bytes ``[offset, offset + byte_size)``, checked against its size."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise InvalidArgument(
                f"{what}: offset {offset} and byte size {byte_size} do not lie within shared "
                f"memory region {self.name!r} ({self.byte_size} bytes)"
            )
        start = self.offset + offset
        return memoryview(self.mapping)[start : start + byte_size]


class SharedMemory:
    """The registered regions of one server (see the module's docstring)."""

    def __init__(
        self, enabled: bool = True, prefix: str = DEFAULT_PREFIX, budget: MemoryBudget | None = None
    ) -> None:
        self.enabled = enabled
        self.prefix = prefix
        self.budget = budget or MemoryBudget(0)
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def _check_on(self) -> None:
        if not self.enabled:
            raise Unsupported(
                "system shared memory is off on this server (--shared-memory off); send "
                "tensors in the request"
            )

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_on()
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        if not _KEY.fullmatch(key or ""):
            raise InvalidArgument(
                f"shared memory key {key!r}: expected '/' and then letters, digits, '.', '_' "
                "or '-' (one name in /dev/shm)"
            )
        if not key.startswith(self.prefix):
            raise InvalidArgument(
                f"shared memory key {key!r} is not under this server's prefix {self.prefix!r} "
                "(--shared-memory-prefix): create the region with a key that starts with it"
            )
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(
                f"shared memory region {name!r}: offset {offset} and byte size {byte_size} "
                "must be >= 0 and > 0"
            )
        with self._lock:
            if name in self._regions:
                raise InvalidArgument(
                    f"shared memory region {name!r} is already registered; unregister it first"
                )
            if len(self._regions) >= MAX_REGIONS:
                raise InvalidArgument(
                    f"{MAX_REGIONS} shared memory regions are registered; unregister one first"
                )
        mapping = _map(key, offset + byte_size, name)
        try:
            charge = self.budget.charge(byte_size, f"shared memory region {name!r}")
        except BaseException:
            mapping.close()
            raise
        region = Region(name, key, offset, byte_size, mapping, charge)
        with self._lock:
            if name in self._regions:  # registered meanwhile by another call
                charge.release()
                raise InvalidArgument(f"shared memory region {name!r} is already registered")
            self._regions[name] = region

    def status(self, name: str = "") -> list[Region]:
        self._check_on()
        with self._lock:
            if not name:
                return sorted(self._regions.values(), key=lambda r: r.name)
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find system shared memory region: {name!r}")
        return [region]

    def unregister(self, name: str = "") -> None:
        """Forget one region (every one when ``name`` is empty). Requests using it keep
        their views; the mapping goes once the last is gone."""
        self._check_on()
        with self._lock:
            if name:
                gone = [self._regions.pop(name)] if name in self._regions else []
            else:
                gone = list(self._regions.values())
                self._regions.clear()
        for region in gone:
            region.charge.release()

    def region(self, name: str, what: str) -> Region:
        self._check_on()
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(
                f"{what}: shared memory region {name!r} is not registered; register it first"
            )
        return region

    def read(self, parameters: dict[str, Any], what: str) -> memoryview:
        """An input's bytes from the region its parameters name."""
        name, byte_size, offset = region_parameters(parameters, what)
        return self.region(name, what).view(offset, byte_size, what).toreadonly()

    def target(self, parameters: dict[str, Any], what: str) -> OutputTarget:
        """Where an output goes, resolved when its request is admitted: the request holds the
        region's bytes from then on, so unregistering it meanwhile changes nothing for it."""
        name, byte_size, offset = region_parameters(parameters, what)
        return OutputTarget(name, self.region(name, what).view(offset, byte_size, what))


@dataclasses.dataclass
class OutputTarget:
    """An output's place in a region (a view held by its request)."""

    region: str
    view: memoryview = dataclasses.field(repr=False)

    def write(self, data: Any, what: str) -> int:
        payload = memoryview(data).cast("B")
        if payload.nbytes > self.view.nbytes:
            raise InvalidArgument(
                f"{what}: shared memory byte size {self.view.nbytes} is too small for the "
                f"output's {payload.nbytes} bytes; give it at least that much"
            )
        self.view[: payload.nbytes] = payload
        return payload.nbytes


def write_outputs(targets: dict[str, OutputTarget], outputs: dict[str, Any]) -> dict[str, Any]:
    """Write each output that has a target into its region (on the thread that ran the
    request, before it is answered); the outputs, unchanged."""
    for name, target in targets.items():
        if name in outputs:
            target.write(array_payload(np.asarray(outputs[name])), f"output {name!r}")
    return outputs


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


def _map(key: str, length: int, name: str) -> mmap.mmap:
    path = os.path.join(_ROOT, key[1:])
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(
            f"Unable to open shared memory region {name!r}: no shared memory object {key!r}"
        ) from None
    except OSError as exc:
        raise InvalidArgument(
            f"Unable to open shared memory region {name!r} ({key!r}): {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"shared memory key {key!r} is not a shared memory object")
        if length > info.st_size:
            raise InvalidArgument(
                f"shared memory region {name!r}: offset + byte size ({length}) is past the end "
                f"of {key!r} ({info.st_size} bytes)"
            )
        return mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
