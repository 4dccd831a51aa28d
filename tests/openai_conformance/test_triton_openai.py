"""Triton's OpenAI frontend tests (triton-inference-server/server, ``python/openai/tests``, BSD
3-clause), run unchanged against plugserve (issue 50): their test files as they are, with the
``tests/conftest.py`` and ``tests/utils.py`` beside this file (triton_conftest.py,
triton_utils.py) in place of Triton's, which start Triton itself.

Their files are not kept in this repository (third-party code stays out of it): point
``PLUGSERVE_TRITON_SERVER_SRC`` at a checkout of triton-inference-server/server (checked at
:data:`COMMIT`) and this test copies :data:`FILES` from it into a temporary ``tests``
package with ours, runs pytest there in a subprocess, and compares each test's outcome with
:data:`EXPECTED`. Without the checkout, or without the packages their files import (FastAPI
for its TestClient, pytest-asyncio for their async tests), it is skipped.

What passes, what is skipped and why: :data:`EXPECTED` (and triton_conftest.py's docstring
for what its fixtures adapt).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from upstream_tests import run_upstream

pytest.importorskip("openai", reason="pip install openai (the test extra)")

#: the commit of triton-inference-server/server these were run at
COMMIT = "e1db8a603d863b1317ee859bdeea2be19959462e"
FILES = ("__init__.py", "test_tool_calling.py")
_IN_PROCESS = "skipped"  # starts Triton in process: no plugserve counterpart
#: each test (class::name) -> its outcome against plugserve
EXPECTED = {
    "TestAsyncClientToolCalling::test_tool_call_and_choice": "passed",
    "TestAsyncClientToolCalling::test_tool_call_with_reply_response": "passed",
    "TestAsyncClientToolCalling::test_tool_call_with_named_tool_choice": "passed",
    "TestAsyncClientToolCalling::test_tool_call_with_required_tool_choice": "passed",
    "TestAsyncClientToolCalling::test_inconsistent_tool_choice_and_tools": "passed",
    "TestStreamingToolParseLimit::test_truncated_when_tool_call_exceeds_limit": _IN_PROCESS,
    "TestStreamingToolParseLimit::test_not_truncated_within_limit": _IN_PROCESS,
    "TestStreamingToolParseLimit::test_limit_ignored_without_tools": _IN_PROCESS,
}
HERE = Path(__file__).parent
#: one event loop for the session: their class-scoped AsyncOpenAI client outlives a test's
#: own loop (pytest-asyncio 1.x closes it; its pooled connection is then dead)
LOOP = (
    "-o", "asyncio_default_test_loop_scope=session",
    "-o", "asyncio_default_fixture_loop_scope=session",
)  # fmt: skip


@pytest.mark.slow
def test_tritons_tool_calling_tests_pass_unchanged(tmp_path):
    source = os.environ.get("PLUGSERVE_TRITON_SERVER_SRC")
    if not source:
        pytest.skip("set PLUGSERVE_TRITON_SERVER_SRC to a triton-inference-server/server checkout")
    pytest.importorskip("fastapi", reason="their file imports FastAPI's TestClient")
    pytest.importorskip("pytest_asyncio", reason="their async tests need pytest-asyncio")
    tree = tmp_path / "tests"
    tree.mkdir()
    for name in FILES:
        shutil.copy(Path(source) / "python" / "openai" / "tests" / name, tree / name)
    shutil.copy(HERE / "triton_conftest.py", tree / "conftest.py")
    shutil.copy(HERE / "triton_utils.py", tree / "utils.py")
    found, output = run_upstream(tmp_path, [*LOOP, "tests/test_tool_calling.py"])
    assert found == EXPECTED, output
