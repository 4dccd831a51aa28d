"""One instance of a Python model as the server runs it: its process (``process.py``), what is
in flight on it (``inflight.py``), its readiness checks (``readiness.py``), and the hop of one
execute: the request's tensors into the instance's arena, the message sent, the answer waited
for, checked (``protocol.py``) and copied out.

The hop is what a small model's request costs beyond its ``execute`` (0.18-0.22 ms here), so
the thread that sent it polls for the answer for ANSWER_SPIN (0.5 ms) before it sleeps, while
most of the model's recent answers came within that (a sleeping thread is woken ~100 us after
the answer on these machines, as long as the whole hop); a model slower than that is not polled
for, and each poll yields the core. A request a process never read (it ended first) goes to
the next process, once.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from plugserve.plugins.api import InferenceError, InvalidInput, TensorSpec
from plugserve.plugins.threads import start_daemon
from plugserve.server.apps.pipelines.python import ipc, protocol
from plugserve.server.apps.pipelines.python.calls import Host
from plugserve.server.apps.pipelines.python.inflight import Inflight
from plugserve.server.apps.pipelines.python.process import HANGS, Limits, ModelProcess
from plugserve.server.apps.pipelines.python.readiness import Readiness
from plugserve.server.plane.errors import Unloaded

if TYPE_CHECKING:
    from plugserve.plugins import cancel
    from plugserve.plugins.tracing import Span

__all__ = ["ANSWER_SPIN", "Instance"]

#: seconds a request's thread polls for its process's answer before it sleeps, while most of
#: the model's recent answers came within it
ANSWER_SPIN = 0.0005
#: the weight of the newest answer in the running share of answers that came within
#: ANSWER_SPIN (a share, not a mean time: one late answer, the machine busy elsewhere, does
#: not stop the polling)
ANSWER_WEIGHT = 0.125


class _NotTaken(Exception):
    """The process ended with the request unread: it goes to the next process, once."""


class Instance:
    """One instance: its process, started on demand, and one ``execute`` at a time (a
    decoupled model's responses may go on after it returns)."""

    def __init__(self, python: str, model_path: Path, host: Host, limits: Limits) -> None:
        self.label = host.label
        self.inflight = Inflight(host)
        self.process = ModelProcess(
            python, model_path, self.inflight.output, self.inflight.mailbox_of, self._started
        )
        self.process.limits = limits
        self.readiness = Readiness(self.process)
        self.decoupled = False
        #: numbers for its executes (a BLS call names the one it was made in)
        self._executes = itertools.count(1)
        #: the running share of answers that came within ANSWER_SPIN of their request
        self.answers_within = 1.0
        HANGS.processes.add(self.process)

    def configure(self, args: dict[str, Any], decoupled: bool, outputs: list[TensorSpec]) -> None:
        """The model's final configuration: what initializes it, and its outputs."""
        self.process.hello = protocol.initialize(str(self.process.model_path), args, decoupled)
        self.decoupled = decoupled
        self.inflight.specs = {spec.name: spec for spec in outputs}

    def _started(self, mailbox: ipc.Mailbox) -> None:
        if self.decoupled:  # responses come while no execute waits: read them
            start_daemon(
                f"{self.label}-reader", self.inflight.serve, mailbox, self.process.exit_code
            )

    # --- execute

    def run(
        self,
        tensors: dict[str, np.ndarray],
        header: dict[str, Any],
        waits: list[tuple[int, cancel.Token | None]] = (),
        spans: list[Span] | None = None,
        tenant: str = "",
    ) -> Any:
        """``header`` with ``tensors`` to the process, and its answer: ``(reply, outputs)``,
        the outputs copied out of the answer's memory (the next request reuses it); a reply
        that is not as the worker writes it raises ValueError (the process is stopped).
        ``waits``: each request's id and token: a token cancelled meanwhile tells the model
        (``is_cancelled()`` for that request), never stops the process. ``spans``: the
        requests' execute spans (traced ones), ended with the times the process measured."""
        with self.process.lock:
            # the BLS calls it makes name its number, and are its tenant's (bls.py)
            header["execute"] = number = next(self._executes)
            self.inflight.executing = (number, tenant)
            try:
                if spans:
                    return self._run_traced(tensors, header, waits, spans)
                reply, out_fd = self._send(tensors, header, waits)
                return self._answer(reply, out_fd, len(header.get("requests", ())))
            finally:
                self.inflight.executing = (None, "")

    def _run_traced(
        self,
        tensors: dict[str, np.ndarray],
        header: dict[str, Any],
        waits: list[tuple[int, cancel.Token | None]],
        spans: list[Span],
    ) -> Any:
        """:meth:`run` of traced requests: their execute spans are where the model's BLS calls
        find them while it runs, and end with the times its process measured, or the error."""
        tracing = self.inflight.tracing
        for span in spans:
            tracing[span.traceparent()] = span
        reply = None
        try:
            reply, out_fd = self._send(tensors, header, waits)
            tracing.clear()
            answer = self._answer(reply, out_fd, len(header.get("requests", ())))
        except BaseException as exc:
            tracing.clear()
            protocol.stamp(spans, reply, exc)
            raise
        protocol.stamp(spans, reply)
        return answer

    def _answer(self, reply: dict[str, Any], out_fd: int, count: int) -> Any:
        process = self.process
        outbox = process.outbox
        if reply.get("error") or self.decoupled:
            if out_fd >= 0:
                os.close(out_fd)
            self.bound_memory()
            return reply, {}
        try:
            protocol.check_reply(reply, count)
            outputs = protocol.tensors_of(reply, out_fd, outbox)
        except ValueError:
            # an answer the worker would never send: the process is not trusted with
            # another request (what it sends next may answer this one)
            process.kill()
            raise
        self.bound_memory()
        return reply, outputs

    def _send(
        self,
        tensors: dict[str, np.ndarray],
        header: dict[str, Any],
        waits: list[tuple[int, cancel.Token | None]],
    ) -> tuple[dict[str, Any], int]:
        """One execute on the process (started again first if it is gone; once more when it
        ended without reading the request): the reply and its descriptor."""
        try:
            return self._exchange(self.process.ensure(), tensors, header, waits)
        except _NotTaken:  # it ended without reading the request: its successor's
            try:
                return self._exchange(self.process.ensure(), tensors, header, waits)
            except _NotTaken:
                raise InferenceError(
                    f"{self.label}: its process ended before reading the request, twice; "
                    "it is started again for the next request"
                ) from None

    def _exchange(
        self,
        mailbox: ipc.Mailbox,
        tensors: dict[str, np.ndarray],
        header: dict[str, Any],
        waits: list[tuple[int, cancel.Token | None]],
    ) -> tuple[dict[str, Any], int]:
        """One execute. A request's token cancelled meanwhile (its deadline, its client gone)
        is told to the model, which may stop early; the process is stopped only by the hang
        watch (past MAX_EXECUTE_SECONDS), or when it ends by itself."""
        process, inflight = self.process, self.inflight
        fd = ipc.pack_into(header, tensors, process.inbox)
        forgets = []
        for rid, token in waits:
            if token is not None:
                forgets.append(token.on_cancel(lambda rid=rid: inflight.tell_cancelled(rid)))
        process.hung = False
        inflight.sent_since = 0
        try:
            within = self.answers_within
            start = time.perf_counter()
            process.execute_started = time.monotonic()
            mailbox.send(header, fd)
            reply, fds = mailbox.wait("main", ANSWER_SPIN if within >= 0.5 else 0.0)
            fast = time.perf_counter() - start < ANSWER_SPIN
            self.answers_within = within + (fast - within) * ANSWER_WEIGHT
            return reply, (fds[0] if fds else -1)
        except ipc.TooLarge as exc:  # sent nothing: the process is as it was
            raise InvalidInput(
                f"{self.label}: the requests' parameters are too large: {exc}"
            ) from None
        except (OSError, EOFError, ValueError, AttributeError) as exc:
            raise self._lost(mailbox, exc) from None
        finally:
            process.execute_started = 0.0
            if fd >= 0:
                os.close(fd)
            for forget in forgets:
                forget()

    def _lost(self, mailbox: ipc.Mailbox, exc: BaseException) -> Exception:
        """What an execute whose process went (or hung up) fails with; the process stopped."""
        process = self.process
        code = None
        if process.process is not None:  # its socket closed: it is exiting, or hung up
            end = time.monotonic() + 2
            while (code := process.exit_code()) is None and time.monotonic() < end:
                time.sleep(0.01)
        process.kill()
        reset = isinstance(exc, ConnectionResetError) or isinstance(
            mailbox.failure, ConnectionResetError
        )
        if process.closed:  # unloaded (past --model-unload-timeout) or the server stops
            return Unloaded(
                f"{self.label}: its model was unloaded, or the server stopped, while it ran "
                "the request; retry"
            )
        if reset and not self.inflight.sent_since and not process.hung:
            # it closed with this request unread (nothing else was sent since: the kernel
            # resets a socket closed with messages unread): it never ran it
            return _NotTaken()
        if process.hung:
            return InferenceError(
                f"{self.label}: its execute ran past MAX_EXECUTE_SECONDS "
                f"({process.limits.max_execute_seconds:g} s), taken as hung: its process was "
                "stopped and is started again for the next request"
            )
        return InferenceError(
            f"{self.label}: its process ended while running the request (exit code "
            f"{code}: {exc or 'no answer'}); it is started again for the next request"
        )

    def bound_memory(self) -> None:
        """Stop the process when it holds too much, unless a decoupled request is open."""
        if not self.inflight.open:
            self.process.bound_memory()

    def finalize(self) -> None:
        """The model is unloaded: its calls' threads go, its ``finalize`` runs, its process
        stops."""
        self.inflight.close()
        self.process.finalize()
