"""Which repository entries are generative models (server/control/repository.py with
server/apps/generate/folder.py): a Hugging Face folder as downloaded, or as version 1 with
plugserve's settings beside it, is one entry; its config.json is transformers', not ours."""

from __future__ import annotations

import json
from pathlib import Path

from plugserve.server.apps.generate.folder import ModelFolder, graph_of
from plugserve.server.control.repository import Repository


def hf_folder(path: Path, graph: str = "model.onnx", config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (path / "tokenizer.json").write_text("{}")
    (path / graph).parent.mkdir(parents=True, exist_ok=True)
    (path / graph).write_bytes(b"onnx")
    return path


def test_a_folder_as_downloaded_is_version_1_of_its_name(tmp_path):
    hf_folder(tmp_path / "qwen")
    entries, problems = Repository(tmp_path).scan()
    assert problems == []
    assert [(e.name, e.version, e.path, e.device) for e in entries] == [
        ("qwen", 1, tmp_path / "qwen", "")
    ]


def test_a_folder_in_1_takes_plugserves_settings_beside_it(tmp_path):
    hf_folder(tmp_path / "llama" / "1", graph="onnx/model.onnx")
    settings = {"device": "ORT", "config": {"MAX_NUM_SEQS": "4"}}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(settings))
    entries, problems = Repository(tmp_path).scan()
    assert problems == []
    (entry,) = entries
    assert (entry.name, entry.version, entry.path) == ("llama", 1, tmp_path / "llama" / "1")
    assert (entry.device, entry.config) == ("ORT", {"MAX_NUM_SEQS": "4"})


def test_a_model_builder_folder_needs_no_config_json(tmp_path):
    folder = tmp_path / "phi"
    folder.mkdir()
    genai = {
        "model": {
            "type": "phi3",
            "context_length": 4096,
            "eos_token_id": [32000, 32007],
            "decoder": {"filename": "model.onnx", "num_key_value_heads": 8, "head_size": 96},
        }
    }
    (folder / "genai_config.json").write_text(json.dumps(genai))
    (folder / "model.onnx").write_bytes(b"onnx")
    entries, _ = Repository(tmp_path).scan()
    assert [e.path for e in entries] == [folder]
    read = ModelFolder.read(folder)
    assert (read.kind, read.context_length, read.config["num_key_value_heads"]) == (
        "genai",
        4096,
        8,
    )


def test_graphs_are_found_in_their_order(tmp_path):
    folder = hf_folder(tmp_path / "m", graph="onnx/model_q4.onnx")
    assert graph_of(folder) == ("onnx", folder / "onnx" / "model_q4.onnx")
    (folder / "onnx" / "model_fp16.onnx").write_bytes(b"onnx")
    assert graph_of(folder) is None  # two candidates, neither model.onnx: not guessed
    (folder / "decoder_model_merged.onnx").write_bytes(b"onnx")
    assert graph_of(folder) == ("onnx", folder / "decoder_model_merged.onnx")
    (folder / "openvino_model.xml").write_text("<net/>")
    assert graph_of(folder)[0] == "openvino"


def test_a_plain_model_folder_is_still_a_plain_model(tmp_path):
    (tmp_path / "add" / "1").mkdir(parents=True)
    (tmp_path / "add" / "1" / "model.onnx").write_bytes(b"onnx")
    (tmp_path / "add" / "config.json").write_text(json.dumps({"device": "NUMPY"}))
    entries, problems = Repository(tmp_path).scan()
    assert problems == []
    assert [(e.name, e.path) for e in entries] == [("add", tmp_path / "add" / "1" / "model.onnx")]
