"""``--max-logprobs`` (vLLM's flag) against real servers with the ``openai`` SDK: the bound on
chat's ``top_logprobs``, completions' ``logprobs`` and vLLM's ``prompt_logprobs``, and their
-1 (the whole vocabulary), allowed only when the bound reaches the vocabulary's size (vLLM's
rule); a count above the bound a 400 naming the field and the bound; -1's answer charged to
``--max-inflight-bytes`` as the vocabulary's size before it starts (refused 429 when it cannot
fit, the server serving on); chat's ``logprobs`` read as vLLM's pydantic model reads a boolean
(``"true"``, vLLM's test sends it), every other boolean field strict.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "user", "content": "the cat sat on a mat"}]
#: the raised server's budget: a -1 answer of 4096 tokens (~600 bytes per alternative per
#: token, the tiny vocabulary of 262: ~640 MB) cannot fit, one of 2 tokens (~320 KB) does
BUDGET = 4_000_000


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_decoder import write

    return write(tmp_path_factory.mktemp("max-logprobs") / "tiny", context=8192)


@pytest.fixture(scope="module")
def vocab(folder) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def default_api(folder):
    """A server with the default bound, OpenAI's 20."""
    with serving({MODEL: (folder, "NUMPY")}) as running:
        yield client(running, timeout=300)


@pytest.fixture(scope="module")
def raised(folder):
    """A server whose bound is the vocabulary (-1) under a small memory budget and a small
    bound on unread events."""
    args = ["--max-logprobs", "-1", "--max-inflight-bytes", str(BUDGET)]
    # events of a whole vocabulary's alternatives (~30 KB a token, the prompt's ~1 MB) are
    # past this bound on unread events, which admits the request's largest event besides
    args += ["--max-inflight-bytes-per-peer", "0", "--max-stream-unread-bytes", "16384"]
    with serving({MODEL: (folder, "NUMPY")}, *args) as running:
        yield running


@pytest.fixture(scope="module")
def raised_api(raised):
    return client(raised, timeout=300)


def _refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as error:
        call()
    assert error.value.body["param"] == param, error.value.body
    return error.value.body["message"]


# --- the default bound: -1 and 21 refused, naming the field and the bound


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"logprobs": 6}, "logprobs"),  # OpenAI's 5 under the default
    ],
)
def test_the_default_bound_refuses_the_whole_vocabulary(default_api, kind, fields, param):
    if kind == "chat":
        message = _refused(
            lambda: default_api.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2, extra_body=fields
            ),
            param,
        )
    else:
        message = _refused(
            lambda: default_api.completions.create(
                model=MODEL, prompt="the cat", max_tokens=2, extra_body=fields
            ),
            param,
        )
    bound = "5" if kind == "completions" and "logprobs" in fields else "20"
    assert f"max allowed: {bound}" in message and "--max-logprobs" in message, message


@pytest.mark.parametrize("value", [-2, 1.5, "3"])
def test_a_count_neither_minus_one_nor_natural_is_refused(default_api, value):
    _refused(
        lambda: default_api.completions.create(
            model=MODEL, prompt="the cat", max_tokens=2, extra_body={"prompt_logprobs": value}
        ),
        "prompt_logprobs",
    )


# --- chat's logprobs read as pydantic's lax boolean; the others strict


@pytest.mark.parametrize(("value", "asked"), [("true", True), ("TRUE", True), ("1", True),
                                              ("yes", True), (1, True), ("false", False),
                                              ("0", False), ("off", False)])  # fmt: skip
def test_chat_logprobs_reads_a_lax_boolean(default_api, value, asked):
    answer = default_api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
        extra_body={"logprobs": value, **({"top_logprobs": 3} if asked else {})},
    )  # fmt: skip
    logprobs = answer.choices[0].logprobs
    if asked:
        assert [len(t.top_logprobs) for t in logprobs.content] == [3, 3]
    else:
        assert logprobs is None


@pytest.mark.parametrize(
    "fields",
    [{"logprobs": "maybe"}, {"logprobs": 2}, {"logprobs": " true"}, {"echo": "true"}],
)
def test_other_values_and_other_boolean_fields_stay_strict(default_api, fields):
    _refused(
        lambda: default_api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body=fields
        ),
        next(iter(fields)),
    )


# --- raised to the vocabulary: -1 served whole, above it refused, the budget charged


