"""A network's queue shared fairly among tenants (``--auth-tokens``: a token is a tenant).

A network's requests wait in one queue of ``queue_limit`` places, served in order of each
request's place. Without tokens every request is one tenant's and the queue is first come,
first served. With tokens, a red team's tenant ran 80 looping clients at a one-stream model:
another tenant's requests got 16 of 17 answers "queue full" (503), and the one admitted waited
8.2 s behind the 64 queued (alone: 2 ms). So, for a token's tenant:

- its requests hold at most its share of the places (``shares.py``: seven eighths alone, less
  as more tenants wait, so that one more always finds a place): past it a tenant's request is
  refused at once, RESOURCE_EXHAUSTED / 503, naming its own count and not the others';
- and a network without a queue policy serves the waiting requests by start-time fair queuing,
  as the generation engine's scheduler does: each request is tagged one past the later of the
  queue's clock (the tag of the request whose run started last) and its tenant's last tag,
  and is placed by its tag. One tenant's requests keep their order, and a tenant with 56
  waiting delays another's next request by about one request a tenant, not by the 56.

A network with a queue policy (Triton's priority levels, its DELAY and REJECT) keeps the
places its policy gives (``queue_policy.py``); the share applies to it too.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from plugserve.plugins.api import QueueFull
from plugserve.plugins.streams import StreamsExecutor
from plugserve.server.plane import shares

__all__ = ["TenantQueue"]


class TenantQueue:
    """One network's waiting requests by tenant: their share of ``limit`` places, and their
    fair places (see the module's docstring)."""

    def __init__(self, name: str, limit: int) -> None:
        self.name = name
        #: the places the network's requests may hold at once (--queue-size)
        self.limit = limit
        self._lock = threading.Lock()
        self._waiting: Counter[str] = Counter()
        self._last: dict[str, int] = {}
        self._clock = 0

    def submit(
        self,
        executor: StreamsExecutor,
        fn: Callable[[Any], Any],
        tenant: str,
        token: Any,
        place: int | None,
    ) -> Future:
        """``executor.submit`` of ``fn`` for a request of ``tenant``, within the network's
        queue limit and, for a token's tenant, its share; at ``place`` (a queue policy's), or
        None: its fair place."""
        if not tenant:  # without tokens (or the server's own call): first come, first served
            return executor.submit(fn, self.limit, token=token, place=place or 0)
        tenant = shares.key(tenant)  # (unattributed BLS calls: one tenant here)
        tag = self.enter(tenant)
        held = [tag]

        def left(started: bool = False) -> None:  # once: its run starts, or it is answered
            try:  # without one (cancelled, past its deadline, rejected)
                mine = held.pop()  # (atomic: the run's thread and the callback's race)
            except IndexError:
                return
            self.leave(tenant, mine, started)

        def run(state: Any) -> Any:
            left(started=True)
            return fn(state)

        try:
            future = executor.submit(
                run, self.limit, token=token, place=tag if place is None else place
            )
        except BaseException:
            left()
            raise
        future.add_done_callback(lambda _: left())
        return future

    def enter(self, tenant: str) -> int:
        """One more waiting request of ``tenant`` (a token's; "" is not counted here): its
        fair place, or QueueFull past the tenant's share."""
        with self._lock:
            waiting = self._waiting[tenant]
            if not shares.may_take(self._waiting, tenant, self.limit):
                raise QueueFull(
                    f"Exceeds maximum queue size: network '{self.name}': this tenant's "
                    f"{waiting} requests waiting hold its share of the queue; retry later"
                )
            last = self._last.get(tenant, 0) if waiting else 0
            tag = max(self._clock, last) + 1
            self._last[tenant] = tag
            self._waiting[tenant] = waiting + 1
            return tag

    def leave(self, tenant: str, tag: int, started: bool = True) -> None:
        """A request that :meth:`enter` placed at ``tag`` left the queue: its run ``started``
        (the clock moves on to it), or it was answered without one. Only a run moves the
        clock: a red team's tenant queued 12 and one more with a short deadline, whose expiry
        moved the clock past all 12, so the next tenant's request waited behind them."""
        with self._lock:
            if started:
                self._clock = max(self._clock, tag)
            left = self._waiting.pop(tenant, 0) - 1
            if left > 0:
                self._waiting[tenant] = left
            else:  # (tenants come and go: nothing is kept of one with nothing waiting)
                self._last.pop(tenant, None)
