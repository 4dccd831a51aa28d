"""The model repository through a real server: bad entries, persist, restarts, names, leftovers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest
from models import mlp
from serving import RunningServer

from plugserve.client import Client
from plugserve.plugins.api import InvalidArgument
from plugserve.server.control.examples import build_examples


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    return build_examples(tmp_path_factory.mktemp("examples"))


def _good(repo: Path, examples: Path, *names: str) -> None:
    for name in names:
        shutil.copytree(examples / name, repo / name)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_bad_entries_are_reported_and_the_good_models_load(tmp_path, examples):
    repo = tmp_path / "models"
    repo.mkdir()
    _good(repo, examples, "add", "mlp")
    model = (examples / "add" / "1" / "model.onnx").read_bytes()

    def version(name: str, folder: str, data: bytes | None = model) -> Path:
        path = repo / name / folder
        path.mkdir(parents=True)
        if data is not None:
            (path / "model.onnx").write_bytes(data)
        return path

    version("bad name", "1")
    version("versions", "0")
    version("versions", "abc")
    version("versions", "²")  # a digit to str.isdigit, not to int()
    version("empty", "1", None)
    version("notjson", "1")
    (repo / "notjson" / "config.json").write_text("{not json")
    version("unknownkey", "1")
    (repo / "unknownkey" / "config.json").write_text('{"devize": "NUMPY"}')
    version("garbage", "1", b"\x00\x01 this is not an onnx model")

    with (
        RunningServer("--model-repository", str(repo), "--exit-on-error", "0") as server,
        Client(server.target, timeout=60) as client,
    ):
        assert {(n.name, n.version) for n in client.networks()} == {("add", 1), ("mlp", 1)}
        out = client.infer("add", {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)})
        assert out["sum"].tolist() == [2, 2]
        probabilities = client.infer("mlp", {"input": np.ones((1, 16), np.float32)})
        assert probabilities["probabilities"].shape == (1, 4)
    errors = [line for line in server.lines if " ERROR " in line]
    expected = {
        repo / "bad name": "invalid model name 'bad name'",
        repo / "versions" / "0": "a version folder must be named by an integer > 0",
        repo / "versions" / "abc": "a version folder must be named by an integer > 0",
        repo / "versions" / "²": "a version folder must be named by an integer > 0",
        repo / "versions": "no version folder with a model.onnx",
        repo / "empty" / "1": "no model.onnx in this version folder",
        repo / "notjson" / "config.json": "not valid JSON",
        repo / "unknownkey" / "config.json": "unknown key(s) ['devize']",
        repo / "garbage" / "1" / "model.onnx": "is not an ONNX model",
    }
    for path, problem in expected.items():
        assert any(f"model repository: {path}: " in e and problem in e for e in errors), (
            path,
            problem,
            server.log,
        )
    assert "server not ready: 2 model version(s)" in server.log  # --exit-on-error 0


@pytest.fixture(scope="module")
def empty_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("persist") / "models"
    repo.mkdir()
    with RunningServer("--model-repository", str(repo)) as server:
        server.repository = repo
        yield server


@pytest.mark.parametrize(
    "name",
    ["a/b", "../escape", "..", "a..b", "x\n", "bad\x01name", "tab\tname", "", ".hidden", "a b"],
)
def test_bad_names_are_refused_before_touching_the_filesystem(empty_server, name):
    repo = empty_server.repository
    before = _tree(repo.parent)
    with Client(empty_server.target, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.load(name, mlp().SerializeToString(), persist=True)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "invalid model name" in info.value.details()
        assert name not in {n.name for n in client.networks()}
    assert _tree(repo.parent) == before


@pytest.mark.parametrize("path", ["../escape", "../../etc/passwd", "a/../../b", "x\n/1"])
def test_bad_repository_paths_are_refused(empty_server, path):
    with Client(empty_server.target, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.load("fine", repository_path=path)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_persist_survives_a_restart_and_unload_with_remove_deletes_it(tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    model = mlp(seed=4).SerializeToString()
    x = np.random.default_rng(4).normal(size=(2, 32)).astype(np.float32)
    with (
        RunningServer("--model-repository", str(repo)) as server,
        Client(server.target, timeout=60) as client,
    ):
        response = client.load("kept", model, config={"PERF_COUNT": "YES"}, persist=True)
        assert response.network.persisted and response.network.version == 1
        before = client.infer("kept", {"x": x})["y"]
        assert client.load("kept", model, persist=True).network.version == 2
    assert (repo / "kept" / "1" / "model.onnx").read_bytes() == model
    assert (repo / "kept" / "2" / "model.onnx").read_bytes() == model
    settings = json.loads((repo / "kept" / "1" / "config.json").read_text())
    assert settings["device"] == "NUMPY"
    mode = (repo / "kept").stat().st_mode & 0o777  # not mkdtemp's 0700 or mkstemp's 0600
    assert (repo / "kept" / "1").stat().st_mode & 0o777 == mode
    assert (repo / "kept" / "1" / "config.json").stat().st_mode & 0o777 == mode & 0o666
    assert not [p for p in repo.iterdir() if p.name.startswith(".")]  # no staging left

    with (
        RunningServer("--model-repository", str(repo)) as server,
        Client(server.target, timeout=60) as client,
    ):
        kept = {n.version: n for n in client.networks() if n.name == "kept"}
        assert sorted(kept) == [1, 2] and kept[1].persisted
        np.testing.assert_array_equal(client.infer("kept", {"x": x}, version=1)["y"], before)
        client.unload("kept", version=2)  # unloaded, still in the repository
        assert (repo / "kept" / "2" / "model.onnx").read_bytes() == model
        client.unload("kept", remove=True)  # the loaded version 1, from disk too
        assert not (repo / "kept" / "1").exists() and (repo / "kept" / "2").is_dir()
        assert not client.networks()
    assert not [p for p in repo.iterdir() if p.name.startswith(".")]  # no trash left


def test_an_interrupted_write_is_cleaned_at_startup_and_never_loaded(tmp_path, examples):
    repo = tmp_path / "models"
    repo.mkdir()
    _good(repo, examples, "add")
    staging = repo / ".add.2.k3j9x"  # a persist of add version 2 that never got renamed
    staging.mkdir()
    shutil.copy(examples / "add" / "1" / "model.onnx", staging / "model.onnx")
    trash = repo / ".trash.add.123.abc"  # an unload that never finished deleting
    shutil.copytree(examples / "add" / "1", trash)
    config_tmp = repo / "add" / ".config.json.x1y2.tmp"
    config_tmp.write_text("{")
    with (
        RunningServer("--model-repository", str(repo)) as server,
        Client(server.target, timeout=60) as client,
    ):
        assert [(n.name, n.version) for n in client.networks()] == [("add", 1)]
    assert not staging.exists() and not trash.exists() and not config_tmp.exists()
    assert sorted(p.name for p in repo.iterdir()) == ["add"]
    for leftover in (staging, trash, config_tmp):
        assert f"removed {leftover}, left by an interrupted write" in server.log
    assert "ERROR" not in server.log


def test_model_name_serves_a_single_file_as_version_1(tmp_path, monkeypatch):
    """--model-name: KServe's storage layout (one .onnx file, or a folder holding one)."""
    import tempfile

    from plugserve.server.control.repository import Repository, single_model_repository

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "scratch"))  # what $TMPDIR sets
    (tmp_path / "scratch").mkdir()
    store = tmp_path / "mnt"
    store.mkdir()
    (store / "net.onnx").write_bytes(mlp(seed=1).SerializeToString())
    (store / "config.json").write_text('{"device": "NUMPY", "max_batch_size": 2}')
    for source in (store, store / "net.onnx"):
        root = single_model_repository(source, "my-isvc")
        assert root.parent == tmp_path / "scratch"
        [entry] = Repository(root).scan()[0]
        assert (entry.name, entry.version) == ("my-isvc", 1)
        assert Repository(root).read_settings("my-isvc").max_batch_size == 2
        assert (root / "my-isvc" / "1" / "model.onnx").resolve() == (store / "net.onnx")
    assert sorted(p.name for p in store.iterdir()) == ["config.json", "net.onnx"]


