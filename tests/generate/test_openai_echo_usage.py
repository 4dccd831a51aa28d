"""Issue 62 point 5, as vLLM serves them: a completion's ``echo`` of a prompt given as token ids
shows its special tokens (vLLM decodes the ids with them: its test_echo_logprob_completion
compares the echo with ``tokenizer.decode(prompt)``), and ``stream_options.continuous_usage_stats``
puts the counts so far on every chunk. A real server on tiny-llama (its tokenizer adds a BOS,
``<|begin_of_text|>``) and the tiny decoder (whose NUMPY decoder scores its prompt, for echo's
logprobs; its BOS ``<|bos|>`` sent as an id), the official client."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
pytest.importorskip("torch")

import llm  # noqa: E402
from openai_serving import client, serving  # noqa: E402

MODEL = "llama"
BOS = "<|begin_of_text|>"
#: the tiny decoder (tests/support/tiny_decoder.py), and its special tokens
SCORED = "tiny"
TINY_BOS, TINY_USER = "<|bos|>", "<|user|>"
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
#: every answer runs to its max_tokens (the tiny model may pick its end of text early)
FULL = {"ignore_eos": True}


@pytest.fixture(scope="module")
def folder():
    try:
        return llm.hf_folder("tiny-llama")
    except Exception as exc:  # the test models are made by tests/support/llm.py
        pytest.skip(f"tiny-llama cannot be made here: {exc}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_decoder import write

    return write(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def api(folder, tiny):
    models = {
        MODEL: (folder, "TORCH", {"INFERENCE_NUM_THREADS": "1"}),
        SCORED: (tiny, "NUMPY"),
    }
    with serving(models) as running:
        yield client(running)


def _tokenizer(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return _tokenizer(folder)


def _ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=True).ids
    assert tokenizer.id_to_token(ids[0]) == BOS  # (the model's tokenizer adds it)
    return ids


def test_echo_of_token_ids_shows_their_special_tokens_as_vllm(api, tokenizer):
    ids = _ids(tokenizer, "Hello, my name is")
    shown = tokenizer.decode(ids, skip_special_tokens=False)  # what vLLM's test compares
    assert shown.startswith(BOS)
    plain = api.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    echoed = api.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == shown + plain.choices[0].text  # the answer unchanged


def test_echo_logprobs_name_the_special_tokens_the_text_shows(api, tiny):
    tokenizer = _tokenizer(tiny)
    ids = [tokenizer.token_to_id(TINY_BOS), tokenizer.token_to_id(TINY_USER)]
    ids += tokenizer.encode("hello there", add_special_tokens=False).ids
    shown = tokenizer.decode(ids, skip_special_tokens=False)
    assert shown == TINY_BOS + TINY_USER + "hello there"
    plain = api.completions.create(model=SCORED, prompt=ids, max_tokens=4, temperature=0)
    echoed = api.completions.create(
        model=SCORED, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    assert choice.text == shown + plain.choices[0].text
    logprobs = choice.logprobs
    generated = echoed.usage.completion_tokens
    assert len(logprobs.tokens) == len(ids) + generated
    assert logprobs.tokens[:2] == [TINY_BOS, TINY_USER]
    assert "".join(logprobs.tokens[: len(ids)]) == shown  # one entry per prompt token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v is not None for v in logprobs.token_logprobs[1:])
    offsets = logprobs.text_offset
    assert offsets == [sum(len(t) for t in logprobs.tokens[:k]) for k in range(len(offsets))]
    assert choice.text[offsets[len(ids)] :] == plain.choices[0].text


def test_echo_only_and_streamed_echo_show_them_too(api, tokenizer):
    ids = _ids(tokenizer, "Once upon")
    shown = tokenizer.decode(ids, skip_special_tokens=False)
    only = api.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True)
    assert only.choices[0].text == shown
    whole = api.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    stream = api.completions.create(
        model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream]
    assert pieces[0].startswith(shown)
    assert "".join(pieces) == whole.choices[0].text


def test_echo_of_a_text_prompt_is_the_text_as_given(api):
    # vLLM's: the text the caller sent, without the BOS its tokenizing added
    prompt = "Hello, my name is"
    echoed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True)
    assert echoed.choices[0].text == prompt


def _counted(chunks) -> tuple[list, object]:
    """The chunks with choices and the final usage chunk (choices empty), checking that
    every chunk carries a usage that adds up."""
    chunks = list(chunks)
    assert chunks and all(c.usage is not None for c in chunks), chunks
    for chunk in chunks:
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    *answer, final = chunks
    assert final.choices == [] and all(c.choices for c in answer)
    return answer, final.usage


def _pair(usage) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_continuous_usage_on_every_completion_chunk(api):
    stream = api.completions.create(
        model=MODEL, prompt="Count: one, two", max_tokens=6, temperature=0, stream=True,
        stream_options=CONTINUOUS, extra_body=FULL,
    )  # fmt: skip
    answer, final = _counted(stream)
    done = [c.usage.completion_tokens for c in answer]
    assert done == sorted(done) and done[0] >= 1 and len(set(done)) == len(done)
    assert {c.usage.prompt_tokens for c in answer} == {final.prompt_tokens}
    assert _pair(answer[-1].usage) == _pair(final)
    assert final.completion_tokens == 6


def test_continuous_usage_on_every_chat_chunk(api):
    stream = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        temperature=0, stream=True, stream_options=CONTINUOUS, extra_body=FULL,
    )  # fmt: skip
    answer, final = _counted(stream)
    assert answer[0].choices[0].delta.role == "assistant"
    assert answer[0].usage.completion_tokens == 0  # the role's chunk, as vLLM's
    done = [c.usage.completion_tokens for c in answer]
    assert done == sorted(done) and done[-1] == final.completion_tokens == 5
    assert {c.usage.prompt_tokens for c in answer} == {final.prompt_tokens}
    assert _pair(answer[-1].usage) == _pair(final)


def test_continuous_usage_counts_each_prompt_and_choice(api):
    prompts = ["Hi", "A longer prompt than that"]
    stream = api.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, stream=True,
        stream_options=CONTINUOUS, extra_body=FULL,
    )  # fmt: skip
    answer, final = _counted(stream)
    sizes = {}
    for chunk in answer:
        sizes.setdefault(chunk.choices[0].index, set()).add(chunk.usage.prompt_tokens)
    assert sorted(sizes) == [0, 1] and all(len(s) == 1 for s in sizes.values())
    assert sum(next(iter(s)) for s in sizes.values()) == final.prompt_tokens
    assert final.completion_tokens == 6


def test_continuous_usage_needs_include_usage_as_vllms(api):
    for options in (
        {"continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
    ):
        stream = api.completions.create(
            model=MODEL, prompt="Hi", max_tokens=3, stream=True, stream_options=options
        )
        assert all(chunk.usage is None for chunk in stream)
    with pytest.raises(openai.BadRequestError):  # stream_options without a stream
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream_options=CONTINUOUS)
