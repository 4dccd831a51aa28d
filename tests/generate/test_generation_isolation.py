"""One request's bad state never fails another (issue 42), against a real server: a request
that fails inside an engine step while others decode beside it fails alone and the others
finish with transformers' answer token for token; a parameter the engine could not take
(``seed: -1`` failed every request of its step with 500) is served or refused with a 400
before it enters the engine, on the OpenAI face and on KServe's generate.

The failure inside the step is a real one, of a real library: the served folder's
``tokenizer.json`` decodes "QQ" as another text (a ``Replace`` decoder after the byte-level
one), which tokenizers' ``DecodeStream`` refuses ("Invalid prefix encountered", vLLM's issue
17448) when a sequence's second "Q" arrives: the victim's second token is sampled in the same
batch as the other streams' tokens.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402

MODEL = "llama"
#: the decoded text the folder's decoder rewrites, and what into (longer: DecodeStream refuses)
PATTERN, REWRITTEN = "QQ", "<two Qs>"
#: the other streams' tokens: many more than the reference's 32, so they are still decoding
#: when the victim's second token comes (their first 32 are compared with the reference; the
#: three run ~130 tokens a second each here)
OTHERS_TOKENS = 400


@pytest.fixture(scope="module")
def folder(llm_folder):
    """tiny-llama's optimum export with a tokenizer.json whose decoder rewrites "QQ"."""
    source = llm_folder("tiny-llama", "optimum-onnx")
    root = Path(tempfile.mkdtemp(prefix="plugserve-isolation-"))
    target = root / "tiny-llama-qq"
    target.mkdir()
    for item in source.iterdir():
        if item.name != "tokenizer.json":
            (target / item.name).symlink_to(item.resolve())
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["decoder"] = {
        "type": "Sequence",
        "decoders": [
            tokenizer["decoder"],
            {"type": "Replace", "pattern": {"String": PATTERN}, "content": REWRITTEN},
        ],
    }
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    yield target
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(folder):
    with serving({MODEL: (folder, "NUMPY")}) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return client(server, timeout=120)


def _cases(reference):
    return [c for c in reference["cases"] if "prompt" in c][:3]


def _stream(api, case, into: dict, ended: dict, started: threading.Event):
    """Read one reference prompt's stream; its token ids into ``into``, its end time into
    ``ended``; ``started`` is set at its first token."""
    ids: list[int] = []
    try:
        stream = api.completions.create(
            model=MODEL, prompt=case["prompt"], max_tokens=OTHERS_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        for chunk in stream:
            for choice in chunk.choices:
                ids += choice.model_extra.get("token_ids") or []
            started.set()
        into[case["name"]] = ids
        ended[case["name"]] = time.monotonic()
    finally:
        started.set()


def _others(api, reference):
    """The reference prompts streaming, each on a thread; returns (threads, ids, ends) once
    every stream has its first token."""
    ids: dict[str, list[int]] = {}
    ends: dict[str, float] = {}
    started = [threading.Event() for _ in _cases(reference)]
    threads = [
        threading.Thread(target=_stream, args=(api, case, ids, ends, event), daemon=True)
        for case, event in zip(_cases(reference), started)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120), "a stream beside the test did not start"
    return threads, ids, ends


def _check_others(reference, threads, ids, ends, after: float | None):
    for thread in threads:
        thread.join(timeout=300)
    for case in _cases(reference):
        got = ids.get(case["name"])
        assert got is not None, f"{case['name']}: the stream beside the failure did not finish"
        assert len(got) == OTHERS_TOKENS, case["name"]
        assert got[: len(case["ids"])] == case["ids"], case["name"]
        if after is not None:  # the scenario happened: each still decoded after the victim
            assert ends[case["name"]] > after, case["name"]


def test_the_decoder_really_refuses_the_pattern(folder):
    """The premise: tokenizers' DecodeStream fails on this folder's "QQ", and the reference
    answers beside it never decode to it (they must not fail for it)."""
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    q = tokenizer.token_to_id("Q")
    stream = DecodeStream(ids=[q], skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        stream.step(tokenizer, q)


def test_a_request_failing_inside_a_step_fails_alone(api, folder, llm_reference):
    from tokenizers import Tokenizer

    reference = llm_reference("tiny-llama")
    for case in _cases(reference):
        text = case["prompt"] + case["completion_ignore_eos"]
        assert PATTERN not in text, "a reference answer would decode the failing pattern"
    q = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("Q")
    threads, ids, ends = _others(api, reference)
    assert not ends, "the streams beside the failure ended before it"
    with pytest.raises(openai.InternalServerError) as caught:
        # its first token is "Q" (decoded fine), its second "Q" fails in a decode step
        # shared with the three streams
        api.completions.create(
            model=MODEL, prompt=[q], max_tokens=8, temperature=0,
            logit_bias={str(q): 100},
        )  # fmt: skip
    answered = time.monotonic()
    error = caught.value
    assert error.status_code == 500
    assert error.body["type"] == "server_error"
    assert "detokeniz" in error.body["message"] and "Invalid prefix" in error.body["message"]
    _check_others(reference, threads, ids, ends, answered)
    # the server goes on: the next request is served
    again = api.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3


def test_a_negative_seed_is_served_beside_others(api, llm_reference):
    reference = llm_reference("tiny-llama")
    threads, ids, ends = _others(api, reference)

    def seeded():
        return api.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=-1,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip

    first = seeded()
    answered = time.monotonic()
    assert first.choices[0].finish_reason == "length"
    _check_others(reference, threads, ids, ends, answered)
    # a negative seed is a seed like any other: the same one draws the same tokens
    assert seeded().choices[0].model_extra["token_ids"] == first.choices[0].model_extra["token_ids"]


#: KServe generate's sampling parameters out of their ranges: each a 400 naming it
KSERVE_REFUSALS = [
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": ["x" * 1025]}, "stop[0]"),
    ({"stop": [""]}, "stop[0]"),
    ({"seed": 2**64}, "seed"),
    ({"top_p": 0}, "top_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
]


def _generate(server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{MODEL}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_kserve_generate_refuses_each_parameter_out_of_range_beside_others(
    api, server, llm_reference
):
    """Each refusal names its parameter; the streams beside them finish untouched."""
    reference = llm_reference("tiny-llama")
    threads, ids, ends = _others(api, reference)
    for params, field in KSERVE_REFUSALS:
        body = {"text_input": "Hello", "sampling_parameters": json.dumps(params)}
        status, answer = _generate(server, body)
        assert status == 400, (params, answer)
        assert field in answer["error"], (field, answer)
    # NaN is not JSON, but Python's json (and so a Triton client's string) writes it
    status, answer = _generate(
        server, {"text_input": "Hello", "sampling_parameters": '{"temperature": NaN}'}
    )
    assert status == 400 and "temperature" in answer["error"], answer
    # the single inputs too: a negative seed is served (a 64-bit seed), an over-wide one not
    status, answer = _generate(
        server, {"text_input": "Hello", "max_tokens": 4, "seed": -1, "temperature": 0.8}
    )
    assert status == 200, answer
    _check_others(reference, threads, ids, ends, None)