def test_model_name_leaves_a_repository_and_refuses_several_files(tmp_path):
    from plugserve.server.control.repository import single_model_repository

    repo = tmp_path / "repo"
    (repo / "a" / "1").mkdir(parents=True)
    (repo / "a" / "1" / "model.onnx").write_bytes(mlp(seed=1).SerializeToString())
    assert single_model_repository(repo, "ignored") == repo
    (tmp_path / "two").mkdir()
    for name in ("a.onnx", "b.onnx"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(InvalidArgument, match=r"several \.onnx files \(a\.onnx, b\.onnx\)"):
        single_model_repository(tmp_path / "two", "x")
    with pytest.raises(InvalidArgument, match="invalid model name"):
        single_model_repository(repo, "../escape")


def test_scratch_folders_are_removed_when_the_server_stops(tmp_path):
    """A fresh machine's test run left ~200 empty plugserve-server-* folders (RunningServer's
    working folder) and every --model-name server its plugserve-models-* folder in $TMPDIR."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    store = tmp_path / "mnt"
    store.mkdir()
    (store / "net.onnx").write_bytes(mlp(seed=1).SerializeToString())
    server = RunningServer(
        "--model-repository", str(store / "net.onnx"), "--model-name", "one",
        env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    with server:
        assert Path(server.cwd).is_dir()
        made = sorted(p.name for p in scratch.iterdir())
        assert any(name.startswith("plugserve-models-") for name in made), made
        with Client(server.target) as client:
            assert client.infer("one", {"x": np.ones((1, 32), np.float32)})
    assert not Path(server.cwd).exists()
    # (openvino's telemetry keeps a session file there: not ours)
    assert [p.name for p in scratch.iterdir() if p.name.startswith("plugserve-")] == []
