"""HETERO's infer request: the subgraphs' requests run in order, passing tensors between them."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import (
    InferenceError,
    InferRequest,
    PerfCount,
    PlugserveError,
    listing,
)
from plugserve.plugins.outputcheck import disagreement
from plugserve.plugins.run_context import RunContext, for_piece
from plugserve.plugins.tracing import Span

if TYPE_CHECKING:
    from plugserve.plugins.hetero.compiled import HeteroCompiledNetwork, Step

__all__ = ["HeteroInferRequest"]


class HeteroInferRequest(InferRequest):
    network: HeteroCompiledNetwork

    def __init__(self, network: HeteroCompiledNetwork) -> None:
        super().__init__(network)
        self._requests = [step.network.create_infer_request() for step in network.steps]
        self._times: list[float] = [0.0] * len(self._requests)

    def _infer(self, arrays: list[Any], run: RunContext) -> dict[str, np.ndarray]:
        return self._run(self._feed(arrays), run)

    def _run(self, values: dict[str, Any], run: RunContext | None = None) -> dict[str, np.ndarray]:
        """Each piece on its device, told the request (``run``) as a piece sees it: the
        outputs it sends to the answer, of those the request wants (``for_piece``), and the
        request's id, parameters, bounds and token; traced (``run.trace``), a span of its own
        as its trace."""
        if run is None:  # start_async: nothing told but its token, the run under way's
            run = RunContext(token=self._token) if self._token is not None else RunContext()
        checks = self.network.checks
        answered = self.network.output_names
        traced = run.trace  # the run's span when the request is traced
        for index, (step, request) in enumerate(zip(self.network.steps, self._requests)):
            start = time.perf_counter()
            piece = for_piece(run, step.outputs, answered)
            if traced is None:
                outputs = request.infer({name: values[name] for name in step.inputs}, piece)
            else:
                outputs = _traced_piece(traced, index, step, request, values, piece)
            self._times[index] = time.perf_counter() - start
            for expected in checks[index]:
                problem = disagreement(expected, outputs.get(expected[0]))
                if problem:
                    raise _wrong_answer(step, expected[0], problem)
            values.update(outputs)
        return {name: values[name] for name in self.network.output_names}

    def _feed(self, arrays: list[Any]) -> dict[str, Any]:
        values = dict(self.network.constants)
        values.update(zip(self.network.input_names, arrays))
        return values

    def get_performance_counts(self) -> list[PerfCount]:
        """Per subgraph (op type ``Subgraph``) and, from each device, per node."""
        self._require_perf_counts()
        counts: list[PerfCount] = []
        for index, (step, request) in enumerate(zip(self.network.steps, self._requests)):
            counts.append(
                PerfCount(
                    f"subgraph{index}",
                    "Subgraph",
                    "EXECUTED",
                    step.device,
                    self._times[index],
                    step.device,
                    tuple(step.node_names),
                )
            )
            try:
                children = request.get_performance_counts()
            except PlugserveError:
                continue
            for c in children:
                counts.append(
                    PerfCount(
                        c.node_name,
                        c.op_type,
                        c.status,
                        c.exec_type,
                        c.real_time_s,
                        step.device,
                        c.original_names or (c.node_name,),
                    )
                )
        return counts


def _traced_piece(
    traced: Span,
    index: int,
    step: Step,
    request: InferRequest,
    values: dict[str, Any],
    run: RunContext,
) -> dict[str, Any]:
    """A piece's run as a span of its own (named as its performance counts are), the span
    its device's pieces open theirs under (its context's ``trace``)."""
    piece = traced.span(
        f"subgraph{index}",
        {"plugserve.device": step.device, "plugserve.nodes": len(step.node_names)},
    )
    try:
        told = dataclasses.replace(run, trace=piece)
        return request.infer({name: values[name] for name in step.inputs}, told)
    except BaseException as exc:
        piece.fail(exc)
        raise
    finally:
        piece.end()


def _wrong_answer(step: Step, value: str, problem: str) -> InferenceError:
    node = step.producers.get(value)
    made_by = f"node {node!r}" if node else f"the piece of node(s) {listing(step.node_names)}"
    return InferenceError(
        f"HETERO: {step.device} answered {value!r} (made by {made_by}) with {problem}; the "
        f"answer is not passed on. {step.device} computes it wrongly: run that node on "
        "another device (AFFINITY, or another DEVICE_PRIORITIES order)"
    )
