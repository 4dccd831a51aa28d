"""A plain stream's chunks (no logprobs, token ids, echo or parsed output) are written from a
template made once per request (``_Answer._plain_template`` in
``server/protocols/openai/serving.py``: the HTTP thread's share per streamed token): they must
be byte for byte the chunks the general path dumps from a dict, for chat and completions, with
and without the usage key, whatever the text, the model's name or the finish. The streams
themselves (order, usage chunk, ``[DONE]``) are checked end to end by the OpenAI tests
(test_openai_generate.py, tests/openai_conformance)."""

from __future__ import annotations

import orjson
import pytest

from plugserve.server.apps.generate.types import GenerationEvent
from plugserve.server.protocols.openai import answer as answers
from plugserve.server.protocols.openai import protocol

TEXTS = ["", "a", " the", 'quote " and \\ back', "line\nbreak\t", "100% %d %s %b", "é 漢字 🙂",
         "\x00\x1f control", "</s>"]  # fmt: skip


def _answers(kind: str, body: dict) -> tuple[answers.Answer, answers.Answer]:
    """Two answers to one request: the template's and the general path's (template off)."""
    parse = protocol.chat_request if kind == "chat" else protocol.completion_request
    made = []
    for _ in range(2):
        ask = parse(dict(body))
        answer = answers.Answer(None, ask, kind, "cmpl-x%d", [[1, 2, 3]], False)  # type: ignore[arg-type]
        made.append(answer)
    made[1]._template = b""  # the dict's path
    return made[0], made[1]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("model", ["decoder", 'm%d "x" \\ é'])
def test_template_chunks_are_the_dicts_bytes(kind, usage, model):
    body: dict = {"model": model, "stream": True, "n": 2}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    if usage:
        body["stream_options"] = {"include_usage": True}
    fast, slow = _answers(kind, body)
    assert fast._plain_template()  # a plain stream: the template is used
    assert fast.opening() == slow.opening()
    count = 0
    for step, text in enumerate(TEXTS):
        for index in range(2):
            finish = "length" if step == len(TEXTS) - 1 and index == 1 else None
            event = GenerationEvent(index, [7], text, finish_reason=finish,
                                    prompt_tokens=3, completion_tokens=step + 1)  # fmt: skip
            a, b = fast.chunk(0, event), slow.chunk(0, event)
            assert a == b, (a, b)
            if a is not None:
                count += 1
                assert a.startswith(b"data: ") and a.endswith(b"\n\n")
                orjson.loads(a[6:])
    assert count >= 2 * (len(TEXTS) - 1)
    assert fast.closing() == slow.closing()


def test_a_stream_asking_more_takes_the_general_path():
    def answer() -> answers.Answer:
        ask = protocol.completion_request({"model": "decoder", "stream": True, "prompt": "hi"})
        return answers.Answer(None, ask, "completion", "cmpl-1", [[1]], False)  # type: ignore[arg-type]

    assert answer()._plain_template()
    logprobs, echo, ids, prompt_only = answer(), answer(), answer(), answer()
    logprobs.names = {}  # (a tokenizer's names: logprobs asked)
    echo.echo = True
    ids.ask.return_token_ids = True
    prompt_only.prompt_only = True
    for made in (logprobs, echo, ids, prompt_only):
        assert made._plain_template() is None
