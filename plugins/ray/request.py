"""RAY's infer request: one remote call to the network's actor per run, never waited for
without a bound.

The run's context crosses with its inputs (``run_context.to_wire``: the request's bounds,
id, parameters, sequence, priority, timeout, tenant, its trace as a W3C ``traceparent``, and
its cancellation as the id the actor registers the run under), and the actor runs its device
under the context rebuilt from it (``run_context.from_wire``).

A run ends at the first of: the actor's answer; the run's token cancelled (its deadline, its
client gone, ``cancel()``), which also tells the actor to stop the run; ``RAY_CALL_TIMEOUT_S``
without an answer (a node cut off answers nothing: UNAVAILABLE); the actor lost (its node
died, or Ray declared it dead: UNAVAILABLE at once). Nothing is polled: the call's future and
the token's callback wake the one wait.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import InferRequest, PerfCount
from plugserve.plugins.run_context import RunContext, to_wire

if TYPE_CHECKING:
    from plugserve.plugins.ray.compiled import RayCompiledNetwork

__all__ = ["RayInferRequest"]

_RUNS = itertools.count()


class RayInferRequest(InferRequest):
    network: RayCompiledNetwork

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        return self._call(arrays, run)

    def _run(self, arrays: list[Any]) -> dict[str, np.ndarray]:
        """A run started with ``start_async``: told nothing but its token."""
        return self._call(arrays, RunContext() if self._token is None else RunContext(self._token))

    def _call(self, arrays: list[Any], told: RunContext) -> dict[str, np.ndarray]:
        """The remote call, its run context sent with it (``run_context.to_wire``: what of
        it is plain values, its cancellation as the id the actor knows the run by)."""
        network = self.network
        run = f"{os.getpid()}-{next(_RUNS)}"
        reference = network.actor.infer.remote(list(arrays), to_wire(told, run))
        answered = threading.Event()
        future = reference.future()
        future.add_done_callback(lambda _f: answered.set())
        token = self._token  # the request's run (InferRequest._checked)
        unhook = token.on_cancel(answered.set) if token is not None else None
        try:
            answered.wait(network.call_timeout)
        finally:
            if unhook is not None:
                unhook()
        if future.done():
            try:
                return future.result()
            except Exception as exc:
                if isinstance(exc, network.plugin.errors.RayActorError):
                    network.revive()  # its node may be back: compiled there again meanwhile
                raise network.plugin.failure(exc, network.where) from None
        if token is not None and token.cancelled:
            network.actor.cancel.remote(run, str(token.error))
            raise token.failure()
        network.actor.cancel.remote(run, "no answer within RAY_CALL_TIMEOUT_S")
        raise network.plugin.unreachable(network.where, network.call_timeout)

    def get_performance_counts(self) -> list[PerfCount]:
        """Per-node times stay on the node (its device's counts); none come back."""
        self._require_perf_counts()
        return []
