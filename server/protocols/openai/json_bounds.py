"""The server's bounds on the structure of a request's JSON (--max-json-values, --max-json-depth).

Held here, apart from the body's reading (``body.py``), because JSON also comes inside a body's
strings: a tool call's ``arguments`` in the history is JSON text the request carries as one
string value, which the adapter parses (``tools.history``). Its values are counted against the
same bound before it is parsed: an assistant message whose arguments held 50M numbers (a 100 MB
body of one string) took 25.7 s and grew the server 0.9 GB, two at once kept a chat waiting
21 s.
"""

from __future__ import annotations

import dataclasses

__all__ = ["MAX_DEPTH", "MAX_VALUES", "Bounds", "bounds", "configure", "values_at_most"]

#: most JSON values in one body (--max-json-values): a completion's 64 prompts of 16k token
#: ids is 1M; 1M small objects hold ~100 MB parsed and take orjson ~0.1 s
MAX_VALUES = 1 << 20
#: deepest nesting of arrays and objects (--max-json-depth): tool schemas nest a few levels;
#: orjson itself stops at 1024
MAX_DEPTH = 64


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The server's bounds on a body's structure (settings.py: --max-json-values,
    --max-json-depth)."""

    values: int = MAX_VALUES
    depth: int = MAX_DEPTH


_bounds = Bounds()


def configure(values: int = MAX_VALUES, depth: int = MAX_DEPTH) -> None:
    """The server's settings (process/app.py)."""
    global _bounds
    _bounds = Bounds(values, depth)


def bounds() -> Bounds:
    return _bounds


def values_at_most(text: str) -> int:
    """The most JSON values ``text`` can hold: one, and one more for each ``{``, ``[`` and
    ``,`` (in strings too: it can only overstate)."""
    return text.count(",") + text.count("{") + text.count("[") + 1
