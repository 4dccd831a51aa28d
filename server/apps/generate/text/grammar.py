"""``response_format``'s JSON schemas as constrained decoding: llguidance, a token mask a step.

The engine asks each constrained sequence, before it samples, which tokens may come next
(``constraint.mask(vocab_size)``), tells it the token chosen (``accept``) and stops the
sequence when the grammar is complete (``done``); see ``server/apps/generate/types.py``.

Why llguidance, not xgrammar (measured here on a 32,000-token byte-level BPE vocabulary and a
five-property schema with a nested object, an enum array and a pattern; /tmp-free script in
the commit message): compiling a schema took 1.5-10 ms with llguidance and 0.8-1.9 s with
xgrammar (without its cache; a server sees new schemas all the time, and xgrammar's cache
holds them in memory); a mask took 40 us (median) against 5-7 us, both under 6.3 ms at the
worst step, far below a decode step of a model worth serving; importing and using it raised
the process's peak memory by 28 MiB against 251 MiB; and llguidance needs no other package,
where xgrammar requires torch, transformers and triton (hundreds of MB, a CUDA compiler) and
hands out its masks as torch tensors. Both refuse bad schemas with a clear message.

Bounds: the vocabulary is read into llguidance once per model (0.5-0.9 s for 32,000 tokens,
on the first constrained request, under a lock; the tokenizer is kept while the model's
tokenizer lives); a schema's compilation and each mask are bounded by llguidance's parser
limits (lexer fuel, items per step, grammar size: ``grammar_check.parser_limits``), which
turn a hostile schema into a refusal or an error state, never a hang; a schema is at most
:data:`MAX_SCHEMA_BYTES`, and it is read and validated in a helper process first
(``grammar_check.py``: llguidance's reading recurses without a bound, and a deep one crashed
the server). A request's schema is compiled into one matcher, once (0.25-1.6 s
for a 210-240 KB schema here, the GIL released), and each of its ``n`` sequences gets a deep
copy of it (0.02-7 ms each, the compiled grammar shared): building a matcher per sequence on
the REST event loop held it for 46-50 s with a 239 KB schema and ``n`` 64. Both run on the
adapter's worker threads (:meth:`CompiledSchema.constraints`), never on the loop. Memory:
compiling a schema took up to 300 bytes per byte of it (its grammar and the first matcher;
a copy 130 KB at most, measured for 64 copies): the adapter charges
:func:`memory` to ``--max-inflight-bytes`` before compiling, and holds it while the request
runs.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import weakref
from typing import Any

import numpy as np

from plugserve.server.apps.generate.text.grammar_check import checked_grammar, parser_limits
from plugserve.server.plane.errors import FieldError

__all__ = [
    "GRAMMAR_KINDS",
    "MAX_SCHEMA_BYTES",
    "Closing",
    "JsonConstraint",
    "closed_schema",
    "closing_reserve",
    "closing_tokens",
    "compile_schema",
    "memory",
]

#: the largest schema (as JSON text) a request may send
MAX_SCHEMA_BYTES = 256 << 10
#: what compiling a schema holds per byte of it, and what each sequence's copy of its matcher
#: holds (measured: see the module's docstring)
GRAMMAR_BYTES_PER_BYTE = 320
MATCHER_BYTES = 256 << 10


def memory(schema: str, sequences: int) -> int:
    """What a request's ``schema`` holds for ``sequences`` sequences, to charge before it is
    compiled."""
    return GRAMMAR_BYTES_PER_BYTE * len(schema) + MATCHER_BYTES * sequences


_lock = threading.Lock()
#: the model's tokenizer -> llguidance's tokenizer built from its vocabulary
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise FieldError(
            "response_format with a JSON schema needs llguidance on the server "
            "(pip install llguidance)",
            "response_format",
            501,
        ) from None
    return llguidance


def _vocabulary(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of ``tokenizer`` (the model's ``Tokenizer``), built once per model."""
    with _lock:
        found = _tokenizers.get(tokenizer)
        if found is not None:
            return found
        llguidance = _llguidance()
        eos = sorted(tokenizer.eos_token_ids)
        made = llguidance.LLTokenizer(
            tokenizer.backend.to_str(),
            n_vocab=max(vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True)),
            eos_token=eos or None,
        )
        _tokenizers[tokenizer] = made
        return made


#: the model's tokenizer -> its :class:`Closing` tokens
_closers: weakref.WeakKeyDictionary[Any, Closing] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class Closing:
    """A vocabulary's tokens that close JSON, as llguidance's packed mask words: ``quotes``
    begin with the quote that ends a string (``"``, ``"}``, ``"]}``), ``brackets`` only close
    objects and arrays (``}``, ``]}``, whitespace aside); and the text of every token that
    holds a quote or a backslash (``marks``), from which a constraint tells whether it is
    inside a string."""

    quotes: np.ndarray
    brackets: np.ndarray
    marks: dict[int, str]


