"""Fixtures of the generative test models (tests/support/llm.py): real folders from real
exporters, made once and cached. A folder whose exporter cannot be set up on this machine skips
the test with the reason and the install line.

    def test_x(llm_folder, llm_reference):
        folder = llm_folder("tiny-llama", "optimum-onnx")  # or "hf", "genai-fp32",
        ref = llm_reference("tiny-llama")                  # "genai-int4", "openvino"
        case = ref["cases"][0]  # prompt_ids, ids, stop, logprobs, top_logprobs, ...
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest


def _or_skip(make: Callable[[], object]):
    import llm

    try:
        return make()
    except llm.Unavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def llm_folder() -> Callable[[str, str], Path]:
    """``get(name, kind)``: decoder ``name`` (a key of llm.MODELS) as ``kind``: "hf" or an
    export (a key of llm.EXPORTS)."""
    import llm

    def get(name: str, kind: str = "optimum-onnx") -> Path:
        if kind == "hf":
            return _or_skip(lambda: llm.hf_folder(name))
        return _or_skip(lambda: llm.export(name, kind))

    return get


@pytest.fixture(scope="session")
def llm_reference() -> Callable[[str], dict]:
    """``get(name)``: transformers' f32 greedy answers of decoder ``name`` to llm.PROMPTS."""
    import llm

    return lambda name: _or_skip(lambda: llm.reference(name))


@pytest.fixture(scope="session")
def encoder_folder() -> Callable[[str], Path]:
    """``get(name)``: encoder ``name`` (a key of llm.ENCODERS) in the sentence-transformers
    hub layout, optimum's graph as ``onnx/model.onnx``."""
    import llm

    return lambda name: _or_skip(lambda: llm.encoder_onnx(name))


@pytest.fixture(scope="session")
def encoder_embeddings() -> Callable[[str], dict]:
    """``get(name)``: sentence-transformers' embeddings of llm.SENTENCES by encoder ``name``."""
    import llm

    return lambda name: _or_skip(lambda: llm.embeddings(name))


@pytest.fixture(scope="module")
def hf_llama(llm_folder) -> Path:
    """tiny-llama's safetensors folder (transformers' layout: what the TORCH device loads)."""
    return llm_folder("tiny-llama", "hf")


@pytest.fixture(scope="module")
def torch_llama(core, hf_llama, request):
    """tiny-llama loaded on TORCH with the test module's own ``SETTINGS`` (its config keys:
    the torch decoder's tests size their batches differently), closed after the module."""
    network = core.load_network(str(hf_llama), "TORCH", request.module.SETTINGS)
    yield network
    network.close()


# --- the engine tests' helpers


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


def run_all(engine, requests) -> dict[str, list]:
    """Every request at once, a thread each, through ``engine.generate``; each one's events."""
    results: dict[str, list] = {}

    def one(request):
        results[request.request_id] = list(engine.generate(request))

    threads = [threading.Thread(target=one, args=(r,)) for r in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def greedy(case: dict, max_tokens: int, **extra):
    """A reference case's prompt as a greedy request ignoring end of sequence, 5 logprobs."""
    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    return GenerationRequest(case["name"], list(case["prompt_ids"]), params, **extra)


class FailingGrammar:
    """A constraint whose mask raises at the sequence's ``at``-th token: what a grammar
    library failing mid-answer does to the engine (the Constraint protocol is the engine's
    extension point; llguidance stands behind it in the server)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def mask(self, vocab_size: int):
        import numpy as np

        if self.seen >= self.at:
            raise RuntimeError("the grammar's matcher broke")
        return np.ones(vocab_size, dtype=bool)

    def accept(self, token_id: int) -> None:
        self.seen += 1

    def done(self) -> bool:
        return False


def post(server, path: str, body: dict) -> bytes:
    """``body`` as JSON to a running server's REST ``path``; the answer's bytes."""
    request = urllib.request.Request(
        server.http_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def continuation(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``prompt_ids`` (what a stream of them sends)."""
    before = tokenizer.decode(prompt_ids)
    return tokenizer.decode([*prompt_ids, *ids])[len(before) :]


@pytest.fixture(scope="session")
def tiny_reference() -> dict:
    return reference("tiny-llama")
