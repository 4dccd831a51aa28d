"""``mlserver infer``, MLServer's batch client, unchanged, against a real server: a file of v2
inference requests sent over REST (one by one and grouped into micro-batches), every answer
written to its output file with the right values and ids.

MLServer runs in its own cached virtual environment (tests/support/venvs.py)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow

VERSION = "1.7.1"


@pytest.fixture(scope="module")
def mlserver():
    from venvs import cached_venv

    try:
        return cached_venv(f"mlserver-{VERSION}", [f"mlserver=={VERSION}"]) / "bin" / "mlserver"
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"could not install MLServer (pip install mlserver=={VERSION}): {exc}")


@pytest.mark.parametrize("batch", [1, 2])
def test_mlserver_infer_runs_a_file_of_requests(mlserver, server, tmp_path, batch):
    requests = []
    for n in range(4):
        requests.append(
            {
                "id": f"r{n}",
                "inputs": [
                    {"name": "a", "shape": [2], "datatype": "FP32", "data": [n, n + 1]},
                    {"name": "b", "shape": [2], "datatype": "FP32", "data": [10, 20]},
                ],
            }
        )
    source, target = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    command = [str(mlserver), "infer", "-u", server.http_target, "-m", "add", "-i", str(source),
               "-o", str(target), "--batch-size", str(batch), "--workers", "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    answers = [json.loads(line) for line in target.read_text().splitlines() if line.strip()]
    assert len(answers) == len(requests), answers
    for answer in answers:
        n = int(answer["id"].removeprefix("r"))
        (output,) = answer["outputs"]
        assert output["data"] == [n + 10, n + 21], answer
