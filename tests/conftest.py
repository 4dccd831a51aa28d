from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def core():
    from plugserve.server import Core

    return Core()


@pytest.fixture
def numpy_plugin():
    """A fresh NUMPY plugin, so config changes and extensions do not leak between tests."""
    from plugserve.plugins.numpy import NumpyPlugin

    return NumpyPlugin()


def ort_run(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real server on the bundled example models, shared by a test module."""
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    with RunningServer("--model-repository", str(repo)) as running:
        running.repository = repo
        yield running
