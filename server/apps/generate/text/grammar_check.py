"""A request's grammar read and validated in a helper process before the server compiles it.

llguidance reads a grammar recursively, a native frame per level of nesting, with no bound of
its own: a JSON schema of 1,000 objects each pointing to the next through ``$ref`` (94 KB) or a
Lark chain of 3,000 rules (40 KB) overflowed an 8 MiB thread stack in ``validate_grammar`` and
the server died of SIGSEGV, every client with it. And a GBNF grammar is first converted to Lark
by llguidance's pure-Python converter, whose fix-point loop is quadratic in a chain of rules
(26,000 rules within the schema cap: 131 s of a worker thread, holding the GIL).

So each grammar a request sends is converted and validated by a helper process
(``plugins/workers.py``: bounded memory and time; a crash costs the request a 400), on a thread
whose stack is :data:`CHECK_STACK`, a quarter of the 8 MiB the server's threads have: what
passes there compiles in the server with room to spare. The server then compiles the grammar
the helper answers (no second conversion) against the model's vocabulary. A GBNF grammar of
more than :data:`MAX_GBNF_RULES` rules is refused before anything converts it. Without a
helper (a sandbox without fork) the check runs in the server, as before.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from plugserve.plugins.workers import Crashed, NoWorker, TooLarge, Workers, bound_data, serve
from plugserve.server.plane.errors import FieldError

__all__ = ["CHECK_STACK", "MAX_GBNF_RULES", "checked_grammar", "grammar_of", "parser_limits"]

log = logging.getLogger(__name__)

#: the stack a grammar is validated on (the server's threads have 8 MiB: 4x the room; a JSON
#: schema of 200 objects chained by $ref passes, of 1,000 does not; a Lark chain of 600 rules
#: passes)
CHECK_STACK = 2 << 20
#: rules a GBNF grammar may have (llama.cpp's JSON grammar has 10; converting 1,000 takes
#: ~0.13 s, 8,000 took 9 s)
MAX_GBNF_RULES = 1000
#: seconds a helper may take to check one grammar (real ones take milliseconds)
CHECK_SECONDS = 10.0
#: what the helper's data may grow by checking one grammar, per byte of it, and at least
CHECK_BYTES_PER_BYTE = 320
CHECK_BYTES = 64 << 20
#: helper processes at most (the adapter's two worker threads each wait for one)
HELPERS = 2
#: llguidance's work on a grammar's first mask, at most (its default: 1M): a regex of counted
#: repetitions of a letter whose tokens repeat it, ``(a{1000}){1000}``, took 1.1 s and 260 MB
#: at 1M and is refused in ~50 ms at 100k, where the largest real schemas need far less
INITIAL_LEXER_FUEL = 100_000

_helpers = Workers("plugserve.server.apps.generate.text.grammar_check", HELPERS, "grammar")
_warned = threading.Event()


def parser_limits(llguidance: Any) -> Any:
    """llguidance's defaults, written down: per mask at most 200k lexer fuel (~14 ms) and 50k
    Earley items (~2.5 ms); a grammar of at most 500k symbols and 250k lexer states."""
    return llguidance.LLParserLimits(
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_grammar_size=500_000,
        max_lexer_states=250_000,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
    )


def grammar_of(llguidance: Any, schema: str, kind: str) -> str:
    """llguidance's grammar of ``schema`` read as ``kind`` (``grammar.GRAMMAR_KINDS``)."""
    if kind == "json":
        # compact separators, as a model writes JSON most often; whitespace stays the
        # model's to choose between tokens only where JSON allows it
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(schema)
    if kind == "choice":
        import orjson

        choices = orjson.loads(schema)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(orjson.dumps(c).decode() for c in choices)
        )
    from llguidance.gbnf_to_lark import any_to_lark

    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(schema))


def _check(llguidance: Any, schema: str, kind: str) -> tuple[str, str]:
    """``(grammar, "")``, or ``("", why)`` when llguidance refuses it."""
    try:
        grammar = grammar_of(llguidance, schema, kind)
    except Exception as exc:  # the library's parsers raise their own kinds of errors
        return "", str(exc)
    why = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits(llguidance))
    return ("", str(why)) if why else (grammar, "")


def checked_grammar(llguidance: Any, schema: str, kind: str, field: str) -> str:
    """llguidance's grammar of ``schema``, read and validated in a helper (see the module's
    docstring); a 400 naming ``field`` when it is refused, too large, too slow to read or
    crashes the helper. Blocking: call it off the event loop."""
    if kind == "grammar" and "::=" in schema and schema.count("::=") > MAX_GBNF_RULES:
        raise FieldError(
            f"{field}: the grammar has {schema.count('::='):,} rules; at most {MAX_GBNF_RULES:,}",
            field,
        )
    data = schema.encode()
    budget = max(CHECK_BYTES, CHECK_BYTES_PER_BYTE * len(data))
    try:
        with _helpers.one(CHECK_SECONDS) as helper:
            answer, body = helper.ask(
                {"kind": kind, "max_bytes": budget}, data, CHECK_SECONDS, 64 * len(data) + (1 << 20)
            )
    except NoWorker as exc:
        if not _warned.is_set():
            _warned.set()
            log.warning("grammars are checked in this process, unbounded: no helper (%s)", exc)
        grammar, why = _check(llguidance, schema, kind)
        answer, body = {"refused": why}, grammar.encode()
    except Crashed as exc:
        log.info("%s: the grammar helper ended (%s) checking a grammar", field, exc.args[0])
        raise FieldError(
            f"{field}: the grammar library failed on it (nested too deeply, or too large); "
            "send a flatter grammar",
            field,
        ) from None
    except (TimeoutError, TooLarge):
        raise FieldError(
            f"{field}: reading the grammar took more than {CHECK_SECONDS:g} s or "
            "made too large a grammar; send a smaller one",
            field,
        ) from None
    if answer.get("refused"):
        raise FieldError(f"{field}: the grammar library refuses it: {answer['refused']}", field)
    return body.decode()


# ----------------------------------------------------------------- the helper's side


def _answer(header: dict, body: bytes) -> tuple[dict, bytes]:
    import llguidance

    found: list[tuple[str, str]] = []

    def work() -> None:
        try:
            found.append(_check(llguidance, body.decode(), str(header.get("kind"))))
        except MemoryError:
            found.append(("", "it needs more memory than a grammar may take"))

    bound_data(int(header.get("max_bytes", 0)))
    threading.stack_size(CHECK_STACK)
    thread = threading.Thread(target=work, name="grammar-check")
    thread.start()
    thread.join()
    bound_data(0)
    grammar, why = found[0] if found else ("", "it could not be read")
    return {"refused": why}, grammar.encode()


def main() -> None:
    import llguidance  # noqa: F401  (imported before the first request: its time is start's)

    serve(_answer)


if __name__ == "__main__":
    sys.exit(main())
