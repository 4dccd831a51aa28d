"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``), served by the chat
path it stands on.

A request is checked and its items turned into chat messages (:mod:`.responses_input`), the
conversation of its ``previous_response_id`` put before them, and the whole run through the chat
route's own code (``OpenAIRoutes._chat_prompt`` and ``started``: the same checks, template,
tokenizing, engine, budget, trace), never an HTTP hop; its answer, the whole choice or its typed
pieces as they come (``answer.answer_deltas``, ``deltas.py``: what the chat route writes as
chunks, never its chunks parsed back), becomes the response's output items or events
(:mod:`.responses_output`, the one seam), and a refusal of chat's names the responses field
(``max_output_tokens``, ``text.format``, ``input``).

Kept responses (``store``, true unless said false) live in :mod:`.responses_store`, bounded in
entries, bytes (charged to the memory budget) and age; ``previous_response_id`` continues the
conversation a kept response ended (404 when it is not kept: evicted, expired, deleted, or
made with ``store: false``, or another tenant's: each tenant finds its own only). A streamed
response is kept once its last event is made; one whose client left is not.

``input_items`` lists a kept response's input items (its request's ``input``, each with an id)
a page at a time as OpenAI does (``limit`` 1-100, default 20; ``order`` ``desc``, the default,
or ``asc``; ``after`` an item's id). ``cancel`` is for ``background`` responses, which this
server does not run (``background: true`` is refused at create): cancelling a kept response
answers what OpenAI answers for a response made in the foreground, a 400; an unknown id a 404.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from plugserve.server.protocols.http import sse
from plugserve.server.protocols.http.http_server import StreamReply
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.openai import protocol
from plugserve.server.protocols.openai.answer import Started, events_of
from plugserve.server.protocols.openai.errors import OpenAIError, rename
from plugserve.server.protocols.openai.responses_input import ResponsesAsk, responses_request
from plugserve.server.protocols.openai.responses_output import (
    EventStream,
    assistant_messages,
    new_id,
    output_items,
    response_object,
    status_of,
    usage,
)
from plugserve.server.protocols.openai.responses_store import ResponseStore

#: input_items' page size: the default and the most (OpenAI's)
PAGE, MAX_PAGE = 20, 100

__all__ = ["ResponsesRoutes"]

#: chat's field -> the responses field a refusal names
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "chat_template_kwargs": "reasoning",
}
#: a request with more items than this is made into its chat request on a worker thread
_INLINE_ITEMS = 64


