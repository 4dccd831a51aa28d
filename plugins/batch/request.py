"""BATCH's infer request: check the inputs, queue them with the batcher, wait for the slice."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins import cancel
from plugserve.plugins.api import (
    Callback,
    InferRequest,
    InvalidInput,
    PerfCount,
)
from plugserve.plugins.run_context import RunContext
from plugserve.plugins.tracing import child

if TYPE_CHECKING:
    from plugserve.plugins.batch.compiled import BatchCompiledNetwork

__all__ = ["BatchInferRequest"]


class BatchInferRequest(InferRequest):
    network: BatchCompiledNetwork

    def _queue(self, arrays: list[Any], run: RunContext | None = None) -> Any:
        """Checked inputs into the batcher; the future holds this request's outputs."""
        network = self.network
        rows = {a.shape[0] for a in arrays if isinstance(a, np.ndarray) and a.ndim}
        if len(rows) != 1 or not all(isinstance(a, np.ndarray) and a.ndim for a in arrays):
            raise InvalidInput(
                f"network {network.name}: BATCH needs every input to have the same first "
                f"(batch) dimension; got shapes "
                + ", ".join(f"{s.name}={list(np.shape(a))}" for s, a in zip(network.inputs, arrays))
            )
        key = tuple((a.shape[1:], a.dtype.str) for a in arrays)
        return network.submit(arrays, key, rows.pop(), self._token, run)

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        waiting = child(run.trace, "batch", {"plugserve.device": self.network.child_device})
        if waiting is None:
            return self._queue(arrays, run).result()
        with waiting:  # the wait for a batch and its run on the batch's device (a batch of
            # this request alone runs under this span: its device's spans open under it)
            return self._queue(arrays, dataclasses.replace(run, trace=waiting)).result()

    def start_async(self, inputs: Mapping[str, Any], callback: Callback | None = None) -> None:
        """Not on the network's streams: the batcher's future is this run's future (whose
        ``cancel()`` drops it from the batcher, or lets go of its batch)."""
        self._refuse_if_busy()
        self._token = cancel.Token()
        self._track(self._queue(self._prepare(inputs)), callback)

    def get_performance_counts(self) -> list[PerfCount]:
        """The device's counts for the last batch this network ran."""
        self._require_perf_counts()
        return list(self.network.last_counts)
