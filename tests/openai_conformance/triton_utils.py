"""``tests/utils.py`` for Triton's OpenAI frontend tests run against plugserve (see
test_triton_openai.py): the names their test files import, over a plugserve server.

``OpenAIServer`` is a running plugserve server (tests/support/openai_serving.py) with the
clients Triton's gives; ``setup_server`` / ``setup_fastapi_app`` start Triton in process and
have no plugserve counterpart: the tests that call them are skipped by the conftest.
"""

from __future__ import annotations

from typing import Any

import openai


class OpenAIServer:
    """Triton's test server's face over a running plugserve server."""

    API_KEY = "EMPTY"

    def __init__(self, running: Any) -> None:
        self.running = running

    @property
    def url_root(self) -> str:
        return self.running.http_url

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.API_KEY, max_retries=0)

    def get_async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.API_KEY, max_retries=0)


def setup_server(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("Triton's in-process server: no plugserve counterpart")


def setup_fastapi_app(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("Triton's FastAPI app: no plugserve counterpart")
