"""vLLM's chat ``echo`` and ``--served-model-name`` (issue 50: vLLM's echo tests run unchanged,
tests/openai_conformance/test_vllm_openai.py), checked here without vLLM's files: a real
server on a tiny decoder, the official client."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402

MODEL = "tiny"
ALIAS = "facebook/opt-125m"
SAYING = "An apple a day, keeps"
CHAT = [{"role": "user", "content": "a saying"}, {"role": "assistant", "content": SAYING}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tiny_decoder import write

    folder = write(tmp_path_factory.mktemp("tiny") / "model")
    with serving({MODEL: (folder, "NUMPY")}, "--served-model-name", f"{ALIAS}={MODEL}") as running:
        yield client(running)


def _chat(api, echo: bool, messages=CHAT, **fields):
    return api.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={**CONTINUE, "echo": echo},
        **fields,
    )


def test_chat_echo_puts_the_continued_message_ahead_of_the_answer(api):
    plain = _chat(api, echo=False).choices[0].message.content
    echoed = _chat(api, echo=True).choices[0].message.content
    assert plain and SAYING not in plain
    assert echoed == SAYING + plain


def test_streamed_chat_echo_comes_first_and_matches(api):
    plain = _chat(api, echo=False).choices[0].message.content
    deltas = [c.choices[0].delta.content or "" for c in _chat(api, echo=True, stream=True)]
    assert deltas[0] == SAYING
    assert "".join(deltas) == SAYING + plain


def test_chat_echo_echoes_only_an_assistant_message(api):
    user_last = [{"role": "user", "content": "a saying"}]
    answer = api.chat.completions.create(
        model=MODEL, messages=user_last, max_tokens=5, temperature=0, extra_body={"echo": True}
    )
    plain = api.chat.completions.create(
        model=MODEL, messages=user_last, max_tokens=5, temperature=0
    )
    assert answer.choices[0].message.content == plain.choices[0].message.content


def test_served_model_name_serves_the_model_under_a_hugging_face_id(api):
    ids = {card.id for card in api.models.list().data}
    assert {MODEL, ALIAS} <= ids
    by_alias = api.completions.create(model=ALIAS, prompt="Hi", max_tokens=4, temperature=0)
    by_name = api.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert by_alias.choices[0].text == by_name.choices[0].text
    assert (by_alias.model, by_name.model) == (ALIAS, MODEL)  # each as it was asked for
    streamed = api.completions.create(model=ALIAS, prompt="Hi", max_tokens=2, stream=True)
    assert {chunk.model for chunk in streamed} == {ALIAS}
    assert by_alias.choices[0].prompt_logprobs is None  # vLLM's key, null when not asked
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="facebook/other", prompt="Hi", max_tokens=1)
