"""Triton's genai-perf, unchanged, against a generative model served by plugserve: over the
OpenAI chat API (server-sent events) and over KServe's ModelStreamInfer with Triton's LLM
convention (``text_input``, ``max_tokens``, ``stream`` in; ``text_output`` out), the way its
users point it at Triton or an OpenAI-compatible server (issue 37: "Triton's clients and
genai-perf work unchanged").

genai-perf 0.0.16 runs perf_analyzer, taken here as tests/support/perf_analyzer.py makes it
(tritonclient 2.51.0's binary); both live in cached virtual environments of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

# genai-perf's first run of each module makes and loads its datasets: about 2 minutes
pytestmark = pytest.mark.slow

GENAI_PERF = "0.0.16"
REQUESTS = 12


@pytest.fixture(scope="module")
def genai_perf():
    import perf_analyzer
    from venvs import cached_venv

    why = perf_analyzer.missing()
    if why:
        pytest.skip(why)
    binary, env = perf_analyzer.environment()
    venv = cached_venv(f"genai-perf-{GENAI_PERF}", [f"genai-perf=={GENAI_PERF}"])
    env = {**env, "PATH": f"{binary.parent}:{env.get('PATH', os.defpath)}"}
    return venv / "bin" / "genai-perf", env


@pytest.fixture(scope="module")
def served(llm_folder, tmp_path_factory):
    from serving import RunningServer

    folder = llm_folder("tiny-llama", "optimum-onnx")
    root = tmp_path_factory.mktemp("genai-perf-models")
    (root / "tiny").symlink_to(folder)
    with RunningServer("--model-repository", str(root), "--default-device", "ORT") as server:
        server.folder = folder
        yield server


@pytest.mark.parametrize("endpoint", ["chat", "kserve"])
def test_genai_perf_profiles_the_model_unchanged(genai_perf, served, endpoint, tmp_path):
    command, env = genai_perf
    url = f"127.0.0.1:{served.http_port if endpoint == 'chat' else served.grpc_port}"
    done = subprocess.run(
        [
            str(command),
            "profile",
            "-m",
            "tiny",
            "--endpoint-type",
            endpoint,
            "--streaming",
            "-u",
            url,
            "--tokenizer",
            str(served.folder),
            "--num-prompts",
            str(REQUESTS),
            "--synthetic-input-tokens-mean",
            "24",
            "--output-tokens-mean",
            "12",
            "--concurrency",
            "4",
            "--request-count",
            str(REQUESTS),
            "--artifact-dir",
            str(tmp_path / "artifacts"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    exports = list(Path(tmp_path / "artifacts").rglob("profile_export_genai_perf.json"))
    assert exports, done.stdout[-2000:]
    stats = json.loads(exports[0].read_text())
    assert stats["request_count"]["avg"] == REQUESTS
    assert stats["time_to_first_token"]["avg"] > 0
    assert stats["output_sequence_length"]["avg"] > 0