def closing_tokens(tokenizer: Any, words: int) -> Closing:
    """The model's :class:`Closing` tokens, once per model: every token decoded alone, in the
    tokenizer's batch (tens of ms for 32,000 tokens)."""
    with _lock:
        found = _closers.get(tokenizer)
        if found is not None and len(found.quotes) == words:
            return found
    size = min(tokenizer.backend.get_vocab_size(with_added_tokens=True), words * 32)
    texts = tokenizer.backend.decode_batch([[t] for t in range(size)], skip_special_tokens=True)
    quotes = np.zeros(words * 32, dtype=bool)
    brackets = np.zeros(words * 32, dtype=bool)
    marks = {}
    for token, text in enumerate(texts):
        if '"' in text or "\\" in text:
            marks[token] = text
            quotes[token] = text.lstrip().startswith('"')
        kept = "".join(text.split())
        brackets[token] = bool(kept) and set(kept) <= _BRACKETS

    def packed(allowed: np.ndarray) -> np.ndarray:
        return np.packbits(allowed, bitorder="little").view(np.int32)

    made = Closing(packed(quotes), packed(brackets), marks)
    with _lock:
        _closers[tokenizer] = made
    return made


#: what a bracket-closing token is made of, whitespace aside
_BRACKETS = frozenset("}]")


class JsonConstraint:
    """One sequence's grammar state: the ``constraint`` of its ``SamplingParams``.

    A forced tool call must close within its tokens, whatever the model: a weak model (a
    random-weight decoder sampled 2,018 tokens of a free-string argument without a quote) would
    have ``max_tokens`` cut the JSON, and the client gets no call. So a call's constraint may be
    given its token budget (:meth:`close_within`): once only the tokens closing needs are left,
    the allowed tokens are narrowed to those that close: inside a string, the ones beginning
    with its closing quote; outside, the ones closing objects and arrays. Where the grammar
    allows none of them (a required property still missing) nothing is narrowed, so the next
    key is written and its string closed at once. An argument is cut only where ``max_tokens``
    would have cut it, and then it still parses."""

    def __init__(self, matcher: Any, words: int) -> None:
        self._matcher = matcher
        self._bits = np.full((1, words), -1, dtype=np.int32)
        self._fill = _llguidance_numpy().fill_next_token_bitmask
        self._left: int | None = None  # tokens left to the budget; None: no budget
        self._reserve = 0
        self._closing: Closing | None = None
        self._in_string = self._escaped = False

    def close_within(self, tokens: int, reserve: int, closing: Closing) -> None:
        """Close within ``tokens``: narrowed to ``closing``'s tokens once ``reserve`` (at most
        half the budget) are left."""
        self._left, self._reserve, self._closing = tokens, min(reserve, tokens // 2), closing

    def _narrowed(self, bits: np.ndarray) -> np.ndarray:
        """``bits`` (packed words) narrowed to the closing tokens when the budget asks for it
        and the grammar allows any of them."""
        closing = self._closing
        if closing is None or self._left is None or self._left > self._reserve:
            return bits
        wanted = closing.quotes if self._in_string else closing.brackets
        narrowed = bits & wanted[: len(bits)]
        return narrowed if narrowed.any() else bits

    def _lex(self, token_id: int) -> None:
        """Whether the text so far ends inside a string: only tokens with a quote or a
        backslash change it."""
        text = self._closing.marks.get(token_id) if self._closing is not None else None
        for char in text or ():
            if self._escaped:
                self._escaped = False
            elif char == "\\" and self._in_string:
                self._escaped = True
            elif char == '"':
                self._in_string = not self._in_string

    def mask(self, vocab_size: int) -> np.ndarray:
        """Which of the model's ``vocab_size`` tokens may come next (bool)."""
        self._fill(self._matcher, self._bits, 0)
        bits = self._narrowed(self._bits[0])
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool)
        if allowed.size >= vocab_size:
            return allowed[:vocab_size]
        return np.concatenate([allowed, np.zeros(vocab_size - allowed.size, dtype=bool)])

    def bitmask(self) -> np.ndarray:
        """The same as llguidance's packed int32 words (bit ``t % 32`` of word ``t // 32``:
        token ``t`` allowed), for a sampler that unpacks them on its device
        (``plugins/torch/sampler.py``): ``vocab / 8`` bytes cross instead of ``vocab``."""
        self._fill(self._matcher, self._bits, 0)
        return self._narrowed(self._bits[0]).copy()

    def accept(self, token_id: int) -> bool:
        """Advance by the token chosen; False when the grammar does not allow it."""
        if self._left is not None:
            self._left -= 1
            self._lex(int(token_id))
        return bool(self._matcher.consume_token(int(token_id)))

    def done(self) -> bool:
        """Nothing may follow: the value is complete (or the matcher failed)."""
        return bool(self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error() or "")


def _llguidance_numpy() -> Any:
    import llguidance.numpy

    return llguidance.numpy


