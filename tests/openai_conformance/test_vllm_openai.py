"""vLLM's OpenAI server tests (vllm-project/vllm, ``tests/entrypoints/openai``, Apache-2.0)
about ``echo`` with ``logprobs``, ``logprobs``, ``prompt_logprobs``, ``seed`` (issue 50) and
``stream_options`` (issue 62), run unchanged against plugserve: their test file as it is, with
a ``tests/utils.py`` of ours (vllm_utils.py: ``RemoteOpenAIServer`` starting plugserve instead
of ``vllm serve``) and a ``vllm`` package holding only the names their module imports
(vllm_shim/: vLLM's tokenizer loader, reading the served model's tokenizer).

Their files are not kept in this repository (third-party code stays out of it): point
``PLUGSERVE_VLLM_SRC`` at a checkout of vllm-project/vllm (checked at :data:`COMMIT`; CI's
``.ci/run`` downloads :data:`FILES` alone) and this test copies them into a temporary
``tests`` package with ours, runs pytest there in a subprocess on the tests :data:`SELECTED`
picks, and compares each one's outcome with :data:`EXPECTED`. Without the checkout it is
skipped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from upstream_tests import run_upstream

pytest.importorskip("openai", reason="pip install openai (the test extra)")

#: the commit of vllm-project/vllm these were run at
COMMIT = "41c5903d049b80b83a6e570f52f0f55e31316e49"
FILES = (
    "tests/entrypoints/openai/completion/test_completion.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
)
#: their tests about echo, logprobs, prompt_logprobs and seed (the parallel-sampling ones send
#: seed=42) and stream_options (``continuous_usage_stats``, issue 62): all of
#: test_chat_echo.py; test_completion.py's others (beam search, prompt truncation, grammars)
#: are not these issues'
SELECTED = "logprob or parallel or echo or stream_options"
#: each test (file::name[parameters]) -> its outcome against plugserve
EXPECTED = {
    "test_completion::test_no_logprobs[facebook/opt-125m]": "passed",
    "test_completion::test_zero_logprobs[facebook/opt-125m]": "passed",
    "test_completion::test_some_logprobs[facebook/opt-125m]": "passed",
    "test_completion::test_too_many_completion_logprobs[facebook/opt-125m]": "passed",
    "test_completion::test_prompt_logprobs_completion[facebook/opt-125m--1]": "passed",
    "test_completion::test_prompt_logprobs_completion[facebook/opt-125m-0]": "passed",
    "test_completion::test_prompt_logprobs_completion[facebook/opt-125m-1]": "passed",
    "test_completion::test_prompt_logprobs_completion[facebook/opt-125m-None]": "passed",
    "test_completion::test_parallel_no_streaming[facebook/opt-125m]": "passed",
    "test_completion::test_parallel_streaming[facebook/opt-125m]": "passed",
    "test_completion::test_echo_logprob_completion[1-facebook/opt-125m]": "passed",
    "test_completion::test_echo_logprob_completion[0-facebook/opt-125m]": "passed",
    # include_usage with and without continuous_usage_stats, and stream_options refused
    # without a stream
    "test_completion::test_completion_stream_options[facebook/opt-125m]": "passed",
    "test_chat_echo::test_chat_session_with_echo_and_continue_final_message[test_case0]": (
        "passed"
    ),
    "test_chat_echo::test_chat_session_with_echo_and_continue_final_message[test_case1]": (
        "passed"
    ),
    # -1, the whole vocabulary: their server raises --max-logprobs to 151936, which
    # vllm_utils.py passes on (the tiny model's vocabulary is smaller); "logprobs": "true", a
    # string, read as vLLM's pydantic model reads a boolean
    "test_chat_echo::test_prompt_logprobs": "passed",
    "test_chat_echo::test_top_logprobs": "passed",
}
HERE = Path(__file__).parent


@pytest.mark.slow
def test_vllms_echo_logprobs_and_seed_tests_pass_unchanged(tmp_path):
    source = os.environ.get("PLUGSERVE_VLLM_SRC")
    if not source:
        pytest.skip("set PLUGSERVE_VLLM_SRC to a vllm-project/vllm checkout")
    pytest.importorskip("pytest_asyncio", reason="their async tests need pytest-asyncio")
    pytest.importorskip("regex", reason="their file imports regex")
    tree = tmp_path / "tests"
    tree.mkdir()
    (tree / "__init__.py").write_text("")
    for name in FILES:
        shutil.copy(Path(source) / name, tree / Path(name).name)
    shutil.copy(HERE / "vllm_utils.py", tree / "utils.py")
    shutil.copytree(HERE / "vllm_shim", tmp_path / "vllm")
    found, output = run_upstream(
        tmp_path, ["-k", SELECTED, *(f"tests/{Path(name).name}" for name in FILES)]
    )
    assert found == EXPECTED, output
