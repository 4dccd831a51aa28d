"""Model control modes as Triton's (issue 14, item 4): none, explicit with --load-model, and
poll following the repository's changes while clients keep sending requests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from models import add_constant
from serving import RunningServer, serve_command, wait_for

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

X = np.arange(4, dtype=np.float32)


def plus(constant: float) -> onnx.ModelProto:
    return add_constant(constant)


def put(root: Path, name: str, version: int, constant: float) -> None:
    """Write a version as a careful operator does: a new file renamed into place."""
    folder = root / name / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(plus(constant), str(folder / ".model.onnx.tmp"))
    os.replace(folder / ".model.onnx.tmp", folder / "model.onnx")


def infer(client, name: str, version: str = "") -> float:
    request = client_module(client).InferInput("x", [4], "FP32")
    request.set_data_from_numpy(X)
    return float(client.infer(name, [request], model_version=version).as_numpy("y")[0])


def client_module(client):
    return grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient


def ready(client, name: str, version: str = "") -> bool:
    try:
        return client.is_model_ready(name, version)
    except InferenceServerException:
        return False


@contextlib.contextmanager
def _hammered(server: RunningServer, name: str) -> Iterator[list[str]]:
    """Requests to ``name``, one after another on a thread, while the block runs: the list
    of the refusals' messages."""
    stop = threading.Event()
    failures: list[str] = []

    def hammer() -> None:
        own = grpcclient.InferenceServerClient(server.target)
        while not stop.is_set():
            try:
                infer(own, name)
            except InferenceServerException as exc:
                failures.append(exc.message())
        own.close()

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        yield failures
    finally:
        stop.set()
        thread.join(60)


@pytest.fixture
def repo(tmp_path):
    put(tmp_path, "a", 1, 1.0)
    put(tmp_path, "b", 1, 10.0)
    return tmp_path


def test_none_loads_everything_and_refuses_load_and_unload(repo):
    with RunningServer("--model-repository", str(repo), "--model-control-mode", "none") as s:
        grpc_client = grpcclient.InferenceServerClient(s.target)
        http_client = httpclient.InferenceServerClient(s.http_target)
        try:
            assert infer(grpc_client, "a") == 1.0 and infer(http_client, "b") == 10.0
            for client, status in ((grpc_client, "StatusCode.UNAVAILABLE"), (http_client, "503")):
                for call in (client.load_model, client.unload_model):
                    with pytest.raises(InferenceServerException) as info:
                        call("a")
                    assert info.value.status() == status
                    assert "--model-control-mode explicit" in info.value.message()
            assert infer(grpc_client, "a") == 1.0  # still served
        finally:
            grpc_client.close()
            http_client.close()


def test_explicit_loads_only_what_is_named_then_by_request(repo):
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    with RunningServer(*args, "--load-model", "a") as s:
        client = httpclient.InferenceServerClient(s.http_target)
        try:
            assert ready(client, "a") and not ready(client, "b")
            client.load_model("b")
            assert infer(client, "b") == 10.0
            client.unload_model("a")
            assert not ready(client, "a")
        finally:
            client.close()
    with RunningServer(*args, "--load-model", "*") as s:
        client = grpcclient.InferenceServerClient(s.target)
        try:
            assert ready(client, "a") and ready(client, "b")
        finally:
            client.close()


