"""Fixtures the server tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def receiver():
    """A real OTLP/HTTP trace receiver on 127.0.0.1 (``tests/support/otlp.py``), for a module's
    traced server; skipped without the OpenTelemetry packages."""
    otlp = pytest.importorskip(
        "otlp", reason="pip install 'plugserve[trace]'", exc_type=ImportError
    )
    with otlp.Receiver() as running:
        yield running
