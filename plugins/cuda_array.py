"""Tensors in GPU memory that is not the device's own: a client's CUDA shared memory region
(``server/plane/cuda_shm.py``) handed to a device that computes on that GPU, without a copy
through the host.

- :class:`CudaArray`: an input's bytes in a client's GPU memory, described by the CUDA Array
  Interface (version 3, ``__cuda_array_interface__``): a GPU device wraps it without a copy
  (``torch.as_tensor(array, device="cuda")``: public, and the memory stays the client's) and
  copies it device to device into its own input. It has ``shape``, ``dtype`` and ``nbytes``,
  so the server checks it as it checks an array; anything else that reads it as numpy
  (``np.asarray``) gets a host copy, correct but slow, which its source counts: the server
  hands one only to a network that says it takes them (:func:`takes_cuda_inputs`).
- :class:`CudaSink`: where an output goes in a client's GPU memory, told to the device in its
  :class:`~plugserve.plugins.run_context.RunContext` (``cuda_outputs``); a device that
  produces the output on that GPU copies it there device to device, waits for its own stream,
  and answers :func:`written` (the output's shape and type, no bytes) so the server does not
  write it again.

Only the element types the interface and torch share travel so (:data:`TYPESTRS`); others (bf16,
strings) take the host path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "TYPESTRS",
    "CudaArray",
    "CudaSink",
    "is_written",
    "takes_cuda_inputs",
    "typestr",
    "written",
]

#: element types a GPU device takes straight from a client's memory (numpy's ``dtype.str``,
#: which is the interface's ``typestr``)
TYPESTRS = frozenset({"|b1", "|i1", "|u1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8"})


def typestr(dtype: Any) -> str | None:
    """The interface's ``typestr`` of ``dtype`` in little-endian order, None when it is not
    one a GPU device takes directly (:data:`TYPESTRS`)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OUSV" or dtype.names is not None:
        return None
    text = dtype.newbyteorder("<").str if dtype.itemsize > 1 else dtype.str
    return text if text in TYPESTRS else None


class CudaArray:
    """``shape`` elements of ``dtype``, C-contiguous, at ``pointer`` on GPU ``device``: memory
    a client registered (``keep``: what holds it open while the array lives). ``host``: makes
    a host copy (``np.asarray`` of it; counted by its region as the host path); ``taken``:
    called the first time a device reads the interface (its region counts the device path)."""

    __slots__ = ("device", "dtype", "host", "keep", "pointer", "shape", "taken")

    def __init__(
        self,
        pointer: int,
        shape: tuple[int, ...],
        dtype: Any,
        device: int,
        keep: Any = None,
        host: Callable[[], np.ndarray] | None = None,
        taken: Callable[[], None] | None = None,
    ) -> None:
        self.pointer = int(pointer)
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        if typestr(self.dtype) is None:
            raise ValueError(f"{self.dtype} is not an element type a GPU device takes directly")
        self.device = int(device)
        self.keep = keep
        self.host = host
        self.taken = taken

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3: C-contiguous (``strides`` None), writable, no stream to wait for (the
        client finished writing before it sent the request, as Triton's protocol asks)."""
        taken, self.taken = self.taken, None
        if taken is not None:
            taken()
        return {
            "shape": self.shape,
            "typestr": typestr(self.dtype),
            "data": (self.pointer, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.host is None:
            raise TypeError("this CUDA array has no host copy")
        array = self.host().view(self.dtype).reshape(self.shape)
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return (
            f"<CudaArray {self.dtype}{list(self.shape)} at 0x{self.pointer:x} on GPU {self.device}>"
        )


def takes_cuda_inputs(network: Any) -> int | None:
    """The GPU whose memory ``network`` takes inputs from without a host copy (its
    ``CompiledNetwork.cuda_inputs``), or None: every other network gets host arrays."""
    found = network.cuda_inputs()
    return found if isinstance(found, int) and not isinstance(found, bool) else None


@dataclasses.dataclass(frozen=True)
class CudaSink:
    """An output's place in a client's GPU memory: ``byte_size`` bytes at ``pointer`` on GPU
    ``device``; ``wrote(nbytes)`` is called once the copy is complete (the path's count)."""

    pointer: int
    byte_size: int
    device: int
    wrote: Callable[[int], None] = dataclasses.field(repr=False, compare=False)
    keep: Any = dataclasses.field(default=None, repr=False, compare=False)

    def too_small(self, nbytes: int) -> str | None:
        """Why an output of ``nbytes`` does not fit (the host path's words), or None."""
        if nbytes > self.byte_size:
            return (
                f"shared memory byte size {self.byte_size} is too small for the output's "
                f"{nbytes} bytes; give it at least that much"
            )
        return None


class _Written(np.ndarray):
    """An output already written into its client's region: its shape and type, no bytes."""


def written(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """What a device answers for an output it wrote through a :class:`CudaSink`: an array of
    the output's shape and type over one zero element (no memory of its size), marked so the
    server neither writes it again nor reads it as values."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape)).view(_Written)


def is_written(value: Any) -> bool:
    return isinstance(value, _Written)
