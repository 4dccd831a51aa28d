"""A Hugging Face model folder's tokenizer: ``tokenizer.json`` run by the ``tokenizers`` library,
the special tokens and chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``),
and the end-of-sequence ids of ``generation_config.json`` and ``config.json``.

What ``transformers``' ``AutoTokenizer`` does with the same files, without importing it (it
takes seconds and a gigabyte of dependencies): ``encode`` runs the tokenizer's pipeline
(normalizer, pre-tokenizer, model, post-processor: BOS/EOS insertion is the post-processor's,
as in fast tokenizers), ``decode`` its decoder, and the chat template renders as
``apply_chat_template`` does (see :mod:`.chat_template`). The pipeline is ``tokenizer.json``'s
as transformers 5 runs it: the class it loads the folder as may rebuild parts of it, and the
tokenizer config's ``add_bos_token`` / ``add_eos_token`` rewrite its post-processor (see
:mod:`.tokenizer_class`).

End of sequence: the union of ``generation_config.json``'s ``eos_token_id`` (what
``transformers``' ``generate`` stops at), ``config.json``'s, and the tokenizer's ``eos_token``
(vLLM's rule: some folders name only one of them).

Threads and the GIL: every encode goes through ``tokenizers``' ``encode_batch_fast``, which
releases the GIL while it tokenizes (``encode`` holds it for the whole text: 2.5 MB of text
took 2.6 s here, and no other thread of the server ran meanwhile; ``encode_batch_fast`` took
0.9 s and the longest stall of another thread was 24 ms, the conversion of its 941k ids to a
list), and skips the character offsets nothing here reads (half the time and 143 against 181
bytes of peak memory per byte of text). Callers still run it off the REST event loop, after
refusing text longer than the context could hold (:attr:`Tokenizer.max_token_bytes`,
``server/apps/generate/limits.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from plugserve.plugins.api import InvalidArgument, InvalidModel
from plugserve.server.apps.generate.text import tokenizer_class
from plugserve.server.apps.generate.text.tokenizer_class import token_text

__all__ = ["SPECIAL_TOKENS", "TOKENIZER_FILE", "Tokenizer", "read_json"]

TOKENIZER_FILE = "tokenizer.json"
#: the special tokens a chat template may name, as transformers passes them
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
#: the most bytes of JSON a settings file of the folder may have (a tokenizer.json of a
#: 256k-token vocabulary is ~30 MB; it is read by ``tokenizers`` itself)
MAX_JSON_BYTES = 16 << 20


def read_json(path: Path) -> dict[str, Any]:
    """A folder's JSON settings file as a dict ({} when absent); InvalidModel naming the file
    when it is not a JSON object or too large."""
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise InvalidModel(f"{path}: over {MAX_JSON_BYTES >> 20} MiB; not a settings file")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModel(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise InvalidModel(f"{path}: expected a JSON object")
    return raw


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """The tokenizer of one model folder; thread-safe (``tokenizers`` releases the GIL and
    keeps no state between calls; the chat template is compiled once)."""

    def __init__(
        self,
        backend: Any,
        config: Mapping[str, Any],
        chat_template: str | None = None,
        eos_token_ids: Iterable[int] = (),
        where: str = "tokenizer",
    ) -> None:
        self.backend = backend
        self.where = where
        #: the special tokens a template may name (bos_token, eos_token, ...)
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKENS:
            text = token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
        self.additional_special_tokens = [
            t for t in (token_text(v) for v in (extra or [])) if t is not None
        ]
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        #: the added tokens marked special (left out of text with skip_special_tokens)
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        eos = list(dict.fromkeys(eos_token_ids))
        eos_text = self.special_tokens.get("eos_token")
        if eos_text is not None:
            found = backend.token_to_id(eos_text)
            if found is not None and found not in eos:
                eos.append(found)
        #: the ids that end a sequence (unless ``ignore_eos``)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos is not None else None
        self.chat_template = chat_template
        self._template: Any = None  # compiled on first use (jinja2 is imported then)
        #: the most bytes of text one token stands for (see :func:`_max_token_bytes`)
        self.max_token_bytes: int = _max_token_bytes(backend)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face model folder (its ``tokenizer.json`` is required)."""
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise InvalidModel(
                f"{folder}: no {TOKENIZER_FILE}; a generative model folder needs the fast "
                "tokenizer's file (save it with transformers' tokenizer.save_pretrained)"
            )
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:  # pragma: no cover - a dependency of the generate extra
            raise InvalidModel(
                "serving a generative model needs the tokenizers package: "
                "pip install 'plugserve[generate]'"
            ) from None
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:
            raise InvalidModel(f"{path}: the tokenizers library cannot read it ({exc})") from None
        config = read_json(folder / "tokenizer_config.json")
        model_config = read_json(folder / "config.json")
        try:
            tokenizer_class.apply(backend, config, model_config, str(folder))
        except Exception as exc:  # the tokenizers library refusing the class's pipeline
            raise InvalidModel(
                f"{path}: cannot run it as transformers 5 does ({type(exc).__name__}: {exc})"
            ) from None
        eos = _ids(read_json(folder / "generation_config.json").get("eos_token_id"))
        eos += _ids(model_config.get("eos_token_id"))
        genai = read_json(folder / "genai_config.json").get("model")
        if isinstance(genai, dict):  # a model builder's folder has no config.json
            eos += _ids(genai.get("eos_token_id"))
        return cls(backend, config, _chat_template(folder, config), eos, where=str(folder))

    # --- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS and the
        like), as transformers' ``encode`` does by default. A chat prompt rendered from the
        template carries its own special tokens: encode it with False."""
        found = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return found[0].ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        found = self.backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in found]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """``ids`` as text (holds the GIL: 84 ms for 128k ids here; for many or long
        sequences off the event loop, :meth:`decode_batch`)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """Each sequence as text; releases the GIL while it decodes."""
        return self.backend.decode_batch(
            [list(ids) for ids in sequences], skip_special_tokens=skip_special_tokens
        )

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), as logprobs name tokens."""
        return self.backend.decode([int(token_id)], skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self.special_ids

    # --- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of a chat, rendered by the folder's template as transformers'
        ``apply_chat_template(..., tokenize=False)`` renders it; InvalidArgument when the
        folder has no template or the template refuses the messages (its own words)."""
        return self.render_chat(messages, add_generation_prompt, tools, kwargs)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        variables: Mapping[str, Any],
        max_chars: int = 0,
    ) -> str:
        """:meth:`apply_chat_template` with the template's extra ``variables`` (a client's
        ``chat_template_kwargs``) as a mapping, and the text bounded: past ``max_chars``
        characters (0: :data:`.chat_template.MAX_PROMPT_CHARS`) rendering stops with
        :class:`.chat_template.TooLong`."""
        from plugserve.server.apps.generate.text import chat_template

        if self.chat_template is None:
            raise InvalidArgument(
                f"{self.where}: this model has no chat template (chat_template in "
                "tokenizer_config.json or chat_template.jinja); use completions instead"
            )
        if self._template is None:
            self._template = chat_template.compile_template(self.chat_template, self.where)
        context = {**self.special_tokens, **variables}
        if self.additional_special_tokens:
            context.setdefault("additional_special_tokens", self.additional_special_tokens)
        return chat_template.render(
            self._template, messages, add_generation_prompt, tools, context, self.where,
            max_chars,
        )  # fmt: skip

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """The chat's prompt ids: the rendered template encoded without added special tokens
        (the template writes them), as ``apply_chat_template(tokenize=True)``."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # --- streaming

    def detokenizer(self, prompt_ids: Sequence[int], params: Any) -> Any:
        """An incremental detokenizer for one sequence continuing ``prompt_ids``
        (:class:`.detokenizer.IncrementalDetokenizer`): new text per token, stop strings
        found and held back."""
        from plugserve.server.apps.generate.text.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(
            self,
            prompt_ids,
            stop=params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop=params.include_stop_str_in_output,
        )


#: a WordPiece model's unknown-word token stands for a whole word of up to this many
#: characters (its ``max_input_chars_per_word``, 100 by default), each up to 4 bytes
_UTF8_MOST = 4


def _max_token_bytes(backend: Any) -> int:
    """The most bytes of text one token of ``backend`` stands for: its longest vocabulary
    entry in the bytes it decodes to (a byte-level BPE writes one character per byte;
    SentencePiece's "▁" is one space) or added token (a client's text may hold one), at
    least one character's 4; a WordPiece model's unknown-word token counts as its longest
    word. A text of more bytes than the context times this cannot fit the context: it is
    refused before it is tokenized (``server/apps/generate/limits.py``). Normalizers that delete
    characters (BERT's control characters, stripped accents) and unknown tokens fused over a
    run of text could make such a text fit: it is refused all the same."""
    try:
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder else {}
    except (AttributeError, TypeError, ValueError):
        decoder = {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, dict)}
    pre = backend.pre_tokenizer
    byte_level = "ByteLevel" in kinds or (pre is not None and "ByteLevel" in repr(pre))
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    longest = _UTF8_MOST
    for piece in backend.get_vocab(with_added_tokens=False):
        if byte_level:
            size = len(piece)
        else:
            size = len(piece.encode("utf-8", "replace")) - 2 * piece.count("\u2581")
        longest = max(longest, size)
    for content in added:
        longest = max(longest, len(content.encode("utf-8", "replace")))
    model = backend.model
    if type(model).__name__ == "WordPiece":
        longest = max(longest, _UTF8_MOST * int(getattr(model, "max_input_chars_per_word", 100)))
    return longest


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The folder's chat template: ``chat_template.jinja`` (transformers writes it since
    4.50), else ``chat_template.json``'s, else ``tokenizer_config.json``'s (a string, or a
    list of named templates whose ``default`` is taken)."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise InvalidModel(f"{path}: cannot read it ({exc})") from None
    raw = read_json(folder / "chat_template.json").get("chat_template")
    if raw is None:
        raw = config.get("chat_template")
    if isinstance(raw, list):
        named = {
            t.get("name"): t.get("template")
            for t in raw
            if isinstance(t, Mapping) and isinstance(t.get("template"), str)
        }
        raw = named.get("default") or next(iter(named.values()), None)
    return raw if isinstance(raw, str) else None
