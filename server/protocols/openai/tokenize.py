"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them (at the root, beside /v1).

``/tokenize`` takes ``model`` and either ``prompt`` (a string; ``add_special_tokens`` true by
default: the tokenizer's BOS and the like, as a completion's prompt is encoded) or ``messages``
(rendered by the model's chat template exactly as /v1/chat/completions renders them, with
``add_generation_prompt`` (true), ``continue_final_message``, ``tools`` and
``chat_template_kwargs``; ``add_special_tokens`` false by default: the template writes its
own), and answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``, the
tokens' own pieces, only with ``return_token_strs``). ``/detokenize`` takes ``model`` and
``tokens`` and answers ``{"prompt": text}`` (special tokens kept, as vLLM decodes them).

Bounded as every prompt is: the text by the model's prompt bound (its context times its
longest token's bytes, or --max-prompt-bytes; 400 naming ``prompt`` or ``messages`` before
anything is rendered or tokenized), tokenizing's memory charged to --max-inflight-bytes, the
work on the OpenAI routes' worker threads (never the event loop). A prompt longer than the
context is counted, not refused: counting is what clients tokenize for. ``tokens`` to
detokenize are at most the model's context and each in its vocabulary (400 naming
``tokens``). Authorized as generating is (ModelInfer): the answer reveals the model's
tokenizer and template.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from plugserve.server.protocols.http.replies import JSON
from plugserve.server.protocols.openai import protocol
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = ["TokenizeRoutes"]


class TokenizeRoutes:
    """The two routes over the chat routes' models, checks and workers (``openai``: their
    :class:`~.serving.OpenAIRoutes`), tokenizing as they do: ``chat_ids(model, ask,
    add_special_tokens)``, ``completion_ids(model, texts, add_special_tokens)`` and
    ``check_prompt(size, model, what, field)`` are serving.py's own (handed in: this module
    is imported by it)."""

    def __init__(
        self,
        openai: Any,
        chat_ids: Callable[..., list[int]],
        completion_ids: Callable[..., list[list[int]]],
        check_prompt: Callable[..., None],
    ) -> None:
        self.openai = openai
        self._chat_ids = chat_ids
        self._completion_ids = completion_ids
        self._check_prompt = check_prompt

    @staticmethod
    def table(
        infer: str, guarded: Callable[[Any], Any], owner: Callable[[], TokenizeRoutes]
    ) -> list[Any]:
        """The two routes, authorized as ``infer`` (ModelInfer); ``owner()`` gives the
        handlers' instance when a request comes."""
        return [
            ("/tokenize", {"POST": (infer, guarded(lambda call: owner().tokenize(call)))}),
            ("/detokenize", {"POST": (infer, guarded(lambda call: owner().detokenize(call)))}),
        ]

    async def tokenize(self, call: Any) -> Any:
        return await self.openai._answer(call, _tokenize_request, "tokenize", self._tokenize)

    async def detokenize(self, call: Any) -> Any:
        return await self.openai._answer(call, _detokenize_request, "detokenize", self._detokenize)

    async def _tokenize(self, ask: Any, trace: Any) -> Any:
        model = self.openai._generative(ask.model)
        if isinstance(ask, protocol.ChatRequest):
            chars = sum(len(m["content"]) for m in ask.messages if isinstance(m["content"], str))
            self._check_prompt(chars, model, "'messages'", "messages")
            ids = await self.openai._in_worker(self._chat_ids, model, ask, ask.special)
        else:
            self._check_prompt(len(ask.prompt), model, "'prompt'", "prompt")
            found = await self.openai._in_worker(
                self._completion_ids, model, [ask.prompt], ask.special
            )
            ids = found[0]
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": model.context,
            "tokens": ids,
            "token_strs": None,
        }
        if ask.token_strs:
            piece = model.tokenizer.backend.id_to_token
            body["token_strs"] = [piece(i) for i in ids]
        return 200, [orjson.dumps(body)], JSON

    async def _detokenize(self, ask: Any, trace: Any) -> Any:
        model = self.openai._generative(ask.model)
        if len(ask.tokens) > model.context:
            raise OpenAIError(
                f"'tokens' holds {len(ask.tokens)} token ids; this model's context holds "
                f"{model.context}",
                "tokens",
            )
        if ask.tokens and max(ask.tokens) >= model.vocab_size:
            raise OpenAIError(
                f"'tokens' holds token id {max(ask.tokens)}; this model's vocabulary has "
                f"{model.vocab_size} tokens",
                "tokens",
            )
        tokenizer = model.tokenizer
        texts = await self.openai._in_worker(tokenizer.decode_batch, [ask.tokens], False)
        return 200, [orjson.dumps({"prompt": texts[0]})], JSON


class _Prompt:
    __slots__ = ("model", "prompt", "special", "token_strs")


class _Tokens:
    __slots__ = ("model", "tokens")


def _tokenize_request(body: dict[str, Any]) -> Any:
    """The body of /tokenize: a chat (``messages``, checked as chat's) or a ``prompt``."""
    token_strs = protocol._boolean(body, "return_token_strs")
    if "messages" in body:
        chat = {
            k: body[k]
            for k in (
                "model", "messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message",
            )
            if k in body
        }  # fmt: skip
        ask: Any = protocol.chat_request(chat)
        ask.special = protocol._boolean(body, "add_special_tokens", False)
        ask.token_strs = token_strs
        return ask
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise OpenAIError("'prompt' must be a string (or send 'messages')", "prompt")
    ask = _Prompt()
    ask.model = protocol._model(body)
    ask.prompt = prompt
    ask.special = protocol._boolean(body, "add_special_tokens", True)
    ask.token_strs = token_strs
    return ask


def _detokenize_request(body: dict[str, Any]) -> Any:
    ask = _Tokens()
    ask.model = protocol._model(body)
    if not isinstance(body.get("tokens"), list):
        raise OpenAIError("'tokens' must be an array of token ids", "tokens")
    ask.tokens = protocol._token_ids(body["tokens"], "tokens", 1 << 20)
    return ask
