"""A load's scratch memory given back to the system once the network is made.

Loading a model makes copies of it that the network does not keep: the parsed proto, the
checked IR, the bytes handed to the backend, the backend's own parse. They are freed when the
load returns, but glibc's heaps keep freed memory, and the network's weights, allocated among
those copies, cut it into pieces the next load cannot reuse whole: measured as users see it
(RSS over 10 loads of an 11.5 MB MLP in a fresh process, nothing trimmed by the measurement),
an ORT network added 20.3-22.2 MB against 12.3-14.1 MB for a bare InferenceSession, 1.41-1.6x,
where what it held alive was 1.0x. ``malloc_trim`` after the load gives those pages back:
within 1.2x on every device (tests/server/test_load_many.py). A trim walks the heaps once,
about a millisecond for a few hundred MB, beside a load's hundreds. Nothing where the C library
is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["give_back", "giving_back"]

_Load = TypeVar("_Load", bound=Callable[..., Any])


def give_back() -> None:
    """Hand the system back the free memory malloc's heaps hold (call after a load)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def giving_back(load: _Load) -> _Load:
    """``load`` (a plugin's load or import), then :func:`give_back` once it has returned or
    failed: its frame, and the scratch copies its locals held, are gone by then."""

    @functools.wraps(load)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        finally:
            give_back()

    return run  # type: ignore[return-value]


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "gnu_get_libc_version") else None
