"""What a network version is, decided in one place for every protocol and the repository.

A version is an integer from 1 to 10^18 - 1: what a repository folder name of at most 18 ASCII
digits reads back as, and well inside protobuf's int64 and KServe's decimal strings. 0 (or an
empty KServe string) means "the latest" where a version is looked up and "the next free one"
where one is loaded. Anything else is refused with InvalidArgument before it reaches the data
plane, so no loaded version can later fail to encode (2^63 - 1 + 1) or fail to come back from
the repository after a restart.
"""

from __future__ import annotations

import re

from plugserve.plugins.api import InvalidArgument, ResourceExhausted

__all__ = ["MAX_VERSION", "check_version", "is_version", "next_version", "parse_version"]

MAX_VERSION = 10**18 - 1
_DECIMAL = re.compile(r"[0-9]{1,19}", re.ASCII)  # str.isdigit would take '²' and '٣'
_FOLDER = re.compile(r"[1-9][0-9]{0,17}", re.ASCII)


def check_version(version: int, what: str = "version") -> int:
    """``version`` if it is 0 (latest / next) or 1..MAX_VERSION; InvalidArgument otherwise."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidArgument(f"{what} must be an integer, not {type(version).__name__}")
    if not 0 <= version <= MAX_VERSION:
        raise InvalidArgument(
            f"{what} {version} is out of range: use 1 to {MAX_VERSION}, or 0 for "
            "the latest (the next free one when loading)"
        )
    return version


def parse_version(text: str, what: str = "model version") -> int:
    """A version sent as text (KServe): '' is 0, otherwise ASCII decimal digits only."""
    if not text:
        return 0
    if not _DECIMAL.fullmatch(text):
        raise InvalidArgument(
            f"{what} {text[:40]!r} is not an integer in ASCII digits; use '' for the latest version"
        )
    return check_version(int(text), what)


def is_version(text: str) -> bool:
    """A version folder's name: a canonical integer > 0 ('1', '12'; not '0', '01' or '²')."""
    return _FOLDER.fullmatch(text) is not None


def next_version(latest: int, name: str) -> int:
    """The version after ``latest`` (0: none yet), refused past MAX_VERSION."""
    if latest >= MAX_VERSION:
        raise ResourceExhausted(
            f"network {name!r}: no version after {latest} is free (the largest is "
            f"{MAX_VERSION}); give a version explicitly or unload {name!r} first"
        )
    return latest + 1
