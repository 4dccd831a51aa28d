"""OpenAI request bodies, checked field by field into what the engine is asked.

One function per route (:func:`chat_request`, :func:`completion_request`,
:func:`embedding_request`) reads the body's JSON and refuses the first field that cannot be
right with an :class:`OpenAIError` naming it (``param``), before anything is tokenized or
generated. What needs the model (the prompt's length against its context, ``logit_bias``'s
token ids against its vocabulary, a schema the grammar library refuses) is checked in
``serving.py`` once the model is known.

Where OpenAI and vLLM differ or are silent, the choice is written here and in docs/openai.md:

* ranges are OpenAI's (temperature in [0, 2], top_p in (0, 1], penalties in [-2, 2],
  logit_bias values in [-100, 100]) with vLLM's extensions (top_k, min_p,
  repetition_penalty, ignore_eos, min_tokens, stop_token_ids, a 64-bit seed) and their
  ranges; the engine's own table of them is ``types.SamplingParams.check``, which the engine
  applies again to whatever a face sends it;
* ``n`` is at most :data:`MAX_N` and a request's choices (``n`` x its prompts) at most
  :data:`MAX_CHOICES`: each is a sequence the engine runs, with its own key/value cache;
* ``top_logprobs`` (chat), ``logprobs`` (completions) and ``prompt_logprobs`` are -1 (vLLM's
  whole vocabulary) or at least 0 here; their upper bound is the server's ``--max-logprobs``
  (default :data:`MAX_LOGPROBS`, OpenAI's 20; completions' ``logprobs`` at most
  :data:`MAX_COMPLETION_LOGPROBS`, OpenAI's 5, unless the setting is raised past 20), checked
  in ``serving.py`` with the model's vocabulary, as vLLM checks its ``max_logprobs``;
* chat's ``logprobs`` is a boolean read as vLLM's pydantic model reads it in its lax mode:
  true/false, the integers 1/0 and the strings of :data:`LAX_TRUE` / :data:`LAX_FALSE` in any
  case (vLLM's own tests send ``"true"``); every other boolean field is strict;
* at most :data:`MAX_STOP` stop strings of at most :data:`MAX_STOP_CHARS` characters each
  (OpenAI says 4; clients send more);
* a body is JSON only when it says so: a ``Content-Type`` other than ``application/json``
  (or none) is a 400 before the body is read, as vLLM answers (its message);
* ``chat_template_kwargs`` may not set what the renderer sets itself (:data:`TEMPLATE_OWN`:
  the messages, tools, the generation prompt's switches, the tokenizer's special tokens and
  the template's helper functions): 400 naming the key, where it was a 500;
* fields this server does not know are ignored, as vLLM does (clients send ``user``,
  ``metadata``, ``store`` and their own extensions); vLLM's and OpenAI's other fields are
  honoured or refused by ``vllm_fields.py``; fields it knows but cannot honour
  (image parts, ``best_of`` over ``n``, ``suffix``) are refused, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import orjson

from plugserve.server.apps.generate.text.tokenizer import SPECIAL_TOKENS
from plugserve.server.apps.generate.types import (
    MAX_LOGPROBS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOKEN_LIST,
    RANGES,
)
from plugserve.server.protocols.openai import tools, vllm_fields
from plugserve.server.protocols.openai.errors import OpenAIError

__all__ = [
    "CHAT_TEXT",
    "MAX_CHOICES",
    "MAX_COMPLETION_LOGPROBS",
    "MAX_LOGPROBS",
    "MAX_N",
    "TEMPLATE_OWN",
    "WHOLE_VOCABULARY",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "GenerationAsk",
    "TextParts",
    "chat_echo",
    "chat_request",
    "check_content_type",
    "completion_request",
    "embedding_request",
    "parse_json",
    "text_of",
]

#: most choices (``n``) per prompt
MAX_N = 16
#: most sequences one request starts (``n`` x its prompts)
MAX_CHOICES = 64
#: most alternatives per token in completions' logprobs (OpenAI's legacy bound; chat's
#: top_logprobs is MAX_LOGPROBS, 20)
MAX_COMPLETION_LOGPROBS = 5
#: the strings pydantic's lax mode reads as a boolean (lower-cased), for chat's ``logprobs``
LAX_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
LAX_FALSE = frozenset(("0", "off", "f", "false", "n", "no"))
#: a logprobs field's value for the whole vocabulary (vLLM's), resolved in serving.py
WHOLE_VOCABULARY = -1
#: OpenAI's temperature range
MAX_TEMPERATURE = 2.0
#: most chat messages, prompts in one completion request, and inputs in one embedding request
MAX_MESSAGES = 4096
MAX_PROMPTS = 64
MAX_EMBEDDING_INPUTS = 2048
#: seeds are 64-bit, as vLLM's
_SEED_RANGE = (-(2**63), 2**63 - 1)

#: the chat roles a template may see (OpenAI's, with 'function' of its older API)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

#: the template's own variables, which ``chat_template_kwargs`` may not replace, and why
TEMPLATE_OWN = {
    "messages": "the request's 'messages'",
    "tools": "the request's 'tools'",
    "add_generation_prompt": "the request field 'add_generation_prompt'",
    "continue_final_message": "the request field 'continue_final_message'",
    **{
        token: "the model's own special token"
        for token in (*SPECIAL_TOKENS, "additional_special_tokens")
    },
    **{name: "a function the template calls" for name in ("raise_exception", "strftime_now")},
    "namespace": "a function the template calls",
}


def check_content_type(value: bytes | None) -> None:
    """A 400 unless the body is declared JSON (``application/json``, any parameters), as
    vLLM refuses it: a body of another type is not read as JSON."""
    media = (value or b"").split(b";", 1)[0].strip().lower()
    if media != b"application/json":
        sent = (value or b"").decode("latin-1")[:100]
        raise OpenAIError(
            "Unsupported Media Type: Only 'application/json' is allowed (this request's "
            + (f"Content-Type is {sent!r}" if sent else "Content-Type is missing")
            + "); send the JSON body with Content-Type: application/json",
            code="unsupported_content_type",
        )


def parse_json(data: bytes | memoryview) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying where it is broken."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(
            f"the request body is not valid JSON ({exc}); send a JSON object with "
            "Content-Type: application/json"
        ) from None
    if not isinstance(value, dict):
        raise OpenAIError(f"the request body must be a JSON object, not {_kind(value)}")
    return value


@dataclasses.dataclass
class GenerationAsk:
    """What a chat or completion request asks of the engine, checked against its ranges;
    ``sampling`` holds the keyword arguments of ``SamplingParams`` but ``max_tokens`` (which
    needs the prompt's length) and ``constraint`` (made per sequence)."""

    model: str
    stream: bool = False
    #: a streamed answer its face keeps whole as it goes (the Responses API: its closing
    #: events repeat the whole text and logprobs), charged as an answer not streamed
    kept: bool = False
    include_usage: bool = False
    #: vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk
    #: carries its prompt's and its choice's counts so far
    continuous_usage: bool = False
    n: int = 1
    max_tokens: int | None = None
    #: the field max_tokens came from, for the message refusing it
    max_tokens_field: str = "max_tokens"
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: top-k alternatives per token (None: no logprobs; 0: only the chosen token's)
    logprobs: int | None = None
    #: the JSON schema the answer must follow (response_format), as text; or a grammar of
    #: ``grammar_kind`` (vLLM's guided decoding: ``vllm_fields.py``) from ``grammar_field``
    schema: str | None = None
    grammar_kind: str = "json"
    grammar_field: str = "response_format"
    #: the tokenizer's special tokens added to the prompt (vLLM's; completions: true)
    add_special_tokens: bool = False
    #: vLLM's extension: each choice also carries its token ids (and the prompt's)
    return_token_ids: bool = False
    #: vLLM's extension: the prompt tokens' logprobs with this many alternatives (None: not
    #: asked); not with ``stream`` (vLLM's rule)
    prompt_logprobs: int | None = None
    #: vLLM's ``cache_salt``: the prefix cache shares blocks only between requests of one
    #: tenant with the same salt ("": none); ``vllm_fields.py`` reads it
    cache_salt: str = ""
    #: the caller's tenant, as its token makes it (``auth.py``; "" without tokens): set by the
    #: route from the caller's identity (``Call.tenant``), never from the body
    tenant: str = ""


@dataclasses.dataclass
class ChatRequest(GenerationAsk):
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    #: "none", "auto", "required" or {"name": ...} (tools.py)
    tool_choice: Any = "none"
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: vLLM's: the final message's content, when it is the assistant's, heads the answer's
    echo: bool = False
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CompletionRequest(GenerationAsk):
    #: each a text or token ids
    prompts: list[str | list[int]] = dataclasses.field(default_factory=list)
    echo: bool = False


@dataclasses.dataclass
class EmbeddingRequest:
    model: str
    #: each a text or token ids
    inputs: list[str | list[int]]
    base64: bool = False
    dimensions: int | None = None
    #: the caller's tenant (``auth.py``; "" without tokens): set by the route, never from the
    #: body; its encoder runs wait in the encoder network's queue as that tenant's
    tenant: str = ""


# --- field readers: each names the field it refuses


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _number(
    body: dict[str, Any],
    key: str,
    default: float | None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OpenAIError(f"'{key}' must be a number, not {_kind(value)}", key)
    if low is not None and (value <= low if low_open else value < low):
        bound = f"greater than {low:g}" if low_open else f"at least {low:g}"
        raise OpenAIError(f"'{key}' must be {bound}, not {value:g}", key)
    if high is not None and value > high:
        raise OpenAIError(f"'{key}' must be at most {high:g}, not {value:g}", key)
    return float(value)


def _integer(
    body: dict[str, Any],
    key: str,
    default: int | None,
    low: int | None = None,
    high: int | None = None,
    why: str = "",
) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        # 4.0 is 4; a float past 2**53 is not exact (JSON's -9223372036854775809, past
        # int64, parses as a float that rounds to -2**63: within the seed's range)
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"'{key}' must be an integer, not {_kind(value)}", key)
    if (low is not None and value < low) or (high is not None and value > high):
        span = (
            f"between {low} and {high}"
            if low is not None and high is not None
            else f"at least {low}"
            if low is not None
            else f"at most {high}"
        )
        raise OpenAIError(f"'{key}' must be {span}{why}, not {value}", key)
    return value


def _boolean(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"'{key}' must be true or false, not {_kind(value)}", key)
    return value


def _lax_boolean(body: dict[str, Any], key: str) -> bool:
    """A boolean as vLLM's pydantic model reads it in lax mode (its clients send ``"true"``):
    true/false, 1/0 and the strings of LAX_TRUE / LAX_FALSE in any case; nothing else."""
    value = body.get(key)
    if isinstance(value, str) and value.lower() in LAX_TRUE | LAX_FALSE:
        return value.lower() in LAX_TRUE
    if not isinstance(value, bool) and isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return _boolean(body, key)


def _logprobs(body: dict[str, Any], key: str, default: int | None) -> int | None:
    """A count of alternatives per token: -1 (the whole vocabulary) or at least 0; its upper
    bound (--max-logprobs, the vocabulary) is serving.py's, which knows the model."""
    value = body.get(key)
    if value == WHOLE_VOCABULARY and not isinstance(value, bool):
        return WHOLE_VOCABULARY
    return _integer(body, key, default, 0, why=" (or -1: the whole vocabulary)")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(
            "'model' must name a served model (GET /v1/models lists them)"
            if model is None
            else f"'model' must be a string, not {_kind(model)}",
            "model",
        )
    return model


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise OpenAIError("'stop' must be a string or an array of strings", "stop")
    if len(stop) > MAX_STOP:
        raise OpenAIError(f"'stop' holds {len(stop)} strings; at most {MAX_STOP}", "stop")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise OpenAIError(
                f"'stop[{i}]' must be 1 to {MAX_STOP_CHARS} characters, not {len(s)}", "stop"
            )
    return stop


def _token_ids(value: Any, key: str, most: int) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise OpenAIError(f"'{key}' must be an array of token ids (integers >= 0)", key)
    if len(value) > most:
        raise OpenAIError(f"'{key}' holds {len(value)} token ids; at most {most}", key)
    return value


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise OpenAIError("'logit_bias' must map token ids to numbers", "logit_bias")
    if len(bias) > MAX_TOKEN_LIST:
        raise OpenAIError(
            f"'logit_bias' holds {len(bias)} tokens; at most {MAX_TOKEN_LIST}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or str(token) != key.strip():
            raise OpenAIError(
                f"'logit_bias' keys must be token ids (integers as strings), not {key!r}",
                "logit_bias",
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (-100 <= value <= 100)
        ):
            raise OpenAIError(
                f"'logit_bias[{key}]' must be a number between -100 and 100, not {value!r}",
                "logit_bias",
            )
        out[token] = float(value)
    return out


def _format_kind(fmt: Any, where: str) -> str | None:
    """The kind of output an answer format asks for ('text', 'json_object' or 'json_schema';
    None: no format): chat's ``response_format`` and Responses' ``text.format`` are the same
    object, refused alike, naming the field ``where``."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError(f"'{where}' must be an object with a 'type'", where)
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise OpenAIError(
            f"'{where}.type' must be 'text', 'json_object' or 'json_schema', not {kind!r}",
            f"{where}.type",
        )
    return kind


def _response_format(body: dict[str, Any]) -> str | None:
    """The JSON schema (as text) response_format asks for; None for plain text."""
    fmt = body.get("response_format")
    kind = _format_kind(fmt, "response_format")
    if kind is None or kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise OpenAIError(
            "'response_format.json_schema' must be an object holding 'name' and 'schema'",
            "response_format.json_schema",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise OpenAIError(
            f"'response_format.json_schema.schema' must be a JSON schema (an object), not "
            f"{_kind(schema)}",
            "response_format.json_schema.schema",
        )
    return orjson.dumps(schema).decode()


def _stream(body: dict[str, Any], ask: GenerationAsk) -> None:
    ask.stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return
    if not ask.stream:
        raise OpenAIError(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", "stream_options")
    ask.include_usage = _boolean(options, "include_usage")
    # vLLM's: continuous usage only with include_usage (alone it changes nothing)
    continuous = _boolean(options, "continuous_usage_stats")
    ask.continuous_usage = ask.include_usage and continuous


def _ranged(key: str, default: Any = None, **narrower: Any) -> Callable[[dict[str, Any]], Any]:
    """A numeric field's check from the engine's one table of ranges (``types.RANGES``, which
    ``SamplingParams.check`` reads again at the engine), narrowed where OpenAI's API is."""
    bounds = dataclasses.replace(RANGES[key], **narrower)
    if bounds.integer:
        high = None if bounds.high is None else int(bounds.high)
        return lambda body: _integer(body, key, default, int(bounds.low), high)
    return lambda body: _number(body, key, default, bounds.low, bounds.high, bounds.low_open)


def _top_k(body: dict[str, Any]) -> int | None:
    top_k = _integer(body, "top_k", None, int(RANGES["top_k"].low))
    return None if top_k is not None and top_k <= 0 else top_k  # 0 and -1: no cut


#: the sampling fields chat and completions share, each read and checked once by its own small
#: function (None: left to the engine's default); adding a field touches this table only
SAMPLING: dict[str, Callable[[dict[str, Any]], Any]] = {
    "temperature": _ranged("temperature", high=MAX_TEMPERATURE),
    "top_p": _ranged("top_p"),
    "top_k": _top_k,
    "min_p": _ranged("min_p"),
    "seed": _ranged("seed", low=_SEED_RANGE[0], high=_SEED_RANGE[1]),
    "stop": _stop,
    "stop_token_ids": lambda body: _token_ids(
        body.get("stop_token_ids") or [], "stop_token_ids", MAX_TOKEN_LIST
    ),
    "ignore_eos": lambda body: _boolean(body, "ignore_eos"),
    "min_tokens": _ranged("min_tokens", 0),
    "presence_penalty": _ranged("presence_penalty", 0.0),
    "frequency_penalty": _ranged("frequency_penalty", 0.0),
    "repetition_penalty": _ranged("repetition_penalty", 1.0),
    "logit_bias": _logit_bias,
}


def _check_min_tokens(ask: GenerationAsk) -> None:
    """``min_tokens`` at most the answer's ``max_tokens`` when both are given (vLLM's rule: a
    minimum past the maximum is a mistake the client should hear of, not a silent cut)."""
    least = ask.sampling.get("min_tokens")
    if least is not None and ask.max_tokens is not None and least > ask.max_tokens:
        raise OpenAIError(
            f"'min_tokens' must be at most '{ask.max_tokens_field}' ({ask.max_tokens}), not "
            f"{least}",
            "min_tokens",
        )


def _sampling(body: dict[str, Any], ask: GenerationAsk) -> None:
    """The sampling fields common to chat and completions."""
    ask.n = _integer(body, "n", 1, 1, MAX_N)  # type: ignore[assignment]
    best_of = _integer(body, "best_of", None, 1)
    if best_of is not None and best_of != ask.n:
        raise OpenAIError(
            "'best_of' other than 'n' is not supported (this server does not rank "
            "candidates); leave it out",
            "best_of",
        )
    read = ((key, check(body)) for key, check in SAMPLING.items())
    ask.sampling = {key: value for key, value in read if value is not None}
    ask.schema = _response_format(body)
    ask.return_token_ids = _boolean(body, "return_token_ids")
    ask.prompt_logprobs = _logprobs(body, "prompt_logprobs", None)
    if ask.prompt_logprobs is not None and ask.stream:
        raise OpenAIError(
            "'prompt_logprobs' is not available with 'stream' (vLLM's rule): the prompt's "
            "logprobs come in the whole answer",
            "prompt_logprobs",
        )


@dataclasses.dataclass(frozen=True)
class TextParts:
    """How a face writes a message's text as an array of parts (chat's, Responses' and
    Anthropic's differ in the part types and the wording only, so :func:`text_of` reads them
    all): ``texts``, each text part's type and the key holding its text; ``joiner``, what
    joins them; its refusals' wording, templates of ``where`` (the field), ``what`` (the
    value's kind), ``i``, ``kind`` (a refused part's type) and ``item`` (its field, itself
    a template of ``where`` and ``i``)."""

    texts: dict[str, str]
    joiner: str
    item: str
    not_array: str
    not_text: str


#: chat's: text parts, joined as they are
CHAT_TEXT = TextParts(
    {"text": "text"},
    "",
    "{where}[{i}]",
    "'{where}' must be a string or an array of content parts",
    '\'{item}\' must be a text part ({{"type": "text", "text": ...}}); this server serves '
    "text models, not {kind!r} parts",
)


def text_of(value: Any, where: str, parts: TextParts) -> str:
    """A message's content as text: a string, or the text of an array of text parts (refused,
    naming ``where``, otherwise)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise OpenAIError(parts.not_array.format(where=where, what=_kind(value)), where)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        key = parts.texts.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            item = parts.item.format(where=where, i=i)
            raise OpenAIError(parts.not_text.format(item=item, kind=kind), item)
        texts.append(part[key])
    return parts.joiner.join(texts)


def _text_content(content: Any, where: str) -> str | None:
    """A chat message's content as text (None: no content, an assistant's with tool calls)."""
    return None if content is None else text_of(content, where, CHAT_TEXT)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty array of messages", "messages")
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(f"'messages' holds {len(messages)}; at most {MAX_MESSAGES}", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise OpenAIError(f"'{where}' must be an object with a 'role'", where)
        role = message.get("role")
        if role not in ROLES:
            raise OpenAIError(
                f"'{where}.role' is {role!r}; a message's role is one of {', '.join(ROLES)}",
                f"{where}.role",
            )
        checked = dict(message)
        checked["content"] = _text_content(message.get("content"), f"{where}.content")
        if checked["content"] is None and role != "assistant":
            raise OpenAIError(f"'{where}.content' is missing", f"{where}.content")
        if role == "developer":  # OpenAI's newer name; the templates people have know 'system'
            checked["role"] = "system"
        out.append(checked)
    return out


def chat_echo(ask: ChatRequest) -> str:
    """What vLLM's chat ``echo`` puts ahead of the answer's content: the final message's text
    when that message is the assistant's (the one ``continue_final_message`` continues), else
    nothing."""
    if not ask.echo or not ask.messages or ask.messages[-1].get("role") != "assistant":
        return ""
    return _text_content(ask.messages[-1].get("content"), "messages[-1].content") or ""


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """POST /v1/chat/completions: the body checked."""
    ask = ChatRequest(model=_model(body), messages=_messages(body))
    _stream(body, ask)
    _sampling(body, ask)
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            ask.max_tokens = _integer(body, key, None, 1)
            ask.max_tokens_field = key
            break
    _check_min_tokens(ask)
    if _lax_boolean(body, "logprobs"):
        ask.logprobs = _logprobs(body, "top_logprobs", 0)
    elif body.get("top_logprobs") is not None:
        _logprobs(body, "top_logprobs", 0)
        raise OpenAIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    ask.continue_final_message = _boolean(body, "continue_final_message")
    ask.echo = _boolean(body, "echo")
    ask.add_generation_prompt = _boolean(
        body, "add_generation_prompt", not ask.continue_final_message
    )
    if ask.continue_final_message and ask.add_generation_prompt:
        raise OpenAIError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true",
            "continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise OpenAIError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for key in kwargs or ():
        if key in TEMPLATE_OWN:
            raise OpenAIError(
                f"'chat_template_kwargs' may not set {key!r}: the chat template gets it from "
                f"{TEMPLATE_OWN[key]}",
                "chat_template_kwargs",
            )
    ask.template_kwargs = dict(kwargs or {})
    vllm_fields.read(body, ask, "chat")
    tools.check_tools(body, ask)  # tools, tool_choice (forced: a schema), reasoning_effort
    tools.history(ask.messages)
    return ask


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            prompts: list[str | list[int]] = list(prompt)
        elif all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            prompts = [_token_ids(prompt, "prompt", 1 << 20)]
        elif all(isinstance(p, list) for p in prompt):
            prompts = [_token_ids(p, f"prompt[{i}]", 1 << 20) for i, p in enumerate(prompt)]
        else:
            prompts = []
        if prompts:
            if len(prompts) > MAX_PROMPTS:
                raise OpenAIError(
                    f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS}", "prompt"
                )
            if any(isinstance(p, list) and not p for p in prompts):
                raise OpenAIError("'prompt' holds an empty array of token ids", "prompt")
            return prompts
    raise OpenAIError(
        "'prompt' must be a string, an array of strings, an array of token ids or an array of "
        "arrays of token ids",
        "prompt",
    )


def completion_request(body: dict[str, Any]) -> CompletionRequest:
    """POST /v1/completions: the body checked."""
    ask = CompletionRequest(model=_model(body), prompts=_prompts(body))
    _stream(body, ask)
    _sampling(body, ask)
    ask.echo = _boolean(body, "echo")
    ask.max_tokens = _integer(body, "max_tokens", None, 0 if ask.echo else 1)
    _check_min_tokens(ask)
    ask.logprobs = _logprobs(body, "logprobs", None)
    if body.get("suffix"):
        raise OpenAIError("'suffix' (insertion) is not supported by this server", "suffix")
    choices = ask.n * len(ask.prompts)
    if choices > MAX_CHOICES:
        raise OpenAIError(
            f"'n' x the prompts is {choices} sequences; at most {MAX_CHOICES} per request", "n"
        )
    vllm_fields.read(body, ask, "completion")
    return ask


def embedding_request(body: dict[str, Any]) -> EmbeddingRequest:
    """POST /v1/embeddings: the body checked."""
    model = _model(body)
    value = body.get("input")
    inputs: list[str | list[int]] = []
    if isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            inputs = list(value)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            inputs = [_token_ids(value, "input", 1 << 20)]
        elif all(isinstance(v, list) for v in value):
            inputs = [_token_ids(v, f"input[{i}]", 1 << 20) for i, v in enumerate(value)]
    if not inputs:
        raise OpenAIError(
            "'input' must be a string, an array of strings, an array of token ids or an array "
            "of arrays of token ids",
            "input",
        )
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise OpenAIError(
            f"'input' holds {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS}", "input"
        )
    for i, item in enumerate(inputs):
        if not item:
            raise OpenAIError(f"'input[{i}]' is empty", "input")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise OpenAIError(
            f"'encoding_format' must be 'float' or 'base64', not {fmt!r}", "encoding_format"
        )
    return EmbeddingRequest(model, inputs, fmt == "base64", _integer(body, "dimensions", None, 1))
