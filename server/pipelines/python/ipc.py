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
import contextlib
import fcntl
import json
import mmap
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

__all__ = [
    "MAX_HEADER",
    "Arena",
    "Mailbox",
    "pack_tensors",
    "receive",
    "receive_all",
    "send",
    "unpack_tensors",
]

#: the largest header a side reads (tensors travel in the memfd, not here)
MAX_HEADER = 1 << 20
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)


def send(
    sock: socket.socket, header: dict[str, Any], fd: int = -1, *more: int, flags: int = 0
) -> None:
    """``header`` (and the descriptors) as one message; ``flags``: ``MSG_DONTWAIT`` for a
    sender that must not block on a peer that does not read (BlockingIOError then)."""
    data = json.dumps(header).encode()
    fds = [f for f in (fd, *more) if f >= 0]
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sock.sendmsg([data], ancillary, flags)
    else:
        sock.sendmsg([data], [], flags)


def receive(sock: socket.socket) -> tuple[dict[str, Any], int]:
    """The next message and its descriptor (-1: none); EOFError when the peer is gone."""
    header, fds = receive_all(sock, 1)
    return header, (fds[0] if fds else -1)


def receive_all(
    sock: socket.socket, most: int, spin: float = 0.0
) -> tuple[dict[str, Any], list[int]]:
    """The next message and up to ``most`` descriptors (others are closed). ``spin``: seconds
    to poll for it before sleeping in the kernel (a process woken from an idle core answers
    tens of microseconds later; one that polls briefly after each answer does not). Each poll
    yields the core (``sched_yield``): on a machine whose cores are all busy (an instance per
    core), the server's threads that make the next request run instead of the poll."""
    fds = array.array("i")
    space = socket.CMSG_SPACE(fds.itemsize * 4)
    received = None
    if spin > 0:
        end = time.perf_counter() + spin
        while received is None and time.perf_counter() < end:
            with contextlib.suppress(BlockingIOError):
                received = sock.recvmsg(MAX_HEADER, space, socket.MSG_DONTWAIT)
            if received is None:
                os.sched_yield()
    data, ancillary, flags, _ = received or sock.recvmsg(MAX_HEADER, space)
    return _message(data, ancillary, flags, most)


def _message(
    data: bytes, ancillary: list[Any], flags: int, most: int
) -> tuple[dict[str, Any], list[int]]:
    if not data and not ancillary:
        raise EOFError("the peer closed its end")
    received: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            received.extend(got)
    for extra in received[most:]:
        os.close(extra)
    received = received[:most]
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in received:
            os.close(fd)
        raise ValueError("a message over the protocol's size limit")
    return json.loads(data), received


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


def _layout(tensors: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], list[Any], int]:
    """Each tensor's description (its offset 64-byte aligned), its bytes, and the total."""
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
    return described, pieces, offset


def _flat(data: Any) -> memoryview:
    return memoryview(data if isinstance(data, bytes) else data.reshape(-1).view(np.uint8))


def pack_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[dict[str, Any]], int]:
    """``tensors`` written into a sealed memfd of their own: their descriptions, and its
    descriptor (-1 when there is nothing to send). For what does not fit an :class:`Arena`."""
    described, pieces, size = _layout(tensors)
    if not size:
        return described, -1
    fd = _memfd(size)
    try:
        for info, data in zip(described, pieces):
            view = _flat(data)
            done = 0
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], info["offset"] + done)
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return described, fd


def _memfd(size: int) -> int:
    fd = os.memfd_create("plugserve-tensors", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sealed_map(fd: int, writable: bool) -> mmap.mmap:
    """``fd`` mapped, once its seals forbid shrinking and growing (a mapping of memory that
    cannot shrink never faults)."""
    seals = fcntl.fcntl(fd, _GET_SEALS)
    if seals & _SEALS != _SEALS:
        raise ValueError("the peer's tensor memory is not sealed against shrinking")
    size = os.fstat(fd).st_size
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, size, mmap.MAP_SHARED, prot)


class Arena:
    """A fixed-size memfd both sides map once (the server makes and seals it, and hands its
    descriptor over when the worker starts): one message's tensors at a time go through it
    with one copy in and no system call, where a memfd per message costs a few of them.
    Tensors too large for it travel in a memfd of their own (:func:`pack_tensors`). The
    reader of an arena uses its tensors before the next message overwrites them (the server
    copies a response's outputs out; a worker's inputs are valid during its ``execute``)."""

    def __init__(self, size: int = 0, fd: int = -1, writable: bool = True) -> None:
        own = fd < 0
        if own:
            fd = _memfd(size)
            fcntl.fcntl(fd, _ADD_SEALS, _SEALS)
        try:
            self.mapping = _sealed_map(fd, writable)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd  # kept open by its maker, to hand over; closed by a peer at once
        if not own:
            os.close(fd)
            self.fd = -1
        self.size = len(self.mapping)
        self.view = memoryview(self.mapping)

    def pack(self, tensors: dict[str, np.ndarray]) -> list[dict[str, Any]] | None:
        """``tensors`` written into the arena, or None when they do not fit."""
        described, pieces, size = _layout(tensors)
        if size > self.size:
            return None
        for info, data in zip(described, pieces):
            flat = _flat(data)
            start = info["offset"]
            self.view[start : start + len(flat)] = flat
        return described

    def unpack(self, described: list[dict[str, Any]], copy: bool) -> dict[str, np.ndarray]:
        out = _read(self.view, described)
        return {k: v.copy() for k, v in out.items()} if copy else out

    def close(self) -> None:
        self.view.release()
        self.mapping.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
    """The tensors a peer sent in a memfd of their own: views of it, mapped once its seals are
    checked (the descriptor is closed here; the mapping lives as long as the arrays)."""
    if not described:
        if fd >= 0:
            os.close(fd)
        return {}
    if fd < 0:
        raise ValueError("tensors described but no memory sent")
    try:
        mapping = _sealed_map(fd, writable=False) if os.fstat(fd).st_size else b""
    finally:
        os.close(fd)
    return _read(memoryview(mapping), described)


