"""The installed plugserve's version: what blobs record, KServe's server metadata and
``plugserve_build_info`` report, and ``plugserve --version`` prints."""

from __future__ import annotations

import functools

__all__ = ["plugserve_version"]


@functools.cache  # read once: importlib.metadata scans the installed packages (~150 us)
def plugserve_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plugserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
