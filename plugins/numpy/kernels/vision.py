"""Image ops: resize, grid sampling, RoI align, non-max suppression, and friends."""

from __future__ import annotations
