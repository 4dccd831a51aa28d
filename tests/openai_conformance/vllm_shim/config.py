"""``vllm.config.ModelConfig`` for vLLM's tests run against plugserve: only what their test
modules call, ``get_vocab_size``, read from the served model's ``config.json`` (found by the
name the test serves it under, as vllm_shim/tokenizers.py finds its tokenizer)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ModelConfig:
    def __init__(self, model: str, **_: Any) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        folder = json.loads(os.environ.get("PLUGSERVE_VLLM_MODELS", "{}"))[self.model]
        return int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
