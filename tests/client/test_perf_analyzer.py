"""perf_analyzer, unchanged, against a real server: every mode its users run, over gRPC and
over HTTP (KServe v2 REST, binary tensors as perf_analyzer sends them).

perf_analyzer checks the server's statistics between measurements (it aborts when the
compute_input/infer/output counts differ, or when counts go backwards), so these runs test the
statistics extension as much as inference.
"""

from __future__ import annotations

import csv
import os
import subprocess

import pytest
from perf_analyzer import environment, missing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def perf_analyzer():
    why = missing()
    if why and os.environ.get("CI"):
        pytest.fail(f"{why}: .ci/run must install it")
    if why:
        pytest.skip(why)
    return environment()


def run(
    perf_analyzer, server, tmp_path, *args: str, protocol: str = "grpc"
) -> list[dict[str, str]]:
    binary, env = perf_analyzer
    report = tmp_path / "report.csv"
    command = [
        str(binary),
        "-u",
        server.target if protocol == "grpc" else server.http_target,
        "-i",
        protocol,
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        "40",
        # stability is about timing, which a shared machine disturbs: enough windows for
        # three calm ones (each is 40 requests), so the runs test behaviour, not the load
        "--max-trials",
        "12",
        "--stability-percentage",
        "100",
        "-f",
        str(report),
        *args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    with open(report) as f:
        rows = list(csv.DictReader(f))
    assert rows and all(float(row["Inferences/Second"]) > 0 for row in rows), rows
    return rows


@pytest.mark.parametrize(
    "mode", [[], ["--async"], ["--streaming"]], ids=["sync", "async", "streaming"]
)
def test_modes_on_a_batched_model(perf_analyzer, server, tmp_path, mode) -> None:
    rows = run(perf_analyzer, server, tmp_path, "-m", "mlp", "--concurrency-range", "1:2", *mode)
    assert [row["Concurrency"] for row in rows] == ["1", "2"]
    # server-side columns come from ModelStatistics: present and non-zero
    assert all(int(row["Server Compute Infer"]) > 0 for row in rows), rows


def test_strings_and_several_inputs(perf_analyzer, server, tmp_path) -> None:
    run(perf_analyzer, server, tmp_path, "-m", "echo", "--shape", "text:4")
    run(perf_analyzer, server, tmp_path, "-m", "add", "--shape", "a:16", "--shape", "b:16")


@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_http_modes_on_a_batched_model(perf_analyzer, server, tmp_path, mode) -> None:
    rows = run(
        perf_analyzer, server, tmp_path, "-m", "mlp", "--concurrency-range", "1:2", *mode,
        protocol="http",
    )  # fmt: skip
    assert [row["Concurrency"] for row in rows] == ["1", "2"]
    assert all(int(row["Server Compute Infer"]) > 0 for row in rows), rows


def test_http_strings_and_dynamic_shapes(perf_analyzer, server, tmp_path) -> None:
    run(perf_analyzer, server, tmp_path, "-m", "echo", "--shape", "text:4", protocol="http")
    run(
        perf_analyzer, server, tmp_path, "-m", "add", "--shape", "a:16", "--shape", "b:16",
        protocol="http",
    )  # fmt: skip


@pytest.fixture(scope="module")
def open_shm_server(tmp_path_factory):
    """A server that lets clients register any /dev/shm key, as Triton does: perf_analyzer
    names its regions itself (not under plugserve's default prefix)."""
    from serving import RunningServer, examples_repository

    repo = examples_repository(tmp_path_factory.mktemp("repo"))
    with RunningServer("--model-repository", str(repo), "--shared-memory-prefix", "/") as running:
        yield running


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_system_shared_memory(perf_analyzer, open_shm_server, tmp_path, protocol) -> None:
    """perf_analyzer --shared-memory system: inputs and outputs in regions it registers, for
    numbers (the batched MLP) and strings, over both protocols; it unregisters them after."""
    for model in (["-m", "mlp"], ["-m", "echo", "--shape", "text:4"]):
        run(
            perf_analyzer,
            open_shm_server,
            tmp_path,
            *model,
            "--shared-memory",
            "system",
            "--output-shared-memory-size",
            "4096",
            protocol=protocol,
        )
