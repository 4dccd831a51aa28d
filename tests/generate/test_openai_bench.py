"""``plugserve bench --protocol openai`` as a user runs it, against a real server's /v1 API: each
concurrency level's report (tokens/s, TTFT, ITL and end-to-end percentiles), the JSON and the
plot. Only counts and orderings are checked: times depend on the machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from openai_serving import serving

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(llm_folder):
    with serving({"llama": (llm_folder("tiny-llama", "optimum-onnx"), "NUMPY")}) as running:
        yield running


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plugserve.server.process.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_generation_levels_report_tokens_ttft_and_itl(server, tmp_path, endpoint):
    pytest.importorskip("matplotlib", reason="pip install 'plugserve[bench]'")
    out, png = tmp_path / "report.json", tmp_path / "gen.png"
    result = bench(
        "llama", "--protocol", "openai", "--target", server.target, "--endpoint", endpoint,
        "--concurrency", "1,3", "--iterations", "6", "--max-tokens", str(MAX_TOKENS),
        "--prompt-words", "20", "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["target"] == f"http://127.0.0.1:{server.http_port}/v1", "found by SERVER_PORTS"
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for level in levels:
        assert level["requests"] == 6 and level["errors"] == 0
        assert level["output_tokens"] == 6 * MAX_TOKENS, "ignore_eos: every request is full"
        assert level["output_tokens_per_s"] > 0
        assert level["prompt_tokens_mean"] > 0
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            q = level[key]
            assert 0 < q["p50"] <= q["p90"] <= q["p99"], (key, q)
        assert level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
    assert png.stat().st_size > 10_000
    assert "tok/s" in result.stdout and "TTFT" in result.stdout


def test_generation_failures_are_counted_and_said(server, tmp_path):
    result = bench(
        "no-such-model", "--protocol", "openai", "--url", f"{server.http_url}/v1",
        "--iterations", "2", "--warmup", "0",
    )  # fmt: skip
    assert result.returncode == 1
    assert "404" in result.stderr and "no-such-model" in result.stderr
    result = bench("llama", "--protocol", "openai", "--target", server.target, "--concurrency", "0")
    assert result.returncode != 0 and "--concurrency" in result.stderr
