"""One memory budget for every request in flight, on every protocol.

Each limit a request meets on its own (``--max-message-bytes``, 1 GiB) bounds one request;
a few connections at once could still take the machine: a 100 MB JSON body raised the
server's peak RSS by 2 GB while it was decoded, four at once by 2.9 GB. So every request is
charged what it will hold *before* it is decoded (a REST body as its bytes arrive, once its
caller is authorized: a charge taken from a header's promise let bodiless sockets hold the
whole budget), against one process-wide
``--max-inflight-bytes``; a request that does not fit is refused at once with
RESOURCE_EXHAUSTED (REST 503) and a message naming the flag, and its charge is released when
its answer has been handed to the transport (or its connection is gone).

What a request is charged (measured here; ``tests/server/test_budget.py``):

* a REST body with JSON tensors: :data:`JSON_FACTOR` x its size. simdjson's tape takes 16
  bytes per number and the array its element size, so a body of small integers ("0,0,...",
  2 bytes a number) peaked at 17-19x its size while it was decoded, short floats ("0.5,") at
  10x, random float32 at 4.6x;
* any other REST body (Triton's binary tensor extension, its JSON header small): 2x (the
  body as read, then joined);
* another REST body (a repository load's JSON, its files in base64): 3x;
* a gRPC message: 2x its size on the wire (grpcio has already received it when the handler
  runs: it is bounded before that by --max-message-bytes only; raw tensors are views of it,
  and each read of a field copies it once), plus what decoding its tensors allocates
  (:func:`decoded_nbytes`: KServe's typed contents, strings), charged before they are decoded.

The default is half of the memory the process may use: the cgroup's limit (v2
``memory.max``, v1 ``memory.limit_in_bytes``) when one is set, else the machine's MemTotal.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.plugins.api import ResourceExhausted
from plugserve.proto import tensors

__all__ = [
    "BINARY_FACTOR",
    "GRPC_FACTOR",
    "JSON_FACTOR",
    "OTHER_FACTOR",
    "Charge",
    "MemoryBudget",
    "body_factor",
    "charged_buffer",
    "charging_strings",
    "decoded_nbytes",
    "default_limit",
    "size_text",
]

JSON_FACTOR = 20
BINARY_FACTOR = 2
OTHER_FACTOR = 3
GRPC_FACTOR = 2
#: a decoded string's cost beyond its characters: the object's header and its array slot
STRING_OBJECT_BYTES = 64
#: what one BYTES element of a REST request holds from its decoding to its answer, beyond the
#: body's own charge: its object and slot, the network's copy, its encoded answer. 4M 2-byte
#: elements through an Identity grew the server 1.4 GB against 48 MB charged; with the answer
#: written into one buffer and no list beside the array (proto/tensors.py), 78 bytes an
#: element (tests/server/test_attacks_bytes.py); charged before they are decoded
#: (:func:`charging_strings`)
STRING_ELEMENT_BYTES = 128

_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)
#: a cgroup v1 "limit" at or above this is no limit (the kernel's page-rounded maximum)
_UNLIMITED = 1 << 60


def _memory_available_to_process() -> int:
    total = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    for path in _CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _UNLIMITED:
            limit = int(text)
            return min(limit, total) if total else limit
    return total or (8 << 30)


def body_factor(path: bytes, binary: bool) -> int:
    """What a REST body is charged per byte: ``path`` is the request's URL, ``binary``
    whether it carries Triton's Inference-Header-Content-Length (binary tensors)."""
    if path.split(b"?", 1)[0].rstrip(b"/").endswith(b"/infer"):
        return BINARY_FACTOR if binary else JSON_FACTOR
    return OTHER_FACTOR


def default_limit() -> int:
    """Half of the memory this process may use (see the module's docstring)."""
    return _memory_available_to_process() // 2


