"""A Python model's BLS calls (Business Logic Scripting, ``InferenceRequest.exec``): each one a
request to any model the server serves, made through the data plane as a client's is (counted,
budgeted, on its model's device, cancellable), whose answer (or each response of a decoupled
call) goes back to the process as it comes, never blocking the thread that reads the model's
socket (:meth:`Inflight.reply`).

A call lives from its message to its final reply; the model may cancel a decoupled call
(``ResponseIterator.cancel``: :attr:`Kind.BLS_CANCEL`), and a model that does not read its
replies has its calls cancelled. Calls are bounded by the model: each waits for its answer
(``async_exec`` on at most ``worker.BLS_THREADS``, 8, threads at once).

Tenants: a call is the tenant's whose requests the execute it names holds, while that execute
is under way (``Inflight.tenant_of``): it reaches that tenant's prefix cache and sequences, as
the tenant's own requests do. The process names the execute a request was made in (a context
variable the worker sets around ``execute``: ``pb_utils.EXECUTE``). A call made with
``trace=request.trace()`` also names that request, and is its tenant's while the request is
open: a decoupled model's thread answering a request after its execute returned passes it so
(Triton's docs pass it for tracing). Any other call made outside an execute under way (a
model's own thread without it) is the server's own tenant (""), which no token's is. The
batcher executes one tenant's requests together. Before, every call was "", so two tenants'
requests through one Python model shared what its calls reached.

Traces: a call made while a traced execute runs names that execute's span (its ``trace``, the
``traceparent`` the server sent with the request), which the instance keeps while the execute
runs (:attr:`Inflight.tracing`). The call gets a ``bls`` span under it, from its message to its
final reply, and the called model's spans (its model span, queue and compute, and whatever it
calls in turn) open under that one, as any traced request's do under its parent. A call naming
a span the server does not hold (made after its execute returned, or forged) is not traced.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from plugserve.plugins.api import Cancelled, InvalidInput, PlugserveError, Unsupported
from plugserve.server.apps.pipelines.python import ipc, protocol
from plugserve.server.plane.request import Request

if TYPE_CHECKING:
    from plugserve.plugins import cancel
    from plugserve.plugins.tracing import Span
    from plugserve.server.apps.pipelines.python.calls import Host

__all__ = ["BlsCalls"]

Reply = Callable[..., None]


class BlsCalls:
    """One instance's BLS calls in flight, by call id (their runs, to cancel them)."""

    def __init__(
        self,
        host: Host,
        reply: Reply,
        spans: Callable[[str], Span | None],
        tenant: Callable[[int | None, int | None], str] = lambda execute, parent: "",
    ) -> None:
        #: the server the calls go to, and how a reply reaches the process
        self.host, self.reply = host, reply
        #: the execute span a ``traceparent`` names, while its execute runs
        self._spans = spans
        #: the tenant of the execute a call names while it is under way, or of the open
        #: request it names: its calls are its (the prefix cache, the sequences they reach
        #: are partitioned by it)
        self._tenant = tenant
        self._lock = threading.Lock()
        self._runs: dict[int, cancel.Token] = {}

    def start(self, header: dict[str, Any], fd: int) -> None:
        """Make the call ``header`` asks for (its tensors in ``fd``)."""
        number = protocol.call_id(header)
        if number < 0:
            if fd >= 0:
                os.close(fd)
            raise ValueError(f"a BLS call without an id: {str(header)[:200]}")
        span = None
        try:
            try:
                inputs = ipc.unpack_tensors(header.get("tensors", []), fd)
            except ValueError as exc:
                raise InvalidInput(f"a BLS request's tensors cannot be read: {exc}") from None
            call = protocol.BlsCall(header)
            span = self._span(call)
            plane = self.host.plane
            if plane is None:
                raise Unsupported("BLS calls need the server's data plane")
            entry = plane.get(call.model, call.version)
            if entry.network.decoupled and not call.decoupled:
                raise InvalidInput(
                    f"model {entry.name!r} is decoupled: call it with exec(decoupled=True)"
                )
            request = Request(
                entry, inputs, outputs=call.outputs, step=call.step,
                timeout=call.timeout,  # its deadline, or its model's queue policy's
                parameters=call.parameters,
                holds=sum(getattr(a, "nbytes", 0) for a in inputs.values()),  # the budget's
                protocol="bls", trace=span, tenant=self._tenant(call.execute, call.parent),
            )  # fmt: skip
            with self._lock:
                self._runs[number] = request.run
            if call.decoupled:
                stream = plane.stream(request)
                lock = threading.Lock()
                stream.add_listener(lambda: self._forward(number, stream, lock, span))
            else:
                future = plane.infer(request)
                future.add_done_callback(lambda f: self._done(number, f, span))
        except PlugserveError as exc:
            self._failed(number, exc, span)

    def _span(self, call: protocol.BlsCall) -> Span | None:
        """The call's span, under the execute it names (None: not traced)."""
        parent = self._spans(call.trace) if call.trace is not None else None
        if parent is None:
            return None
        return parent.span("bls", {"plugserve.bls_model": call.model})

    def _done(self, number: int, future: Any, span: Span | None) -> None:
        try:
            outputs = future.result()
        except Exception as exc:
            self._failed(number, exc, span)
            return
        self._forget(number)
        if span is not None:  # ended before the model can read its answer and go on
            span.end()
        self.reply(number, {"final": True}, dict(outputs))

    def _forward(self, number: int, stream: Any, lock: threading.Lock, span: Span | None) -> None:
        """A decoupled call's responses, in order, as they arrive."""
        with lock:
            try:
                items = stream.take()
            except PlugserveError as exc:
                self._failed(number, exc, span)
                return
            for item, final in items:
                if final:
                    self._forget(number)
                    if span is not None:
                        span.end()
                if item is None:
                    self.reply(number, {"final": final})
                elif item.error is not None:
                    self.reply(number, protocol.failure(item.error, final=final))
                else:
                    self.reply(
                        number, {"final": final, "parameters": item.parameters}, item.outputs
                    )

    def _failed(self, number: int, exc: BaseException, span: Span | None) -> None:
        """The call ended with ``exc``: its final reply says so."""
        self._forget(number)
        if isinstance(exc, PlugserveError):
            answer = protocol.failure(exc, final=True)
        else:
            answer = {"error": [f"{type(exc).__name__}: {exc}", "INTERNAL"], "final": True}
        if span is not None:
            span.fail(exc)
            span.end()
        self.reply(number, answer)

    def _forget(self, number: int) -> None:
        with self._lock:
            self._runs.pop(number, None)

    def cancel(self, header: dict[str, Any], fd: int) -> None:
        """The model cancelled its decoupled call (``ResponseIterator.cancel``)."""
        if fd >= 0:
            os.close(fd)
        self.stop(
            protocol.call_id(header),
            Cancelled(f"{self.host.label}: the model cancelled its BLS call"),
        )

    def stop(self, number: int, error: PlugserveError) -> None:
        """Cancel call ``number`` with ``error`` (nothing when it is over)."""
        with self._lock:
            run = self._runs.get(number)
        if run is not None:
            run.cancel(error)
