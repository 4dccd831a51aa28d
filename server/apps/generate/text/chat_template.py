"""A model folder's chat template, rendered as transformers' ``apply_chat_template`` renders it.

The template is the folder's (written by whoever published the model), the messages are the
client's: it runs in jinja2's ``ImmutableSandboxedEnvironment`` (no attribute of Python's
internals, no mutation of the client's lists and dicts, ``range`` bounded at 100,000), with
transformers' environment: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, its ``tojson`` (no HTML escaping; ``indent``, ``separators``, ``sort_keys``),
``raise_exception`` (a template refusing the messages: InvalidArgument with its words),
``strftime_now``, and ``namespace`` refusing underscore names. The variables are
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...) and the caller's keyword arguments (the OpenAI
face's ``chat_template_kwargs``, such as ``enable_thinking``).

Bound: the rendered prompt is at most :data:`MAX_PROMPT_CHARS` characters, or the caller's
tighter ``max_chars`` (the model's prompt bound, ``server/apps/generate/limits.py``), counted as the
template writes it: rendering stops at the first piece past it (a template looping over a
client's message could otherwise make a string far larger than the request), with
:class:`TooLong`. Rendering holds the GIL (jinja2 is Python): callers run it off the REST
event loop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from plugserve.plugins.api import InvalidArgument, InvalidModel

__all__ = ["MAX_PROMPT_CHARS", "TooLong", "compile_template", "render"]

#: the longest prompt a template may render (characters); a context of 128k tokens is ~500k
MAX_PROMPT_CHARS = 4 << 20


class TooLong(InvalidArgument):
    """The rendered prompt passed its bound (``chars``: the bound it passed)."""

    def __init__(self, message: str, chars: int) -> None:
        super().__init__(message)
        self.chars = chars


def _environment() -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore names (no reaching Python's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the underscore name {name!r} on a namespace"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    return env


def compile_template(source: str, where: str) -> Any:
    """The template compiled once; InvalidModel naming the folder when jinja2 refuses it."""
    try:
        import jinja2
    except ImportError:  # pragma: no cover - a dependency of the generate extra
        raise InvalidModel(
            "a chat template needs the jinja2 package: pip install 'plugserve[generate]'"
        ) from None
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidModel(f"{where}: the chat template does not compile: {exc}") from None


def _plain(value: Any, depth: int = 0) -> Any:
    """The client's JSON values as plain dicts, lists and scalars (what the sandbox expects;
    the depth is bounded by the JSON parser that made them, checked again here)."""
    if depth > 64:
        raise InvalidArgument("messages: nested deeper than 64 levels")
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return value


def render(
    template: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    context: Mapping[str, Any],
    where: str,
    max_chars: int = 0,
) -> str:
    """The prompt text; InvalidArgument with the template's own message when it refuses,
    :class:`TooLong` past ``max_chars`` characters (0, or above it: :data:`MAX_PROMPT_CHARS`)."""
    most = min(max_chars, MAX_PROMPT_CHARS) if max_chars > 0 else MAX_PROMPT_CHARS
    import jinja2

    chat = _plain(list(messages))
    for i, message in enumerate(chat):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{i}]: expected an object")
    variables = dict(_plain(dict(context)))
    variables.update(
        messages=chat,
        tools=_plain(list(tools)) if tools is not None else None,
        documents=variables.get("documents"),
        add_generation_prompt=bool(add_generation_prompt),
    )
    pieces: list[str] = []
    size = 0
    try:
        for piece in template.generate(**variables):  # bounded as it grows, not after
            size += len(piece)
            if size > most:
                raise TooLong(f"the chat template rendered over {most} characters", most)
            pieces.append(piece)
    except TooLong:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise InvalidArgument(f"the chat template refused to run: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidArgument(f"the chat template refused these messages: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        raise InvalidArgument(
            f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"
        ) from None
    return "".join(pieces)
