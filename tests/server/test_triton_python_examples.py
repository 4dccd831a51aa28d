"""Triton's own python_backend examples, unchanged: their model files laid out as their READMEs
lay them out, served by plugserve, driven by their own client scripts (which talk to
localhost:8000/8001 as Triton's do).

The examples are Triton's, not ours: this test runs them from a checkout of
github.com/triton-inference-server/python_backend named by PLUGSERVE_TRITON_PYTHON_BACKEND,
and is skipped without one (the suite fetches nothing from the network). The examples that need
what this machine lacks are left out: preprocessing (TensorRT), instance_kind (a GPU), jax.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
pytest.importorskip("torch", reason="the pytorch example's model needs torch: pip install torch")

CHECKOUT = os.environ.get("PLUGSERVE_TRITON_PYTHON_BACKEND", "")

#: repository entry -> (example folder, model file, config file or None), as the READMEs copy
#: them
MODELS = {
    "add_sub": ("add_sub", "model.py", "config.pbtxt"),
    "pytorch": ("pytorch", "model.py", "config.pbtxt"),
    "bls_sync": ("bls", "sync_model.py", "sync_config.pbtxt"),
    "bls_async": ("bls", "async_model.py", "async_config.pbtxt"),
    "repeat_int32": ("decoupled", "repeat_model.py", "repeat_config.pbtxt"),
    "square_int32": ("decoupled", "square_model.py", "square_config.pbtxt"),
    "bls_decoupled_sync": ("bls_decoupled", "sync_model.py", "sync_config.pbtxt"),
    "bls_decoupled_async": ("bls_decoupled", "async_model.py", "async_config.pbtxt"),
    "custom_metrics": ("custom_metrics", "model.py", "config.pbtxt"),
    # no config.pbtxt: auto_complete_config in the model says what it is
    "nobatch_auto_complete": ("auto_complete", "nobatch_model.py", None),
    "batch_auto_complete": ("auto_complete", "batch_model.py", None),
}
CLIENTS = [
    "add_sub/client.py",
    "pytorch/client.py",
    "bls/sync_client.py",
    "bls/async_client.py",
    "decoupled/repeat_client.py",
    "decoupled/square_client.py",
    "bls_decoupled/sync_client.py",
    "bls_decoupled/async_client.py",
    "custom_metrics/client.py",
    "auto_complete/client.py",
]


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    if not CHECKOUT or not (Path(CHECKOUT) / "examples").is_dir():
        pytest.skip(
            "set PLUGSERVE_TRITON_PYTHON_BACKEND to a checkout of "
            "https://github.com/triton-inference-server/python_backend to run its examples"
        )
    if not all(_free(port) for port in (8000, 8001, 8002)):
        pytest.skip("Triton's example clients need ports 8000 and 8001, which are taken here")
    from serving import RunningServer

    source = Path(CHECKOUT) / "examples"
    root = tmp_path_factory.mktemp("triton-examples") / "models"
    for name, (folder, model, config) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        shutil.copy(source / folder / model, root / name / "1" / "model.py")
        if config is not None:
            shutil.copy(source / folder / config, root / name / "config.pbtxt")
    command = ["--grpc-port", "8001", "--http-port", "8000", "--metrics-port", "8002"]
    with RunningServer("--model-repository", str(root), *command) as server:
        server.examples = source
        yield server


@pytest.mark.parametrize("client", CLIENTS)
def test_example_client_passes_unchanged(examples, client):
    done = subprocess.run(
        [sys.executable, str(examples.examples / client)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "PASS" in done.stdout
