"""``vllm.tokenizers.get_tokenizer`` for vLLM's tests run against plugserve: the served
model's own tokenizer (``tokenizer.json``, by Hugging Face ``tokenizers``), found by the name
the test serves it under (``PLUGSERVE_VLLM_MODELS``, set by tests/utils.py's
``RemoteOpenAIServer``). Their tests decode token ids with it to know what an echoed prompt
reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class _Tokenizer:
    """The tokenizer as vLLM's (Hugging Face ``transformers``') decodes: special tokens kept
    unless asked (``tokenizers``' own ``decode`` leaves them out by default)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def get_tokenizer(tokenizer_name: str, *args: Any, **kwargs: Any) -> Any:
    from tokenizers import Tokenizer

    folder = json.loads(os.environ.get("PLUGSERVE_VLLM_MODELS", "{}"))[str(tokenizer_name)]
    return _Tokenizer(Tokenizer.from_file(str(Path(folder) / "tokenizer.json")))
