"""Stopping work whose caller is gone: loads and queries, and running inferences.

**Loads and queries.** Compiling a network runs for as long as its model asks; the caller of
LoadNetwork or QueryNetwork may cancel, or pass its deadline, long before. The server says how
to tell (``should_stop``, e.g. "the RPC is no longer active") with :func:`stop_when` around
the call; the long steps (between transformation passes, between the subgraphs of a HETERO
load) ask :func:`check`, which raises :class:`Cancelled` once it is true.

**Runs.** One inference can run for as long as its inputs ask: a Loop's trip count, a while
loop's condition or a Scan's length come from the request. Each run has a :class:`Token`; its
owner (the server's deadline watch, a client that went away, ``InferRequest.cancel()``)
cancels it with the error the caller should get, and the run stops at its next checkpoint:
NUMPY checks between nodes and between Loop and Scan iterations (:func:`checkpoint`), ORT and
OPENVINO register a callback (:meth:`Token.on_cancel`) that interrupts their backend. A device
stops no sooner than its backend lets it: a single kernel runs to its end.

The token is cancellation only: what the run is for reaches its device as an argument, a
:class:`~plugserve.plugins.run_context.RunContext` that holds the token. Both ``should_stop``
and the run's token are also context variables, for the checkpoints alone: a checkpoint sits
where no argument reaches (between transformation passes, in NUMPY's node loop and its Loop
and Scan bodies, a TorchScript program's hooks), and a nested run on the same thread answers
to the same token; work handed to another thread takes its token along explicitly
(:func:`running`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from plugserve.plugins.errors import Cancelled, PlugserveError, ResourceExhausted

__all__ = [
    "Token",
    "check",
    "checking",
    "checkpoint",
    "current",
    "enter",
    "every",
    "leave",
    "running",
    "started",
    "stop_when",
]

log = logging.getLogger(__name__)


class _Stop(NamedTuple):
    """What :func:`check` asks: whether the caller is gone, and until when the work may run
    (``until``, ``time.monotonic``; ``inf``: no limit) under which limit (``limit``, the
    flag that sets it)."""

    should_stop: Callable[[], bool] | None
    until: float
    seconds: float
    limit: str


_should_stop: contextvars.ContextVar[_Stop | None] = contextvars.ContextVar(
    "plugserve_should_stop", default=None
)
_token: contextvars.ContextVar[Token | None] = contextvars.ContextVar(
    "plugserve_run_token", default=None
)


@contextlib.contextmanager
def stop_when(
    should_stop: Callable[[], bool] | None, seconds: float = 0.0, limit: str = ""
) -> Iterator[None]:
    """Within the block, :func:`check` raises once ``should_stop()`` is true (None: never),
    and once ``seconds`` have passed (0: no limit), naming ``limit`` (the flag that sets it):
    the server's own bound on work a client asks for (QueryNetwork: --max-read-seconds)."""
    until = time.monotonic() + seconds if seconds > 0 else math.inf
    token = _should_stop.set(_Stop(should_stop, until, seconds, limit))
    try:
        yield
    finally:
        _should_stop.reset(token)


def check(what: str) -> None:
    """Raise :class:`Cancelled` when the caller of the load or query under way is gone, and
    :class:`ResourceExhausted` when it has run past the time it was given."""
    stop = _should_stop.get()
    if stop is None:
        return
    if stop.should_stop is not None and stop.should_stop():
        message = f"{what}: stopped, its caller is gone (cancelled or past its deadline)"
        log.info("%s", message)  # the caller cannot read the error: the log says it
        raise Cancelled(message)
    if time.monotonic() > stop.until:
        raise ResourceExhausted(
            f"{what}: stopped after {stop.seconds:g} s, this server's limit ({stop.limit})"
        )


def checking(what: str, every: int = 1024) -> Callable[[int], None]:
    """:func:`check` for a loop over many items: ``tick(i)`` checks on every ``every``-th
    ``i``, so a loop of a million nodes asks a thousand times (a few hundred ns each)."""
    if _should_stop.get() is None:
        return _no_tick

    def tick(i: int) -> None:
        if i % every == 0:
            check(what)

    return tick


def _no_tick(_: int) -> None:
    pass


def _nothing() -> None:
    pass


