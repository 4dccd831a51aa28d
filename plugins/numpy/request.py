"""NUMPY's infer request: check inputs, run the plan, keep the last run's per-node timings."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from plugserve.plugins.api import (
    InferenceError,
    InferRequest,
    PerfCount,
)
from plugserve.plugins.shapecheck import shapes_of, translate

if TYPE_CHECKING:
    from plugserve.plugins.numpy.compiled import NumpyCompiledNetwork

__all__ = ["NumpyInferRequest"]


class NumpyInferRequest(InferRequest):
    network: NumpyCompiledNetwork

    def __init__(self, network: NumpyCompiledNetwork) -> None:
        super().__init__(network)
        self._perf = bool(network.config.get("PERF_COUNT"))
        self._counts: list[PerfCount] = []

    def _run(self, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        profile: list[PerfCount] | None = [] if self._perf else None
        try:
            outputs = self.network.run_plan(arrays, profile)
        except InferenceError as exc:
            shapes = shapes_of([s.name for s in self.network.inputs], arrays)
            raise translate(exc, self.network.name, self.network.shape_model, shapes) from exc
        if profile is not None:
            self._counts = profile
        return dict(zip(self.network.output_names, outputs))

    def get_performance_counts(self) -> list[PerfCount]:
        self._require_perf_counts()
        return list(self._counts)
