"""Sequence and optional values (Python lists and None at run time)."""

from __future__ import annotations