class CompiledSchema:
    """A request's schema compiled against its model's vocabulary into one matcher;
    :meth:`constraints` gives each sequence a state of its own (``n`` choices each follow the
    schema on their own)."""

    def __init__(self, vocabulary: Any, matcher: Any) -> None:
        #: the mask's packed int32 words
        self.words = (vocabulary.vocab_size + 31) // 32
        self._matcher = matcher

    def constraints(self, count: int) -> list[JsonConstraint]:
        """``count`` fresh states, copies of the compiled matcher (blocking: off the loop)."""
        return [JsonConstraint(self._matcher.deep_copy(), self.words) for _ in range(count)]

    def constraint(self) -> JsonConstraint:
        (one,) = self.constraints(1)
        return one


def closing_reserve(schema: str) -> int:
    """The tokens a forced call keeps to close its JSON (:meth:`JsonConstraint.close_within`):
    a few for the brackets, and what every property the schema requires would take if none
    were written yet (its key, colon and an empty value; of alternatives, the costliest), at
    most 512. An upper bound: a required key costs its characters, as a tokenizer of single
    characters spells it."""
    return min(8 + _required_cost(json.loads(schema), 0), 512)


def _required_cost(node: Any, depth: int) -> int:
    if not isinstance(node, dict) or depth > 32:
        return 0
    cost = max((_required_cost(n, depth + 1) for n in node.get("anyOf", ())), default=0)
    cost += max((_required_cost(n, depth + 1) for n in node.get("oneOf", ())), default=0)
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = node.get("required")
    # each name once: a schema is a tree, so every node is then visited once (a name listed
    # k times at each of d levels cost k**d visits: 3 at 20 levels, hours of a worker thread)
    for name in dict.fromkeys(str(n) for n in required) if isinstance(required, list) else ():
        cost += len(name) + 6 + _required_cost(properties.get(name), depth + 1)
    return cost + _required_cost(node.get("items"), depth + 1)


#: the kinds of grammar :func:`compile_schema` takes besides a JSON schema (vLLM's guided
#: decoding: ``regex``, ``choice`` (a JSON array of strings), ``grammar`` (Lark, or GBNF as
#: llama.cpp and xgrammar write it, converted by llguidance's own converter)
GRAMMAR_KINDS = ("json", "regex", "choice", "grammar")


def compile_schema(
    schema: str,
    tokenizer: Any,
    vocab_size: int,
    kind: str = "json",
    field: str = "response_format",
) -> CompiledSchema:
    """``schema`` (JSON text; or a grammar of another of :data:`GRAMMAR_KINDS`) against
    ``tokenizer``'s vocabulary, or a 400 naming ``field`` with llguidance's reason.
    Blocking (0.5-0.9 s the first time per model, a few ms to seconds after, the GIL
    released): call it off the event loop."""
    if len(schema) > MAX_SCHEMA_BYTES:
        raise FieldError(
            f"{field}: the grammar is {len(schema)} bytes; at most {MAX_SCHEMA_BYTES}", field
        )
    llguidance = _llguidance()
    grammar = checked_grammar(llguidance, schema, kind, field)
    vocabulary = _vocabulary(tokenizer, vocab_size)
    limits = parser_limits(llguidance)
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=limits)
    if not matcher.is_error():  # its first mask here, on the request's worker, not in a step
        matcher.compute_bitmask()  # of the engine that every sequence of the model waits on
    if matcher.is_error():  # a grammar past the parser's limits fails here, before generating
        raise FieldError(f"{field}: it cannot be used: {matcher.get_error()}", field)
    return CompiledSchema(vocabulary, matcher)


#: a schema's keywords holding subschemas by name, in a list, or one
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LISTED = ("anyOf", "oneOf", "prefixItems")
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")
#: what says an object's other keys already (left as the schema says)
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
#: how deep a schema is closed (a deeper one is left as it is below that)
_CLOSED_DEPTH = 32


def closed_schema(schema: Any, depth: int = 0) -> Any:
    """``schema`` with each object that does not say what other keys it takes closed
    (``additionalProperties: false``): a forced tool call's arguments hold the declared
    properties only, as OpenAI's strict function calling has them. llguidance, as JSON
    Schema, lets an object take any other key unless told; a weak model forced into a call
    then writes key after key and the call never closes (a random-weight decoder's forced
    call ran to ``max_tokens`` 200 of 200 with made-up keys; closed, a named call ended in 32
    tokens and a ``required`` one in 70: tests/generate/test_anthropic.py). ``required`` is
    llguidance's to honour, as it does. ``allOf`` branches are left open: closing each would
    refuse the others' properties."""
    if not isinstance(schema, dict) or depth > _CLOSED_DEPTH:
        return schema
    out = dict(schema)
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v, depth + 1) for k, v in out[key].items()}
    for key in _LISTED:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(v, depth + 1) for v in out[key]]
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key], depth + 1)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (is_object or "properties" in out) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out