class ResponsesRoutes:
    """``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` over the chat
    routes (``openai``: their :class:`~.serving.OpenAIRoutes`) and a bounded store."""

    def __init__(self, openai: Any, store: ResponseStore) -> None:
        self.openai = openai
        self.store = store

    @staticmethod
    def table(
        prefix: str,
        infer: str,
        guarded: Callable[[Any], Any],
        owner: Callable[[], ResponsesRoutes],
    ) -> list[Any]:
        """The routes under ``prefix``, each authorized as ``infer`` (ModelInfer); ``owner()``
        gives the handlers' instance when a request comes."""
        one = prefix + r"/responses/(?P<response>[^/]+)"
        return [
            (prefix + "/responses", {"POST": (infer, guarded(lambda call: owner().create(call)))}),
            (
                one,
                {
                    "GET": (infer, guarded(lambda call: owner().retrieve(call))),
                    "DELETE": (infer, guarded(lambda call: owner().delete(call))),
                },
            ),
            (
                one + "/input_items",
                {"GET": (infer, guarded(lambda call: owner().input_items(call)))},
            ),
            (one + "/cancel", {"POST": (infer, guarded(lambda call: owner().cancel(call)))}),
        ]

    # --- GET and DELETE

    def _kept(self, rid: str, tenant: str) -> Any:
        """``tenant``'s kept response ``rid``, or the 404 (another tenant's is not found)."""
        entry = self.store.get(rid, tenant)
        if entry is None:
            raise OpenAIError(
                f"Response with id '{rid}' not found (never made with 'store', deleted, or "
                f"evicted from this server's bounded store: {self._bounds()})",
                "response_id",
                404,
            )
        return entry

    def _bounds(self) -> str:
        s = self.store
        if not s.on:
            return "the store is off (--responses-store-bytes 0)"
        return (
            f"{s.tenant_entries} responses and {s.tenant_bytes >> 20} MiB a tenant, "
            f"{s.max_age_s:g} s (--responses-store-tenant-entries, "
            "--responses-store-tenant-bytes, --responses-store-seconds)"
        )

    def retrieve(self, call: Any) -> Any:
        entry = self._kept(call.path["response"], call.tenant)
        return 200, [entry.response], JSON

    def delete(self, call: Any) -> Any:
        rid = call.path["response"]
        if not self.store.delete(rid, call.tenant):
            self._kept(rid, call.tenant)
        body = {"id": rid, "object": "response.deleted", "deleted": True}
        return 200, [orjson.dumps(body)], JSON

    def input_items(self, call: Any) -> Any:
        entry = self._kept(call.path["response"], call.tenant)
        query = getattr(call, "query", {}) or {}

        def one(name: str) -> str | None:
            values = query.get(name)
            return values[-1] if values else None

        limit_text = one("limit")
        try:
            limit = PAGE if limit_text is None else int(limit_text)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_PAGE:
            raise OpenAIError(
                f"'limit' must be an integer from 1 to {MAX_PAGE}, not {limit_text!r}", "limit"
            )
        order = one("order") or "desc"
        if order not in ("asc", "desc"):
            raise OpenAIError(f"'order' must be 'asc' or 'desc', not {order!r}", "order")
        include = [v for name in ("include", "include[]") for v in query.get(name, ())]
        if include:
            raise OpenAIError(
                f"'include' asks for {include!r}; this server adds nothing to input items",
                "include",
            )
        after = one("after")
        page = entry.page(limit, order == "desc", after)
        if page is None:
            raise OpenAIError(
                f"'after' names the item {after!r}, which is not an input item of this response",
                "after",
            )
        return 200, [page], JSON

    def cancel(self, call: Any) -> Any:
        rid = call.path["response"]
        self._kept(rid, call.tenant)
        raise OpenAIError(
            f"Response with id '{rid}' was not created with 'background': true: only "
            "background responses can be cancelled (this server answers every response in "
            "the foreground)",
            "response_id",
        )

    # --- POST

    async def create(self, call: Any) -> Any:
        return await self.openai._answer(call, responses_request, "responses", self._create)

    def _history(self, ask: ResponsesAsk) -> list[dict[str, Any]]:
        if ask.previous_response_id is None:
            return []
        entry = self.store.get(ask.previous_response_id, ask.tenant)
        if entry is None:
            raise OpenAIError(
                f"Previous response with id '{ask.previous_response_id}' not found (never made "
                f"with 'store', deleted, or evicted from this server's bounded store: "
                f"{self._bounds()})",
                "previous_response_id",
                404,
            )
        return entry.messages()

    def _chat_ask(
        self, ask: ResponsesAsk, history: list[dict[str, Any]]
    ) -> tuple[protocol.ChatRequest, list[dict[str, Any]]]:
        """The chat request of ``ask`` after ``history`` (checked as chat checks it, a
        refusal naming the responses field) and the conversation it continues."""
        conversation = [*history, *ask.messages]
        system = [{"role": "system", "content": ask.instructions}] if ask.instructions else []
        body = {**ask.chat, "messages": [*system, *conversation]}
        try:
            chat = protocol.chat_request(body)
        except OpenAIError as exc:
            raise _renamed(exc) from None
        chat.max_tokens_field = "max_output_tokens"
        chat.tenant = ask.tenant  # its prefix cache is its tenant's
        chat.kept = True  # EventStream keeps the text and logprobs for its closing events
        return chat, conversation

    async def _start(self, chat: protocol.ChatRequest, trace: Any) -> Started:
        """The chat request started on the chat path (its checks, template, engine, budget,
        trace), a refusal naming the responses field."""
        try:
            model, ids, plan = await self.openai._chat_prompt(chat)
            started = await self.openai.started(model, chat, [ids], "chat", "messages", trace, plan)
        except OpenAIError as exc:
            raise _renamed(exc) from None
        assert isinstance(started, Started)  # (only a completion's echo answers at once)
        return started

    async def _create(self, ask: ResponsesAsk, trace: Any) -> Any:
        history = self._history(ask)
        if history or len(ask.messages) > _INLINE_ITEMS:
            chat, conversation = await self.openai._in_worker(self._chat_ask, ask, history)
        else:
            chat, conversation = self._chat_ask(ask, history)
        rid = new_id("resp")
        created = int(time.time())
        started = await self._start(chat, trace)
        answer = started.answer
        if chat.stream:
            events = EventStream(rid, created, chat.model, ask.echo)
            kept = conversation if ask.store else None
            chunks = self._streamed(events, started, kept, ask.items, ask.tenant)
            return StreamReply(200, sse.HEADERS, chunks)
        try:
            long = await self.openai.gathered(started)
        except OpenAIError as exc:
            raise _renamed(exc) from None
        choice = await self.openai._in_worker(answer.choice, 0) if long else answer.choice(0)
        message = choice["message"]
        state = status_of(choice["finish_reason"])
        output = output_items(
            message.get("content"),
            message.get("tool_calls"),
            message.get("reasoning_content"),
            logprobs=(choice["logprobs"] or {}).get("content"),
        )
        body = response_object(
            rid, created, chat.model, ask.echo, state, output, usage(answer.usage())
        )
        if ask.store:
            self._keep(body, conversation, ask.items, ask.tenant)
        return 200, [orjson.dumps(body)], JSON

    def _keep(
        self,
        body: dict[str, Any],
        conversation: list[dict[str, Any]],
        items: list[dict[str, Any]],
        tenant: str,
    ) -> None:
        messages = [*conversation, *assistant_messages(body["output"])]
        self.store.put(body["id"], body, messages, items, tenant)

    def _streamed(
        self,
        events: EventStream,
        started: Started,
        conversation: list[dict[str, Any]] | None,
        items: list[dict[str, Any]],
        tenant: str,
    ) -> AsyncIterator[bytes]:
        """The response's events (``answer.events_of``), kept once the last is made (with
        ``conversation``: None, not kept). A failure midway (the status line is out) is the
        ``response.failed`` event, with chat's error object."""
        if conversation is None:
            return events_of(events, started)

        def keep() -> None:
            response = events.response(status_of(events.finish))
            self._keep(response, conversation, items, tenant)

        return events_of(events, started, keep)


def _renamed(exc: OpenAIError) -> OpenAIError:
    """A chat refusal naming the responses field it came from."""
    param = exc.param or ""
    for chat_name, name in _PARAMS.items():
        if (
            param == chat_name
            or param.startswith(chat_name + "[")
            or param.startswith(chat_name + ".")
        ):
            # (a message's index is not its input item's: instructions come first)
            rename(exc, chat_name, name, paths=chat_name != "messages")
            break
    return exc
