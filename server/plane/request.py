"""One inference request as the server holds it, from its adapter to its answer.

Every protocol adapter (KServe v2 over gRPC and REST, plugserve.v1, OpenAI, Triton's generate
extension) and every application that calls a model (an ensemble's step, a Python model's BLS
call, an embeddings run) builds one :class:`Request` where it decodes the call, and hands it to
:meth:`DataPlane.infer` (one answer) or :meth:`DataPlane.stream` (a stream of responses).
Nothing about the request travels beside it: its identity, deadline, cancellation, the bytes it
is charged, the outputs it wants, its parameters, its place in a sequence, its ``timeout`` and
``priority`` (which a model's queue policy reads) and its trace context are fields here, so the
data plane admits it, accounts for it and releases it in one place
(``DataPlane._admit``), as MLServer's ``_infer_contextmanager`` and vLLM's
``EngineCoreRequest`` keep a request in one object.

The device sees the part of it a device may act on, a frozen
:class:`plugserve.plugins.run_context.RunContext` (:meth:`Request.context`: its cancellation
token :attr:`Request.run`, the room an output may take, the outputs wanted, what a Python
model reads of its request: id, parameters, sequence, timeout, and its caller's tenant),
which the data plane builds when the run starts and hands to the device as an argument:
plugins never import the server.

The fields are set once, by the adapter, before the request is admitted; the data plane only
reads them (but for :attr:`deadline`, which a request's ``timeout`` parameter and its client's
own deadline meet in, and :attr:`holds`, what is charged).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from plugserve.plugins import cancel
from plugserve.plugins.api import InvalidInput
from plugserve.plugins.run_context import RunContext

if TYPE_CHECKING:
    import numpy as np

    from plugserve.plugins.tracing import Span
    from plugserve.server.plane.networks import LoadedNetwork
    from plugserve.server.plane.sequences import Step

__all__ = ["MAX_REQUEST_ID", "Request", "checked_id"]

#: the longest request id a client may send (characters): every response of the request
#: echoes it (a decoupled or generate stream's each one), so a 512 KB id on a stream of 3,000
#: tokens had made 1.5 GB of answer from a 0.5 MB request; ids are names (a UUID is 36)
MAX_REQUEST_ID = 1024


def checked_id(value: str) -> str:
    """A request's ``id``, refused when longer than :data:`MAX_REQUEST_ID`."""
    if len(value) > MAX_REQUEST_ID:
        raise InvalidInput(
            f"the request's id is {len(value)} characters long; at most {MAX_REQUEST_ID} "
            "(every response echoes it)"
        )
    return value


