"""Model control for generative folders (issue 42), against a real server with tritonclient's
repository calls over gRPC and HTTP: load, unload, load again and reload, in both layouts
docs/generate.md shows (the Hugging Face files at the model's top, served as version 1; and a
version folder ``1/`` holding them beside plugserve's ``config.json``), with
``--model-control-mode explicit`` and in the default mode. Unloading then loading a generative
model was a 500 (``ValueError`` reading its version from the folder's parent) and explicit
mode could not load one at all; each load here is then asked for transformers' greedy answer."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from serving import RunningServer

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKENS = 8


@pytest.fixture(scope="module")
def repository(llm_folder):
    """``flat``: the folder's files at the model's top; ``versioned``: ``versioned/1`` is the
    folder, ``versioned/config.json`` plugserve's settings."""
    source = llm_folder("tiny-llama", "optimum-onnx")
    root = Path(tempfile.mkdtemp(prefix="plugserve-gen-control-"))
    (root / "flat").mkdir()
    for item in source.iterdir():
        (root / "flat" / item.name).symlink_to(item.resolve())
    (root / "versioned").mkdir()
    (root / "versioned" / "1").symlink_to(source.resolve(), target_is_directory=True)
    (root / "versioned" / "config.json").write_text(json.dumps({"device": "NUMPY"}))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _answer(server, model: str, case: dict) -> list[int]:
    api = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="x", max_retries=0, timeout=120)
    answer = api.completions.create(
        model=model, prompt=case["prompt"], max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    return answer.choices[0].model_extra["token_ids"]


def _ready(client, name: str) -> bool:
    try:
        return client.is_model_ready(name)
    except InferenceServerException:
        return False


def _serve(repository: Path, *args: str) -> RunningServer:
    server = RunningServer(
        "--model-repository", str(repository), "--default-device", "NUMPY", *args
    )
    return server.start(timeout=300)


@pytest.mark.parametrize("mode", ["explicit", ""])
def test_generative_folders_load_unload_and_reload_in_both_layouts(repository, llm_reference, mode):
    case = llm_reference("tiny-llama")["cases"][1]
    expected = case["ids"][:TOKENS]
    args = ["--model-control-mode", "explicit"] if mode else []
    server = _serve(repository, *args)
    grpc_client = grpcclient.InferenceServerClient(server.target)
    http_client = httpclient.InferenceServerClient(server.http_target)
    try:
        index = {m["name"]: m for m in http_client.get_model_repository_index()}
        assert set(index) == {"flat", "versioned"}
        for name in ("flat", "versioned"):
            # explicit mode loaded nothing; the default mode loaded both
            assert _ready(grpc_client, name) is (not mode), name
        for name, client in (("flat", grpc_client), ("versioned", http_client)):
            client.load_model(name)  # a first load (explicit) or a reload (default)
            assert _ready(grpc_client, name) and _ready(http_client, name), name
            assert _answer(server, name, case) == expected, name
            client.unload_model(name)
            assert not _ready(grpc_client, name), name
            other = http_client if client is grpc_client else grpc_client
            other.load_model(name)  # loaded again after its unload: was a 500
            assert _ready(grpc_client, name), name
            assert _answer(server, name, case) == expected, name
            client.load_model(name)  # a reload while it is loaded: swapped in, served
            assert _answer(server, name, case) == expected, name
        stats = grpc_client.get_model_repository_index(as_json=True)["models"]
        assert {(m["name"], m.get("version"), m.get("state")) for m in stats} == {
            ("flat", "1", "READY"),
            ("versioned", "1", "READY"),
        }
    finally:
        grpc_client.close()
        http_client.close()
        server.stop()


def test_explicit_mode_loads_a_generative_model_named_at_startup(repository, llm_reference):
    case = llm_reference("tiny-llama")["cases"][1]
    server = _serve(repository, "--model-control-mode", "explicit", "--load-model", "versioned")
    client = grpcclient.InferenceServerClient(server.target)
    try:
        assert _ready(client, "versioned") and not _ready(client, "flat")
        assert _answer(server, "versioned", case) == case["ids"][:TOKENS]
        client.unload_model("versioned")
        client.load_model("versioned")
        assert _answer(server, "versioned", case) == case["ids"][:TOKENS]
    finally:
        client.close()
        server.stop()
