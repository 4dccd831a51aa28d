"""A traced generation's spans: its wait in the engine's queue, each prompt chunk, and its
decoding with one event per batch of its tokens.

A request is traced when its :class:`.types.GenerationRequest` carries a span to open these
under (``trace``: the model's span the data plane opens for the request's stream, or the run
of a device that started it; ``plugins/tracing.py``). The engine then gives its
:class:`~.scheduler.RequestState` one :class:`RequestSpans`; a request that is not traced has
None there, and that check is all tracing costs it: the engine asks it once per request and
per step, the runner once per prompt chunk.

The spans, under the request's span (the model's, as Triton names it):

=========  ==============================================  =================================
span       from, to                                        attributes
=========  ==============================================  =================================
queue      the engine takes the request (``Engine.add``),  (the model's, at export)
           to its first prompt chunk starting
prefill    one per prompt chunk: its forward                ``plugserve.prompt_offset``,
                                                           ``plugserve.tokens``,
                                                           ``plugserve.batch_rows``
decode     the prompt computed, to the last token           ``gen_ai.usage.completion_tokens``,
                                                           ``gen_ai.response.finish_reasons``
=========  ==============================================  =================================

``decode`` has one ``tokens`` event per step that gave the request tokens (``plugserve.tokens``:
how many, one per sequence that advanced; ``plugserve.batch_rows``: the rows of the batch
they were chosen in), at most ``plugins.tracing.MAX_EVENTS`` (128) a span: a longer answer
keeps its first events and counts the rest in ``plugserve.dropped_events``. The span the
request's spans open under gets the request's counts (``gen_ai.usage.prompt_tokens``,
``gen_ai.usage.completion_tokens``, ``plugserve.cached_prompt_tokens``) and its sequences'
``gen_ai.response.finish_reasons``, vLLM's names. A failure of the engine's (a forward's, a
sequence's sampling or detokenizing) is recorded on the spans it ended.

**Written before the trace ends.** The request's trace ends (and goes to the exporter, whose
thread reads the spans) once its stream ends: the engine's last event, a failure it sends, or
the request's cancellation (its client left, its deadline passed), which the engine learns at
its next step. So everything here is written by the engine's loop thread before it sends the
request's last event or failure, and once the trace has ended nothing more is: a cancelled
request's spans are exported as they stood when it was cancelled (open ones ending with the
request; its finish reasons empty, the model's span saying why it was cancelled). The
attributes written after a span is kept are set when it is made and only replaced later (a
dictionary whose size does not change can be read while it is written), and the counts are
brought up to date at each step's event.

Bounds: a request keeps 3 spans of its own and one per prompt chunk (a prompt of a 4,096
context in chunks of ``max_num_batched_tokens``, 256 on ORT by default: 16); the trace keeps at most
``plugins.tracing.MAX_SPANS`` (256) in all.
"""

from __future__ import annotations

from typing import Any

from plugserve.plugins.tracing import Span

__all__ = ["RequestSpans"]

_COMPLETION = "gen_ai.usage.completion_tokens"
_REASONS = "gen_ai.response.finish_reasons"


class RequestSpans:
    """The spans of one traced generation (see the module's docstring), made when the
    engine takes the request (``prompt_tokens``: its prompt's length)."""

    __slots__ = ("decode", "over", "parent", "pending", "prefill", "queue", "rows")

    def __init__(self, parent: Span, prompt_tokens: int) -> None:
        self.parent = parent
        parent.set("gen_ai.usage.prompt_tokens", prompt_tokens)
        parent.set("plugserve.cached_prompt_tokens", 0)
        parent.set(_COMPLETION, 0)
        parent.set(_REASONS, [])
        self.queue: Span | None = parent.span("queue")
        #: the prompt chunk whose forward runs now
        self.prefill: Span | None = None
        self.decode: Span | None = None
        #: tokens chosen this step and not yet in an event, and the rows of their batch
        self.pending = 0
        self.rows = 0
        #: nothing more is written: the request ended, or its trace did
        self.over = False

    def _live(self) -> bool:
        """Whether the spans may still be written (the request's trace has not ended)."""
        if not self.over and self.parent.trace.end_ns:
            self.over = True
        return not self.over

    def chunk(self, offset: int, tokens: int, rows: int) -> None:
        """A prompt chunk of ``tokens`` from position ``offset`` starts (in a forward of
        ``rows`` rows): the queue's wait ends with the first."""
        if not self._live():
            return
        queue = self.queue
        if queue is not None:
            queue.end()
            self.queue = None
        self.prefill = self.parent.span(
            "prefill",
            {
                "plugserve.prompt_offset": offset,
                "plugserve.tokens": tokens,
                "plugserve.batch_rows": rows,
            },
        )

    def chunked(self, error: BaseException | None = None) -> None:
        """The chunk's forward ended (``error``: it failed)."""
        span = self.prefill
        if span is not None and self._live():
            if error is not None:
                span.fail(error)
            span.end()
        self.prefill = None

    def decoding(self, cached: int) -> None:
        """The prompt is computed (``cached`` of its tokens came from the prefix cache): its
        first token is chosen now."""
        self.chunked()
        if self._live():
            self.parent.set("plugserve.cached_prompt_tokens", cached)
            self.decode = self.parent.span("decode", {_COMPLETION: 0, _REASONS: []})

    def token(self, rows: int, final: bool, state: Any) -> bool:
        """One of the request's sequences got a token in a batch of ``rows``; ``final``: the
        request's last. True when it is the first this step (the caller then calls
        :meth:`flush` once the step's tokens are chosen); the last one's event, the counts and
        the spans' end are written now, before that token is sent."""
        self.pending += 1
        self.rows = rows
        if final:
            self.finished(state)
            return False
        return self.pending == 1

    def flush(self, state: Any = None) -> None:
        """The step's event (the tokens it gave the request) and the counts so far."""
        count, self.pending = self.pending, 0
        decode = self.decode
        if not count or decode is None or not self._live():
            return
        decode.event("tokens", {"plugserve.tokens": count, "plugserve.batch_rows": self.rows})
        if state is not None:
            generated = sum(seq.generated for seq in state.sequences)
            decode.attributes[_COMPLETION] = generated
            self.parent.attributes[_COMPLETION] = generated

    def finished(self, state: Any, error: BaseException | None = None) -> None:
        """The request ended (each sequence's ``finish_reason`` set) or failed (``error``):
        its counts and finish reasons written, its open spans ended."""
        if self.pending:
            self.flush()
        if not self._live():
            return
        self.over = True
        generated = sum(seq.generated for seq in state.sequences)
        reasons = [seq.finish_reason or "abort" for seq in state.sequences]
        for span in (self.parent, self.decode):
            if span is not None:
                span.attributes[_COMPLETION] = generated
                span.attributes[_REASONS] = reasons
        for span in (self.queue, self.prefill, self.decode):
            if span is not None:
                if error is not None:
                    span.fail(error)
                span.end()
        self.queue = self.prefill = self.decode = None
