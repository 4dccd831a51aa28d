"""Models that are folders an application knows, not one graph file: the Core's and the
repository's one hook into the applications.

A Hugging Face folder (``config.json``, a tokenizer, a decoder or encoder graph) is served as it
is downloaded, by the generation application; model control must recognize such a folder (the
repository reads it as a model without version folders) and the Core must hand it to that
application to compile, without either importing the application: the arrows between
``server/`` folders run from the applications down to model control, never back. So an
application declares a :class:`FolderFormat` under the entry-point group
``plugserve.formats`` (pyproject.toml), the way a device plugin declares itself under
``plugserve.plugins``, and model control asks each declared format, in name order, whether a
folder is its own. A third-party package adds a format the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugserve.plugins.api import CompiledNetwork
    from plugserve.server.control.core import Core

__all__ = ["ENTRY_POINT_GROUP", "FolderFormat", "folder_formats", "format_of"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "plugserve.formats"


@dataclasses.dataclass(frozen=True)
class FolderFormat:
    """A kind of model folder and how the Core compiles one.

    ``claims(folder)``: whether ``folder`` (an existing directory) is one of this format's; it
    reads a few small files at most, as it runs for every folder the repository scans.
    ``load(core, folder, device, config)``: the compiled network; ``core.format_settings[name]``
    holds the server's defaults for the format (the generation engine's flags), if any.
    """

    name: str
    claims: Callable[[Path], bool]
    load: Callable[[Core, str, str, Any], CompiledNetwork]


@functools.cache
def folder_formats() -> tuple[FolderFormat, ...]:
    """Every format declared under :data:`ENTRY_POINT_GROUP`, read once; one that fails to
    import is logged and left out (its folders are then not models), as an unavailable
    device is."""
    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            found.append(ep.load())
        except Exception as exc:  # an optional application's dependency missing
            log.warning("model format %s is unavailable: %s: %s", ep.name, type(exc).__name__, exc)
    return tuple(found)


def format_of(model: Any) -> FolderFormat | None:
    """The format whose folder ``model`` is, or None (a file, bytes, an unclaimed folder)."""
    if not isinstance(model, str | os.PathLike) or not os.path.isdir(model):
        return None
    folder = Path(model)
    for fmt in folder_formats():
        if fmt.claims(folder):
            return fmt
    return None