def test_a_load_model_not_in_the_repository_stops_startup(repo):
    command = serve_command(
        "--model-repository", str(repo), "--model-control-mode", "explicit",
        "--load-model", "a", "--load-model", "nope",
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--load-model nope: no such model in the repository" in done.stdout + done.stderr


def test_load_model_needs_explicit_mode():
    done = subprocess.run(
        [sys.executable, "-m", "plugserve.server.process.cli", "serve", "--load-model", "a"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "needs --model-control-mode explicit" in done.stderr


def test_poll_follows_added_changed_and_removed_versions_without_dropping_requests(repo):
    args = ["--model-repository", str(repo), "--model-control-mode", "poll"]
    with RunningServer(*args, "--repository-poll-secs", "0.3") as s:
        client = grpcclient.InferenceServerClient(s.target)
        with _hammered(s, "a") as failures:
            put(repo, "a", 2, 2.0)  # added
            assert wait_for(lambda: ready(client, "a", "2"), timeout=30), s.log
            assert wait_for(lambda: infer(client, "a") == 2.0, timeout=30)
            time.sleep(0.05)
            put(repo, "a", 2, 3.0)  # changed
            assert wait_for(lambda: infer(client, "a") == 3.0, timeout=30), s.log
            shutil.rmtree(repo / "a" / "1")  # removed
            assert wait_for(lambda: not ready(client, "a", "1"), timeout=30), s.log
            put(repo, "c", 1, 7.0)  # a new model
            assert wait_for(lambda: ready(client, "c"), timeout=30), s.log
            with pytest.raises(InferenceServerException):
                client.load_model("a")
        client.close()
        assert not failures, failures[:3]
        assert infer(grpcclient.InferenceServerClient(s.target), "c") == 7.0


def test_poll_keeps_serving_a_model_while_its_files_are_being_written(repo):
    """A config.pbtxt rewritten in place, and a version folder copied in before its model file,
    were a model the scan could not read or load: its versions were unloaded before anything
    replaced them, and a red team's clients got 404 for the whole write (223 in 3 s). A model
    the scan cannot read keeps what it serves; what is new loads before what it replaces
    goes (deleting the latest version: the one before it serves on)."""
    config = repo / "a" / "config.pbtxt"
    config.write_text('name: "a"\nplatform: "onnxruntime_onnx"\n')
    args = ["--model-repository", str(repo), "--model-control-mode", "poll"]
    with RunningServer(*args, "--repository-poll-secs", "0.2") as s:
        client = grpcclient.InferenceServerClient(s.target)
        with _hammered(s, "a") as failures:
            config.write_text('name: "a"\nplatfo')  # half written
            time.sleep(1.0)  # several polls
            config.write_text('name: "a"\nplatform: "onnxruntime_onnx"\n')
            (repo / "a" / "2").mkdir()  # copied in: the folder first, its model file later
            time.sleep(1.0)
            put(repo, "a", 2, 2.0)
            assert wait_for(lambda: infer(client, "a") == 2.0, timeout=30), s.log
            shutil.rmtree(repo / "a" / "2")  # the latest deleted: version 1 again
            assert wait_for(lambda: infer(client, "a") == 1.0, timeout=30), s.log
        client.close()
        assert not failures, (len(failures), failures[:3])


@pytest.mark.parametrize("module", [grpcclient, httpclient])
def test_load_with_config_and_file_overrides(repo, module):
    """Triton's overrides: the model is loaded from the bytes and the configuration sent (its
    folder on disk untouched), seamlessly replacing the loaded one."""
    with RunningServer("--model-repository", str(repo), "--model-control-mode", "explicit",
                       "--load-model", "*") as s:  # fmt: skip
        client = module.InferenceServerClient(s.target if module is grpcclient else s.http_target)
        try:
            model = plus(100.0)
            model.ir_version = 9
            config = '{"backend": "onnxruntime", "version_policy": {"all": {}}}'
            client.load_model(
                "a", config=config, files={"file:3/model.onnx": model.SerializeToString()}
            )
            assert infer(client, "a", "3") == 100.0
            assert client.get_model_config("a") is not None
            assert not (repo / "a" / "3").exists()
            client.load_model("b", config='{"max_batch_size": 0, "backend": "openvino"}')
            assert infer(client, "b") == 10.0  # the folder's model, the new configuration
            # what Triton's simple_*_model_control examples check: a malformed override and an
            # unknown model both say "failed to load" (first, with plugserve's reason after)
            for name, config in (("b", '"parameters": {"config": {{"max_batch_size": "16"}}}'),
                                 ("wrong_model_name", None)):  # fmt: skip
                with pytest.raises(InferenceServerException) as info:
                    client.load_model(name, config=config)
                assert info.value.message().startswith(f"failed to load '{name}': "), info.value
            assert infer(client, "b") == 10.0  # the failed reload left it serving
        finally:
            client.close()
