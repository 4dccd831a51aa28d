"""What an operator meets starting and running the server: ports, startup errors, logs,
``--version`` and the newcomer's first commands (issue: the tools Triton users already have)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from importlib.metadata import version

from serving import RunningServer, examples_repository, serve_command

PLUGSERVE = [sys.executable, "-m", "plugserve.server.process.cli"]


def serve(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    """A server that is expected to exit by itself (a startup error)."""
    return subprocess.run(
        serve_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def test_version(tmp_path) -> None:
    done = subprocess.run([*PLUGSERVE, "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == f"plugserve {version('plugserve')}"


def test_examples_name_real_files(tmp_path) -> None:
    listed = subprocess.run(
        [*PLUGSERVE, "examples"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    names = [line.split()[0] for line in listed if line]
    assert names == ["add", "cnn", "echo", "image_classifier", "mlp", "text_encoder"]
    path = subprocess.run(
        [*PLUGSERVE, "examples", "cnn"], capture_output=True, text=True, check=True
    ).stdout.strip()
    import onnx

    onnx.checker.check_model(path)
    unknown = subprocess.run([*PLUGSERVE, "examples", "nope"], capture_output=True, text=True)
    assert unknown.returncode == 2
    assert "examples: add, cnn, echo, image_classifier" in unknown.stderr


def test_readme_commands_on_the_examples(server) -> None:
    """README's 'from another shell' commands, with the file `plugserve examples` names."""
    cnn = subprocess.run(
        [*PLUGSERVE, "examples", "cnn"], capture_output=True, text=True, check=True
    ).stdout.strip()
    target = ["--target", server.target]
    for command in (
        ["load", "mine", cnn, "--device", "NUMPY", "--config", "PERF_COUNT=YES"],
        ["query", cnn, "--device", "NUMPY"],
        ["infer", "mine"],
    ):
        done = subprocess.run(
            [*PLUGSERVE, *command, *target], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)


def test_no_server_gives_a_hint(tmp_path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [*PLUGSERVE, "list", "--target", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "no server answers at" in done.stderr and "plugserve serve" in done.stderr


def test_an_occupied_grpc_port_is_one_line_and_a_failure(server, tmp_path) -> None:
    done = serve("--grpc-port", str(server.grpc_port), cwd=tmp_path)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"plugserve: cannot listen on 127.0.0.1:{server.grpc_port}")
    assert "--grpc-port" in message and "Traceback" not in done.stderr


def test_sharing_the_grpc_port_is_opt_in(tmp_path) -> None:
    """Both servers must ask for it (SO_REUSEPORT), as with Triton's --reuse-grpc-port."""
    repo = examples_repository(tmp_path)
    share = ("--reuse-grpc-port", "1", "--model-repository", str(repo))
    first = RunningServer(*share).start()
    try:
        with RunningServer(*share, "--grpc-port", str(first.grpc_port)) as second:
            assert second.grpc_port == first.grpc_port
    finally:
        first.stop()


def test_an_occupied_metrics_port_is_one_line_and_a_failure(server, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = serve("--metrics-port", str(port), cwd=tmp_path)
    assert done.returncode != 0
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"plugserve: cannot listen on 127.0.0.1:{port} (--metrics-port)")
    )
    assert "Traceback" not in done.stderr


def test_a_missing_repository_exits_unless_told_otherwise(tmp_path) -> None:
    missing = tmp_path / "no-such-folder"
    done = serve("--model-repository", str(missing), cwd=tmp_path)
    assert done.returncode == 1
    assert f"--model-repository {missing}: no such file or folder" in done.stderr
    with RunningServer("--model-repository", str(missing), "--exit-on-error", "0") as server:
        assert "server ready: 0 model version(s)" in server.log


def test_a_model_that_fails_to_load_stops_startup(tmp_path) -> None:
    repo = examples_repository(tmp_path)
    broken = repo / "broken" / "1"
    broken.mkdir(parents=True)
    (broken / "model.onnx").write_bytes(b"not a model")
    done = serve("--model-repository", str(repo), cwd=tmp_path)
    assert done.returncode == 1
    assert "1 model(s) cannot be served at startup: model 'broken' version 1:" in done.stderr
    assert f"{broken / 'model.onnx'}" in done.stdout  # the problem itself, in the log


def test_logs_go_to_stdout_and_can_be_json(tmp_path) -> None:
    repo = examples_repository(tmp_path)
    process = subprocess.Popen(
        serve_command("--model-repository", str(repo), "--log-format", "json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "server ready" in line:
                break
        process.terminate()
        rest, errors = process.communicate(timeout=60)
    finally:
        process.kill()
    records = [json.loads(line) for line in [*lines, *rest.splitlines()] if line.strip()]
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records), records
    assert any(r["message"].startswith("server ready: 4 model version(s)") for r in records)
    assert any(r["message"] == "stopped" for r in records)
    assert errors == "", errors
