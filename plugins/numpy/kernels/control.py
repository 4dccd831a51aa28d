"""If, Loop, Scan: subgraphs run through the same engine."""

from __future__ import annotations
