"""An OpenAI answer assembled from the engine's events (DESIGN's ``answer.py``): the choices'
text, tokens, logprobs, tool calls and usage, whole (:meth:`Answer.body`) or as server-sent
chunks (:func:`stream_reply`, and :class:`_Pushed` for the plain chunks the HTTP thread writes
itself); and :class:`ServedModel`, a generative model as the face uses it. The routes
(``serving.py``) decode, call the engine and hand its streams here; a chat's events become
typed pieces (:meth:`Answer.deltas`, ``deltas.py``), which the chat route writes as chunks and
the Anthropic and Responses faces, from :func:`answer_deltas` (:func:`events_of`) or the
whole answer's :meth:`Answer.choice`, as their own events and bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from plugserve.plugins.api import Cancelled, PlugserveError
from plugserve.server.apps.generate.types import GenerationEvent
from plugserve.server.protocols.http import sse
from plugserve.server.protocols.http.http_server import Push, StreamReply
from plugserve.server.protocols.openai import encode, protocol, tools
from plugserve.server.protocols.openai.deltas import Delta, FaceEvents
from plugserve.server.protocols.openai.errors import OpenAIError, stream_error

__all__ = [
    "Answer",
    "ServedModel",
    "Started",
    "answer_deltas",
    "events_of",
    "merged",
    "sse_bytes",
    "stream_reply",
]


def sse_bytes(value: Any) -> bytes:
    return sse.event(orjson.dumps(value))


class ServedModel:
    """A generative model as the adapter uses it: its entry, network and tokenizer, and what
    the network says of its bounds (the adapter reads nothing of its engine)."""

    __slots__ = (
        "context",
        "entry",
        "max_n",
        "name",
        "network",
        "parsers",
        "tokenizer",
        "vocab_size",
    )

    def __init__(self, entry: Any) -> None:
        network = entry.network
        self.entry = entry
        self.name = entry.name
        self.network = network
        self.tokenizer = network.tokenizer
        #: the longest sequence, prompt and answer
        self.context: int = network.context
        #: the decoder's logits (a padded embedding may have more rows than the tokenizer)
        self.vocab_size: int = network.vocab_size
        #: choices per request at most
        self.max_n: int = network.max_n
        #: the model's own parser settings (config keys), over the server's
        self.parsers: dict[str, str] = network.parsers


async def merged(streams: list[Any]) -> AsyncIterator[list[tuple[int, GenerationEvent]]]:
    """The events of every prompt's stream as they come, with the prompt's number: a list of
    what one stream had ready at once (``ResponseStream.batches``: one wake-up, one write of
    the stream's chunks, however many events a lagging client let queue). Several streams go
    through a queue of one batch: beyond each stream's own bounded buffer a pump holds at most
    the batch it took, so the unread bound is at most doubled, never lifted."""
    if len(streams) == 1:
        async for items in streams[0].batches():
            batch = [(0, event) for event, _final in items if event is not None]
            if batch:
                yield batch
        return
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue(maxsize=1)
    finished = object()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for items in stream.batches():
                batch = [(i, event) for event, _final in items if event is not None]
                if batch:
                    await queue.put((batch, None))
            await queue.put((finished, None))
        except Exception as exc:
            await queue.put((finished, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            batch, error = await queue.get()
            if error is not None:
                raise error
            if batch is finished:
                left -= 1
                continue
            yield batch
    finally:
        for task in tasks:
            task.cancel()


@dataclasses.dataclass(slots=True)
class Started:
    """A generation under way (``OpenAIRoutes.started``): its answer, its streams (one a
    prompt), and the alternatives per prompt token its answer writes (None: no prompt
    logprobs)."""

    answer: Answer
    streams: list[Any]
    scored: int | None = None

    def cancel(self) -> None:
        """Every stream cancelled (one that ended is not affected): when the body that reads
        them ends, however it ends (a client that left before the first piece too)."""
        for stream in self.streams:
            with contextlib.suppress(Exception):
                stream.cancel()


async def answer_deltas(started: Started) -> AsyncIterator[list[Delta]]:
    """A chat answer's typed pieces (:meth:`Answer.deltas`) as its streams' events come: a
    list per wake-up, what came together (a face writes it at once); the streams cancelled
    when it ends, is closed or fails. A failure midway (the stream's, or the answer's: a
    PlugserveError or OpenAIError) is raised for the face to write as its last event, after
    the pieces of the events before it."""
    answer = started.answer
    try:
        async for batch in merged(started.streams):
            made: list[Delta] = []
            try:
                for prompt, event in batch:
                    made += answer.deltas(prompt, event)
            except (PlugserveError, OpenAIError):
                if made:  # (as chat's stream writes what came before its failure)
                    yield made
                raise
            if made:
                yield made
    finally:
        started.cancel()


async def events_of(
    events: FaceEvents, started: Started, ended: Callable[[], None] | None = None
) -> AsyncIterator[bytes]:
    """A face's streamed body: ``events``' opening, the events of the answer's typed pieces
    (:func:`answer_deltas`, a list per wake-up: their events written together) and its
    closing, ``ended()`` called once the closing is made, before it is sent (the Responses
    API keeps the response there). A failure midway (the status line is out) is the face's
    last event, from chat's error object."""
    deltas = answer_deltas(started)
    try:
        yield b"".join(events.opening())
        try:
            async for batch in deltas:
                made = [event for delta in batch for event in events.delta(delta)]
                if made:
                    yield b"".join(made)
        except (PlugserveError, OpenAIError) as exc:
            yield b"".join(events.failed(stream_error(exc)["error"]))
            return
        events.usage = started.answer.usage()
        closing = events.closing()
        if ended is not None:
            ended()
        yield b"".join(closing)
    finally:
        await deltas.aclose()  # type: ignore[attr-defined]
        started.cancel()  # (closed before its first piece, ``deltas`` never ran)


class Answer:
    """One request's choices as they grow: text, tokens, logprobs, finish reasons, counts."""

    def __init__(
        self,
        model: ServedModel,
        ask: protocol.GenerationAsk,
        kind: str,
        rid: str,
        prompts: list[list[int]],
        echo: bool,
        plan: tools.Plan | None = None,
    ) -> None:
        self.model = model
        self.ask = ask
        self.kind = kind
        self.rid = rid
        self.created = int(time.time())
        self.prompts = prompts
        self.echo = echo
        #: vLLM's chat echo: the text ahead of each choice's content ("" for none)
        self.chat_echo = protocol.chat_echo(ask) if isinstance(ask, protocol.ChatRequest) else ""
        self.names = encode.token_names(model.tokenizer) if ask.logprobs is not None else None
        #: echo, logprobs and max_tokens 0: the one token generated is left out
        self.prompt_only = False
        count = ask.n * len(prompts)
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[Any]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.completion = [0] * count
        self.prompt_tokens = [len(p) for p in prompts]
        self.cached = [0] * len(prompts)
        self.prompt_logprobs: list[Any] = [None] * len(prompts)
        self.offsets = [0] * count
        #: the choices whose stream has begun
        self.started: set[int] = set()
        #: each chat choice's reasoning, content and tool calls (None: content only)
        self.outputs = [plan.output() for _ in range(count)] if plan is not None else None
        #: a plain stream's chunk as a template (see :meth:`_plain_template`); None: not made
        self._template: bytes | None = None
        #: per choice, a plain chunk's bytes up to its text's JSON; after it, without a finish
        self._heads: list[bytes] = []
        self._tail = b""

    def index(self, prompt: int, event: GenerationEvent) -> int:
        return prompt * self.ask.n + event.index

    def bare(self, event: GenerationEvent) -> GenerationEvent:
        """``event`` as the answer takes it: with :attr:`prompt_only`, nothing generated."""
        if not self.prompt_only or not (event.token_ids or event.text or event.logprobs):
            return event
        return dataclasses.replace(
            event,
            token_ids=[],
            text="",
            logprobs=None,
            completion_tokens=0,
            finish_reason=None if event.finish_reason is None else "length",
        )

    def add(self, prompt: int, event: GenerationEvent) -> int:
        event = self.bare(event)
        i = self.index(prompt, event)
        if event.text:
            self.texts[i].append(event.text)
        if self.ask.return_token_ids:
            self.token_ids[i].extend(event.token_ids)
        if event.logprobs:
            self.logprobs[i].extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = event.prompt_logprobs
        if event.prompt_tokens:
            self.prompt_tokens[prompt] = event.prompt_tokens
        self.cached[prompt] = max(self.cached[prompt], event.cached_tokens)
        self.completion[i] = max(self.completion[i], event.completion_tokens)
        if event.finish_reason is not None:
            self.finish[i] = _finish_reason(event.finish_reason)
        return i

    def usage(self) -> dict[str, Any]:
        return encode.usage(sum(self.prompt_tokens), sum(self.completion), sum(self.cached))

    def _prompt_text(self, prompt: int) -> str:
        source = (
            self.ask.prompts[prompt] if isinstance(self.ask, protocol.CompletionRequest) else ""
        )
        if isinstance(source, str):
            return source
        return self.model.tokenizer.decode(source, skip_special_tokens=False)  # as _texts_of

    def _completion_logprobs(self, i: int, prompt: int) -> dict[str, Any] | None:
        if self.names is None:
            return None
        top = self.ask.logprobs or 0
        first = None
        offset = 0
        if self.echo:
            first, offset = encode.prompt_logprobs(
                self.prompts[prompt], self.prompt_logprobs[prompt], self.names, top
            )
        rest, _ = encode.completion_logprobs(self.logprobs[i], self.names, top, offset)
        return encode.join_logprobs(first, rest)

    def _ids(self, choice: dict[str, Any], i: int, prompt: int) -> None:
        """vLLM's ``return_token_ids``: the choice's token ids, and (completions) the prompt's
        beside them; chat's prompt ids are the response's own (:meth:`body`)."""
        if self.ask.return_token_ids:
            if self.kind != "chat":
                choice["prompt_token_ids"] = self.prompts[prompt]
            choice["token_ids"] = self.token_ids[i]

    def _choice(self, i: int, lazy: bool) -> dict[str, Any]:
        """Choice ``i``; ``lazy``: chat's logprobs made as they are written (encode.Slices)."""
        prompt = i // self.ask.n
        text = "".join(self.texts[i])
        if self.kind == "chat":
            logprobs = None
            if self.names is not None:
                entries, names, top = self.logprobs[i], self.names, self.ask.logprobs or 0
                content: Any = (
                    encode.chat_logprobs(entries, names, top)
                    if not lazy
                    else (
                        encode.Slices(
                            len(entries),
                            lambda a, b: encode.chat_logprobs(entries[a:b], names, top),
                        )
                    )
                )
                logprobs = {"content": content}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.outputs is not None:  # the whole answer through the parsers
                message = self.outputs[i].whole(text)
            if self.chat_echo:  # vLLM's: the continued message ahead of the content
                message["content"] = self.chat_echo + (message.get("content") or "")
            choice = {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self._chat_finish(i),
            }
        else:
            if self.echo:
                text = self._prompt_text(prompt) + text
            choice = {
                "index": i,
                "text": text,
                "logprobs": self._completion_logprobs(i, prompt),
                "finish_reason": self.finish[i] or "stop",
            }
        self._ids(choice, i, prompt)
        if self.kind != "chat":  # vLLM's, per choice: null when not asked, as vLLM writes it
            # (its clients read ``choice.prompt_logprobs``: a missing key is an AttributeError)
            choice["prompt_logprobs"] = (
                None if self.ask.prompt_logprobs is None else self._vllm_prompt_logprobs(prompt)
            )
        return choice

    def body(self, lazy: bool = False) -> dict[str, Any]:
        """The response; ``lazy``: each choice made when ``encode.json_pieces`` reaches it."""
        choices: list[Any] = [
            encode.Later(functools.partial(self._choice, i, True))
            if lazy
            else self._choice(i, False)
            for i in range(len(self.texts))
        ]
        body = {
            "id": self.rid,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            # the name asked for: --served-model-name's answers as itself (vLLM's do too)
            "model": self.ask.model,
            "choices": choices,
            "usage": self.usage(),
            "system_fingerprint": None,
        }
        if self.kind == "chat" and self.ask.return_token_ids:  # vLLM: the response's own
            body["prompt_token_ids"] = self.prompts[0]
        if self.kind == "chat" and self.ask.prompt_logprobs is not None:  # vLLM: its own too
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        return body

    def _vllm_prompt_logprobs(self, prompt: int) -> list[Any]:
        return encode.vllm_prompt_logprobs(
            self.prompts[prompt],
            self.prompt_logprobs[prompt],
            encode.token_names(self.model.tokenizer),
            self.ask.prompt_logprobs or 0,
        )

    # --- streaming

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.ask.model,
            "choices": choices,
        }
        if self.ask.include_usage:
            chunk["usage"] = None
            if self.ask.continuous_usage and choices:  # vLLM's: its prompt's, its choice's
                i = choices[0]["index"]
                prompt = i // self.ask.n
                chunk["usage"] = encode.usage(
                    self.prompt_tokens[prompt], self.completion[i], self.cached[prompt]
                )
        return chunk

    def opening(self) -> list[bytes]:
        """Chat's first chunk per choice (the role), as OpenAI sends it; with vLLM's
        ``return_token_ids`` each carries the prompt's ids at its top, as vLLM's do."""
        if self.kind != "chat":
            return []
        chunks = []
        for i in range(len(self.texts)):
            role = {
                "index": i,
                "delta": {"role": "assistant", "content": self.chat_echo},
                "logprobs": None,
                "finish_reason": None,
            }
            chunk = self._chunk([role])
            if self.ask.return_token_ids:
                chunk["prompt_token_ids"] = self.prompts[0]
            chunks.append(sse_bytes(chunk))
        return chunks

    def _plain_template(self) -> bytes | None:
        """The event of a plain stream's chunk with its constant parts (id, object, created,
        model, the usage key) written once, its choice's index, text and finish left to
        ``%``; None when a chunk may carry more (logprobs, token ids, echo, parsed output).
        Building and dumping the chunk's dict per token was most of the encoding's cost on
        the HTTP thread; the template's chunk is byte for byte the dict's (a test compares)."""
        if self._template is None:
            ask = self.ask
            plain = not self.prompt_only and self.names is None and not ask.return_token_ids
            plain = plain and not ask.continuous_usage  # (each chunk's counts differ)
            plain = plain and (self.outputs is None if self.kind == "chat" else not self.echo)
            if not plain:
                self._template = b""
            else:
                head, _key, tail = orjson.dumps(self._chunk([])).rpartition(b'"choices":[]')
                body = b'"delta":%b' if self.kind == "chat" else b'"text":%b'
                self._template = b"".join([
                    b"data: ", head.replace(b"%", b"%%"), b'"choices":[{"index":%d,', body,
                    b',"logprobs":null,"finish_reason":%b}]', tail.replace(b"%", b"%%"),
                    b"\n\n",
                ])  # fmt: skip
                before, after = self._template.split(b"%b", 1)
                opened, closed = (b'{"content":', b"}") if self.kind == "chat" else (b"", b"")
                self._heads = [before % i + opened for i in range(len(self.texts))]
                self._tail = closed + after % b"null"
        return self._template or None

    def chunk(self, prompt: int, event: GenerationEvent) -> bytes | None:
        """The chunk for one event (None: it carries nothing to send)."""
        template = self._template if self._template is not None else self._plain_template()
        if template and event.finish_reason is None:  # the common event: text only
            i, text = self._text_only(prompt, event)
            if not text:
                return None
            return b"".join((self._heads[i], orjson.dumps(text), self._tail))
        if template:  # its last event: the finish reason
            i = self.add(prompt, event)
            self.started.add(i)
            text = event.text
            finish = self.finish[i] if event.finish_reason is not None else None
            if not text and finish is None:
                return None
            value = orjson.dumps(text)
            if self.kind == "chat":
                value = b'{"content":' + value + b"}" if text else b"{}"
            return template % (i, value, b"null" if finish is None else orjson.dumps(finish))
        if self.kind == "chat":
            return self._chat_chunks(self.deltas(prompt, event))
        event = self.bare(event)
        i = self.add(prompt, event)
        first = i not in self.started
        self.started.add(i)
        first_echo = self.echo and first
        finish = self.finish[i] if event.finish_reason is not None else None
        text = event.text
        if not (text or event.logprobs or finish is not None or first_echo) and not (
            self.ask.return_token_ids and event.token_ids
        ):
            return None
        logprobs = None
        if first_echo:
            text = self._prompt_text(prompt) + text
            if self.names is not None:
                logprobs, self.offsets[i] = encode.prompt_logprobs(
                    self.prompts[prompt], self.prompt_logprobs[prompt], self.names,
                    self.ask.logprobs or 0,
                )  # fmt: skip
        if self.names is not None:
            more, self.offsets[i] = encode.completion_logprobs(
                event.logprobs or [], self.names, self.ask.logprobs or 0, self.offsets[i]
            )
            logprobs = encode.join_logprobs(logprobs, more)
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.ask.return_token_ids:
            if first:  # completions: in the choice's first chunk
                choice["prompt_token_ids"] = self.prompts[prompt]
            choice["token_ids"] = list(event.token_ids)
        return sse_bytes(self._chunk([choice]))

    def _chat_finish(self, i: int) -> str:
        """OpenAI's ``tool_calls`` for a choice that ended by itself with calls it chose
        (``auto``); a forced ``tool_choice`` (``required``, a named function) ends ``stop``,
        as OpenAI answers it and Triton's OpenAI tests assert."""
        finish = self.finish[i] or "stop"
        output = self.outputs[i] if self.outputs is not None else None
        if finish == "stop" and output is not None and output.calls and output.forced is None:
            return "tool_calls"
        return finish

    def _text_only(self, prompt: int, event: GenerationEvent) -> tuple[int, str]:
        """A plain answer's common event taken in (text and counts only: no finish, nothing
        asked beside the text), cheaper than :meth:`add`: its choice and its text."""
        i = prompt * self.ask.n + event.index
        text = event.text
        if text:
            self.texts[i].append(text)
        if event.completion_tokens > self.completion[i]:
            self.completion[i] = event.completion_tokens
        if event.prompt_tokens:
            self.prompt_tokens[prompt] = event.prompt_tokens
        if event.cached_tokens > self.cached[prompt]:
            self.cached[prompt] = event.cached_tokens
        return i, text

    def deltas(self, prompt: int, event: GenerationEvent) -> list[Delta]:
        """A chat choice's typed pieces for one engine event (``deltas.py``): its text through
        the choice's parsers when it has them (reasoning, content, a call's head, its
        arguments), the event's logprobs and token ids on the first piece, the finish on the
        last; none when the event carries nothing to send. The chat route writes them as
        chunks (:meth:`chunk`), the Responses and Anthropic faces as their own events."""
        if (
            event.finish_reason is None
            and event.prompt_logprobs is None
            and self.outputs is None
            and self.names is None
            and not self.prompt_only
            and not self.ask.return_token_ids
        ):  # the common event of a plain answer: its text
            i, text = self._text_only(prompt, event)
            return [Delta(i, text)] if text else []
        event = self.bare(event)
        i = self.add(prompt, event)
        self.started.add(i)
        finish = self.finish[i] if event.finish_reason is not None else None
        text = event.text
        ids = list(event.token_ids) if self.ask.return_token_ids else None
        logprobs = None
        if self.names is not None and event.logprobs:
            logprobs = encode.chat_logprobs(event.logprobs, self.names, self.ask.logprobs or 0)
        if self.outputs is None:
            if not (text or event.logprobs or finish is not None or ids):
                return []
            return [Delta(i, text or None, logprobs=logprobs, token_ids=ids, finish=finish)]
        output = self.outputs[i]
        made = output.feed(text) if text else []
        if finish is not None:
            made += output.finish()
            finish = self._chat_finish(i)
        if not made:
            if logprobs is None and finish is None and not ids:
                return []
            made = [Delta()]
        for delta in made:
            delta.choice = i
            if ids is not None:
                delta.token_ids = []
        made[0].logprobs, made[0].token_ids = logprobs, ids
        made[-1].finish = finish
        return made

    def _chat_chunks(self, deltas: list[Delta]) -> bytes | None:
        """Chat's chunks of an event's pieces, one a piece."""
        pieces = []
        for delta in deltas:
            choice = {
                "index": delta.choice,
                "delta": delta.chat(),
                "logprobs": None if delta.logprobs is None else {"content": delta.logprobs},
                "finish_reason": delta.finish,
            }
            if delta.token_ids is not None:
                choice["token_ids"] = delta.token_ids
            pieces.append(sse_bytes(self._chunk([choice])))
        return b"".join(pieces) or None

    def choice(self, i: int) -> dict[str, Any]:
        """Chat's choice ``i`` of the whole answer (its message through the parsers, its
        logprobs, its finish): what the Responses and Anthropic faces make their own of."""
        return self._choice(i, False)

    def closing(self) -> list[bytes]:
        if not self.ask.include_usage:
            return []
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        return [sse_bytes(chunk)]


