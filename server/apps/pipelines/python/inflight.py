"""What is in flight between the server and one instance's process, by id, and the messages the
process sends while it runs.

===========================  ==========================================================
a decoupled request          by its request id (``rid``) in :attr:`Inflight.open`, from its
                             execute to its final response, its cancellation, or its
                             process's end (its sender fails then, naming the exit code)
a BLS call of the model's    by its call id in ``bls.BlsCalls``, from its message to its
                             final reply
another call of the model's  by its call id in ``calls.Calls`` (custom metrics, the model
                             loading API), on a bounded pool
a traced execute's spans     by their ``traceparent`` in :attr:`Inflight.tracing`, while the
                             execute runs: the BLS calls it makes go under them
===========================  ==========================================================

The process's own messages (:data:`kinds.SERVER_HANDLES`: a decoupled response, a BLS call or
its cancellation, a call, a Logger line) are handled at once by whichever thread reads the
socket (``ipc.Mailbox``: the thread waiting for an execute's answer, or a decoupled model's
reader), so nothing here blocks: replies and notices go out without waiting
(``MSG_DONTWAIT``), and a model that does not read them misses them (a notice) or has the call
cancelled (a reply). Every other message answers the thread that waits for it (``"main"``).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from plugserve.plugins.api import (
    InferenceError,
    PlugserveError,
    ResourceExhausted,
    ResponseSender,
    TensorSpec,
)
from plugserve.server.apps.pipelines.python import ipc, protocol
from plugserve.server.apps.pipelines.python.bls import BlsCalls
from plugserve.server.apps.pipelines.python.calls import Calls, Host
from plugserve.server.apps.pipelines.python.kinds import LOG_LEVELS, SERVER_HANDLES, Kind
from plugserve.server.apps.pipelines.python.output import LineBudget

if TYPE_CHECKING:
    from plugserve.plugins.tracing import Span

__all__ = ["Inflight", "route"]

log = logging.getLogger(__name__)
#: numbers the tenants of calls no one tenant's requests account for (``Inflight.tenant_of``;
#: "!" is in no token file's tenant name)
_unattributed = itertools.count(1)
#: closed requests whose tenants a process's later calls naming them still find
CLOSED_KEPT = 4096
#: where a model's Logger lines and output go, each at its level and with the model's name
model_log = logging.getLogger("plugserve.server.apps.pipelines.python.device.model")
#: Triton's Logger levels -> the server's (VERBOSE shows with --log-level DEBUG)
_LOG_LEVELS = dict(zip(LOG_LEVELS, (logging.INFO, logging.WARNING, logging.ERROR, logging.DEBUG)))


def route(header: dict[str, Any]) -> Any:
    """Where a message from the process goes: None, handled as it is read; else to the thread
    that waits for the process's answers."""
    return None if header.get("op") in SERVER_HANDLES else "main"


