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
import math
import mmap
import operator
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
    "TooLarge",
    "pack_into",
    "pack_tensors",
    "receive",
    "receive_all",
    "send",
    "unpack_tensors",
]

#: the largest header a side reads (tensors travel in the memfd, not here)
MAX_HEADER = 1 << 20
#: a header longer than this travels in a memfd of its own (see :func:`send`)
SPILL_ABOVE = 64 << 10
#: the longest spilled header a side reads (a batch of requests' parameters)
MAX_SPILLED = 64 << 20
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
# plain ints (the socket module's flags are enums, whose ``|`` and ``&`` cost a microsecond)
_DONTWAIT = int(socket.MSG_DONTWAIT)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_RIGHTS = (int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS))
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize * 5)  # (4 and a spilled header)
# headers are small: compact JSON, encoded and decoded without the module functions' wrapping
_encode = json.JSONEncoder(separators=(",", ":")).encode
_decode = json.JSONDecoder().decode


class TooLarge(Exception):
    """A header too large to send (the peer is not at fault: not an OSError nor a
    ValueError, which mean a process gone or a protocol broken)."""


def send(
    sock: socket.socket, header: dict[str, Any], fd: int = -1, *more: int, flags: int = 0
) -> None:
    """``header`` (and the descriptors) as one message; ``flags``: ``MSG_DONTWAIT`` for a
    sender that must not block on a peer that does not read (BlockingIOError then). A header
    over SPILL_ABOVE bytes travels in a memfd, the message saying only ``{"spilled": n}``:
    a message is at most the socket's send buffer (~208 KiB), and a client's 213 KB request
    parameter failed the send, which the server took for its model process's death."""
    data = _encode(header).encode()
    if len(data) > MAX_SPILLED:
        raise TooLarge(f"a message of {len(data):,} bytes; at most {MAX_SPILLED:,} travel")
    if fd < 0 and not more and len(data) <= SPILL_ABOVE:
        sock.sendmsg((data,), (), flags)
        return
    fds = [f for f in (fd, *more) if f >= 0]
    spill = -1
    if len(data) > SPILL_ABOVE:
        spill = _memfd(len(data))
        fds.append(spill)  # the last descriptor (_message takes it off)
    try:
        if spill >= 0:
            os.pwrite(spill, data, 0)
            data = _encode({"spilled": len(data)}).encode()
        ancillary = [(*_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg((data,), ancillary, flags)
    finally:
        if spill >= 0:
            os.close(spill)


def receive(sock: socket.socket) -> tuple[dict[str, Any], int]:
    """The next message and its descriptor (-1: none); EOFError when the peer is gone."""
    header, fds = receive_all(sock, 1)
    return header, (fds[0] if fds else -1)


def receive_all(
    sock: socket.socket, most: int, spin: float = 0.0
) -> tuple[dict[str, Any], list[int]]:
    """The next message and up to ``most`` descriptors (others are closed). ``spin``: seconds
    to poll for it before sleeping in the kernel (a process woken from an idle core answers
    tens of microseconds later; one that polls briefly does not). Each poll yields the core
    (``sched_yield``): on a machine whose cores are all busy, the threads and processes that
    make the next message run instead of the poll. (A poll that reads, not ``poll(2)`` then a
    read: measured faster here, 0.18-0.22 ms against 0.29-0.31 ms a small model's request.)"""
    if spin > 0:
        end = time.perf_counter() + spin
        while time.perf_counter() < end:
            try:
                data, ancillary, flags, _ = sock.recvmsg(MAX_HEADER, _FD_SPACE, _DONTWAIT)
                return _message(data, ancillary, flags, most)
            except BlockingIOError:
                os.sched_yield()
    data, ancillary, flags, _ = sock.recvmsg(MAX_HEADER, _FD_SPACE)
    return _message(data, ancillary, flags, most)


def _message(
    data: bytes, ancillary: list[Any], flags: int, most: int
) -> tuple[dict[str, Any], list[int]]:
    if not data and not ancillary:
        raise EOFError("the peer closed its end")
    received: list[int] = []
    for level, kind, payload in ancillary:
        if (level, kind) == _RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            received.extend(got)
    try:
        if flags & _TRUNCATED:
            raise ValueError("a message over the protocol's size limit")
        header = _decode(data.decode())
        if not isinstance(header, dict):
            raise ValueError("a message that is not a JSON object")
        if len(header) == 1 and "spilled" in header:  # the header is in the last descriptor
            if not received:
                raise ValueError("a spilled header without its memory")
            spill = received.pop()
            try:
                header = _spilled(spill, header["spilled"])
            finally:
                os.close(spill)
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    if len(received) > most:
        for extra in received[most:]:
            os.close(extra)
        del received[most:]
    return header, received


def _spilled(fd: int, size: Any) -> dict[str, Any]:
    """The header a peer spilled into ``fd`` (:func:`send`), read once, at most MAX_SPILLED."""
    if type(size) is not int or not 0 < size <= MAX_SPILLED or os.fstat(fd).st_size < size:
        raise ValueError(f"a spilled header of {str(size)[:20]} bytes; at most {MAX_SPILLED}")
    data = os.pread(fd, size, 0)
    header = _decode(data.decode())
    if not isinstance(header, dict):
        raise ValueError("a message that is not a JSON object")
    return header


def _encoded(value: np.ndarray) -> tuple[np.ndarray | bytes, str]:
    kind = value.dtype.kind
    if kind == "O" or kind in "SU":
        parts = []
        for item in value.reshape(-1):
            raw = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(struct.pack("<I", len(raw)) + raw)
        return b"".join(parts), "BYTES"
    if not value.flags.c_contiguous:
        value = np.ascontiguousarray(value)
    if value.dtype.byteorder == ">":
        value = value.astype(value.dtype.newbyteorder("<"))
    return value, value.dtype.str


def _layout(tensors: dict[str, np.ndarray]) -> tuple[list[list[Any]], list[Any], int]:
    """Each tensor's description, ``[name, element type, shape, offset, bytes]`` (offsets
    64-byte aligned; lists, not objects: the header is smaller and faster to read and
    write), its bytes, and the total."""
    described, pieces, offset = [], [], 0
    for name, value in tensors.items():
        if type(value) is not np.ndarray:
            value = np.asarray(value)
        data, kind = _encoded(value)
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        described.append([name, kind, value.shape, offset, nbytes])
        pieces.append(data)
        offset += (nbytes + 63) & ~63
    return described, pieces, offset


def _flat(data: Any) -> memoryview:
    return memoryview(data if isinstance(data, bytes) else data.reshape(-1).view(np.uint8))


def pack_tensors(tensors: dict[str, np.ndarray]) -> tuple[list[list[Any]], int]:
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
                done += os.pwritev(fd, [view[done:]], info[3] + done)
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return described, fd


def pack_into(header: dict[str, Any], tensors: dict[str, np.ndarray], arena: Arena | None) -> int:
    """``tensors`` described in ``header["tensors"]``: written into ``arena`` when they fit
    there (``header["arena"]`` says so), else into a sealed memfd of their own, whose
    descriptor is returned for the caller to send beside the header and close (-1: none)."""
    described = arena.pack(tensors) if arena is not None else None
    fd = -1
    if described is None:
        described, fd = pack_tensors(tensors)
        header.pop("arena", None)
    else:
        header["arena"] = True
    header["tensors"] = described
    return fd


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

    def pack(self, tensors: dict[str, np.ndarray]) -> list[list[Any]] | None:
        """``tensors`` written into the arena, or None when they do not fit."""
        described, pieces, size = _layout(tensors)
        if size > self.size:
            return None
        view = self.view
        for info, data in zip(described, pieces):
            start, nbytes = info[3], info[4]
            view[start : start + nbytes] = _flat(data)
        return described

    def unpack(self, described: list[list[Any]], copy: bool) -> dict[str, np.ndarray]:
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


#: a memfd of at most this many bytes is copied out and unmapped at once
COPY_BELOW = 1 << 20


def unpack_tensors(described: list[list[Any]], fd: int) -> dict[str, np.ndarray]:
    """The tensors a peer sent in a memfd of their own, mapped once its seals are checked (the
    descriptor is closed here). Up to COPY_BELOW bytes they are copied out and the mapping
    closed; larger, they are views of the mapping, which lives as long as they do and holds a
    descriptor meanwhile (Python's mmap keeps a duplicate of it): a decoupled model's small
    responses, each in a memfd of its own while its client read none, held one each, and four
    unread streams reached the server's limit of open files."""
    if not described:
        if fd >= 0:
            os.close(fd)
        return {}
    if fd < 0:
        raise ValueError("tensors described but no memory sent")
    try:
        size = os.fstat(fd).st_size
        mapping: Any = _sealed_map(fd, writable=False) if size else b""
    finally:
        os.close(fd)
    if size and size <= COPY_BELOW:
        with mapping:
            mapping = mapping[:]  # (bytes: the mapping and its descriptor closed here)
    return _read(memoryview(mapping), described)


#: the element types a peer may name, by their numpy string (a plain number each)
_DTYPES = {
    np.dtype(t).str: np.dtype(t)
    for t in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16")
}
_DTYPES.update({d.newbyteorder(">").str: d.newbyteorder(">") for d in list(_DTYPES.values())})


def _read(buffer: memoryview, described: Any) -> dict[str, np.ndarray]:
    """The tensors ``described`` lists, as views of ``buffer``; ValueError for a description
    that is malformed or lies outside it (the peer's header is checked, never trusted)."""
    out: dict[str, np.ndarray] = {}
    if not isinstance(described, list):
        raise ValueError("the tensors' descriptions are not a list")
    size = len(buffer)
    for info in described:
        try:
            name, kind, shape, start, nbytes = info
            if type(start) is not int or type(nbytes) is not int or not isinstance(name, str):
                raise TypeError
            shape = tuple(map(operator.index, shape))
        except (TypeError, ValueError):
            raise ValueError(f"a malformed tensor description: {str(info)[:200]}") from None
        if start < 0 or nbytes < 0 or start + nbytes > size or min(shape, default=0) < 0:
            raise ValueError(f"tensor {name!r} lies outside the memory sent")
        count = math.prod(shape)
        if kind == "BYTES":
            if count > nbytes // 4:  # each element has its 4-byte length: never allocated
                raise ValueError(f"tensor {name!r}: {count} BYTES elements in {nbytes} bytes")
            out[name] = _decode_bytes(buffer[start : start + nbytes], count).reshape(shape)
            continue
        dtype = _DTYPES.get(kind)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: element type {str(kind)[:40]!r} is not a number")
        if count * dtype.itemsize != nbytes:
            raise ValueError(f"tensor {name!r}: {nbytes} bytes for shape {list(shape)}")
        out[name] = np.ndarray(shape, dtype, buffer, start)
    return out


class Mailbox:
    """One end of the socket, shared by the threads of a side: each waits for the messages
    meant for it (a key: ``route(header)``), and whichever waits reads the socket for all
    (leader and followers: a side runs no reader thread of its own, so the common case, one
    thread waiting for the answer to what it sent, reads that answer itself and returns it,
    with no hand-off between threads and no other thread woken). A message ``route`` gives
    no key is handled at once by ``handle``, on the reading thread (it must not block). Sends
    are serialized by a lock: any thread sends.

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
        self._waiting = 0  # threads asleep on the condition (none: nobody to notify)
        self.closed: str = ""  # why the mailbox is closed ("": open)
        #: what reading the socket failed with, when that closed it (ConnectionResetError: the
        #: peer closed with messages of ours unread)
        self.failure: BaseException | None = None

    def send(self, header: dict[str, Any], *fds: int, block: bool = True) -> None:
        with self._send_lock:
            send(self.sock, header, *fds, flags=0 if block else _DONTWAIT)

    def send_tensors(
        self,
        header: dict[str, Any],
        tensors: dict[str, np.ndarray],
        arena: Arena | None = None,
        block: bool = True,
    ) -> None:
        """``header`` with ``tensors`` beside it (:func:`pack_into`)."""
        fd = pack_into(header, tensors, arena)
        try:
            self.send(header, fd, block=block)
        finally:
            if fd >= 0:
                os.close(fd)

    def wait(self, key: Hashable, spin: float = 0.0) -> tuple[dict[str, Any], list[int]]:
        """The next message for ``key`` (reading the socket while nobody else does; ``spin``:
        seconds the reader polls for a message before it sleeps, :func:`receive_all`)."""
        cond = self._cond
        while True:
            with cond:
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
                    self._waiting += 1
                    try:
                        cond.wait()
                    finally:
                        self._waiting -= 1
            message = self._read_one(spin, key=key)
            if type(message) is tuple:
                return message

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

    def _read_one(
        self, spin: float, block: bool = True, key: Hashable = None
    ) -> tuple[dict[str, Any], list[int]] | bool:
        """Read one message and deliver it (the caller holds the reading role, which this
        gives back): the message itself when it is for ``key`` (the caller's own), else True
        once it is delivered; False when the socket failed, or nothing waited (``block``
        off)."""
        try:
            if block:
                header, fds = receive_all(self.sock, self.most_fds, spin)
            else:
                try:
                    header, fds = _receive_now(self.sock, self.most_fds)
                except BlockingIOError:
                    self._give_back()
                    return False
        except (EOFError, OSError, ValueError) as exc:
            self.failure = exc
            self.close(str(exc) or type(exc).__name__)
            return False
        try:
            route = self.route(header)
        except Exception:
            route = None
        if route is None:
            try:
                if self.handle is not None:
                    self.handle(header, fds)
            finally:
                self._give_back()
            return True
        if route == key and key is not None:  # the reader's own: no box, no hand-off
            self._give_back()
            return header, fds
        with self._cond:
            self._boxes.setdefault(route, deque()).append((header, fds))
            self._reading = False
            if self._waiting:
                self._cond.notify_all()
        return True

    def _give_back(self) -> None:
        """Give up the reading role (a waiting thread takes it)."""
        with self._cond:
            self._reading = False
            if self._waiting:
                self._cond.notify_all()

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
    data, ancillary, flags, _ = sock.recvmsg(MAX_HEADER, _FD_SPACE, _DONTWAIT)
    return _message(data, ancillary, flags, most)
