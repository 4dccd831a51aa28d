"""``tests/utils.py`` for vLLM's OpenAI server tests run against plugserve (see
test_vllm_openai.py): the name their test files import, over a plugserve server.

``RemoteOpenAIServer(model, vllm_serve_args)`` starts ``vllm serve`` in vLLM; here it starts
plugserve (tests/support/serving.py) serving a tiny generative model of ours
(tests/support/tiny_decoder.py: seeded weights, a byte-level tokenizer, an end of sequence
that sampling sometimes picks) as the repository model ``served``, named ``model`` on the
OpenAI API by ``--served-model-name`` (their names are Hugging Face ids,
``facebook/opt-125m``, which a repository folder cannot be). Of vLLM's own flags, those in
:data:`PASSED` mean the same to plugserve and are passed on (``--max-logprobs``: test_chat_echo
raises it to ask for the whole vocabulary); the others (``--dtype``, ``--enforce-eager``,
``--max-model-len``...) are engine settings with no plugserve counterpart and are not passed.
The model's folder is published in ``PLUGSERVE_VLLM_MODELS`` for the ``vllm`` shim's
tokenizer loader (vllm_shim/tokenizers.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import openai

sys.path[:0] = os.environ.get("PLUGSERVE_TEST_SUPPORT", "").split(os.pathsep)

from openai_serving import serving  # noqa: E402
from tiny_decoder import write  # noqa: E402

API_KEY = "EMPTY"
#: the tiny decoder's end of sequence, sometimes sampled: their parallel-sampling tests want
#: answers of several lengths within 50 tokens (with their seed 42: 50, 3 and 10 tokens; at
#: 1.0 all three ran to 50)
EOS_LOGIT = 2.0
#: vLLM's flags (each taking one value) plugserve takes under the same name and meaning
PASSED = ("--max-logprobs",)


def _passed(args: list[str]) -> list[str]:
    """The flags of :data:`PASSED` in ``args`` (``--flag value`` or ``--flag=value``)."""
    kept: list[str] = []
    for i, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if flag in PASSED:
            kept += [flag, value if equals else args[i + 1]]
    return kept


class RemoteOpenAIServer:
    """vLLM's test server's face over a plugserve server serving a tiny decoder as ``model``."""

    def __init__(self, model: str, vllm_serve_args: list[str] | None = None, **_: Any) -> None:
        self.model = model
        self._folder = Path(tempfile.mkdtemp(prefix="plugserve-vllm-"))
        write(self._folder / "served", context=4096, eos_logit=EOS_LOGIT)
        known = json.loads(os.environ.get("PLUGSERVE_VLLM_MODELS", "{}"))
        os.environ["PLUGSERVE_VLLM_MODELS"] = json.dumps(
            {**known, model: str(self._folder / "served")}
        )
        self._serving = serving(
            {"served": (self._folder / "served", "NUMPY")},
            "--served-model-name", f"{model}=served",
            *_passed(vllm_serve_args or []),
        )  # fmt: skip
        self.running = None

    def __enter__(self) -> RemoteOpenAIServer:
        self.running = self._serving.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._serving.__exit__(*exc)
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def url_root(self) -> str:
        return self.running.http_url

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=API_KEY, max_retries=0, **kwargs
        )