class Inflight:
    """One instance's requests, calls and spans in flight, and the handler of what its process
    sends while it runs."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.label = host.label
        #: the model's outputs (a decoupled response's are checked against them)
        self.specs: Mapping[str, TensorSpec] = {}
        #: what the process may put in the server's log (its output, its Logger lines)
        self.output = LineBudget(host.label, model_log)
        #: the socket's mailbox of the process started last
        self.mailbox: ipc.Mailbox | None = None
        #: a decoupled model's requests not yet complete: request id -> its sender, and
        #: its tenant (:meth:`opened`, :meth:`closed`)
        self.open: dict[int, ResponseSender] = {}
        self._tenants: dict[int, str] = {}
        #: the tenants of the requests closed last (at most CLOSED_KEPT), for the calls a
        #: model's thread makes for them after (:meth:`tenant_of`)
        self._closed: collections.OrderedDict[int, str] = collections.OrderedDict()
        #: the execute spans of the traced execute under way, by the ``traceparent`` the
        #: process was sent (one execute at a time: emptied when it returns)
        self.tracing: dict[str, Span] = {}
        #: messages sent to the process since the execute under way (notices, answers)
        self.sent_since = 0
        #: the execute under way: the number it was sent with and its requests' tenant (the
        #: Python batcher executes one tenant's requests together); (None, "") between them
        self.executing: tuple[int | None, str] = (None, "")
        self.bls = BlsCalls(host, self.reply, self.tracing.get, self.tenant_of)
        self.calls = Calls(host, self.reply)
        self._handlers: dict[str, Callable[[dict[str, Any], int], None]] = {
            Kind.SEND: self._response,
            Kind.BLS: self.bls.start,
            Kind.BLS_CANCEL: self.bls.cancel,
            Kind.CALL: self.calls.start,
            Kind.LOG: self._log,
        }

    def tenant_of(self, execute: int | None, parent: int | None = None) -> str:
        """The tenant of a BLS call the process made in execute number ``execute``, naming
        request ``parent`` (its ``trace()``): the execute's requests' while it is under way;
        else that request's while it is open (a decoupled one); else see below."""
        number, tenant = self.executing
        if execute is not None and execute == number:
            return tenant
        if parent is not None:  # its request's, open or closed (one of the last CLOSED_KEPT);
            # never the open requests' tenant (which took a cancelled one's call into its own
            # sequence: a red team's b read a's value); past them a tenant of its own, which
            # the shares count as one with every other (shares.key: a private tenant a call
            # had gone past every share and ahead of every fair place)
            known = self._tenants.get(parent)
            if known is None:
                known = self._closed.get(parent)
            return known if known is not None else f"!unattributed-{next(_unattributed)}"
        # a thread of the model's own, naming no request: the tenant whose requests are
        # open, when one tenant's are (the thread answers one of them); when several
        # tenants' are, a tenant of its own, which shares nothing with any other call (before,
        # the server's own: a decoupled model's threads answering two tenants shared a
        # sequence); when none are, the server's own
        tenants = set(self._tenants.values())
        if len(tenants) == 1:
            return tenants.pop()
        return f"!unattributed-{next(_unattributed)}" if tenants else ""

    def opened(self, rid: int, sender: ResponseSender, tenant: str) -> None:
        """Decoupled request ``rid`` of ``tenant`` is open until :meth:`closed`."""
        self._tenants[rid] = tenant
        self.open[rid] = sender

    def closed(self, rid: int) -> ResponseSender | None:
        """Request ``rid`` is complete (or cancelled, or failed): its sender, if it was open."""
        tenant = self._tenants.pop(rid, None)
        if tenant is not None:
            self._closed[rid] = tenant
            if len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)
        return self.open.pop(rid, None)

    def mailbox_of(self, sock: socket.socket) -> ipc.Mailbox:
        """The mailbox of a process just started, on our end of its socket."""
        self.mailbox = ipc.Mailbox(sock, route, self.handle, most_fds=1)
        return self.mailbox

    # --- what the process sends (on the reading thread: nothing here blocks)

    def handle(self, header: dict[str, Any], fds: list[int]) -> None:
        fd = fds[0] if fds else -1
        try:
            handler = self._handlers.get(header.get("op"))
            if handler is not None:
                handler(header, fd)
            elif fd >= 0:
                os.close(fd)
        except Exception:  # a model's malformed message must not stop the reader
            log.exception("%s: a message from its process could not be handled", self.label)

    def _log(self, header: dict[str, Any], fd: int) -> None:
        if fd >= 0:
            os.close(fd)
        level = _LOG_LEVELS.get(str(header.get("level")), logging.INFO)
        self.output.emit(level, str(header.get("message", "")))

    def _response(self, header: dict[str, Any], fd: int) -> None:
        """A decoupled request's response, checked against the model's outputs."""
        rid = int(header.get("rid", -1))
        sender = self.open.get(rid)
        final = bool(header.get("final"))
        described = header.get("response")
        if sender is None:  # cancelled, or sent after its final response: dropped
            if fd >= 0:
                os.close(fd)
            return
        if final:
            self.closed(rid)
        if described is None:  # the final flag alone
            if fd >= 0:
                os.close(fd)
            sender.send(None, final=True)
            return
        try:
            tensors = ipc.unpack_tensors(header.get("tensors", []), fd)
            response = protocol.response_of(self.label, described, tensors, self.specs)
        except (PlugserveError, ValueError) as exc:
            self.fail(rid, sender, protocol.unreadable(self.label, "response", exc))
            return
        sender.send(response, final=final)

    # --- what the server sends besides executes (never blocking)

    def reply(
        self, call: int, reply: dict[str, Any], tensors: dict[str, Any] | None = None
    ) -> None:
        """An answer to the model's call ``call`` (not blocking: a model that does not read
        its answers has the call cancelled)."""
        mailbox = self.mailbox
        if mailbox is None or mailbox.closed:
            return
        self.sent_since += 1
        reply["call"] = call
        try:
            mailbox.send_tensors(reply, tensors or {}, block=False)
        except OSError:
            self.bls.stop(call, ResourceExhausted(f"{self.label}: it does not read its answers"))

    def tell_cancelled(self, rid: int) -> None:
        """Tell the model request ``rid`` was cancelled (its ``is_cancelled()``), without
        blocking: a model that does not read its socket misses the notice, nothing else."""
        mailbox = self.mailbox
        if mailbox is None or mailbox.closed:
            return
        self.sent_since += 1
        with contextlib.suppress(OSError):
            mailbox.send({"op": Kind.CANCEL, "rid": rid}, block=False)

    # --- decoupled requests

    def cancel_request(self, rid: int) -> None:
        """A decoupled request was cancelled: tell the model (``is_cancelled()``) and stop
        expecting its responses (its execute, if it runs on, is the hang watch's)."""
        self.closed(rid)
        self.tell_cancelled(rid)

    def fail(self, rid: int, sender: ResponseSender, error: BaseException) -> None:
        """End decoupled request ``rid`` with ``error``."""
        self.closed(rid)
        sender.fail(error)

    def serve(self, mailbox: ipc.Mailbox, exit_code: Callable[[], int | None]) -> None:
        """A decoupled model's reader: keeps the socket read between executes, and fails the
        requests still open when the process goes."""
        try:
            while True:
                _, fds = mailbox.wait("reader")
                for fd in fds:
                    os.close(fd)
        except EOFError:
            pass
        code = exit_code()
        for rid, sender in list(self.open.items()):
            self.fail(
                rid,
                sender,
                InferenceError(
                    f"{self.label}: its process ended (exit code {code}) while the request was "
                    "open; it is started again for the next request"
                ),
            )

    def close(self) -> None:
        """The model is unloaded: its calls' threads go."""
        self.calls.close()
