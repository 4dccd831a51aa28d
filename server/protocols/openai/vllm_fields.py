"""vLLM's and OpenAI's request fields beyond the ones ``protocol.py`` reads as its own: each
honoured or refused with a 400 naming it, never accepted and dropped.

Honoured:

* guided decoding, vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``) and its older ``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``: the same llguidance path as ``response_format``
  (``server/apps/generate/text/grammar.py``), a grammar in Lark or GBNF; at most one constraint a
  request (with ``response_format`` too); ``guided_decoding_backend`` may name llguidance (or
  ``auto``) only;
* ``skip_special_tokens`` and ``include_stop_str_in_output`` (the engine's own parameters),
  ``add_special_tokens`` (the tokenizer's BOS and the like: completions true, chat false by
  default, as vLLM's);
* ``cache_salt`` (vLLM's): a string of 1 to :data:`MAX_CACHE_SALT` characters mixed into the
  first block's hash of the prompt's chain in the prefix cache (``kvcache.salt``), beside the
  caller's tenant: only requests of the same tenant with the same salt share cached blocks.

Refused when set to anything but the value that changes nothing (:data:`REFUSED`): beam search,
``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``, ``logits_processors``,
``return_tokens_as_token_ids``, ``prompt_embeds``, a custom ``chat_template``, multimodal and
audio fields, OpenAI's legacy ``functions`` / ``function_call``, ``prediction``,
``web_search_options``.
"""

from __future__ import annotations

from typing import Any

import orjson

from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = ["MAX_CACHE_SALT", "REFUSED", "read"]

#: ``cache_salt``'s characters at most: it is hashed with every prompt's first block, and a
#: salt is a name, not a document (vLLM bounds it by the request's size only)
MAX_CACHE_SALT = 256

#: field -> (the routes it applies to, the values that change nothing, why it is refused)
REFUSED: dict[str, tuple[str, tuple[Any, ...], str]] = {
    "use_beam_search": ("both", (False,), "beam search is not supported"),
    "length_penalty": ("both", (1, 1.0), "it weighs beam search, which is not supported"),
    "allowed_token_ids": ("both", ([],), "use 'logit_bias' to steer tokens"),
    "bad_words": ("both", ([],), "use 'logit_bias' to keep tokens out"),
    "truncate_prompt_tokens": ("both", (), "prompts are never truncated (too long: a 400)"),
    "logits_processors": ("both", ([],), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ("both", (False,), "use 'return_token_ids'"),
    "spaces_between_special_tokens": ("both", (True,), "special tokens are decoded as they are"),
    "guided_whitespace_pattern": ("both", (), "the JSON is compact; no whitespace pattern"),
    "prompt_embeds": ("completion", (), "prompts are text or token ids"),
    "chat_template": ("chat", (), "the model folder's chat template is the one served"),
    "documents": ("chat", ([],), "retrieval documents are not given to the template"),
    "mm_processor_kwargs": ("chat", ({},), "this server serves text models"),
    "audio": ("chat", (), "this server serves text models"),
    "modalities": ("chat", (["text"],), "this server answers text only"),
    "prediction": ("chat", (), "predicted outputs are not supported"),
    "web_search_options": ("chat", (), "this server runs no web search"),
    "functions": ("chat", ([],), "the legacy 'functions' API: send 'tools'"),
    "function_call": ("chat", (), "the legacy 'functions' API: send 'tool_choice'"),
}
#: the keys of ``structured_outputs`` (vLLM's) that carry a grammar, and its older fields
_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_BACKENDS = (None, "", "auto", "guidance", "llguidance")


def _refuse_unsupported(body: dict[str, Any], route: str) -> None:
    for key, (where, harmless, why) in REFUSED.items():
        value = body.get(key)
        if value is None or where not in ("both", route) or value in harmless:
            continue
        raise OpenAIError(f"'{key}' is not supported by this server: {why}", key)


def _grammar_text(value: Any, kind: str, field: str) -> str:
    """The grammar of a guided field as text (``grammar.compile_schema``'s input)."""
    if kind == "json":
        if isinstance(value, str):
            return value
        if isinstance(value, (dict, bool)):
            return orjson.dumps(value).decode()
        raise OpenAIError(f"'{field}' must be a JSON schema (an object or its text)", field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise OpenAIError(f"'{field}' must be a non-empty array of strings", field)
        return orjson.dumps(value).decode()
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"'{field}' must be a non-empty string", field)
    return value


def _guided(body: dict[str, Any]) -> tuple[str, str, str] | None:
    """The request's one guided-decoding grammar: (kind, text, the field it came from)."""
    found: list[tuple[str, str, str]] = []
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise OpenAIError("'structured_outputs' must be an object", "structured_outputs")
        for key, value in outputs.items():
            field = f"structured_outputs.{key}"
            if value is None or value is False:
                continue
            if key in _KINDS:
                found.append((_KINDS[key], _grammar_text(value, _KINDS[key], field), field))
            elif key == "json_object":
                found.append(("json", '{"type": "object"}', field))
            else:  # structural_tag, whitespace_pattern, disable_*: not supported
                raise OpenAIError(f"'{field}' is not supported by this server", field)
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            found.append((kind, _grammar_text(body[key], kind, key), key))
    backend = body.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise OpenAIError(
            f"'guided_decoding_backend' is {backend!r}; this server's grammars are "
            "llguidance's ('guidance' or 'auto')",
            "guided_decoding_backend",
        )
    if len(found) > 1:
        raise OpenAIError(
            f"'{found[1][2]}': one grammar a request ({found[0][2]} is one already)", found[1][2]
        )
    return found[0] if found else None


def read(body: dict[str, Any], ask: Any, route: str) -> None:
    """The fields of the module's docstring onto ``ask`` (a ``GenerationAsk``; ``route``:
    "chat" or "completion"), or the 400 naming the first refused."""
    _refuse_unsupported(body, route)
    for key in ("skip_special_tokens", "include_stop_str_in_output"):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise OpenAIError(f"'{key}' must be true or false", key)
            ask.sampling[key] = value
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise OpenAIError("'add_special_tokens' must be true or false", "add_special_tokens")
    ask.add_special_tokens = special if special is not None else route != "chat"
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT:
            raise OpenAIError(
                f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT} characters", "cache_salt"
            )
        ask.cache_salt = salt
    guided = _guided(body)
    if guided is None:
        return
    kind, text, field = guided
    if ask.schema is not None:
        raise OpenAIError(
            f"'{field}': one grammar a request ('response_format' is one already)", field
        )
    ask.schema, ask.grammar_kind, ask.grammar_field = text, kind, field
