"""What a model may be called: a name that is a safe folder name in a repository, checked
wherever a name comes from (a client's load, a repository folder, an OVMS pipeline)."""

from __future__ import annotations

import re

from plugserve.plugins.api import InvalidArgument

__all__ = ["check_name"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def check_name(name: str) -> str:
    """Refuse a model name that could escape the repository or confuse a shell or a log."""
    # fullmatch, not match with '$': '$' also matches before a trailing newline
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"invalid model name {name!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit (no '/', '..' or control characters)"
        )
    return name
