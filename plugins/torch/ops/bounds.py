"""Index bounds for the converters that index with client data (Gather, GatherElements,
GatherND, ScatterND, ScatterElements): an index out of range is the request's error
(INVALID_ARGUMENT naming the node), never the device's.

Why: on CUDA, torch's indexing kernels check their indices with a device-side assert
(``indexSelectSmallIndex: Assertion srcIndex < srcSelectDimSize``). A device-side assert is a
sticky error: the process's CUDA context is unusable afterwards (plugins/torch/devmem.py), so
one request with a token id past the vocabulary would take the whole GPU down. On the CPU torch
raises IndexError, which is harmless but says nothing of the node.

How, without a host synchronisation (a step must stay capturable as a CUDA graph,
plugins/torch/graphs.py):

* on the CPU the check is on the host: an index out of range raises :class:`InvalidArgument`
  at once (reading a CPU tensor costs no synchronisation); so on CUDA outside a request (no
  flag set: the host read synchronises, which is correct if slow);
* on CUDA the out-of-range indices are replaced by 0 (the kernel then reads in range) and the
  node's code is raised into the running request's :class:`BoundsFlag`, a one-element device
  tensor, with device ops only. The request reads the flag after the stream synchronisation
  it makes anyway (8 bytes back) and refuses itself, naming the node, when it is set; the
  outputs computed with the replaced indices are dropped. A graph captured with the flag
  replays writing into the same flag (each request owns its flag and its lane's graphs).
* An axis of length 0 indexed at all is refused on the host (its length is a shape: no sync).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from plugserve.plugins.api import InvalidArgument

__all__ = ["CHECKED_OPS", "BoundsFlag", "active", "checker", "describe", "refused"]

#: the ops whose converters check their indices here
CHECKED_OPS = frozenset({"Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements",
                         "Scatter"})  # fmt: skip

#: the device types whose checks raise the request's flag instead of reading on the host
#: (tests add "cpu" to run the CUDA path's logic on the CPU)
FLAGGED = frozenset({"cuda"})

_current: contextvars.ContextVar[BoundsFlag | None] = contextvars.ContextVar(
    "plugserve_torch_bounds", default=None
)
_lock = threading.Lock()
#: node descriptions by code (1, 2, ...); one code per description, so reloads reuse them
_codes: dict[str, int] = {}
_names: dict[int, str] = {}


def _code(what: str) -> int:
    with _lock:
        code = _codes.get(what)
        if code is None:
            code = _codes[what] = len(_codes) + 1
            _names[code] = what
        return code


def describe(code: int) -> str:
    """The node a flag's code names."""
    return _names.get(int(code), f"an indexing node (code {code})")


def refused(what: str) -> InvalidArgument:
    return InvalidArgument(
        f"{what}: an index is out of range of the axis it indexes; the request was refused"
    )


class BoundsFlag:
    """One request's flag on its CUDA device: 0, or the code of a node that met an index out
    of range (the largest such code)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.value = torch.zeros((), dtype=torch.int64, device=device)
        if device.type == "cuda":  # zeroed on this thread's stream: done before a lane's reads
            torch.cuda.current_stream(device).synchronize()

    def raise_code(self, bad: Any, code: int) -> None:
        """Device ops only: ``value = max(value, code if any(bad) else 0)``."""
        hit = bad.any().to(self.value.dtype) * code
        self.value.copy_(self.torch.maximum(self.value, hit))

    def take(self, stream: Any = None) -> str | None:
        """After the request's work is synchronised: the node that met an index out of range
        (the flag cleared for the next request), None when none did. On ``stream`` (the
        lane's), so that the clearing is ordered before the next request's work there."""
        torch = self.torch
        on = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with on:
            code = int(self.value.item())
            if code:
                self.value.zero_()
        return describe(code) if code else None


@contextlib.contextmanager
def active(flag: BoundsFlag | None) -> Iterator[None]:
    """``flag`` is the running request's while the block runs (steps run, and graphs are
    captured, in the request's thread)."""
    token = _current.set(flag)
    try:
        yield
    finally:
        _current.reset(token)


def checker(ctx: Any) -> Any:
    """The node's check, ``check(indices, bound) -> indices``: ``indices`` int64; ``bound`` the
    axis length (an int: the caller has wrapped the negative indices), or a tuple of lengths,
    one per position of the last dimension (GatherND's and ScatterND's index tuples, whose
    negatives are wrapped here, each by its axis). Returns indices safe to index with. Only
    device ops on device tensors, with host ints."""
    what = f"model {ctx.graph.name!r}: node {ctx.node.name!r} ({ctx.node.op_type})"
    code = _code(what)

    def check(indices: Any, bound: int | tuple[int, ...]) -> Any:
        if not indices.numel():
            return indices
        if isinstance(bound, tuple):  # index tuples: their negatives are wrapped here
            if 0 in bound:
                raise refused(what)
            columns, bad = [], None
            for j, length in enumerate(bound):
                column = indices[..., j]
                column = column + (column < 0).to(column.dtype) * int(length)
                out = (column < 0) | (column >= int(length))
                columns.append(column)
                bad = out if bad is None else bad | out
            indices = ctx.torch.stack(columns, -1)
            bad = bad.unsqueeze(-1).expand_as(indices)
        else:
            if bound == 0:
                raise refused(what)
            bad = (indices < 0) | (indices >= int(bound))
        flag = _current.get() if indices.device.type in FLAGGED else None
        if flag is None:  # the CPU; or CUDA outside a request (a host read: it synchronises)
            if bool(bad.any()):
                raise refused(what)
            return indices
        flag.raise_code(bad, code)
        return indices.masked_fill(bad, 0)

    return check
