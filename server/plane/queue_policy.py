"""Triton's queue policies: how long a model's requests may wait, how many may wait, and in
which order they are served, from the ``dynamic_batching`` of its ``config.pbtxt``.

Triton keeps one queue per priority level in front of a model's instances
(``src/scheduler_utils.cc``: ``PriorityQueue``, ``PolicyQueue``); plugserve keeps the same
rules where its requests wait, on every device (an ONNX network, a Python model, a BATCH
device's batcher):

=================================  ===========================================================
``priority_levels``                levels 1..N, 1 served first; 0 (Triton's default): one level
``default_priority_level``         the level of a request that names none, or one out of range
                                   (the request's ``priority`` parameter, as Triton's
                                   ``SetPriority``)
``default_queue_policy``           each level's policy unless ``priority_queue_policy`` names
                                   the level
``max_queue_size``                 requests of the level that may wait (0: no bound, the
                                   server's ``--queue-size`` still holds): one more is refused
                                   at once, UNAVAILABLE (HTTP 503), "Exceeds maximum queue size"
``default_timeout_microseconds``   how long a request may wait before ``timeout_action``
                                   (0: forever)
``allow_timeout_override``         a request's own ``timeout`` parameter (microseconds) is its
                                   wait's bound when it is not 0 and under the default (as
                                   Triton: ``override != 0 && override < default``)
``timeout_action``                 REJECT: answered at once, UNAVAILABLE (503), "Request timeout
                                   expired"; DELAY: it runs after every request of its level
                                   that has not waited past its own bound
=================================  ===========================================================

A request *waits* from its admission until it starts on its model: a stream takes it, or, on a
device that gathers requests into batches (BATCH, a Python model with dynamic batching), its
batch starts (``CompiledNetwork.gathers``; the device says so with ``cancel.started``). That is
Triton's queue: in its QA test (``qa/L0_http``: ``max_queue_size: 1``, a 1 s batching delay) the
first request waits for its batch, and a second one is refused with 503. Priorities order what
waits for a stream (``plugins/streams.py``) and what a device's batcher gathers (BATCH, a Python
model's dynamic batching: the token's ``place``): a batch takes the highest priority first,
arrival order within a level, as Triton's dynamic batcher (issue 52: 8 of 16 pairs of a high
and a low priority request ran low first). Both form a batch when their instance (BATCH: a
stream of its device) is free, as Triton's, and a model with priority levels lets 64 requests
wait in its batcher (``model_control.WAITING_WITH_PRIORITIES``, the Python gatherer's
``MAX_GATHER_STREAMS``), so a higher priority reaches it while lower ones wait there.

A model with a queue policy reads a request's ``timeout`` as Triton does, as its wait's bound
(when the policy allows an override); a model without one keeps plugserve's meaning, the
request's deadline, queued or running (``dataplane.py``). Each policy's bookkeeping is one lock
per model and one timer per request with a bound (the data plane's ``queue-timeouts`` watch);
a model without a policy pays nothing for them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from typing import Any

from plugserve.plugins.api import InvalidArgument, PlugserveError
from plugserve.plugins.cancel import Token

__all__ = ["LevelPolicy", "PolicyQueue", "QueuePolicy", "QueueRejected", "read_queue_policy"]


class QueueRejected(PlugserveError):
    """Refused by the model's queue policy: its level's queue is full, or the request waited
    past its bound (Triton's UNAVAILABLE, HTTP 503; the client may retry)."""

    code = "UNAVAILABLE"


@dataclasses.dataclass(frozen=True)
class LevelPolicy:
    """One level's ``ModelQueuePolicy``."""

    #: requests that may wait at once (0: no bound)
    max_queue_size: int = 0
    #: seconds a request may wait (0: no bound)
    timeout: float = 0.0
    #: a request's own ``timeout`` may shorten it
    allow_override: bool = False
    #: past the bound the request runs later (DELAY) instead of being refused (REJECT)
    delay: bool = False

    def bound(self, requested: float | None) -> float:
        """Seconds a request that asked for ``requested`` (its ``timeout``) may wait."""
        if self.allow_override and requested and requested < self.timeout:
            return requested
        return self.timeout


@dataclasses.dataclass(frozen=True)
class QueuePolicy:
    """A model's queue policies (Triton's ``dynamic_batching`` fields), checked at load."""

    default: LevelPolicy = LevelPolicy()
    #: ``priority_levels`` (0: one level)
    levels: int = 0
    default_level: int = 0
    per_level: tuple[tuple[int, LevelPolicy], ...] = ()

    def level(self, priority: int) -> int:
        """The level a request's ``priority`` puts it at (Triton's ``SetPriority``)."""
        if not self.levels:
            return 0
        return priority if 1 <= priority <= self.levels else self.default_level

    def of(self, level: int) -> LevelPolicy:
        for number, policy in self.per_level:
            if number == level:
                return policy
        return self.default


def _level_policy(message: Any) -> LevelPolicy:
    return LevelPolicy(
        max_queue_size=int(message.max_queue_size),
        timeout=int(message.default_timeout_microseconds) / 1e6,
        allow_override=bool(message.allow_timeout_override),
        delay=message.timeout_action == type(message).DELAY,
    )


def read_queue_policy(batching: Any, where: str) -> QueuePolicy | None:
    """The queue policy of a ``ModelDynamicBatching`` message (None when it sets none),
    checked as Triton checks it (InvalidArgument naming the field)."""
    fields = {f.name for f, _ in batching.ListFields()}
    if not fields & {"default_queue_policy", "priority_levels", "priority_queue_policy"}:
        return None
    levels = int(batching.priority_levels)
    default_level = int(batching.default_priority_level)
    if levels and not 1 <= default_level <= levels:
        raise InvalidArgument(
            f"{where}: dynamic_batching default_priority_level {default_level} must be in "
            f"range [1, {levels}] (priority_levels)"
        )
    per_level = []
    for level, message in sorted(batching.priority_queue_policy.items()):
        if not 1 <= level <= levels:
            raise InvalidArgument(
                f"{where}: dynamic_batching priority_queue_policy has priority level {level}; "
                f"it must be in range [1, {levels}] (priority_levels)"
            )
        per_level.append((int(level), _level_policy(message)))
    if batching.preserve_ordering and levels > 1:
        raise InvalidArgument(
            f"{where}: only one priority level is allowed when preserve_ordering is true"
        )
    return QueuePolicy(
        _level_policy(batching.default_queue_policy),
        levels,
        default_level if levels else 0,
        tuple(per_level),
    )


_WAITING, _STARTED, _EXPIRED, _LEFT = range(4)


class Ticket:
    """One admitted request's place in its model's policy queue: counted as waiting until it
    starts or ends, and acted on once its bound passes (the watch calls :meth:`cancel`)."""

    __slots__ = ("_delay", "_executor", "_future", "_queue", "_state", "level", "place", "token")

    def __init__(self, queue: PolicyQueue, level: int, token: Token, delay: bool) -> None:
        self._queue, self.level, self.token, self._delay = queue, level, token, delay
        self.place = 2 * level  # plugins/streams.py: smaller first; DELAYED adds 1
        token.place = self.place  # a batcher's order (BATCH, a Python model's dynamic batching)
        self._state = _WAITING
        self._future: Future | None = None
        self._executor: Any = None

    def queued(self, future: Future, executor: Any) -> None:
        """Where the request waits (a DELAY past its bound moves it there)."""
        self._future, self._executor = future, executor

    def started(self) -> None:
        """It starts on its model: no longer waiting (``Token.on_start``)."""
        queue = self._queue
        with queue.lock:
            if self._state != _WAITING:
                return
            self._state = _STARTED
            queue.waiting[self.level] -= 1
        queue.watch.forget(self)

    def ended(self, _future: Any = None) -> None:
        """Its future is done (answered, refused, cancelled, failed)."""
        queue = self._queue
        with queue.lock:
            if self._state in (_STARTED, _LEFT):
                return
            self._state = _LEFT
            queue.waiting[self.level] -= 1
        queue.watch.forget(self)

    def cancel(self, error: PlugserveError) -> bool:
        """Its bound passed (the watch's call): REJECT fails it with ``error``; DELAY moves it
        behind its level's others. Nothing when it started or ended meanwhile."""
        queue = self._queue
        with queue.lock:
            if self._state != _WAITING:
                return False
            if not self._delay:
                self._state = _EXPIRED  # counted until its future is done
        if self._delay:
            self.token.place = self.place | 1  # behind its level's others in a batcher too
            executor, future = self._executor, self._future
            if executor is not None and future is not None:
                executor.delay(future)
            return True
        return self.token.cancel(error)


def _timed_out(name: str, waited: float) -> QueueRejected:
    return QueueRejected(
        f"Request timeout expired: model {name!r}: the request waited {waited:.3f} s in its "
        "queue, past its queue policy's timeout (config.pbtxt dynamic_batching); retry later"
    )


class PolicyQueue:
    """A loaded model's queue policy at work: how many of its requests wait at each level,
    and the timer of each that has a bound."""

    def __init__(self, name: str, policy: QueuePolicy, watch: Any) -> None:
        self.name, self.policy, self.watch = name, policy, watch
        self.lock = threading.Lock()
        self.waiting: dict[int, int] = {}

    def enter(self, token: Token, priority: int = 0, timeout: float | None = None) -> Ticket:
        """Admit one request (its ``token``, and its ``priority`` and ``timeout`` parameters:
        ``Request.priority``, ``Request.timeout``): its ticket, or QueueRejected when its
        level's queue is full. The ticket stops counting when ``token``'s request starts
        (``Token.on_start``) or its future is done (:meth:`Ticket.ended`)."""
        policy = self.policy
        level = policy.level(priority)
        rules = policy.of(level)
        with self.lock:
            waiting = self.waiting.get(level, 0)
            if rules.max_queue_size and waiting >= rules.max_queue_size:
                raise QueueRejected(
                    f"Exceeds maximum queue size: model {self.name!r}"
                    + (f" priority level {level}" if policy.levels else "")
                    + f": {waiting} requests wait, its queue policy's max_queue_size "
                    f"{rules.max_queue_size} (config.pbtxt dynamic_batching); retry later"
                )
            self.waiting[level] = waiting + 1
        ticket = Ticket(self, level, token, rules.delay)
        token.on_start = ticket.started
        bound = rules.bound(timeout)
        if bound:
            now = time.monotonic()
            self.watch.watch(ticket, now + bound, _timed_out, self.name, bound)
        return ticket
