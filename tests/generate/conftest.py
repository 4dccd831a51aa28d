"""Generative test models for tests/generate: the tiny decoder made by tests/support/llm.py and
exported by the real exporters, and transformers' own greedy answers to its prompts."""

from __future__ import annotations

import pytest


def exported(name: str, kind: str):
    """The folder of ``name`` exported by ``kind``; the test skips, saying why and what to
    install, when this machine cannot make it."""
    llm = pytest.importorskip("llm", reason="tests/support/llm.py makes the generative models")
    try:
        return llm.export(name, kind)
    except llm.Unavailable as exc:
        pytest.skip(f"{kind} export of {name} unavailable: {exc}")


def reference(name: str) -> dict:
    llm = pytest.importorskip("llm", reason="tests/support/llm.py makes the generative models")
    try:
        return llm.reference(name)
    except llm.Unavailable as exc:
        pytest.skip(f"transformers' reference answers of {name} unavailable: {exc}")


def continuation(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``prompt_ids`` (what a stream of them sends)."""
    before = tokenizer.decode(prompt_ids)
    return tokenizer.decode([*prompt_ids, *ids])[len(before) :]


@pytest.fixture(scope="session")
def tiny_reference() -> dict:
    return reference("tiny-llama")