def _read(buffer: memoryview, described: list[dict[str, Any]]) -> dict[str, np.ndarray]:
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


class Mailbox:
    """One end of the socket, shared by the threads of a side: each waits for the messages
    meant for it (a key: ``route(header)``), and whichever waits reads the socket for all
    (leader and followers: a side runs no reader thread of its own, so the common case, one
    thread waiting for the answer to what it sent, reads that answer itself with no hand-off
    between threads). A message ``route`` gives no key is handled at once by ``handle``, on
    the reading thread (it must not block). Sends are serialized by a lock: any thread sends.

    When the peer is gone (or a read fails), every waiter raises EOFError."""

    def __init__(
        self,
        sock: socket.socket,
        route: Callable[[dict[str, Any]], Hashable | None],
        handle: Callable[[dict[str, Any], list[int]], None] | None = None,
        most_fds: int = 2,
    ) -> None:
        self.sock = sock
        self.route, self.handle, self.most_fds = route, handle, most_fds
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._boxes: dict[Hashable, deque[tuple[dict[str, Any], list[int]]]] = {}
        self._reading = False
        self.closed: str = ""  # why the mailbox is closed ("": open)

    def send(self, header: dict[str, Any], *fds: int, block: bool = True) -> None:
        with self._send_lock:
            send(self.sock, header, *fds, flags=0 if block else socket.MSG_DONTWAIT)

    def wait(self, key: Hashable, spin: float = 0.0) -> tuple[dict[str, Any], list[int]]:
        """The next message for ``key`` (reading the socket while nobody else does)."""
        while True:
            with self._cond:
                while True:
                    box = self._boxes.get(key)
                    if box:
                        message = box.popleft()
                        if not box:
                            del self._boxes[key]
                        return message
                    if self.closed:
                        raise EOFError(self.closed)
                    if not self._reading:
                        self._reading = True
                        break
                    self._cond.wait()
            self._read_one(spin)

    def poll(self) -> None:
        """Read what has arrived, without blocking, when nobody else is reading (a thread
        that only sends, or a model asking ``is_cancelled()``, sees notices this way)."""
        while True:
            with self._cond:
                if self._reading or self.closed:
                    return
                self._reading = True
            if not self._read_one(0.0, block=False):
                return

    def _read_one(self, spin: float, block: bool = True) -> bool:
        """Read one message and deliver it (the caller holds the reading role, which this
        gives back); False when ``block`` is off and nothing waited."""
        try:
            if block:
                header, fds = receive_all(self.sock, self.most_fds, spin)
            else:
                try:
                    header, fds = _receive_now(self.sock, self.most_fds)
                except BlockingIOError:
                    with self._cond:
                        self._reading = False
                        self._cond.notify_all()
                    return False
        except (EOFError, OSError, ValueError) as exc:
            self.close(str(exc) or type(exc).__name__)
            return False
        key = self.route(header)
        if key is None:
            try:
                if self.handle is not None:
                    self.handle(header, fds)
            finally:
                with self._cond:
                    self._reading = False
                    self._cond.notify_all()
            return True
        with self._cond:
            self._boxes.setdefault(key, deque()).append((header, fds))
            self._reading = False
            self._cond.notify_all()
        return True

    def discard(self, key: Hashable) -> None:
        """Drop what waits for ``key`` (closing its descriptors): nobody will take it."""
        with self._cond:
            box = self._boxes.pop(key, None)
        for _, fds in box or ():
            for fd in fds:
                os.close(fd)

    def close(self, why: str = "closed") -> None:
        with self._cond:
            if not self.closed:
                self.closed = why or "closed"
            self._reading = False
            self._cond.notify_all()


def _receive_now(sock: socket.socket, most: int) -> tuple[dict[str, Any], list[int]]:
    """:func:`receive_all` that raises BlockingIOError when no message waits."""
    fds = array.array("i")
    space = socket.CMSG_SPACE(fds.itemsize * 4)
    data, ancillary, flags, _ = sock.recvmsg(MAX_HEADER, space, socket.MSG_DONTWAIT)
    return _message(data, ancillary, flags, most)
