"""One at a time per tenant: work a client may ask of the server's own CPU, taken in turns.

QueryNetwork is open to every ``infer`` client, and answering it reads, checks and transforms
the client's model in the server (NUMPY, ORT, TORCH; OPENVINO's in a helper): ~0.1 ms of CPU a
node here, up to --max-model-nodes (250,000: ~20-40 s). Each query holds a gRPC handler thread and
the GIL between its steps, so one client sending many at once took as many threads and most of
the CPU. A tenant's queries now run one after another: up to :data:`WAITING` more wait their
turn (as long as their callers stay; each query before them stops at --max-read-seconds:
``cancel.stop_when``), and one more is refused at once with RESOURCE_EXHAUSTED. Tenants are
tokens (``auth``); without tokens the whole server is one, as a caller not known is bounded
tighter.

Every call held here, running or waiting, holds a gRPC handler thread (waiting as
``callpool.blocked``: no CPU, but the thread). A token file of many tenants could so hold every
one of --grpc-workers, and inference calls would queue behind them: the server as a whole
holds at most ``most`` (a quarter of --grpc-workers, as many as the call gate lets wait for
their message), past which a query is refused at once whoever sends it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from plugserve.plugins.api import Cancelled, ResourceExhausted
from plugserve.server.plane.callpool import blocked

__all__ = ["WAITING", "Turns"]

#: a tenant's calls that may wait for the one running; more are refused at once
WAITING = 4
#: how often a waiting caller looks whether it is gone
_LOOK = 0.25


class Turns:
    """Per tenant (the token file's: few), how many hold or wait for its one turn."""

    def __init__(self, what: str, most: int = 0, why: str = "") -> None:
        """``what``: the work taken in turns, as refusals name it; ``most``: calls held at
        once, all tenants together (0: no bound but each tenant's); ``why``: where that bound
        comes from, as its refusal says (the caller sets it, so the caller describes it)."""
        self.what = what
        self.most = most
        self.why = why
        self._ready = threading.Condition()
        self._counts: dict[str, int] = {}  # tenant -> its calls running or waiting
        self._held = 0  # all tenants' calls running or waiting
        self._running: set[str] = set()

    @contextlib.contextmanager
    def turn(self, tenant: str, gone: Callable[[], bool] | None = None) -> Iterator[None]:
        """Wait for ``tenant``'s turn (a caller found ``gone`` stops waiting), then hold it
        for the block."""
        with self._ready:
            count = self._counts.get(tenant, 0)
            if count > WAITING:
                raise ResourceExhausted(
                    f"{self.what}: this caller has one running and {WAITING} waiting; they "
                    "run one at a time per token (per server without tokens): retry when "
                    "one has ended"
                )
            if self.most and self._held >= self.most:
                raise ResourceExhausted(
                    f"{self.what}: {self._held} are running or waiting on this server, the "
                    f"most it holds at once{self.why}: retry when one has ended"
                )
            self._counts[tenant] = count + 1
            self._held += 1
        try:
            with blocked(), self._ready:  # a wait, not work: the pool may run another call
                while tenant in self._running:
                    self._ready.wait(_LOOK)
                    if tenant in self._running and gone is not None and gone():
                        raise Cancelled(f"{self.what}: its caller left while it waited its turn")
                self._running.add(tenant)
            try:
                yield
            finally:
                with self._ready:
                    self._running.discard(tenant)
                    self._ready.notify_all()
        finally:
            with self._ready:
                self._held -= 1
                left = self._counts[tenant] - 1
                if left:
                    self._counts[tenant] = left
                else:
                    del self._counts[tenant]
