"""The OpenAI routes: check, render, tokenize, generate through the data plane, encode.

A thin adapter like the KServe ones (``server/protocols/kserve/rest.py``): each handler checks the
body (``protocol.py``), looks the model up once (``DataPlane.get``), renders the chat template and
tokenizes with the model's own :class:`Tokenizer`, checks what needs the model (the context
length, the vocabulary, the schema), opens one stream per prompt through
``DataPlane.stream`` (admission, the in-flight count, the deadline watch, the memory
budget, the recorder: what every request gets) whose producer is the model's engine, and
encodes the engine's events as OpenAI's bodies (``encode.py``) or server-sent events. A chat's
answer goes through ``tools.py`` when the model's family or the request asks it: reasoning
split out, tool calls parsed (``server/apps/generate/tool_parsers``), a forced tool choice read
back as its calls.

Paths: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models`` and
``/v1/models/{id}``, each also under ``/v3`` (OpenVINO Model Server's prefix). Every refusal is
OpenAI's error body (``errors.py``). What the adapter holds per request is bounded before it
starts: the body (the REST port's --max-message-bytes), the prompt's text (the model's context
times its longest token's bytes, or --max-prompt-bytes: ``server/apps/generate/limits.py``; a 400
before anything is rendered or tokenized), tokenizing's memory and the schema's (charged to
--max-inflight-bytes before the work), the answer (``n`` x ``max_tokens``, charged with the
stream: over the budget is 429 at once), the unread events of a stream
(--max-stream-unread-bytes), the schema (``grammar.MAX_SCHEMA_BYTES``).

No request's CPU work runs on the REST event loop: a body over 64 KiB is parsed and checked on
the adapter's two worker threads, and every chat is rendered and every prompt tokenized there
(``tokenizers`` releasing the GIL), a schema compiled there once and copied for each sequence;
more than :data:`MAX_QUEUED` jobs waiting is 503. Four clients sending 60 KB chats for 3 s
had held REST health up to 1.8 s (p99) while the loop rendered and tokenized bodies up to
64 KiB itself; 21-46 ms since (tests/server/test_attacks_generate.py).

Traces: a request the trace settings sample for its model (or that carries a W3C
``traceparent`` while tracing is on) gets Triton's root span, ``InferRequest``, opened once
its body names the model and ended when its answer is composed, its stream's last event is
written or its client leaves; each prompt's stream opens the model's span under it, and the
engine its queue, prefill and decode spans under that (docs/tracing.md). A request that is
not traced costs one attribute read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from plugserve.plugins.api import (
    InvalidArgument,
    NotFound,
    PlugserveError,
    ResourceExhausted,
)
from plugserve.plugins.tracing import Trace
from plugserve.server.apps.generate import limits
from plugserve.server.apps.generate.text import chat_template
from plugserve.server.apps.generate.types import (
    MAX_LOGPROBS,
    GenerationRequest,
    SamplingParams,
)
from plugserve.server.plane.networks import ModelLoading
from plugserve.server.plane.request import Request
from plugserve.server.plane.tracing import name_request
from plugserve.server.protocols.auth import KSERVE
from plugserve.server.protocols.http import sse
from plugserve.server.protocols.http.http_server import StreamReply
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.openai import encode, protocol, tools
from plugserve.server.protocols.openai.answer import (
    Answer,
    ServedModel,
    Started,
    merged,
    sse_bytes,
    stream_reply,
)
from plugserve.server.protocols.openai.body import read as read_body
from plugserve.server.protocols.openai.errors import (
    OpenAIError,
    error_reply,
    guard,
)
from plugserve.server.protocols.openai.responses import ResponsesRoutes
from plugserve.server.protocols.openai.responses_store import ResponseStore
from plugserve.server.protocols.openai.sleep import SleepRoutes
from plugserve.server.protocols.openai.tokenize import TokenizeRoutes

__all__ = ["MAX_QUEUED", "OpenAIRoutes"]

log = logging.getLogger(__name__)

#: a body larger than this is parsed and checked on a worker thread (every chat is rendered
#: and every prompt tokenized there, whatever its size)
INLINE_BYTES = 64 << 10
#: jobs waiting for the adapter's worker threads, at most: a backstop, since every request
#: is now one job (its chat rendered, its prompts tokenized there) and the REST port's
#: connection limit (4 x --grpc-workers: 256 by default) bounds them first; a waiting job's
#: body is charged to --max-inflight-bytes already, so the budget refuses (429) before this
MAX_QUEUED = 4096
#: what an answer holds per generated token, to charge the memory budget before it starts:
#: its text and bookkeeping, and per logprob alternative the engine's entry, its answer's
#: object and JSON at once (536 bytes measured at peak: 160 had let prompt_logprobs over the
#: vocabulary grow the server by 4.1 GB against 1.24 GB charged)
_TOKEN_BYTES = 64
_LOGPROB_BYTES = 600
#: a prompt's token id as a Python int in a list (its object and its slot)
_ID_BYTES = 36

Reply = tuple[int, list[bytes], list[tuple[bytes, bytes]]]


class OpenAIRoutes:
    """The handlers, and the route table ``Router.add_routes`` takes (``protocols/http/app.py``)."""

    def __init__(
        self,
        plane: Any,
        control: Any,
        max_completion_tokens: int = 0,
        responses_store: ResponseStore | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
        served_names: dict[str, str] | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        """``max_completion_tokens``: the server's limit on ``max_tokens`` (0: the model's
        context only); ``responses_store``: where /v1/responses keeps responses (default:
        :class:`ResponseStore`'s bounds); ``tool_call_parser`` and ``reasoning_parser``: the
        operator's choice of parser (``auto``: from each model's chat template; ``none``: off);
        ``served_names``: another name -> the repository model it stands for
        (``--served-model-name``: a Hugging Face id such as ``facebook/opt-125m``, which a
        repository folder cannot be named); ``max_logprobs``: the most alternatives per token
        a request may ask for (``--max-logprobs``; -1: the vocabulary's size)."""
        self.plane = plane
        self.max_logprobs = max_logprobs
        self.control = control
        self.max_completion_tokens = max_completion_tokens
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        #: another name -> the repository model it stands for
        self.aliases = dict(served_names or {})
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="openai")
        self._queued = 0
        #: jobs running on the workers now
        self._running = 0
        self._running_lock = threading.Lock()
        self.created = int(time.time())
        if responses_store is None:  # (an empty store is falsy: it has a length)
            responses_store = ResponseStore(plane.budget)
        self.responses = ResponsesRoutes(self, responses_store)
        self.tokenize = TokenizeRoutes(self, _chat_ids, _completion_ids, _check_prompt)
        self.sleeping = SleepRoutes(control)

    def routes(self) -> list[tuple[str, dict[str, tuple[str, Callable[[Any], Any]]]]]:
        """``Router.add_routes``' table: each path authorized as the KServe method it stands
        for (generating and embedding as ModelInfer, listing as ModelMetadata: the ``infer``
        role), so ``--auth-tokens`` governs these routes as it does /v2's."""
        infer, metadata = f"/{KSERVE}/ModelInfer", f"/{KSERVE}/ModelMetadata"
        table: list[tuple[str, dict[str, tuple[str, Callable[[Any], Any]]]]] = []
        for prefix in ("/v1", "/v3"):
            table += [
                (prefix + "/chat/completions", {"POST": (infer, guard(self.chat))}),
                (prefix + "/completions", {"POST": (infer, guard(self.completions))}),
                (prefix + "/embeddings", {"POST": (infer, guard(self.embeddings))}),
                (prefix + "/models", {"GET": (metadata, guard(self.models))}),
                (
                    prefix + r"/models/(?P<model>[^/]+)",
                    {"GET": (metadata, guard(self.model))},
                ),
            ]
            # the handlers' owners are read when a request comes: the table is read without
            # them too (tests/server/test_roles.py reads it from an uninitialized instance)
            table += ResponsesRoutes.table(prefix, infer, guard, lambda: self.responses)
        table += TokenizeRoutes.table(infer, guard, lambda: self.tokenize)
        table += SleepRoutes.table(guard, lambda: self.sleeping)  # admin: vLLM's sleep mode
        return table

    def close(self) -> int:
        """Stop the workers; the jobs still running on them (a process exiting need not wait
        for them: the server counts them as abandoned)."""
        self.workers.shutdown(wait=False, cancel_futures=True)
        return self._running

    def _job(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._running_lock:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._running_lock:
                self._running -= 1

    @staticmethod
    def refusal(status: int, message: str, error: PlugserveError | None) -> Reply:
        """A request to these routes refused before its handler runs (``add_routes``): its
        body does not fit --max-inflight-bytes (429, as OpenAI says "retry later"), is over
        --max-message-bytes (413), or came too slowly (408); OpenAI's body either way."""
        if isinstance(error, ResourceExhausted):
            status = 429
        return error_reply(status, message)

    # --- helpers

    async def _in_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._queued >= MAX_QUEUED:
            raise OpenAIError(
                f"the server is busy preparing {self._queued} requests (templates, "
                "tokenizing, schemas); retry later",
                status=503,
            )
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.workers, self._job, fn, *args
            )
        finally:
            self._queued -= 1

    async def _loaded(self, name: str | None) -> None:
        """A model that a request is loading on demand (--model-load-on-demand), awaited off
        the loop before the request's own lookup; anything else wrong with the name is left
        to that lookup to say."""
        if not name:
            return
        try:
            self.plane.get(self.aliases.get(name, name))
        except ModelLoading as loading:
            await loading.loaded()
        except PlugserveError:
            pass

    def _lookup(self, name: str) -> Any:
        try:
            return self.plane.get(self.aliases.get(name, name))
        except NotFound as exc:
            raise OpenAIError(
                f"The model '{name}' does not exist ({exc})", "model", 404, "model_not_found"
            ) from None

    def _generative(self, name: str) -> ServedModel:
        entry = self._lookup(name)
        if not _is_generative(entry):
            raise OpenAIError(
                f"model '{name}' is not a generative model (a Hugging Face model folder with a "
                "decoder); chat and completions serve those only",
                "model",
            )
        return ServedModel(entry)

    # --- GET /v1/models

    def _served(self) -> list[Any]:
        seen: dict[str, Any] = {}
        for entry in sorted(self.control.networks(), key=lambda e: (e.name, -e.version)):
            if entry.name not in seen and (
                _is_generative(entry) or _is_encoder(entry, self.control)
            ):
                seen[entry.name] = entry
        return list(seen.values())

    def _unloaded(self) -> list[str]:
        """--model-load-on-demand: the repository's Hugging Face model folders not loaded
        yet, which a request loads (listed with no ``max_model_len``: it is read at load)."""
        on_demand = self.control.on_demand
        return on_demand.unloaded_folders() if on_demand is not None else []

    def _card(self, entry: Any) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": entry.name,
            "object": "model",
            "created": self.created,
            "owned_by": "plugserve",
        }
        if _is_generative(entry):
            card["max_model_len"] = entry.network.context
        return card

    def models(self, call: Any) -> Reply:
        cards = [self._card(e) for e in self._served()]
        cards += [
            {"id": name, "object": "model", "created": self.created, "owned_by": "plugserve"}
            for name in self._unloaded()
        ]
        by_name = {card["id"]: card for card in cards}
        for alias, name in self.aliases.items():
            if name in by_name:
                cards.append({**by_name[name], "id": alias})
        body = {"object": "list", "data": cards}
        return 200, [orjson.dumps(body)], JSON

    def model(self, call: Any) -> Reply:
        name = call.path["model"]
        entry = self._lookup(name)
        if not (_is_generative(entry) or _is_encoder(entry, self.control)):
            raise OpenAIError(
                f"The model '{name}' is not served on the OpenAI API (it is a tensor model: "
                "use /v2/models)",
                "model",
                404,
                "model_not_found",
            )
        return 200, [orjson.dumps(self._card(entry))], JSON

    # --- POST /v1/chat/completions

    async def _answer(
        self,
        call: Any,
        check: Callable[[dict[str, Any]], Any],
        operation: str,
        answer: Callable[[Any, Trace | None], Awaitable[Any]],
    ) -> Any:
        """A POST route's request: its body bounded, charged and checked (body.py), then
        ``answer(ask, trace)`` in the request's span if sampled (``operation`` names it)."""
        protocol.check_content_type(call.headers.get(b"content-type"))
        budget = self.plane.budget
        ask, charge = await read_body(call.body, check, budget, self._in_worker, INLINE_BYTES)
        try:
            if hasattr(ask, "tenant"):  # the caller's, from its token: what its caches are keyed by
                ask.tenant = call.tenant
            await self._loaded(getattr(ask, "model", None))
            trace = self._trace(call, ask.model, operation)
            if trace is None:
                return await answer(ask, None)
            return await _traced(trace, answer(ask, trace))
        finally:
            charge.release()

    async def chat(self, call: Any) -> Any:
        return await self._answer(call, protocol.chat_request, "chat", self._chat)

    async def _chat(self, ask: protocol.ChatRequest, trace: Trace | None) -> Any:
        model, ids, plan = await self._chat_prompt(ask)
        started = await self.started(model, ask, [ids], "chat", "messages", trace, plan)
        return await self._written(started)

    async def _chat_prompt(
        self, ask: protocol.ChatRequest
    ) -> tuple[ServedModel, list[int], tools.Plan | None]:
        """A chat's model, prompt ids and answer plan: what it generates from (Anthropic's
        face counts the ids for /v1/messages/count_tokens and message_start)."""
        model = self._generative(ask.model)
        # refused at once, unrendered, when its text alone cannot fit (characters <= bytes)
        chars = sum(len(m["content"]) for m in ask.messages if isinstance(m["content"], str))
        _check_prompt(chars, model, "'messages'", "messages")
        ids = await self._in_worker(_chat_ids, model, ask, ask.add_special_tokens)
        plan = tools.plan(
            ask,
            model.tokenizer,
            ids,
            model.parsers.get("tool_call_parser", self.tool_call_parser),
            model.parsers.get("reasoning_parser", self.reasoning_parser),
        )
        return model, ids, plan

    # --- POST /v1/completions

    async def completions(self, call: Any) -> Any:
        return await self._answer(
            call, protocol.completion_request, "text_completion", self._completions
        )

    async def _completions(self, ask: protocol.CompletionRequest, trace: Trace | None) -> Any:
        model = self._generative(ask.model)
        for i, prompt in enumerate(ask.prompts):
            if isinstance(prompt, str):
                where = "prompt" if len(ask.prompts) == 1 else f"prompt[{i}]"
                _check_prompt(len(prompt), model, f"'{where}'", where)
        texts = [p for p in ask.prompts if isinstance(p, str)]
        encoded = iter(
            await self._in_worker(_completion_ids, model, texts, ask.add_special_tokens)
            if texts
            else []
        )
        ids = [next(encoded) if isinstance(p, str) else p for p in ask.prompts]
        return await self._written(
            await self.started(model, ask, ids, "completion", "prompt", trace)
        )

    # --- generation, shared

    def _max_tokens(self, model: ServedModel, ask: protocol.GenerationAsk, longest: int) -> int:
        room = model.context - longest
        limit = self.max_completion_tokens
        field = ask.max_tokens_field
        if ask.max_tokens is None:
            return max(0, min(room, limit) if limit else room)
        if limit and ask.max_tokens > limit:
            raise OpenAIError(
                f"'{field}' is {ask.max_tokens}, above this server's limit of {limit} tokens "
                "(--max-completion-tokens)",
                field,
            )
        if ask.max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {model.context} tokens. However, you "
                f"requested {longest + ask.max_tokens} tokens ({longest} in the prompt, "
                f"{ask.max_tokens} for the completion). Please reduce the prompt or "
                f"'{field}'.",
                field,
            )
        return ask.max_tokens

    def _check_prompts(self, model: ServedModel, prompts: list[list[int]], field: str) -> None:
        for i, ids in enumerate(prompts):
            where = field if len(prompts) == 1 else f"{field}[{i}]"
            if len(ids) >= model.context:
                raise OpenAIError(
                    f"This model's maximum context length is {model.context} tokens. However, "
                    f"your {'messages' if field == 'messages' else 'prompt'} resulted in "
                    f"{len(ids)} tokens, leaving no room to generate. Please shorten it.",
                    where,
                )
            if ids and max(ids) >= model.vocab_size:
                raise OpenAIError(
                    f"'{where}' holds token id {max(ids)}; this model's vocabulary has "
                    f"{model.vocab_size} tokens",
                    where,
                )

    def _check_logprobs(self, model: ServedModel, ask: protocol.GenerationAsk) -> None:
        """The alternatives per token asked (``logprobs``, ``top_logprobs``,
        ``prompt_logprobs``) within ``--max-logprobs``, as vLLM checks its ``max_logprobs``:
        -1 is the vocabulary's size (of the request and of the setting), and a count above the
        bound is a 400 naming the field and the bound. -1 is replaced by the vocabulary's size
        here, before the answer's bytes are charged to the budget (~160 bytes per alternative
        per token: a whole vocabulary of 150k is 24 MB a token, refused by the budget, never
        allocated). Completions' ``logprobs`` keep OpenAI's 5 unless the setting is raised
        past OpenAI's 20 (vLLM's completions follow the setting alone)."""
        bound = model.vocab_size if self.max_logprobs < 0 else self.max_logprobs
        completions = isinstance(ask, protocol.CompletionRequest)
        for attr, key in (
            ("logprobs", "logprobs" if completions else "top_logprobs"),
            ("prompt_logprobs", "prompt_logprobs"),
        ):
            asked = getattr(ask, attr)
            if asked is None:
                continue
            limit = bound
            if key == "logprobs" and completions and 0 <= self.max_logprobs <= MAX_LOGPROBS:
                limit = min(bound, protocol.MAX_COMPLETION_LOGPROBS)
            count = model.vocab_size if asked == protocol.WHOLE_VOCABULARY else asked
            if count > limit:
                raise OpenAIError(
                    f"'{key}' asks for {count} alternatives per token"
                    + (" (-1: this model's whole vocabulary)" if asked < 0 else "")
                    + f", which is greater than max allowed: {limit} "
                    + (
                        "(OpenAI's bound on completions' logprobs while --max-logprobs is at "
                        f"most {MAX_LOGPROBS})"
                        if limit != bound
                        else "(this server's --max-logprobs)"
                    ),
                    key,
                )
            setattr(ask, attr, count)

    async def _written(self, started: Started | Reply) -> Any:
        """A started answer (:meth:`started`) written as OpenAI's: a stream of chunks, or the
        whole body."""
        if not isinstance(started, Started):
            return started
        if started.answer.ask.stream:
            return stream_reply(started.answer, started.streams)
        return await self._whole(started)

    async def started(
        self,
        model: ServedModel,
        ask: protocol.GenerationAsk,
        prompts: list[list[int]],
        kind: str,
        field: str,
        trace: Trace | None = None,
        plan: tools.Plan | None = None,
    ) -> Started | Reply:
        """A generation checked against the model (``field`` names its prompts in a
        refusal), charged and started: its answer and streams, which the chat route writes
        as chunks or a body and the Responses and Anthropic faces read as typed pieces
        (``answer.answer_deltas``) or the whole :class:`Answer`; a completion that echoes
        its prompt and generates nothing is its reply at once."""
        max_tokens = self._checked(model, ask, prompts, field)
        constraints, schema_bytes = await self._constraints(model, ask, len(prompts), max_tokens)
        if plan is not None:  # a grammar waits for the reasoning to end
            constraints = plan.gated(constraints, model.tokenizer)
        echo = isinstance(ask, protocol.CompletionRequest) and ask.echo
        if echo and not all(isinstance(p, str) for p in ask.prompts):
            # prompts given as ids are echoed as text: decoded on a worker (decode holds the
            # GIL, 84 ms for 128k ids), not as the answer is written on the loop
            ask.prompts = await self._in_worker(_texts_of, model, ask.prompts)
        scored = _prompt_scored(ask, echo)
        if scored is not None and not model.network.prompt_logits:  # before a stream starts
            field = "prompt_logprobs" if ask.prompt_logprobs is not None else "echo"
            raise OpenAIError(
                f"model '{model.name}' cannot score its prompt (its decoder gives only the last "
                f"logits of each chunk, as OpenVINO's paged-attention IR): '{field}' with "
                "logprobs is not served for it",
                field,
            )
        if echo and max_tokens == 0 and scored is None:
            return _echo_only(model, ask, prompts)
        sampling = ask.sampling
        if plan is not None and plan.keeps_special_tokens:  # the parsers read the markers
            sampling = {**sampling, "skip_special_tokens": False}
        params = SamplingParams(
            # echo, logprobs and max_tokens 0: one token is generated (the prompt's logprobs
            # come with it) and left out of the answer
            max_tokens=max(max_tokens, 1),
            logprobs=ask.logprobs,
            prompt_logprobs=scored,
            **sampling,
        )
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if trace is not None:
            name_request(trace, rid)
        holds = _holds(ask, max_tokens, prompts, scored, schema_bytes, plan)
        streams = self._open_all(model, ask, rid, prompts, params, constraints, holds, trace)
        answer = Answer(model, ask, kind, rid, prompts, echo, plan)
        answer.prompt_only = echo and max_tokens == 0
        return Started(answer, streams, scored)

    def _checked(
        self, model: ServedModel, ask: protocol.GenerationAsk, prompts: list[list[int]], field: str
    ) -> int:
        """The ask's checks against the model (prompts, logprobs, n, token ids it names), once,
        before anything is held; returns its max_tokens."""
        self._check_prompts(model, prompts, field)
        self._check_logprobs(model, ask)
        if ask.n > model.max_n:
            raise OpenAIError(
                f"'n' is {ask.n}; this model runs at most {model.max_n} sequences at once "
                "(its max_num_seqs)",
                "n",
            )
        max_tokens = self._max_tokens(model, ask, max(len(p) for p in prompts))
        named = (
            ("logit_bias", ask.sampling.get("logit_bias") or {}),
            ("stop_token_ids", ask.sampling.get("stop_token_ids") or ()),
        )
        for key, tokens in named:
            for token in tokens:
                if token >= model.vocab_size:
                    raise OpenAIError(
                        f"'{key}' names token {token}; this model's vocabulary has "
                        f"{model.vocab_size} tokens",
                        key,
                    )
        return max_tokens

    def _open_all(
        self,
        model: ServedModel,
        ask: protocol.GenerationAsk,
        rid: str,
        prompts: list[list[int]],
        params: SamplingParams,
        constraints: list[Any],
        holds: int,
        trace: Trace | None,
    ) -> list[Any]:
        """A stream per prompt (its ``n`` sequences), the first holding the answer's bytes; a
        failure part way cancels the ones opened."""
        streams = []
        unread = _unread(ask, params)  # (each prompt's stream: one answer)
        try:
            for i, ids in enumerate(prompts):
                request = GenerationRequest(
                    request_id=f"{rid}-{i}",
                    prompt_token_ids=ids,
                    params=params,
                    n=ask.n,
                    arrival=time.time(),
                    tenant=ask.tenant,
                    cache_salt=ask.cache_salt,
                )
                if constraints:
                    mine = constraints[i * ask.n : (i + 1) * ask.n]
                    if ask.n == 1:
                        params_i = SamplingParams(**{**vars(params)})
                        params_i.constraint = mine[0]
                        request.params = params_i
                    else:
                        request.constraints = mine
                streams.append(self._open(model, request, holds if i == 0 else 0, trace, unread))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    async def gathered(self, started: Started) -> bool:
        """A non-streamed answer: every stream's events taken into it; whether it is long
        (many choices, logprobs: each alternative ~64 bytes), to be written on a worker."""
        answer, streams = started.answer, started.streams
        try:
            async for batch in merged(streams):
                for index, event in batch:
                    answer.add(index, event)
        finally:
            for stream in streams:
                stream.cancel()
        tokens = sum(len(t) for t in answer.token_ids) + sum(answer.completion)
        size = tokens * (1 + (answer.ask.logprobs or 0))
        if started.scored is not None:  # the prompts' logprobs are written too
            size += sum(len(p) for p in answer.prompts) * (1 + started.scored)
        return size > INLINE_BYTES // 64

    async def _whole(self, started: Started) -> Any:
        """A non-streamed answer: gathered, then encoded (a long one on a worker, a bounded
        piece at a time: encode.json_pieces)."""
        answer = started.answer
        if await self.gathered(started):
            return 200, [await self._in_worker(_dumped, answer)], JSON
        return 200, [orjson.dumps(answer.body())], JSON

    async def _constraints(
        self, model: ServedModel, ask: protocol.GenerationAsk, prompts: int, max_tokens: int
    ) -> tuple[list[Any], int]:
        """The schema's matchers, one per sequence, and the bytes they hold (none without a
        schema): compiled once and copied for each sequence, on a worker, their memory
        charged first (and held again by the request's stream). A forced tool call's close
        within ``max_tokens`` (``grammar.JsonConstraint.close_within``)."""
        if ask.schema is None:
            return [], 0
        from plugserve.server.apps.generate.text import grammar

        count = ask.n * prompts
        schema_bytes = grammar.memory(ask.schema, count)
        charge = self.plane.budget.charge(schema_bytes, "this request's response_format")
        try:
            constraints = await self._in_worker(
                _compiled, ask, model.tokenizer, model.vocab_size, count, max_tokens
            )
        finally:
            charge.release()
        return constraints, schema_bytes

    def _open(
        self,
        model: ServedModel,
        request: GenerationRequest,
        holds: int,
        trace: Trace | None,
        unread: tuple[int, int] | None = None,
    ) -> Any:
        network = model.network
        ask = Request(
            model.entry, holds=holds, protocol="openai", trace=trace, tenant=request.tenant,
            unread=unread,
        )  # fmt: skip
        return self.plane.stream(ask, lambda sender, span: network.generate(request, sender, span))

    def _trace(self, call: Any, model: str, operation: str) -> Trace | None:
        """The request's root span (``InferRequest``, as the KServe adapters open it) when
        the trace settings sample it for ``model``, continuing the client's W3C
        ``traceparent``; None (most requests) otherwise. ``operation``: OpenTelemetry's
        ``gen_ai.operation.name`` (chat, text_completion, embeddings)."""
        if not self.plane.tracing.on:
            return None
        trace = self.plane.tracing.start(model, "", call.headers.get(b"traceparent"), "HTTP")
        if trace is not None:
            trace.set("gen_ai.operation.name", operation)
            trace.set("plugserve.request_bytes", len(call.body))
        return trace

    # --- POST /v1/embeddings

    async def embeddings(self, call: Any) -> Reply:
        return await self._answer(call, protocol.embedding_request, "embeddings", self._embeddings)

    async def _embeddings(self, ask: Any, trace: Trace | None) -> Reply:
        from plugserve.server.apps.generate import embeddings

        entry = self._lookup(ask.model)
        encoder = embeddings.encoder_of(entry, self.control)
        if encoder is None:
            raise OpenAIError(
                f"model '{ask.model}' is not an embedding model (a sentence-transformers folder "
                "with an ONNX encoder); /v1/embeddings serves those only",
                "model",
            )
        body = await embeddings.embed(self.plane, entry, encoder, ask, self._in_worker, trace)
        return 200, [body], JSON


