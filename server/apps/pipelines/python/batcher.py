"""Triton's dynamic batcher for a Python model (``dynamic_batching`` with ``max_batch_size`` >
0): the requests waiting for the model are handed to one instance's ``execute`` together, as the
list Triton's contract says ``requests`` may be, until their rows reach the largest
``preferred_batch_size`` (else ``max_batch_size``) or ``max_queue_delay_microseconds`` after the
first of them (Triton's default 0: what waits now), the highest priority first (the queue
policy's level, ``cancel.Token.place``), as Triton's. A request with more rows runs alone. Unlike
BATCH, nothing is concatenated: each request keeps its own tensors and gets its own response.

One dispatcher thread per instance takes the next batch when its instance is free; the requests
wait on the network's streams (at most :data:`MAX_GATHER_STREAMS`, all instances together), so
the queue is the data plane's, bounded as any model's. A traced request's execute span is made
on its stream's thread (under its run's span) and ended with its batch's execute.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

from plugserve.plugins import cancel
from plugserve.plugins.api import Cancelled, InferenceError, PlugserveError
from plugserve.plugins.threads import start_daemon
from plugserve.server.apps.pipelines.python import protocol

if TYPE_CHECKING:
    from plugserve.plugins.tracing import Span
    from plugserve.server.apps.pipelines.python.device import PythonNetwork
    from plugserve.server.apps.pipelines.python.instance import Instance

__all__ = ["MAX_GATHER_STREAMS", "Gatherer"]

#: streams a dynamically batched model's requests may wait on at once, all instances together
MAX_GATHER_STREAMS = 64


class _Waiting:
    """One request in a :class:`Gatherer`: its inputs, its header entry, its rows, its run and
    execute span, and the future its stream waits on."""

    __slots__ = ("arrays", "arrived", "future", "request", "rows", "span", "tenant", "token")

    def __init__(
        self,
        arrays: list[Any],
        request: dict[str, Any],
        rows: int,
        token: Any,
        span: Any,
        tenant: str = "",
    ) -> None:
        self.arrays, self.request, self.rows, self.token = arrays, request, rows, token
        self.tenant = tenant
        self.span: Span | None = span
        self.arrived = time.monotonic()
        self.future: Future = Future()


class Gatherer:
    """The requests of one model waiting to be executed together, on its instances."""

    def __init__(self, network: PythonNetwork, size: int, delay: float) -> None:
        self.network, self.size, self.delay = network, max(1, size), max(0.0, delay)
        self._cond = threading.Condition()
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._closed = False
        #: batches run, by how many requests they held (statistics and tests)
        self.executions: dict[int, int] = {}
        for instance in network.instances:
            start_daemon(f"{instance.label}-batcher", self._dispatch, instance)

    def run(
        self,
        arrays: list[Any],
        request: dict[str, Any],
        rows: int,
        span: Any = None,
        token: cancel.Token | None = None,
        tenant: str = "",
    ) -> Any:
        """Queue one request; its outputs once the batch it joined has run. ``token``: its
        run's (``RunContext.token``), which takes it out of the queue or its batch;
        ``tenant``: its caller's."""
        item = _Waiting(arrays, request, rows, token, span, tenant)
        with self._cond:
            if self._closed:
                raise Cancelled(f"python model {self.network.name!r} is unloaded")
            self._queue.append(item)
            self._cond.notify()
        forget = None
        if token is not None:
            forget = token.on_cancel(lambda: settle(item.future, token.failure()))
        try:
            return item.future.result()
        finally:
            if forget is not None:
                forget()

    def _take(self) -> list[_Waiting] | None:
        with self._cond:
            while True:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return None
                first = min(i.arrived for i in self._queue)
                while sum(i.rows for i in self._queue) < self.size and not self._closed:
                    left = first + self.delay - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._queue:
                    break
            # the highest priority first (the queue policy's place; stable: arrival order
            # within a level), as Triton's dynamic batcher
            self._queue = collections.deque(sorted(self._queue, key=_place))
            # one tenant's requests in an execute: its BLS calls are that tenant's (bls.py);
            # the others keep their places for the next one
            first = self._queue.popleft()
            batch, rows, passed = [first], first.rows, []
            while self._queue:
                item = self._queue[0]
                if item.tenant != first.tenant:
                    passed.append(self._queue.popleft())
                    continue
                if rows + item.rows > self.size:
                    break
                rows += item.rows
                batch.append(self._queue.popleft())
            self._queue.extendleft(reversed(passed))
            return batch

    def _dispatch(self, instance: Instance) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            live = [i for i in batch if not i.future.done()]  # cancelled while waiting
            for item in live:
                cancel.started(item.token)
            if live:
                with self._cond:
                    self.executions[len(live)] = self.executions.get(len(live), 0) + 1
                self._run(instance, live)

    def _run(self, instance: Instance, batch: list[_Waiting]) -> None:
        """``batch`` in one execute on ``instance``; each request's future is settled with its
        own response (its outputs checked against the model's, all of them)."""
        network = self.network
        names, where = network.input_names, network.where
        tensors: dict[str, Any] = {}
        for index, item in enumerate(batch):
            tensors.update(protocol.inputs_of(item.arrays, names, index))
        header = protocol.execute(network.name, [i.request for i in batch])
        spans = [i.span for i in batch if i.span is not None]
        try:
            reply, outputs = instance.run(
                tensors,
                header,
                [(i.request["rid"], i.token) for i in batch],
                spans,
                batch[0].tenant,  # (one tenant's requests: _take)
            )
            if reply.get("error"):
                raise InferenceError(f"{where}: {reply['error']}")
        except BaseException as exc:
            if isinstance(exc, ValueError):
                exc = InferenceError(
                    f"{where}: its answer cannot be read: {exc}; its process is started again "
                    "for the next request"
                )
            for item in batch:
                settle(item.future, exc)
            return
        specs = network.output_specs
        for index, (item, response) in enumerate(zip(batch, reply["responses"])):
            try:
                if response.get("error"):
                    raise protocol.error_of(where, response["error"])
                result = protocol.outputs_of(
                    where, response["outputs"], outputs, specs, f"{index}/", True
                )
            except PlugserveError as exc:
                settle(item.future, exc)
                continue
            settle(item.future, result=result)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for item in waiting:
            settle(item.future, Cancelled("the model was unloaded before its batch ran"))


def _place(item: _Waiting) -> int:
    return item.token.place if item.token is not None else 0


def settle(future: Future, error: BaseException | None = None, result: Any = None) -> None:
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
