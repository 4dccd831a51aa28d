"""The ``plugserve`` console script's user verbs, run as a user would against a real server."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from models import mlp, with_custom_op

from plugserve.client import Client

PLUGSERVE = shutil.which("plugserve")
pytestmark = pytest.mark.skipif(PLUGSERVE is None, reason="the plugserve script is not on PATH")

VERBS = ["serve", "conformance", "examples", "make-model", "devices", "metric", "config", "load"]
VERBS += ["unload", "list", "query", "infer", "export", "import", "bench"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PLUGSERVE, *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


@pytest.fixture(scope="module")
def cli(server):
    """``cli(verb, *args)`` runs the verb against the module's server; ok=False expects failure."""

    def call(verb: str, *args: str, ok: bool = True, cwd: Path | None = None):
        result = run(verb, *args, "--target", server.target, cwd=cwd)
        assert "Traceback" not in result.stderr, result.stderr
        if ok:
            assert result.returncode == 0, result.stderr
        else:
            assert result.returncode != 0, result.stdout
        return result

    return call


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("files")
    (folder / "mlp.onnx").write_bytes(mlp().SerializeToString())
    (folder / "custom.onnx").write_bytes(with_custom_op().SerializeToString())
    return folder


def _rows(table: str) -> dict[str, list[str]]:
    """A printed table by its first column (the header row included)."""
    rows = [line.split(None, 2) for line in table.splitlines() if line.strip()]
    return {row[0]: row[1:] for row in rows}


def test_help_lists_the_verbs_and_an_unknown_verb_exits_2():
    result = run("--help")
    assert result.returncode == 0
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(VERBS)
    result = run("frobnicate")
    assert result.returncode == 2
    assert "unknown verb 'frobnicate'" in result.stderr and "devices" in result.stderr


def test_devices_shows_numpy_available(cli):
    rows = _rows(cli("devices").stdout)
    assert rows["DEVICE"][0] == "STATE" and rows["DEVICE"][1].split() == ["DETAIL", "STOPS"]
    assert rows["NUMPY"][0] == "available" and "numpy" in rows["NUMPY"][1]
    assert rows["NUMPY"][1].endswith("before each node and Loop/Scan iteration")  # cancelled


def test_metric(cli, client):
    out = cli("metric", "NUMPY", "FULL_DEVICE_NAME").stdout
    assert out.strip() == f'"{client.get_metric("NUMPY", "FULL_DEVICE_NAME")}"'
    result = cli("metric", "NUMPY", "NOPE", ok=False)
    assert "NOT_FOUND" in result.stderr and "FULL_DEVICE_NAME" in result.stderr


def test_config_get_set_and_unknown_key(cli, client):
    lines = cli("config", "NUMPY").stdout.splitlines()
    current = dict(line.split("=", 1) for line in lines)
    assert current == client.get_config("NUMPY") and current["PERF_COUNT"] == "NO"
    assert lines == sorted(lines)
    assert cli("config", "NUMPY", "PERF_COUNT").stdout == "PERF_COUNT=NO\n"
    try:
        assert cli("config", "NUMPY", "PERF_COUNT=YES").stdout == "PERF_COUNT=YES\n"
        assert cli("config", "NUMPY", "PERF_COUNT").stdout == "PERF_COUNT=YES\n"
        assert client.get_config("NUMPY", "PERF_COUNT") == {"PERF_COUNT": "YES"}
    finally:
        client.set_config({"PERF_COUNT": "NO"}, "NUMPY")
    for key in ("NOPE", "NOPE=1"):
        result = cli("config", "NUMPY", key, ok=False)
        assert (
            "INVALID_ARGUMENT" in result.stderr and "unsupported config key 'NOPE'" in result.stderr
        )
        assert "PERF_COUNT" in result.stderr  # the server's message names the supported keys
    assert client.get_config("NUMPY", "PERF_COUNT") == {"PERF_COUNT": "NO"}


def test_load_list_unload(cli, files):
    out = cli("load", "cli_load", str(files / "mlp.onnx")).stdout
    assert out.startswith("cli_load v1 on NUMPY (f32): inputs x:float32[batch,32] -> outputs y:")
    assert "cli_load v1 on NUMPY" in cli("list").stdout
    assert cli("unload", "cli_load").stdout.strip() == "unloaded cli_load"
    assert "cli_load" not in cli("list").stdout
    result = cli("load", "cli_load", str(files / "missing.onnx"), ok=False)
    assert "missing.onnx" in result.stderr


def test_load_persist_and_from_the_repository(cli, server, files):
    repo = server.repository
    cli("load", "cli_kept", str(files / "mlp.onnx"), "--persist")
    assert (repo / "cli_kept" / "1" / "model.onnx").read_bytes() == mlp().SerializeToString()
    assert json.loads((repo / "cli_kept" / "1" / "config.json").read_text())["device"] == "NUMPY"
    out = cli("load", "cli_again", "cli_kept", "--repository").stdout
    assert out.startswith("cli_again v1 on NUMPY (f32): inputs x:float32[batch,32]")
    out = cli("load", "cli_v1", "cli_kept/1", "--repository").stdout
    assert out.startswith("cli_v1 v1 on NUMPY")
    result = cli("load", "cli_none", "no_such_model", "--repository", ok=False)
    assert "NOT_FOUND" in result.stderr and "no_such_model" in result.stderr
    for name in ("cli_kept", "cli_again", "cli_v1"):
        assert cli("unload", name).stdout.strip() == f"unloaded {name}"
    assert (repo / "cli_kept" / "1" / "model.onnx").is_file()  # unload leaves files be
    cli("load", "cli_gone", str(files / "mlp.onnx"), "--persist")
    assert (repo / "cli_gone" / "1" / "model.onnx").is_file()
    out = cli("unload", "cli_gone", "--remove").stdout.strip()
    assert out == "unloaded cli_gone and removed it from the repository"
    assert not (repo / "cli_gone").exists()
    assert not [p.name for p in repo.iterdir() if p.name.startswith(".")]


