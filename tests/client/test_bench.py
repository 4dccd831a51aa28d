"""``plugserve bench`` as a user runs it: a subprocess against a real server (the conftest's
``server`` on the bundled examples) and in-process.

Only counts and fields are checked: times depend on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from models import mlp

#: Loop trips per request of the spin model: tens of milliseconds on NUMPY
SPIN_TRIPS = 5000
LATENCY_KEYS = {"min", "p50", "p90", "p99", "max", "mean"}


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plugserve.server.process.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "mlp.onnx"
    onnx.save(mlp(), str(path))
    return path


def check_report(report: dict, requests: int, concurrency: int, batch: int = 1) -> None:
    assert report["requests"] == requests
    assert report["errors"] == 0
    assert report["concurrency"] == concurrency
    assert report["batch"] == batch
    assert set(report["latency_ms"]) == LATENCY_KEYS
    lat = report["latency_ms"]
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert len(report["latencies_ms"]) == requests
    assert len(report["starts_s"]) == requests
    assert report["throughput_rps"] > 0
    assert report["throughput_ips"] == pytest.approx(report["throughput_rps"] * batch)


@pytest.mark.parametrize("protocol", ["plugserve", "kserve"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_server(server, tmp_path, protocol, mode):
    out = tmp_path / "report.json"
    result = bench(
        "mlp",
        "--target",
        server.target,
        "--protocol",
        protocol,
        "--mode",
        mode,
        "--iterations",
        "24",
        "--concurrency",
        "3",
        "--batch",
        "2",
        "--metrics-url",
        server.metrics_url,
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    check_report(report, 24, 3, batch=2)
    assert report["protocol"] == protocol
    assert report["inputs"]["input"] == ["float32", [2, 16]]
    # the server counted our requests (plus the warm-up) on the mlp's device
    (figures,) = report["devices"].values()
    assert figures["requests"] == 25
    assert figures["requests_success"] == 25
    assert "compute_mean_ms" in figures
    assert "p50" in result.stdout and "throughput" in result.stdout
    assert "24 requests" in result.stderr  # the final progress line (stderr is not a tty)


def test_server_without_metrics(server, tmp_path):
    out = tmp_path / "report.json"
    result = bench(
        "add",
        "--target",
        server.target,
        "--iterations",
        "5",
        "--metrics-url",
        "http://127.0.0.1:1/metrics",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    check_report(report, 5, 1)
    assert "metrics unavailable" in report["metrics_note"]
    assert set(report["inputs"]) == {"a", "b"}


def test_inputs_from_file(server, tmp_path):
    import numpy as np

    np.save(tmp_path / "x.npy", np.ones((4, 16), np.float32))
    out = tmp_path / "report.json"
    result = bench(
        "mlp", "--target", server.target, "--iterations", "3", "--input",
        str(tmp_path / "x.npy"), "--json", str(out), "--metrics-url", server.metrics_url,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["inputs"]["input"] == ["float32", [4, 16]]


@pytest.mark.parametrize("device", ["NUMPY", "ORT"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_inprocess(model_file, tmp_path, device, mode):
    out = tmp_path / "report.json"
    result = bench(
        "--inprocess", "--device", device, str(model_file), "--mode", mode, "--iterations",
        "30", "--nireq", "2", "--batch", "4", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    check_report(report, 30, 2, batch=4)
    assert report["device"] == device
    assert report["protocol"] == "inprocess"
    assert "devices" not in report


def test_time_limit(model_file, tmp_path):
    out = tmp_path / "report.json"
    result = bench("--inprocess", str(model_file), "--time", "0.3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["requests"] >= 1
    assert len(report["latencies_ms"]) == report["requests"]


def test_plot(model_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    result = bench("--inprocess", str(model_file), "--iterations", "20", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot -> {png}" in result.stderr


def test_bad_target():
    result = bench("mlp", "--target", "127.0.0.1:1", "--iterations", "2", "--timeout", "5")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("protocol", ["plugserve", "kserve"])
def test_unknown_network(server, protocol):
    result = bench("nosuch", "--target", server.target, "--protocol", protocol, "--iterations", "2")
    assert result.returncode == 1
    assert "nosuch" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_model_file(tmp_path):
    result = bench("--inprocess", str(tmp_path / "missing.onnx"), "--iterations", "2")
    assert result.returncode == 1
    assert "no such model file" in result.stderr
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    result = bench("--inprocess", str(garbage), "--iterations", "2")
    assert result.returncode == 1
    assert "cannot load" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_arguments(model_file):
    result = bench("--inprocess", str(model_file), "--iterations", "0")
    assert result.returncode != 0
    assert "--iterations" in result.stderr
    result = bench("--inprocess", str(model_file), "--iterations", "2", "--time", "1")
    assert result.returncode == 2  # argparse: not both


def test_plot_without_matplotlib(model_file, tmp_path):
    """Without matplotlib a run asked for a plot stops before it starts, saying what to
    install (it used to run, then skip the plot on a line easy to miss, and exit 0)."""
    import os

    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    png = tmp_path / "plot.png"
    result = subprocess.run(
        [sys.executable, "-m", "plugserve.server.process.cli", "bench", "--inprocess",
        str(model_file),
         "--iterations", "5", "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(shadow.parent)},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "--plot" in result.stderr and "plugserve[bench]" in result.stderr
    assert "p50" not in result.stdout and "Traceback" not in result.stderr
    assert not png.exists()


def test_failed_requests_make_the_run_fail(tmp_path):
    """A run in which requests failed exits 1 and says how many, as perf_analyzer does: here
    one stream and a queue of one place refuse most of a burst of 32. Each request is a
    Loop of SPIN_TRIPS additions (tens of milliseconds on NUMPY), so the queue is full
    whatever the machine's load: with the cnn (0.2 ms) a loaded machine once answered all 64
    before the next arrived. All 32 calls run at once (--grpc-active-workers): with the
    default two, the handler threads' own queue paces the burst."""
    import numpy as np
    from models import spin_repository
    from serving import RunningServer

    models = spin_repository(tmp_path / "models", streams=1)
    trips = tmp_path / "trips.npy"
    np.save(trips, np.array(SPIN_TRIPS, np.int64))
    args = ("--model-repository", str(models), "--queue-size", "1")
    with RunningServer(*args, "--grpc-active-workers", "32") as server:
        result = bench(
            "spin", "--target", server.target, "--mode", "async", "--concurrency", "32",
            "--iterations", "64", "--input", f"M={trips}",
        )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "requests failed" in result.stderr and "RESOURCE_EXHAUSTED" in result.stderr


def test_the_default_metrics_url_is_the_one_the_server_reports(server, tmp_path):
    """No --metrics-url: the server's real metrics port (here a free-picked one, not 8002)."""
    out = tmp_path / "report.json"
    result = bench(
        "add", "--target", server.target, "--iterations", "5", "--json", str(out)
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert "metrics_note" not in report, report["metrics_note"]
    (figures,) = report["devices"].values()
    assert figures["requests"] == 6  # 5 and the warm-up
