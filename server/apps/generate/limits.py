"""What one generation request may make the server do before it generates, on every face (the
OpenAI routes, KServe ``generate`` / ``generate_stream``, Triton's ``text_input`` over gRPC),
and how much of the unread answer the server keeps for it.

The bounds, each checked before the work it bounds:

* **Prompt text.** A prompt of more UTF-8 bytes than the model's context times its longest
  token's bytes (``Tokenizer.max_token_bytes``) cannot fit the context whatever it says: it is
  refused with 400 before it is rendered or tokenized (tokenizing first cost 214 bytes of
  resident memory per byte of text and held the GIL: a 2.7 MB prompt stalled every protocol
  for 2.4-2.7 s and grew the server by 578 MB before its 400). ``--max-prompt-bytes`` lowers
  the bound server-wide. A chat is checked on its messages' characters first (characters are
  at most bytes), then rendered with the bound (a template stops at it), then its text's
  bytes are checked.
* **Tokenizing's memory.** Tokenizing a text takes up to :data:`TOKENIZE_BYTES_PER_BYTE` of
  memory per byte of it while it runs (measured with ``tokenizers`` 0.23's
  ``encode_batch_fast`` on a byte-level BPE: 143 per byte of English words, 121 of CJK, 255 of
  random ASCII): that much is charged to ``--max-inflight-bytes`` before tokenizing starts and
  released when it ends; over the budget the request is refused (429 / RESOURCE_EXHAUSTED).
  Up to :data:`UNCHARGED_TOKENIZING` (a text of 3,276 bytes at most) nothing is charged: only a
  bounded set of threads tokenizes (the OpenAI face's two workers; for KServe's generate, the
  model's streams, which the operator sets), each holding at most that much uncharged, and no
  client adds threads. Charging it made a burst of small chats starve: each
  chat's 40 KiB for its tokenizing did not fit between the 300-byte bodies of the requests
  behind it, which took every byte a refusal freed (1,000 chats sent at once on raw sockets to
  a 300 KB budget: 35 and 144 served in two runs, the official client's burst once none on a
  loaded host; uncharged, 144-194; tests/generate/test_openai_refusals.py).
* **Unread events.** A generation stream keeps at most ``--max-stream-unread-bytes`` (1 MiB by
  default) of events its client has not taken (each event counted at its Python size:
  ``GenerationEvent.nbytes``, about 320 bytes, 2.9 KB with 20 logprob alternatives), none
  of them for longer than ``--request-read-timeout`` (30 s; checked as each event comes),
  besides the request's largest event and one token event after it (its logprobs:
  ``GenerationEvent.largest``, charged to the budget by the OpenAI face; a whole vocabulary's
  alternatives are MBs a token; the next token's, as a pipelined engine may send it while the
  reader takes one);
  past either the request is cancelled (``ResourceExhausted``: the client is not reading)
  and the engine frees its sequence's cache slot at its next step. Besides, the stream's
  consumer may hold what it took last (at most as much again) and its connection what the
  transport took: REST the socket's 128 KiB and the event loop's 64 KiB
  (``server/protocols/http/http_server.py``), gRPC the HTTP/2 stream's window. See
  ``server/plane/response_stream.py``.

The server sets these once at startup (:func:`configure`, from ``server/process/settings.py``); an
in-process user of a generative network gets the defaults and no memory budget.

Why threads, not a tokenizer process. TGI tokenizes on Rust worker threads behind its payload
limit; vLLM runs its engine core in a process of its own and tokenizes in its API server. Here
the tokenizer is Rust too (``tokenizers``' ``encode_batch_fast`` releases the GIL for all but
the conversion of its ids to a list: 15 ms for a million ids), rendering a template is bounded
by the prompt's bound, and both run on the OpenAI adapter's worker threads or a model's stream
threads, never the REST loop. With text the context cannot hold refused unread and the rest
charged to the budget, a process would add a copy of every prompt and its ids through a socket
and a second tokenizer and template environment per model, for nothing the probes measured:
during every attack of tests/server/test_attacks_generate.py REST and gRPC health answered
within 250 ms (p99) with threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from plugserve.plugins.api import InvalidArgument
from plugserve.server.apps.generate.types import (
    GenerationEvent,
    GenerationRequest,
    logprob_entry_bytes,
)
from plugserve.server.plane.budget import MemoryBudget
from plugserve.server.plane.response_stream import ResponseStream

__all__ = [
    "TOKENIZE_BYTES_PER_BYTE",
    "UNCHARGED_TOKENIZING",
    "PromptTooLong",
    "check_prompt",
    "configure",
    "memory_budget",
    "prompt_limit",
    "stream_bounded",
    "text_bytes",
    "tokenizing",
]

#: memory tokenizing takes per byte of text, at most (see the module's docstring: 255 measured
#: at worst, with a margin)
TOKENIZE_BYTES_PER_BYTE = 320
#: tokenizing that takes at most this much memory is not charged (see the module's docstring)
UNCHARGED_TOKENIZING = 1 << 20


@dataclasses.dataclass
class _Limits:
    budget: MemoryBudget | None = None
    max_prompt_bytes: int = 0
    stream_unread_bytes: int = 1 << 20
    stream_unread_seconds: float = 30.0


_limits = _Limits()


def configure(
    budget: MemoryBudget | None,
    max_prompt_bytes: int = 0,
    stream_unread_bytes: int = 1 << 20,
    stream_unread_seconds: float = 30.0,
) -> None:
    """The server's settings: its memory budget, ``--max-prompt-bytes`` (0: the context's
    bound only), ``--max-stream-unread-bytes`` and ``--request-read-timeout`` (how long an
    event may wait unread)."""
    _limits.budget = budget
    _limits.max_prompt_bytes = max_prompt_bytes
    _limits.stream_unread_bytes = stream_unread_bytes
    _limits.stream_unread_seconds = stream_unread_seconds


def memory_budget() -> MemoryBudget | None:
    """The server's memory budget (None in process: nothing charged), which what a model
    keeps between requests is charged to as well (the KV host tier, :mod:`.kv_host_tier`)."""
    return _limits.budget


class PromptTooLong(InvalidArgument):
    """A prompt over its model's bound, refused before it was tokenized."""