def _check_prompt(size: int, model: ServedModel, what: str, field: str) -> None:
    """A 400 naming ``field`` when ``size`` bytes (or characters) of prompt cannot fit."""
    try:
        limits.check_prompt(size, model.tokenizer, model.context, what)
    except limits.PromptTooLong as exc:
        raise OpenAIError(str(exc), field) from None


def _chat_ids(
    model: ServedModel, ask: protocol.ChatRequest, add_special_tokens: bool = False
) -> list[int]:
    """The chat's prompt ids (a worker's job): rendered with the prompt's bound, its bytes
    checked, tokenized with its memory charged (``add_special_tokens``: /tokenize's, the
    template writes its own)."""
    tokenizer = model.tokenizer
    variables = {**ask.template_kwargs, "continue_final_message": ask.continue_final_message}
    bound = limits.prompt_limit(tokenizer, model.context)
    try:
        text = tokenizer.render_chat(
            ask.messages, ask.add_generation_prompt, ask.tools, variables, bound
        )
    except chat_template.TooLong as exc:
        _check_prompt(exc.chars + 1, model, "the rendered chat", "messages")
        raise OpenAIError(f"messages: {exc}", "messages") from None  # the template's own bound
    except InvalidArgument as exc:
        raise OpenAIError(f"messages: {exc}", "messages") from None
    size = limits.text_bytes(text)
    _check_prompt(size, model, "the rendered chat", "messages")
    with limits.tokenizing(size, "the chat"):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _completion_ids(
    model: ServedModel, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """The prompts' ids (a worker's job): each one's bytes checked, their tokenizing's memory
    charged."""
    sizes = [limits.text_bytes(t) for t in texts]
    for i, size in enumerate(sizes):
        where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
        _check_prompt(size, model, f"'{where}'", where)
    with limits.tokenizing(sum(sizes), "the prompts"):
        return model.tokenizer.encode_batch(texts, add_special_tokens)


def _texts_of(model: ServedModel, prompts: list[Any]) -> list[str]:
    """Each prompt as ``echo`` writes it: a text as given, ids decoded with their special
    tokens (BOS and the like) as vLLM's echo shows them (decode_batch releases the GIL)."""
    ids = [p for p in prompts if not isinstance(p, str)]
    decoded = iter(model.tokenizer.decode_batch(ids, skip_special_tokens=False))
    return [p if isinstance(p, str) else next(decoded) for p in prompts]


def _dumped(answer: Answer) -> bytes:
    """A long answer's body, made and written a piece at a time (a worker's job), the GIL
    given away between pieces (encode.json_pieces)."""
    return b"".join(encode.json_pieces(answer.body(lazy=True), pause=_yield_gil))


def _yield_gil() -> None:
    time.sleep(0)


def _compiled(
    ask: protocol.GenerationAsk, tokenizer: Any, vocab_size: int, count: int, max_tokens: int
) -> list[Any]:
    """``count`` constraints of the request's schema or grammar (a worker's job: compiled
    once, then copied); a forced tool call's, each closing within ``max_tokens``."""
    from plugserve.server.apps.generate.text import grammar

    assert ask.schema is not None
    compiled = grammar.compile_schema(
        ask.schema, tokenizer, vocab_size, ask.grammar_kind, ask.grammar_field
    )
    constraints = compiled.constraints(count)
    if ask.grammar_field == "tool_choice" and max_tokens > 0:
        closing = grammar.closing_tokens(tokenizer, compiled.words)
        reserve = grammar.closing_reserve(ask.schema)
        for constraint in constraints:
            constraint.close_within(max_tokens, reserve, closing)
    return constraints


def _is_generative(entry: Any) -> bool:
    from plugserve.server.apps.generate.network import GenerativeNetwork

    return isinstance(entry.network, GenerativeNetwork)


def _is_encoder(entry: Any, control: Any) -> bool:
    from plugserve.server.apps.generate import embeddings

    if _is_generative(entry):
        return False
    try:
        return embeddings.encoder_of(entry, control) is not None
    except PlugserveError as exc:  # a broken folder: said at each listing, served by none
        log.warning("model %r: not an embedding model: %s", entry.name, exc)
        return False


def _holds(
    ask: protocol.GenerationAsk,
    max_tokens: int,
    prompts: list[list[int]],
    scored: int | None,
    schema_bytes: int,
    plan: tools.Plan | None,
) -> int:
    """The bytes a generation holds while it runs: its answers, the schema's matchers, the
    prompts' ids, their logprobs (each token's k alternatives) and a tool call being read."""
    holds = _answer_bytes(ask, max_tokens) * len(prompts) + schema_bytes
    holds += _ID_BYTES * sum(len(p) for p in prompts)
    if scored is not None:
        holds += _LOGPROB_BYTES * (scored + 1) * sum(len(p) for p in prompts)
    if plan is not None:  # held until the call closes
        holds += plan.holds(ask.n * len(prompts), ask.stream)
    return holds


def _prompt_scored(ask: protocol.GenerationAsk, echo: bool) -> int | None:
    """The alternatives per prompt token the answer needs (None: no prompt logprobs): echo
    with logprobs' and vLLM's ``prompt_logprobs``, the larger."""
    wanted = [k for k in (ask.logprobs if echo else None, ask.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None


def _unread(ask: protocol.GenerationAsk, params: SamplingParams) -> tuple[int, int] | None:
    """What a prompt's stream may keep unread, past its own bound: a non-streamed answer is
    read by this face, and its whole answer is charged before it starts (:func:`_holds`), so
    its stream may hold it all (an event per token of each sequence at most)."""
    if ask.stream:
        return None
    return ask.n * params.max_tokens + 1, _answer_bytes(ask, params.max_tokens)


def _answer_bytes(ask: protocol.GenerationAsk, max_tokens: int) -> int:
    """What one prompt's answer may hold until it is sent (the whole answer without stream;
    streamed, the stream's own bounded buffer holds it, so only two tokens' worth: the one the
    reader takes and the next, which a pipelined engine may have sent already). A stream its
    face keeps whole (``kept``: the Responses API's) holds the whole answer and, at its end,
    the closing events that repeat it: twice the answer (16 streams of 4,000 tokens with 20
    logprobs had grown the server 1.1 GB against a 64 MiB budget, charged two tokens each)."""
    per_token = _TOKEN_BYTES
    if ask.logprobs is not None:
        per_token += _LOGPROB_BYTES * (ask.logprobs + 1)
    if ask.stream and not ask.kept:
        return ask.n * min(2, max_tokens) * per_token
    return ask.n * max_tokens * per_token * (2 if ask.kept else 1)


async def _traced(trace: Trace, answer: Awaitable[Any]) -> Any:
    """``answer`` (a reply, or a stream's) within the request's root span, which ends once the
    reply is made (its body's bytes counted), once a stream's last chunk is written or its
    client left, or when the request fails (the error recorded)."""
    try:
        reply = await answer
    except BaseException as exc:
        trace.fail(exc)
        trace.end()
        raise
    if isinstance(reply, StreamReply):
        reply.chunks = _counted(trace, reply.chunks)
        return reply
    if reply[0] >= 400:
        trace.fail(f"HTTP {reply[0]}")
    trace.set("plugserve.response_bytes", sum(len(piece) for piece in reply[1]))
    trace.end()
    return reply


async def _counted(trace: Trace, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream's chunks, their bytes counted on its root span, which ends with them."""
    size = 0
    try:
        async for piece in chunks:
            size += len(piece)
            yield piece
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            trace.fail(exc)
        raise
    finally:
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]  # its own finally: cancels
        trace.set("plugserve.response_bytes", size)
        trace.end()


def _echo_only(model: ServedModel, ask: Any, prompts: list[list[int]]) -> Reply | Any:
    """A completion with ``echo`` and ``max_tokens`` 0: the prompt back, nothing generated."""
    answer = Answer(model, ask, "completion", f"cmpl-{uuid.uuid4().hex}", prompts, True)
    for i in range(len(answer.texts)):
        answer.finish[i] = "length"
    if not ask.stream:
        return 200, [orjson.dumps(answer.body())], JSON

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(len(answer.texts)):
            prompt = i // ask.n
            choice = {
                "index": i,
                "text": answer._prompt_text(prompt),
                "logprobs": answer._completion_logprobs(i, prompt),
                "finish_reason": "length",
            }
            yield sse_bytes(answer._chunk([choice]))
        for piece in answer.closing():
            yield piece
        yield sse.DONE

    return StreamReply(200, sse.HEADERS, chunks())