class Charge:
    """What one request holds of the budget; :meth:`release` gives it back (once)."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: MemoryBudget | None, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes

    def release(self) -> int:
        """Give the bytes back; how many (0: given back already, or never counted)."""
        budget, self._budget = self._budget, None
        if budget is None:
            return 0
        with budget._lock:
            budget.used -= self.nbytes
        return self.nbytes


#: The charge of nothing (a request whose bytes its protocol charged already).
_NOTHING = Charge(None, 0)


class MemoryBudget:
    def __init__(self, limit: int) -> None:
        """``limit``: bytes in flight at most (0: no limit, nothing is counted)."""
        self.limit = limit
        self.used = 0
        #: charges refused: a request answered RESOURCE_EXHAUSTED (REST 429 or 503), or a KV
        #: tier's block not kept
        self.refused = 0
        self._lock = threading.Lock()

    def snapshot(self) -> tuple[int, int, int]:
        """``(used, limit, refused)`` now (the metrics' ``plugserve_inflight_bytes*``)."""
        return self.used, self.limit, self.refused

    def free(self) -> int:
        """Bytes not held now (0: no limit): the most one output of a run admitted now may
        hold (``plugins/amplify.py`` refuses more before it is allocated)."""
        if not self.limit:
            return 0
        return max(self.limit - self.used, 1)

    def holder(self) -> Charge:
        """An empty charge to add to step by step (:meth:`charge` ``onto`` it)."""
        return Charge(self if self.limit else None, 0)

    def charge(self, nbytes: int, what: str, onto: Charge | None = None) -> Charge:
        """Take ``nbytes`` for a request (added ``onto`` a charge it already holds), or raise
        ResourceExhausted if they do not fit."""
        if not self.limit or (not nbytes and onto is None):
            return onto if onto is not None else _NOTHING
        with self._lock:
            if self.used + nbytes > self.limit:
                self.refused += 1
            else:
                self.used += nbytes
                if onto is not None and onto._budget is self:
                    onto.nbytes += nbytes
                    return onto
                return Charge(self, nbytes)
        # what the others hold is not said: with tokens they are other tenants, whose requests'
        # sizes it would tell (n x max_tokens read off a 429); the operator reads it on /metrics
        # (plugserve_inflight_bytes)
        raise ResourceExhausted(
            f"{what} would hold about {size_text(nbytes)} while in flight, more than is free "
            f"now of this server's {size_text(self.limit)} for requests in flight "
            "(--max-inflight-bytes / PLUGSERVE_MAX_INFLIGHT_BYTES); retry later, or send "
            "large tensors as binary data (JSON costs 20x its size to decode)"
        )


def charged_buffer(budget: MemoryBudget, nbytes: int, what: str) -> np.ndarray:
    """``nbytes`` bytes of buffer, charged to ``budget`` before they are allocated and given
    back when the last array over them is freed (a shared memory region's input copy)."""
    charge = budget.charge(nbytes, what)
    try:
        buffer = np.empty(nbytes, np.uint8)
    except BaseException:
        charge.release()
        raise
    weakref.finalize(buffer, charge.release)
    return buffer


def charging_strings(
    expect: Callable[..., None], budget: MemoryBudget, onto: Charge
) -> Callable[..., None]:
    """``expect`` (a network's check of an input's type and declared shape, which decoders call
    before they decode its data) that also charges a BYTES input's elements onto ``onto`` at
    :data:`STRING_ELEMENT_BYTES` each, before a Python object is made for any of them."""

    def charged(name: str, dtype: np.dtype, shape: Any = None) -> None:
        expect(name, dtype, shape)
        if np.dtype(dtype).kind == "O" and shape is not None:
            count = math.prod(max(int(d), 0) for d in shape)
            budget.charge(count * STRING_ELEMENT_BYTES, f"input {name!r}'s BYTES elements", onto)

    return charged


def decoded_nbytes(count: int, dtype: np.dtype) -> int:
    """What ``count`` values of ``dtype`` decoded from a message hold beyond it: the array, or
    for strings an object per value (their characters are at most the message's size again,
    which :data:`GRPC_FACTOR` covers). Strings over --max-string-elements count nothing: their
    decoding refuses them before it allocates."""
    if dtype.kind != "O":
        return count * dtype.itemsize
    return count * STRING_OBJECT_BYTES if count <= tensors.MAX_STRING_ELEMENTS else 0


def size_text(nbytes: int) -> str:
    """``nbytes`` for a refusal's message, in the unit that shows it (a budget of a few
    hundred KB said "0 MiB of this server's 0 MiB")."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):,.{0 if nbytes >= 10 << shift else 1}f} {unit}"
    return f"{nbytes:,} bytes"
