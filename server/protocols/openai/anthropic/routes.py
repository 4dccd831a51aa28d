"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: decode, call the chat path,
encode.

A body is checked and made into a chat request (``request.py``), whose prompt is rendered and
tokenized by the chat route's own code (``OpenAIRoutes._chat_prompt``: the same template,
tools, limits and workers), started by it (``OpenAIRoutes.started``: the same checks,
engine, budget, deadline and trace), never an HTTP hop; its answer, the whole choice or its
typed pieces as they come (``openai/answer.answer_deltas``), becomes the message or its
events (``answer.py``): no chat chunk is written and read back. ``count_tokens`` stops
after the prompt: its ``input_tokens`` are the ids the message would be generated from, so a
message's ``input_tokens`` plus ``cache_read_input_tokens`` is always that count.

Every refusal is Anthropic's error body (``errors.py``), those of the router too (a token
missing or wrong, a body too large, the memory budget). The routes are authorized as the chat
route is (ModelInfer: an ``infer`` token), the token sent as ``x-api-key`` (Anthropic's SDK) or
``authorization: Bearer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from plugserve.server.protocols.auth import KSERVE
from plugserve.server.protocols.http import sse
from plugserve.server.protocols.http.http_server import StreamReply
from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.openai.answer import Answer, Started, events_of
from plugserve.server.protocols.openai.anthropic import errors
from plugserve.server.protocols.openai.anthropic.answer import EventStream, message, new_id
from plugserve.server.protocols.openai.anthropic.request import (
    MessagesAsk,
    count_request,
    messages_request,
    renamed,
)
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = ["AnthropicRoutes"]


class AnthropicRoutes:
    """The Messages API over the OpenAI face's chat path (``openai``: its
    :class:`~plugserve.server.protocols.openai.serving.OpenAIRoutes`)."""

    def __init__(self, openai: Any) -> None:
        self.openai = openai

    @staticmethod
    def table(owner: Callable[[], AnthropicRoutes]) -> list[Any]:
        """The routes, each authorized as ModelInfer; ``owner()`` gives the handlers' instance
        when a request comes (the table is read without one too: tests/server/test_roles.py)."""
        infer = f"/{KSERVE}/ModelInfer"
        create = errors.guarded(lambda call: owner().create(call))
        count_tokens = errors.guarded(lambda call: owner().count_tokens(call))
        return [
            ("/v1/messages", {"POST": (infer, create)}),
            ("/v1/messages/count_tokens", {"POST": (infer, count_tokens)}),
        ]

    def routes(self) -> list[Any]:
        """``Router.add_routes``' table (with :attr:`refusal` and ``auth_errors=True``)."""
        return self.table(lambda: self)

    refusal = staticmethod(errors.refusal)

    # --- POST /v1/messages

    async def create(self, call: Any) -> Any:
        return await self.openai._answer(call, messages_request, "chat", self._create)

    async def _prompt(self, ask: MessagesAsk) -> Any:
        ask.chat.tenant = ask.tenant  # its prefix cache is its tenant's
        try:
            return await self.openai._chat_prompt(ask.chat)
        except OpenAIError as exc:
            raise renamed(exc) from None

    async def _create(self, ask: MessagesAsk, trace: Any) -> Any:
        model, ids, plan = await self._prompt(ask)
        chat = ask.chat
        try:
            started = await self.openai.started(model, chat, [ids], "chat", "messages", trace, plan)
        except OpenAIError as exc:
            raise renamed(exc) from None
        assert isinstance(started, Started)  # (only a completion's echo answers at once)
        rid = new_id("msg")
        answer = started.answer
        if chat.stream:
            events = EventStream(rid, ask.model, ask.stop_sequences, len(ids))
            return StreamReply(200, sse.HEADERS, events_of(events, started))
        try:
            long = await self.openai.gathered(started)
        except OpenAIError as exc:
            raise renamed(exc) from None
        if long:
            made = await self.openai._in_worker(_message, rid, ask, answer)
        else:
            made = _message(rid, ask, answer)
        return 200, [made], JSON

    # --- POST /v1/messages/count_tokens

    async def count_tokens(self, call: Any) -> Any:
        return await self.openai._answer(call, count_request, "count_tokens", self._count)

    async def _count(self, ask: MessagesAsk, trace: Any) -> Any:
        _model, ids, _plan = await self._prompt(ask)
        return 200, [orjson.dumps({"input_tokens": len(ids)})], JSON


def _message(rid: str, ask: MessagesAsk, answer: Answer) -> bytes:
    made = message(rid, ask.model, answer.choice(0), answer.usage(), ask.stop_sequences)
    return orjson.dumps(made)
