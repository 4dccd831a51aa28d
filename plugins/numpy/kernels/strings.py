"""String ops (object arrays of str at run time)."""

from __future__ import annotations
