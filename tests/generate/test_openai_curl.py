"""The README's OpenAI examples, run as written (curl and the official client) against a real
server whose repository serves a test model under the README's name; only the port differs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from openai_serving import serving

README = Path(__file__).parents[2] / "README.md"
MARKER = "<!-- openai-example"


def _examples() -> list[tuple[str, str]]:
    """(language, code) of each fenced block right after an openai-example marker."""
    text = README.read_text()
    found = re.findall(MARKER + r"[^\n]*-->\n```(\w+)\n(.*?)```", text, flags=re.S)
    assert len(found) == 2, "README.md: the curl and the Python example, each after the marker"
    return found


@pytest.fixture(scope="module")
def server(llm_folder):
    # the README's model is "qwen"; a tiny test model stands in for it under that name
    with serving({"qwen": (llm_folder("tiny-llama", "optimum-onnx"), "NUMPY")}) as running:
        yield running


def _here(code: str, server) -> str:
    return code.replace("localhost:8000", f"127.0.0.1:{server.http_port}")


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl (apt-get install curl)")
def test_the_readme_curl_commands(server):
    (language, code), _ = _examples()
    assert language == "bash"
    commands = [c for c in re.split(r"\n(?=curl )", code.strip()) if c.strip()]
    assert len(commands) == 3
    outputs = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", _here(command, server)], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    models = json.loads(outputs[0])
    assert [m["id"] for m in models["data"]] == ["qwen"]
    chat = json.loads(outputs[1])
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] >= 1
    events = [line for line in outputs[2].splitlines() if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(chunks) >= 2


def test_the_readme_python_example(server):
    pytest.importorskip("openai", reason="pip install openai (the test extra)")
    _, (language, code) = _examples()
    assert language == "python"
    done = subprocess.run(
        [sys.executable, "-c", _here(code, server)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "CompletionUsage(" in done.stdout
    assert "completion_tokens=" in done.stdout
