from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/support holds the helpers every folder imports (serving, models, reference); tests/ holds
# the zoo package. Test files sit in folders by area: plugins/<device>, server, client, deploy, zoo.
sys.path[:0] = [str(Path(__file__).parent / "support"), str(Path(__file__).parent)]


@pytest.fixture(scope="session")
def core():
    from plugserve.server import Core

    return Core()


@pytest.fixture
def numpy_plugin():
    """A fresh NUMPY plugin, so config changes and extensions do not leak between tests."""
    from plugserve.plugins.numpy import NumpyPlugin

    return NumpyPlugin()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server on the bundled example models, shared by a test module."""
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    with RunningServer("--model-repository", str(repo)) as running:
        running.repository = repo
        yield running
