"""An ensemble's graph, checked and ordered once at load (Triton's ensemble scheduler, OVMS's
DAG): which step writes each tensor, the steps in an order that runs every writer before its
readers, a cycle or a tensor nobody writes refused with its name (:class:`Graph`), and the
plan of one request over it (:class:`Plan`: what each step waits for). The running of it is
``ensemble.py``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from plugserve.plugins.api import InvalidModel
from plugserve.server.control.pipelines import Step

__all__ = ["Graph", "Plan"]


class Plan:
    """The steps one set of requested outputs needs, and their order: ``first`` run at once,
    ``waits[i]`` steps must finish before step ``i`` runs, ``then[i]`` are the steps that
    wait on step ``i``."""

    __slots__ = ("first", "parts", "steps", "then", "waits", "writer")

    def __init__(self, steps: list[Step], writer: dict[str, Step]) -> None:
        self.steps = steps
        self.writer = writer
        #: a decoupled ensemble's plan, by context label: the steps that run in each context
        self.parts: dict[int, Plan] = {}
        needed = {s.index for s in steps}
        self.waits: dict[int, int] = {}
        self.then: dict[int, list[Step]] = {s.index: [] for s in steps}
        for step in steps:
            before = {
                writer[t].index
                for t in step.inputs.values()
                if t in writer and writer[t].index in needed
            }
            self.waits[step.index] = len(before)
            for index in sorted(before):
                self.then[index].append(step)
        self.first = [s for s in steps if not self.waits[s.index]]

    def part(self, label: int, labels: Mapping[int, int]) -> Plan:
        """The steps of this plan that run in a context of ``label`` (``labels``: each step's),
        as a plan of their own (kept: a plan's parts are asked at every response)."""
        found = self.parts.get(label)
        if found is None:
            found = Plan([s for s in self.steps if labels[s.index] == label], self.writer)
            self.parts[label] = found
        return found


class Graph:
    """The steps of an ensemble as a graph, checked at load: each tensor written once, read
    only after it is, no cycle; the plans of the sets of outputs requests ask for."""

    #: plans kept per ensemble: one per set of requested outputs (2^outputs at most)
    MAX_PLANS = 64

    def __init__(self, where: str, steps: list[Step], inputs: set[str], outputs: set[str]):
        if not steps:
            raise InvalidModel(f"{where}: it has no step")
        self.where = where
        writer: dict[str, Step] = {}
        for step in steps:
            for tensor in step.outputs.values():
                if tensor in inputs:
                    raise InvalidModel(f"{where}: {step} writes {tensor!r}, an input of it")
                if tensor in writer:
                    raise InvalidModel(
                        f"{where}: tensor {tensor!r} is written by {writer[tensor]} and by {step}"
                    )
                writer[tensor] = step
        for step in steps:
            for tensor in step.inputs.values():
                if tensor not in inputs and tensor not in writer:
                    raise InvalidModel(
                        f"{where}: {step} reads tensor {tensor!r}, which no step writes and the "
                        f"{where.split()[0]} does not take as an input"
                    )
        for tensor in sorted(outputs):
            if tensor not in writer and tensor not in inputs:
                raise InvalidModel(f"{where}: output {tensor!r} is written by no step")
        self.writer = writer
        self.ordered = self._order(steps)
        self._plans: dict[frozenset[str], Plan] = {}
        self._lock = threading.Lock()

    def _order(self, steps: list[Step]) -> list[Step]:
        """The steps in dependency order (each after the steps writing its inputs), or
        InvalidModel naming a cycle. A depth-first walk with a stack of its own: a recursive
        one overflowed Python's stack on a chain of 20,000 steps listed last step first (a
        500 after 4 s), copying its path at every level."""
        ordered: list[Step] = []
        state: dict[int, str] = {}
        for first in steps:
            if state.get(first.index) == "done":
                continue
            state[first.index] = "open"
            stack = [(first, iter(self._writers(first)))]
            while stack:
                step, writers = stack[-1]
                upstream = next(writers, None)
                if upstream is None:
                    stack.pop()
                    state[step.index] = "done"
                    ordered.append(step)
                elif state.get(upstream.index) == "open":
                    path = [s for s, _ in stack]
                    cycle = [*path[path.index(upstream) :], upstream]
                    raise InvalidModel(
                        f"{self.where}: its steps form a cycle: {' -> '.join(map(str, cycle))}"
                    )
                elif state.get(upstream.index) != "done":
                    state[upstream.index] = "open"
                    stack.append((upstream, iter(self._writers(upstream))))
        return ordered

    def _writers(self, step: Step) -> list[Step]:
        """The steps that write ``step``'s inputs, in its inputs' order."""
        return [self.writer[t] for t in step.inputs.values() if t in self.writer]

    def needed(self, wanted: set[str]) -> list[Step]:
        """The steps that ``wanted`` tensors need, in dependency order."""
        want = set(wanted)
        keep: list[Step] = []
        for step in reversed(self.ordered):
            if want & set(step.outputs.values()):
                keep.append(step)
                want |= set(step.inputs.values())
        keep.reverse()
        return keep

    def plan(self, tensors: frozenset[str]) -> Plan:
        """The plan that computes ``tensors`` (kept for the next request that asks the same)."""
        found = self._plans.get(tensors)
        if found is None:
            found = Plan(self.needed(set(tensors)), self.writer)
            with self._lock:
                if len(self._plans) < self.MAX_PLANS:
                    self._plans[tensors] = found
        return found
