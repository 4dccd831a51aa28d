"""What a model may be called: a name that is a safe folder name in a repository, checked
wherever a name comes from (a client's load, a repository folder, an OVMS pipeline); and how
a file that its configuration names is read (:func:`read_capped`)."""

from __future__ import annotations

import re
from pathlib import Path

from plugserve.plugins.api import InvalidArgument

__all__ = ["check_name", "read_capped"]

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


def read_capped(path: Path, most: int, where: str, name: str) -> bytes:
    """The bytes of ``path``, a file a model's configuration names (its labels, a warm-up
    sample), read no further than ``most`` bytes: InvalidArgument saying ``where`` it is named
    and what it is called (``name``) when it is larger or cannot be read (the admin's file,
    read at every load)."""
    try:
        with open(path, "rb") as f:
            data = f.read(most + 1)
    except OSError as exc:
        raise InvalidArgument(f"{where}: cannot read {name}: {exc.strerror}") from None
    if len(data) > most:
        raise InvalidArgument(f"{where}: {name} is over {most} bytes")
    return data
