"""The one protocol between the server and a Python model's worker process.

A message is a JSON header over a Unix socket (``SOCK_SEQPACKET``: one send is one message)
with at most one file descriptor beside it: a memfd holding the message's tensors, one after
another, each described in the header (name, element type, shape, offset, byte size). Arrays
never travel pickled: the writer fills the memfd, seals it against shrinking and growing
(``F_SEAL_SHRINK | F_SEAL_GROW``) and passes it; the reader maps it only once the seals are
checked, so a peer that misbehaves can never make the reader's mapping fault (SIGBUS), and
arrays are views of that mapping. BYTES tensors use Triton's layout (a 4-byte little-endian
length before each element).

Standard library and numpy only: the worker side may run under a model's own Python.
"""

from __future__ import annotations

import array
import fcntl
import json
import mmap
import os
import socket
import struct
from typing import Any

import numpy as np

__all__ = ["MAX_HEADER", "pack_tensors", "receive", "send", "unpack_tensors"]

#: the largest header a side reads (tensors travel in the memfd, not here)
MAX_HEADER = 1 << 20
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)


def send(sock: socket.socket, header: dict[str, Any], fd: int = -1) -> None:
    data = json.dumps(header).encode()
    if fd >= 0:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    else:
        sock.sendmsg([data])


def receive(sock: socket.socket) -> tuple[dict[str, Any], int]:
    """The next message and its descriptor (-1: none); EOFError when the peer is gone."""
    fds = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(MAX_HEADER, socket.CMSG_SPACE(fds.itemsize * 4))
    if not data and not ancillary:
        raise EOFError("the peer closed its end")
    received: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            received.extend(got)
    for extra in received[1:]:
        os.close(extra)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        if received:
            os.close(received[0])
        raise ValueError("a message over the protocol's size limit")
    return json.loads(data), (received[0] if received else -1)


def _encoded(value: np.ndarray) -> tuple[np.ndarray | bytes, str]:
    if value.dtype == np.dtype(object) or value.dtype.kind in "SU":
        parts = []
        for item in value.reshape(-1):
            raw = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(struct.pack("<I", len(raw)) + raw)
        return b"".join(parts), "BYTES"
    array_ = np.ascontiguousarray(value)
    if array_.dtype.byteorder == ">":
        array_ = array_.astype(array_.dtype.newbyteorder("<"))
    return array_, array_.dtype.str


def pack_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], int]:
    """``tensors`` written into a sealed memfd: their descriptions, and its descriptor (-1 when
    there is nothing to send)."""
    described, pieces, offset = [], [], 0
    for name, value in tensors.items():
        value = np.asarray(value)
        data, kind = _encoded(value)
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        described.append(
            {"name": name, "dtype": kind, "shape": list(value.shape), "offset": offset,
             "nbytes": nbytes}
        )  # fmt: skip
        pieces.append(data)
        offset += (nbytes + 63) // 64 * 64
    if not offset:
        return described, -1
    fd = os.memfd_create("plugserve-tensors", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        os.ftruncate(fd, offset)
        for info, data in zip(described, pieces):
            view = memoryview(data if isinstance(data, bytes) else data.reshape(-1).view(np.uint8))
            done = 0
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], info["offset"] + done)
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return described, fd


def _decode_bytes(data: memoryview, count: int) -> np.ndarray:
    out = np.empty(count, dtype=object)
    offset = 0
    for index in range(count):
        if offset + 4 > len(data):
            raise ValueError(f"BYTES element {index} has no length")
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise ValueError(f"BYTES element {index} runs past its tensor")
        out[index] = bytes(data[offset : offset + length])
        offset += length
    return out


def unpack_tensors(described: list[dict[str, Any]], fd: int) -> dict[str, np.ndarray]:
    """The tensors a peer sent: views of its memfd, mapped once its seals are checked (the
    descriptor is closed here; the mapping lives as long as the arrays)."""
    if not described:
        if fd >= 0:
            os.close(fd)
        return {}
    if fd < 0:
        raise ValueError("tensors described but no memory sent")
    try:
        seals = fcntl.fcntl(fd, _GET_SEALS)
        if seals & _SEALS != _SEALS:
            raise ValueError("the peer's tensor memory is not sealed against shrinking")
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else b""
    finally:
        os.close(fd)
    buffer = memoryview(mapping)
    out: dict[str, np.ndarray] = {}
    for info in described:
        start, nbytes = int(info["offset"]), int(info["nbytes"])
        if start < 0 or nbytes < 0 or start + nbytes > len(buffer):
            raise ValueError(f"tensor {info.get('name')!r} lies outside the memory sent")
        shape = tuple(int(d) for d in info["shape"])
        data = buffer[start : start + nbytes]
        if info["dtype"] == "BYTES":
            out[info["name"]] = _decode_bytes(data, int(np.prod(shape))).reshape(shape)
        else:
            out[info["name"]] = np.frombuffer(data, np.dtype(info["dtype"])).reshape(shape)
    return out
