"""Reductions, softmax family, cumulative ops, TopK and normalizations."""

from __future__ import annotations