def prompt_limit(tokenizer: Any, context: int) -> int:
    """The most bytes of prompt text a model of ``context`` tokens takes (see the module)."""
    limit = context * tokenizer.max_token_bytes
    if _limits.max_prompt_bytes:
        limit = min(limit, _limits.max_prompt_bytes)
    return limit


def text_bytes(text: str | bytes) -> int:
    """``text``'s size in UTF-8 bytes (an ASCII string's length, without encoding it)."""
    if isinstance(text, bytes | bytearray | memoryview):
        return len(text)
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_prompt(size: int, tokenizer: Any, context: int, what: str = "the prompt") -> None:
    """PromptTooLong (400) when ``size`` bytes of text (or characters: never more than its
    bytes) are over :func:`prompt_limit`; the message says which bound and how to fix it."""
    limit = prompt_limit(tokenizer, context)
    if size <= limit:
        return
    if _limits.max_prompt_bytes and limit == _limits.max_prompt_bytes:
        why = f"this server takes at most {limit:,} bytes of prompt text (--max-prompt-bytes)"
    else:
        why = (
            f"this model's context of {context:,} tokens holds at most {limit:,} bytes of text "
            f"(its longest token is {tokenizer.max_token_bytes} bytes)"
        )
    raise PromptTooLong(f"{what} is at least {size:,} bytes long; {why}. Please shorten it.")


@contextlib.contextmanager
def tokenizing(nbytes: int, what: str) -> Iterator[None]:
    """Hold the memory tokenizing ``nbytes`` of text takes, charged before and released after
    (ResourceExhausted, 429, when the budget has no room for it)."""
    budget = _limits.budget
    takes = nbytes * TOKENIZE_BYTES_PER_BYTE
    if budget is None or takes <= UNCHARGED_TOKENIZING:
        yield
        return
    charge = budget.charge(takes, f"tokenizing {what}")
    try:
        yield
    finally:
        charge.release()


def stream_bounded(sender: Any, request: GenerationRequest | None = None) -> None:
    """Bound what a generation request's stream keeps unread (``--max-stream-unread-bytes``),
    plus the largest event ``request`` makes (its logprobs: ``GenerationEvent.largest``; an
    event is sent whole, and the face charged it to the budget before the request started),
    so a request asking more alternatives than the bound holds is served, and one that stops
    reading is still cancelled past one such event; called before the stream's first event (a
    sender that is no stream is left alone)."""
    if isinstance(sender, ResponseStream):
        largest = next_one = 0
        if request is not None:
            largest = GenerationEvent.largest(request)
            logprobs = request.params.logprobs
            next_one = logprob_entry_bytes(logprobs + 1) if logprobs is not None else 0
        # and the token event after it: a pipelined engine (overlap.py) sends a step's events
        # while the step behind it runs, so a reader that keeps up may find the next one come
        # already (only the first event carries the prompt's logprobs)
        sender.max_bytes = min(sender.max_bytes, _limits.stream_unread_bytes) + largest + next_one
        sender.max_wait = _limits.stream_unread_seconds