def test_query_shows_each_node_and_why_not(cli, files):
    rows = _rows(cli("query", str(files / "mlp.onnx"), "--device", "NUMPY").stdout)
    assert rows.pop("NODE") == ["DEVICE", "WHY NOT"]
    assert rows == {n.name: ["NUMPY"] for n in mlp().graph.node}
    rows = _rows(cli("query", str(files / "custom.onnx"), "--device", "NUMPY").stdout)
    assert rows["relu"] == ["NUMPY"] and rows["add"] == ["NUMPY"]
    assert rows["scale"][0] == "-"
    assert "no kernel for op 'Scale' of domain 'com.example'" in rows["scale"][1]


def test_infer_random_inputs_from_the_metadata(cli, client, tmp_path):
    out = cli("infer", "mlp", "--seed", "3", "--output-dir", str(tmp_path)).stdout
    assert out.strip() == f"probabilities: float32[1, 4] -> {tmp_path / 'probabilities.npy'}"
    x = np.random.default_rng(3).normal(size=[1, 16]).astype(np.float32)
    expected = client.infer("mlp", {"input": x})["probabilities"]
    np.testing.assert_array_equal(np.load(tmp_path / "probabilities.npy"), expected)
    printed = cli("infer", "echo").stdout
    assert printed.startswith("echo: object[1]") and "plugserve" in printed
    cli("infer", "echo", "--output-dir", str(tmp_path))
    assert np.load(tmp_path / "echo.npy").tolist() == ["plugserve"]  # no pickle needed


def test_infer_inputs_from_npy_and_npz_and_outputs_to_files(cli, files, tmp_path):
    from plugserve.server import Core

    x = np.random.default_rng(5).normal(size=(3, 32)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    expected = Core().load_network(mlp(), "NUMPY").infer({"x": x})["y"]
    cli("load", "cli_infer", str(files / "mlp.onnx"))
    try:
        for given in (f"x={tmp_path / 'x.npy'}", str(tmp_path / "x.npy")):  # a lone input
            out = tmp_path / "out"
            shutil.rmtree(out, ignore_errors=True)
            printed = cli("infer", "cli_infer", "--input", given, "--output-dir", str(out)).stdout
            assert printed.strip() == f"y: float32[3, 10] -> {out / 'y.npy'}"
            assert sorted(p.name for p in out.iterdir()) == ["y.npy"]
            np.testing.assert_allclose(np.load(out / "y.npy"), expected, rtol=1e-6)
    finally:
        cli("unload", "cli_infer")
    a = np.array([1.5, -2, 3], np.float32)
    b = np.array([0.5, 4, -1], np.float32)
    np.savez(tmp_path / "ab.npz", a=a, b=b)
    out = cli("infer", "add", "--input", str(tmp_path / "ab.npz")).stdout
    assert out.splitlines() == ["sum: float32[3]", "[2. 2. 2.]"]
    cli("infer", "add", "--input", str(tmp_path / "ab.npz"), "--output-dir", str(tmp_path))
    np.testing.assert_array_equal(np.load(tmp_path / "sum.npy"), a + b)
    result = cli("infer", "add", "--input", f"a={tmp_path / 'missing.npy'}", ok=False)
    assert "missing.npy" in result.stderr
    result = cli("infer", "add", "--input", f"c={tmp_path / 'x.npy'}", ok=False)
    assert "INVALID_ARGUMENT" in result.stderr and "unknown input" in result.stderr


def test_export_and_import(cli, client, tmp_path):
    blob = tmp_path / "mlp.blob"
    assert cli("export", "mlp", str(blob)).stdout.startswith("mlp: ")
    assert blob.read_bytes() == client.export("mlp")
    out = cli("import", "cli_imported", str(blob), "--device", "NUMPY").stdout
    assert out.startswith("cli_imported v1 on NUMPY (f32): inputs input:float32[batch,16]")
    try:
        x = np.random.default_rng(2).normal(size=(2, 16)).astype(np.float32)
        np.testing.assert_array_equal(
            client.infer("cli_imported", {"input": x})["probabilities"],
            client.infer("mlp", {"input": x})["probabilities"],
        )
    finally:
        cli("unload", "cli_imported")
    result = cli("import", "cli_bad", str(tmp_path / "nothing.blob"), "--device", "NUMPY", ok=False)
    assert "nothing.blob" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["infer", "nope"],
        ["infer", "mlp", "--version", "7"],
        ["unload", "nope"],
        ["export", "nope", "nope.blob"],
        ["metric", "NUMPY", "NETWORK_NAME", "--network", "nope"],
    ],
)
def test_an_unknown_network_is_not_found(cli, args, tmp_path):
    result = cli(*args, ok=False, cwd=tmp_path)
    assert "NOT_FOUND: Request for unknown model: " in result.stderr
    assert not (tmp_path / "nope.blob").exists()
