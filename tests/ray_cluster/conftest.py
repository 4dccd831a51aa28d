"""Fixtures of the Ray tests: a real multi-node cluster per module (tests/support/ray_cluster.py),
skipped with the reason where one cannot be made (not root, no network namespaces, no venv)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import ray_cluster


def make_cluster(**kwargs) -> ray_cluster.RayCluster:
    """A started cluster, or the test skipped with why it cannot be made here."""
    try:
        cluster = ray_cluster.RayCluster(**kwargs)
    except ray_cluster.Unavailable as exc:
        pytest.skip(str(exc))
    return cluster.start()
