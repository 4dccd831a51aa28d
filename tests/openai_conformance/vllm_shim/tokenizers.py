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


def get_tokenizer(tokenizer_name: str, *args: Any, **kwargs: Any) -> Any:
    from tokenizers import Tokenizer

    folder = json.loads(os.environ.get("PLUGSERVE_VLLM_MODELS", "{}"))[str(tokenizer_name)]
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