class Request:
    """One request to one loaded network (``entry``, the adapter's one lookup).

    Inputs come one of three ways: ``inputs`` by name; ``checked``, arrays in the network's
    order that a protocol's fast path already knows pass the network's checks; or ``decode``,
    a callable that decodes them once the request's bytes are charged (KServe's typed contents
    and strings allocate memory of their own, which must be charged before it is allocated).
    """

    __slots__ = (
        "after",
        "checked",
        "deadline",
        "decode",
        "entry",
        "holds",
        "id",
        "inline",
        "inputs",
        "outputs",
        "parameters",
        "partial_outputs",
        "priority",
        "protocol",
        "run",
        "sequence",
        "step",
        "tenant",
        "timeout",
        "trace",
        "unread",
    )

    def __init__(
        self,
        entry: LoadedNetwork,
        inputs: Mapping[str, Any] | None = None,
        *,
        outputs: list[str] | None = None,
        checked: list[np.ndarray] | None = None,
        decode: Callable[[], Mapping[str, Any]] | None = None,
        deadline: float | None = None,
        run: cancel.Token | None = None,
        id: str = "",
        parameters: dict[str, Any] | None = None,
        step: Step | None = None,
        holds: int = 0,
        inline: bool = False,
        after: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        timeout: float | None = None,
        priority: int = 0,
        protocol: str = "",
        trace: Any = None,
        partial_outputs: bool = False,
        like: Request | None = None,
        tenant: str = "",
        unread: tuple[int, int] | None = None,
    ) -> None:
        self.entry = entry
        #: the inputs by name (unused when ``checked`` or ``decode`` gives them)
        self.inputs = inputs
        #: the outputs the client asked for, by name (None: every one the network answers)
        self.outputs = outputs
        self.checked = checked
        self.decode = decode
        #: when the request stops waiting (``time.monotonic``): the client's deadline and its
        #: ``timeout`` parameter, whichever comes first; the server's --max-request-seconds is
        #: the data plane's own
        self.deadline = deadline
        #: bytes charged to --max-inflight-bytes when it is admitted, held until it is answered
        #: (0: the adapter charged them itself, as REST does when a body's headers arrive)
        self.holds = holds
        #: the responses and bytes its stream may keep unread, when more than the stream's
        #: own bound (None: that bound): a face that charged its whole answer to the budget
        #: before it started, and reads it itself (a non-streamed answer), lets it be that
        #: much behind. On a busy machine a 10 MB answer's own reader fell 1 MiB behind the
        #: engine, and its request failed 429 "the client is not reading"
        self.unread = unread
        #: its caller waits for the answer anyway (a unary call): run on the caller's thread
        #: when one of the network's streams is idle
        self.inline = inline
        #: applied to the outputs on the thread that ran the request, before it counts as
        #: done (outputs written into shared memory regions)
        self.after = after
        #: the place in a sequence (Triton's ``sequence_*`` parameters), or None
        self.step = step
        #: which face it came in by ("grpc", "rest", "v1", "openai", "bls", "ensemble"), for
        #: traces and logs
        self.protocol = protocol
        if run is None:
            run = cancel.Token()
        #: its cancellation (``plugins/cancel.py``): what the deadline watch, its client and
        #: its queue policy act on
        self.run = run
        if like is not None:  # a run made for another request (a sequence's, a relay's)
            id, parameters, trace, tenant = like.id, like.parameters, like.trace, like.tenant
            timeout, priority, partial_outputs = like.timeout, like.priority, like.partial_outputs
        #: the client's id for the request (KServe's ``id``), "" when it gave none
        self.id = id
        #: the request's own parameters (those the server does not act on itself)
        self.parameters = parameters
        #: Triton's ``timeout`` (seconds) and ``priority`` (1 is the highest; 0: the model's
        #: default level) parameters: the model's queue policy reads them, else the timeout
        #: is a deadline
        self.timeout = timeout
        self.priority = priority
        #: the request's trace (``plugins/tracing.py``: its spans, which the devices it runs on
        #: open theirs under), None when it is not traced: that check is tracing's only cost
        self.trace = trace
        #: outputs its model does not produce may be left out (an ensemble's step)
        self.partial_outputs = partial_outputs
        #: the caller's tenant as auth established it from its token (``auth.py``; "" without
        #: tokens: one tenant): what a model's caches are partitioned by (a generative
        #: network's prefix cache, docs/security.md)
        self.tenant = tenant
        #: ``(sequence id, flags)`` for a Python model's ``correlation_id()`` and ``flags()``
        self.sequence: tuple[int | str, int] | None = None
        if like is not None:
            self.sequence = like.sequence
        elif step is not None:
            self.sequence = (step.id, int(step.start) | int(step.end) << 1)

    def context(
        self,
        room: int = 0,
        answer: int = 0,
        outputs: list[str] | None = None,
        network: str = "",
        trace: Span | None = None,
    ) -> RunContext:
        """What the device is told when the request runs (``room``: what the budget has free
        then; ``answer``: the answer's bound; ``outputs``: those it computes; ``network``: the
        name refusals give; ``trace``: the span of its run, which the device opens its spans
        under, None when the request is not traced), with its token."""
        return RunContext(  # positional, in its fields' order: one per request, kept cheap
            self.run, network, None if outputs is None else tuple(outputs), room, answer,
            self.parameters, self.partial_outputs, self.id, self.sequence, trace,
            self.priority, self.timeout, getattr(self.after, "cuda_outputs", None), False,
            self.tenant,
        )  # fmt: skip

    def until(self, deadline: float | None) -> None:
        """Stop waiting at ``deadline`` too (a ``timeout`` parameter beside the client's)."""
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline

    def __repr__(self) -> str:
        entry = self.entry
        return f"<Request {entry.name}:{entry.version} id={self.id!r} via {self.protocol or '?'}>"