def _finish_reason(reason: str) -> str:
    if reason == "abort":
        # the engine ends a sequence so when its request was cancelled or passed its
        # deadline; the stream's failure says which (and the client is usually gone)
        raise Cancelled("the request was aborted before it finished")
    return reason


class _Pushed(Push):
    """One prompt's stream written from the HTTP loop's wake-up (``http_server.Push``): the
    events taken, encoded and written in the callback that says they came, with no task step,
    future or async generator per event; the same bytes and writes as ``stream_reply``'s
    chunks (an event per token, what came together in one write, the usage chunk and
    [DONE] last). A peer that does not read stops the taking (the stream's own bounds then
    apply) until the connection resumes it."""

    def __init__(self, answer: Answer, stream: Any) -> None:
        self.answer, self.stream = answer, stream
        self.write: Callable[[bytes], bool] = lambda data: False
        self.done: asyncio.Future[None] | None = None
        self.blocked = False  # the peer does not read: nothing is taken until resume()
        self.caller: Any = None  # (the stream's arming of _pump)

    def start(self, write: Callable[[bytes], bool]) -> asyncio.Future[None]:
        self.write = write
        self.done = asyncio.get_running_loop().create_future()
        self.caller = self.stream.caller(self._pump)
        opening = self.answer.opening()
        self.blocked = bool(opening) and not write(b"".join(opening))
        self._pump()
        return self.done

    def resume(self) -> None:
        self.blocked = False
        self._pump()

    def stop(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.cancel()
        with contextlib.suppress(Exception):
            self.stream.cancel()

    def _pump(self) -> None:
        """Take what came (armed at once for what comes next: one take per wake-up), write
        it; at the end the closing chunks and [DONE]."""
        done = self.done
        if done is None or done.done() or self.blocked:
            return
        chunk, stream = self.answer.chunk, self.stream
        pieces: list[bytes] = []
        try:
            while True:
                for event, _final in stream.take(self.caller, always=True):
                    if event is not None and (piece := chunk(0, event)) is not None:
                        pieces.append(piece)
                if stream.exhausted:
                    break
                if pieces:
                    joined, pieces = b"".join(pieces), []
                    if not self.write(joined):
                        self.blocked = True  # resume() goes on
                        return
                if not stream.ended:
                    return  # armed: called again when more comes
                # (it failed after what was taken: the next take raises its error)
            last = self.answer.closing()
        except (PlugserveError, OpenAIError) as exc:
            # the status line is out: the failure is the stream's last event, as vLLM's
            last = [sse_bytes(stream_error(exc))]
        except Exception as exc:
            done.set_exception(exc)
            return
        self.write(b"".join([*pieces, *last, sse.DONE]))
        done.set_result(None)


def stream_reply(answer: Answer, streams: list[Any]) -> StreamReply:
    async def chunks() -> AsyncIterator[bytes]:
        try:
            opening = answer.opening()
            if opening:
                yield b"".join(opening)
            pieces: list[bytes] = []
            chunk = answer.chunk
            try:
                if len(streams) == 1:  # (the common case: its stream's batches, one layer less)
                    async for items in streams[0].batches():
                        # an event per token; what came together is written together
                        for event, _final in items:
                            if event is not None and (piece := chunk(0, event)) is not None:
                                pieces.append(piece)
                        if pieces:
                            joined, pieces = b"".join(pieces), []
                            yield joined
                else:
                    async for batch in merged(streams):
                        for prompt, event in batch:
                            if (piece := chunk(prompt, event)) is not None:
                                pieces.append(piece)
                        if pieces:
                            joined, pieces = b"".join(pieces), []
                            yield joined
                last = answer.closing()
            except (PlugserveError, OpenAIError) as exc:
                # the status line is out: the failure is the stream's last event, as vLLM's
                last = [sse_bytes(stream_error(exc))]
            yield b"".join([*pieces, *last, sse.DONE])
        finally:
            for stream in streams:
                with contextlib.suppress(Exception):
                    stream.cancel()

    push = _Pushed(answer, streams[0]) if len(streams) == 1 else None
    return StreamReply(200, sse.HEADERS, chunks(), push)
