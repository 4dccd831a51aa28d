"""MULTI's and AUTO's infer requests.

A MULTI request takes a request on a device with room (see
:meth:`MultiCompiledNetwork.acquire`), runs there and gives it back. With RUNTIME_FALLBACK a
request that fails is run again on the next device in priority order (each device once).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import (
    Callback,
    Cancelled,
    DeadlineExceeded,
    InferenceError,
    InferRequest,
    InvalidInput,
    PerfCount,
    PlugserveError,
    VariableState,
)
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.tracing import child

if TYPE_CHECKING:
    from plugserve.plugins.multi.compiled import AutoCompiledNetwork, MultiCompiledNetwork

__all__ = ["AutoInferRequest", "MultiInferRequest"]

log = logging.getLogger(__name__)

_NO_RETRY = (InvalidInput, Cancelled, DeadlineExceeded)


class MultiInferRequest(InferRequest):
    network: MultiCompiledNetwork

    def __init__(self, network: MultiCompiledNetwork) -> None:
        super().__init__(network)
        self._perf = bool(network.config.get("PERF_COUNT"))
        self._counts: list[PerfCount] = []
        self.last_device = ""

    def _run_on(
        self, pool: Any, request: InferRequest, arrays: list[Any], run: RunContext | None
    ) -> dict[str, Any]:
        """On one device: the values checked here against the same specs go as they are,
        under the request's context as it was handed here (``run``); traced, with a span of
        the device's run as its trace."""
        self.last_device = pool.device
        piece = (
            None
            if run is None
            else child(run.trace, pool.device, {"plugserve.device": pool.device})
        )
        try:
            told = run if piece is None else dataclasses.replace(run, trace=piece)
            outputs = request.infer_checked(arrays, told)
            if self._perf:
                try:
                    self._counts = [
                        _on_device(c, pool.device) for c in request.get_performance_counts()
                    ]
                except PlugserveError:
                    self._counts = []
        except BaseException as exc:
            self.network.release(pool, request, failed=exc)
            if piece is not None:
                piece.fail(exc)
            raise
        finally:
            if piece is not None:
                piece.end()
        self.network.release(pool, request)
        return outputs

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        return self._run(self._feed(arrays), run)

    def _run(self, feeds: list[Any], run: RunContext | None = None) -> dict[str, np.ndarray]:
        """On the device with room (``start_async``: ``run`` None, the device's request then
        answers to this run's token, the one under way on this thread)."""
        network = self.network
        pool, request = network.acquire()
        if not network.fallback:
            try:
                return self._run_on(pool, request, feeds, run)
            except PlugserveError as exc:
                raise type(exc)(f"MULTI device {pool.device}: {exc}") from exc
            except Exception as exc:
                raise InferenceError(
                    f"MULTI device {pool.device}: {type(exc).__name__}: {exc}"
                ) from exc
        # each device once, those set aside last (a cut-off node is tried when nothing else is)
        up = network.up(network.pools)
        order = [p.device for p in up] + [p.device for p in network.pools if p not in up]
        start = order.index(pool.device)
        reasons: list[str] = []
        for step in range(len(order)):
            if step:
                pool, request = network.acquire_on(order[(start + step) % len(order)])
            try:
                return self._run_on(pool, request, feeds, run)
            except _NO_RETRY:
                raise
            except Exception as exc:
                reasons.append(f"{pool.device}: {type(exc).__name__}: {exc}")
                if step + 1 < len(order):
                    log.warning(
                        "network %s: request failed on %s (%s); falling back to %s",
                        network.name,
                        pool.device,
                        exc,
                        order[(start + step + 1) % len(order)],
                    )
        raise InferenceError(
            f"network {network.name}: the request failed on every device of MULTI: "
            + "; ".join(reasons)
        )

    def get_performance_counts(self) -> list[PerfCount]:
        """The counts of this request's last run, from the device that ran it."""
        self._require_perf_counts()
        return list(self._counts)


class AutoInferRequest(InferRequest):
    """The chosen device's request, as it is."""

    network: AutoCompiledNetwork

    def __init__(self, network: AutoCompiledNetwork, request: InferRequest) -> None:
        super().__init__(network)
        self.request = request

    def infer(
        self, inputs: Mapping[str, Any], run: RunContext | None = None
    ) -> dict[str, np.ndarray]:
        return self.request.infer(inputs, run)

    def query_state(self) -> list[VariableState]:
        return self.request.query_state()

    def reset_state(self) -> None:
        self.request.reset_state()

    def infer_checked(
        self, arrays: list[Any], run: RunContext | None = None
    ) -> dict[str, np.ndarray]:
        return self.request.infer_checked(arrays, run)

    def start_async(self, inputs: Mapping[str, Any], callback: Callback | None = None) -> None:
        self.request.start_async(inputs, callback)

    def wait(self, timeout: float | None = None) -> dict[str, np.ndarray]:
        return self.request.wait(timeout)

    def cancel(self) -> None:
        self.request.cancel()

    def get_performance_counts(self) -> list[PerfCount]:
        return self.request.get_performance_counts()


def _on_device(count: PerfCount, device: str) -> PerfCount:
    if count.device:
        return count
    return PerfCount(
        count.node_name,
        count.op_type,
        count.status,
        count.exec_type,
        count.real_time_s,
        device,
        count.original_names,
    )
