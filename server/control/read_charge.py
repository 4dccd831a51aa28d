"""What reading a model holds of the server's memory budget, charged before the read starts.

Reading a model computes values its bytes do not hold (onnx's shape inference and data
propagation, dense sparse initializers, folded constants), each bounded by one read's limit,
``--max-read-bytes`` (``plugins/reading.py``). That limit is charged to ``--max-inflight-bytes``
(``server/plane/budget.py``) before the read starts and given back when it ends, so reads and
requests in flight together stay within the one budget: eight QueryNetworks at once under an
8 GiB budget with the 256 MiB default hold 2 GiB at most. A budget smaller than the limit is
charged whole (one read at a time then).

A model a client sends (QueryNetwork, LoadNetwork) that does not fit is refused at once
(RESOURCE_EXHAUSTED naming the flags: retry later); the repository's own loads (at startup,
a poll, RepositoryModelLoad) wait for room, up to :data:`WAIT_SECONDS`, since several load at
once (``--model-load-threads``) and an operator's model should not fail for that.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from plugserve.plugins import reading
from plugserve.plugins.api import ResourceExhausted
from plugserve.server.plane.budget import MemoryBudget

__all__ = ["read_charge"]

#: how often a waiting read looks for room in the budget
_POLL_SECONDS = 0.02
#: how long a repository's read waits for room (a generative folder's load can take minutes)
WAIT_SECONDS = 300.0


@contextlib.contextmanager
def read_charge(budget: MemoryBudget, what: str, wait: bool = False) -> Iterator[None]:
    """Hold one read's limit of ``budget`` while the block runs (``what``: the read, for the
    refusal's message); ``wait``: wait for room up to :data:`WAIT_SECONDS` first."""
    nbytes = min(reading.limits().max_bytes, budget.limit)
    end = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            charge = budget.charge(nbytes, what)
            break
        except ResourceExhausted:
            if not wait or time.monotonic() > end:
                raise ResourceExhausted(
                    f"{what}: reading a model holds {nbytes >> 20} MiB of this server's memory "
                    "budget while it runs (--max-read-bytes / PLUGSERVE_MAX_READ_BYTES), and "
                    f"requests and reads in flight hold {budget.used >> 20} of its "
                    f"{budget.limit >> 20} MiB (--max-inflight-bytes / "
                    "PLUGSERVE_MAX_INFLIGHT_BYTES); retry later"
                ) from None
            time.sleep(_POLL_SECONDS)
    try:
        yield
    finally:
        charge.release()