class Token:
    """One run's cancellation: once cancelled it stays so, with the error the run raises.

    Cancelling is cheap and safe from any thread, before, during or after the run: before, the
    run raises at its first checkpoint without starting; after, nothing happens. Callbacks run
    on the cancelling thread, once, outside the token's lock (a backend's interrupt may block
    briefly); one registered after the cancellation runs at once.

    What the request is (its id, parameters, outputs, bounds, trace...) is not here: it is the
    run's :class:`~plugserve.plugins.run_context.RunContext`, handed to the device as an
    argument, which holds this token. The token keeps only what changes while the run waits
    or runs, owned by the run's lifecycle: its cancellation, that it is over (``finished``),
    and its place in its model's queue with the hook for when it leaves it (``place``,
    ``on_start``: written by a queue policy after the request was built, while it waits,
    which a frozen description could not take).
    """

    __slots__ = ("_callbacks", "_lock", "error", "finished", "on_start", "place")

    def __init__(self) -> None:
        #: the error the run raises once cancelled (None: not cancelled)
        self.error: PlugserveError | None = None
        #: where the request waits among its model's others, set by its model's queue policy
        #: (``Ticket.place``: twice its priority level, +1 once delayed; smaller first): a
        #: device that gathers requests into batches takes them in this order (Triton's
        #: dynamic batcher serves the highest priority first); 0: every request alike
        self.place = 0
        #: called once when the request starts on its model (:func:`started`), set by what
        #: counts it as waiting until then (a queue policy); None: nobody asked
        self.on_start: Callable[[], object] | None = None
        #: the run is over: cancelling now does nothing (and costs nothing)
        self.finished = False
        self._callbacks: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self.error is not None

    def cancel(self, error: PlugserveError | None = None) -> bool:
        """Cancel with ``error`` (default: :class:`Cancelled`); False if it already was, or
        the run is over."""
        if self.finished:
            return False
        with self._lock:
            if self.error is not None or self.finished:
                return False
            self.error = error if error is not None else Cancelled("the request was cancelled")
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one backend's failing interrupt must not stop the others
                log.exception("interrupting a cancelled run failed")
        return True

    def finish(self) -> None:
        """The run is over (its owner says so): later cancels are no-ops, and the callbacks
        (and what they hold) are let go. No lock: a cancel under way already took the
        callbacks it runs, and one registered from now on is never run."""
        self.finished = True
        self._callbacks = []

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` when cancelled (now, if it is); returns what unregisters it."""
        with self._lock:
            if self.error is None:
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        callback()
        return _nothing

    def _forget(self, callback: Callable[[], object]) -> None:
        with self._lock:  # once per run on ORT and OPENVINO: kept cheap
            callbacks = self._callbacks
            if callback in callbacks:
                callbacks.remove(callback)

    def raise_if_cancelled(self) -> None:
        if self.error is not None:
            raise self.failure()

    def failure(self) -> PlugserveError:
        """A fresh copy of the error, so runs on several threads raise their own."""
        error = self.error
        if error is None:
            return Cancelled("the request was cancelled")
        return type(error)(str(error))


def started(token: Token | None) -> None:
    """``token``'s request starts on its model now: a stream took it, or a device that gathers
    requests (``CompiledNetwork.gathers``) started the batch it is in."""
    if token is not None:
        hook = token.on_start
        if hook is not None:
            token.on_start = None
            hook()


def every(
    tokens: Sequence[Token | None], error: Callable[[], PlugserveError]
) -> tuple[Token | None, Callable[[], None]]:
    """A token for one run that serves several requests (a batch), cancelled with ``error()``
    once every request's own token is: until the last of their clients is gone, the others
    still want the run. None when a request has no token (it cannot be cancelled, so neither
    can the run); one request's run is its own token's. Also returns what unhooks the run's
    token from the requests' once the run is over."""
    if len(tokens) == 1:
        return tokens[0], _nothing
    if any(t is None for t in tokens):
        return None, _nothing
    run = Token()  # what the run is told of its requests: run_context.for_batch
    left = [len(tokens)]
    lock = threading.Lock()

    def one_gone() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            run.cancel(error())

    hooks = [t.on_cancel(one_gone) for t in tokens if t is not None]

    def forget() -> None:
        for unhook in hooks:
            unhook()

    return run, forget


@contextlib.contextmanager
def running(token: Token) -> Iterator[Token]:
    """Within the block, the run's checkpoints and backends answer to ``token``."""
    reset = _token.set(token)
    try:
        yield token
    finally:
        _token.reset(reset)


#: :func:`running` without a context manager, for a per-request hot path: ``entered =
#: enter(token)`` ... ``leave(entered)``. The context variable's own methods, so that a
#: request pays no Python call for them.
enter: Callable[[Token], contextvars.Token] = _token.set
leave: Callable[[contextvars.Token], None] = _token.reset

#: The token of the run under way on this thread (None outside a run).
current: Callable[[], Token | None] = _token.get


def checkpoint() -> None:
    """Raise the run's error if it was cancelled: a place where stopping is safe."""
    token = _token.get()
    if token is not None and token.error is not None:
        raise token.failure()