def test_minus_one_is_the_whole_vocabulary_when_the_bound_allows_it(raised_api, vocab):
    # 3 tokens: an event past the bound on unread events that is not the last would cancel
    # the request (the last is delivered whatever its size)
    chat = raised_api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3,
        extra_body={"top_logprobs": -1, "logprobs": "true", "ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert [len(t.top_logprobs) for t in content] == [vocab] * 3
    scored = raised_api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3,
        extra_body={"prompt_logprobs": -1, "ignore_eos": True},
    )  # fmt: skip
    prompt = scored.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) > 1
    assert all(len(entry) >= vocab for entry in prompt[1:])  # the chosen one's rank too
    text = raised_api.completions.create(model=MODEL, prompt="the cat", max_tokens=1, logprobs=-1)
    # completions key alternatives by their text, and the byte-level tokens past ASCII share
    # one (U+FFFD): fewer keys than tokens, but far past the default bound
    alternatives = text.choices[0].logprobs.top_logprobs[0]
    assert 100 < len(alternatives) <= vocab, len(alternatives)


def test_above_the_raised_bound_is_refused_naming_it(raised_api, vocab):
    message = _refused(
        lambda: raised_api.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=1,
            extra_body={"logprobs": True, "top_logprobs": vocab + 1},
        ),
        "top_logprobs",
    )
    assert f"max allowed: {vocab}" in message, message


def test_the_whole_vocabulary_is_charged_to_the_budget(raised, raised_api):
    with pytest.raises(openai.RateLimitError) as error:
        raised_api.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4096,
            extra_body={"logprobs": True, "top_logprobs": -1, "ignore_eos": True},
        )  # fmt: skip
    assert "max-inflight-bytes" in error.value.body["message"], error.value.body
    assert raised.process.poll() is None
    after = raised_api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, extra_body={"logprobs": True, "top_logprobs": 2}
    )
    assert [len(t.top_logprobs) for t in after.choices[0].logprobs.content] == [2, 2]


def test_a_streamed_responses_answer_is_charged_whole_as_it_keeps_it(raised, raised_api):
    """A streamed chat answer holds two tokens at a time (the stream's own bound holds the
    rest), but a streamed Responses answer keeps its text and logprobs for its closing events:
    charged whole, it is refused where the chat stream of the same size is served (16 of them
    had grown a server 1.1 GB against a 64 MiB budget, charged two tokens each)."""
    fields = {"ignore_eos": True}
    chat = raised_api.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1000, stream=True, logprobs=True,
        top_logprobs=20, extra_body=fields,
    )  # fmt: skip
    chat.close()  # admitted (its 200 and headers came); read whole, it outruns this reader
    with pytest.raises(openai.RateLimitError) as error:
        raised_api.responses.create(
            model=MODEL, input="the cat sat on a mat", max_output_tokens=1000, stream=True,
            extra_body={"top_logprobs": 20, **fields},
        )  # fmt: skip
    assert "max-inflight-bytes" in error.value.body["message"], error.value.body
    small = raised_api.responses.create(
        model=MODEL, input="the cat sat on a mat", max_output_tokens=20, stream=True,
        extra_body={"top_logprobs": 2, **fields},  # (small events: the bound on unread ones)
    )  # fmt: skip
    events = list(small)  # served whole: 20 tokens, their logprobs in the closing events
    assert events[-1].type == "response.incomplete", events[-1].response.error
    text_done = [e for e in events if e.type == "response.output_text.done"]
    assert len(text_done) == 1 and len(text_done[0].logprobs) == 20, text_done
    assert raised.process.poll() is None


def test_a_refusal_does_not_tell_what_other_requests_hold(raised, raised_api):
    """The budget's 429 names the request's own size and the limit, never what the requests
    in flight hold: with tokens those are other tenants', whose sizes (n x max_tokens) a red
    team read off the figure, polling it. The refusal while another answer is held (its bytes
    on /metrics) is word for word the refusal on an idle server."""
    import contextlib
    import threading

    from openai_serving import metric

    def refused() -> str:
        with pytest.raises(openai.RateLimitError) as error:
            raised_api.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4096,
                extra_body={"logprobs": True, "top_logprobs": -1, "ignore_eos": True},
            )  # fmt: skip
        return error.value.body["message"]

    idle = refused()

    def hold() -> None:  # (its end does not matter: this server's bound on unread events is
        # small, and a long answer may outrun its gathering; it is held while it runs)
        with contextlib.suppress(openai.APIError):
            raised_api.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=3000, extra_body={"ignore_eos": True}
            )

    other = threading.Thread(target=hold)
    other.start()
    try:
        held = 0.0
        for _ in range(200):  # until the other answer's charge is in flight
            held = metric(raised, "plugserve_inflight_bytes", "")
            if held:
                break
        busy = refused()
        still = metric(raised, "plugserve_inflight_bytes", "")
    finally:
        other.join(120)
    assert held and still, (held, still)  # the refusal came while the other was held
    assert busy == idle, (busy, idle)
    assert "max-inflight-bytes" in busy, busy
