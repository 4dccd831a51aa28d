"""OpenAI's Responses API (server/protocols/openai/responses.py) against a real server, with the
real ``openai`` SDK: create from a string and from items (messages, function calls and their
outputs), streamed (``responses.stream`` accumulates the events into the same response),
``previous_response_id``, retrieve and delete, ``store: false``, the store's bounds (entries,
bytes; a deep chain ends in a 400, not a growing prompt), and a 400 naming each refused field.

The model is tests/support/tiny_decoder.py's (made in code, no exporter): its answers are fixed
by its seed, it never ends a sequence itself (so a plain answer runs to ``max_output_tokens``:
``incomplete``, as OpenAI says), and a ``text.format`` schema ends one (``completed``). Every
responses answer is checked against the chat route's answer to the same conversation (greedy),
which is what the route must be: the chat path run on the items.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402

MODEL = "tiny"
ENTRIES = 6
STORE_BYTES = 40 << 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_decoder import write

    return write(tmp_path_factory.mktemp("responses") / "tiny", context=2048, long_token=8)


@pytest.fixture(scope="module")
def server(folder):
    args = ("--responses-store-entries", str(ENTRIES), "--responses-store-bytes", str(STORE_BYTES))
    with serving({MODEL: (folder, "NUMPY")}, *args) as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    return client(server)


def _chat(api, messages, **kwargs) -> str:
    answer = api.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)
    return answer.choices[0].message.content


ENUM = {
    "format": {
        "type": "json_schema",
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    }
}


def test_a_string_input_with_instructions_is_the_chat_of_them(api):
    response = api.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", temperature=0,
        max_output_tokens=6,
    )  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"  # the tiny model never ends by itself
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens == 6
    assert response.instructions == "Be brief."
    chat = _chat(
        api,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=6,
    )
    assert response.output_text == chat and chat


def test_v3_serves_the_same_routes(server):
    v3 = client(server, "/v3")
    response = v3.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    assert v3.responses.retrieve(response.id).output_text == response.output_text


def test_items_render_as_chat_messages_with_tool_calls_and_outputs(api):
    tools = [
        {
            "type": "function",
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
    ]
    response = api.responses.create(
        model=MODEL, input=items, tools=tools, temperature=0, max_output_tokens=5
    )
    assert response.tools[0].name == "weather"
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}
    ]
    assert response.output_text == _chat(api, messages, max_tokens=5, tools=chat_tools)


def test_top_logprobs_are_chats_in_the_output_text(api):
    response = api.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, temperature=0, top_logprobs=2
    )
    entries = response.output[0].content[0].logprobs
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    expected = chat.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in expected]
    assert all(len(e.top_logprobs) == 2 for e in entries) and len(entries) == 4
    events = list(
        api.responses.create(
            model=MODEL, input="Hi", max_output_tokens=4, temperature=0, stream=True,
            include=["message.output_text.logprobs"],
        )
    )  # fmt: skip
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in expected]


def test_text_format_makes_a_completed_json_answer(api):
    response = api.responses.create(model=MODEL, input="Is it?", text=ENUM, max_output_tokens=64)
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"ok"}


def test_a_stream_is_the_events_the_sdk_accumulates(api):
    with api.responses.stream(
        model=MODEL, input="Is it?", text=ENUM, max_output_tokens=64, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and json.loads(deltas)["ok"] in (True, False)
    assert final.status == "completed" and final.usage.output_tokens > 0
    # the same answer as not streamed, and kept: GET returns the final response
    whole = api.responses.create(
        model=MODEL, input="Is it?", text=ENUM, max_output_tokens=64, temperature=0
    )
    assert whole.output_text == final.output_text
    assert api.responses.retrieve(final.id).output_text == final.output_text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(api):
    stream = api.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.output_tokens == 4
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output[0].content[0].text == text


def test_previous_response_id_continues_the_conversation(api):
    first = api.responses.create(
        model=MODEL, input="Hi", instructions="Be brief.", temperature=0, max_output_tokens=4
    )
    second = api.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, temperature=0,
        max_output_tokens=4,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # the instructions are not carried over (OpenAI's rule)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.output_text == _chat(api, messages, max_tokens=4)


def test_retrieve_delete_and_store_false(api):
    kept = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert api.responses.retrieve(kept.id).output_text == kept.output_text
    api.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError) as error:
        api.responses.create(model=MODEL, input="x", previous_response_id=kept.id)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(kept.id)
    unkept = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unkept.id)


def test_the_store_keeps_at_most_its_entries_and_bytes(api):
    ids = [
        api.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=1).id for i in range(10)
    ]
    kept = []
    for rid in ids:
        try:
            api.responses.retrieve(rid)
            kept.append(rid)
        except openai.NotFoundError:
            pass
    assert kept == ids[-ENTRIES:]  # the oldest went first
    # large ones: the bytes bound keeps fewer (each ~3 x (its 1.5 KB prompt + 1 KB body))
    big = "word " * 300
    ids = [api.responses.create(model=MODEL, input=big, max_output_tokens=1).id for _ in range(8)]
    kept = []
    for rid in ids:
        try:
            api.responses.retrieve(rid)
            kept.append(rid)
        except openai.NotFoundError:
            pass
    assert kept and len(kept) < ENTRIES and kept == ids[-len(kept) :]


def test_a_deep_chain_ends_in_a_400_when_its_conversation_cannot_fit(api, server):
    previous = None
    turn = "tell me more about it " * 10
    depth = 0
    for depth in range(200):  # noqa: B007  # read after the loop
        try:
            response = api.responses.create(
                model=MODEL, input=turn, previous_response_id=previous, max_output_tokens=8
            )
        except openai.BadRequestError as error:
            assert error.body["param"] in ("input", "max_output_tokens")
            break
        previous = response.id
    else:
        pytest.fail("a chain of 200 turns never passed the model's context of 2048 tokens")
    assert 2 < depth < 20
    # the server still answers
    assert api.responses.create(model=MODEL, input="Hi", max_output_tokens=1).status


REFUSED = [
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        "text.format",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": "x " * 5000}, "input"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[p for _f, p in REFUSED])
def test_each_refused_field_is_a_400_naming_it(api, fields, param):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        api.post("/responses", body=body, cast_to=openai.types.responses.Response)
    assert error.value.body["param"] == param, error.value.body


def _post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_tokenize_and_detokenize_as_vllm(server, folder):
    from plugserve.server.apps.generate.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    url = server.http_url
    _, answer = _post(f"{url}/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert answer["tokens"] == tokenizer.encode("Hello world")
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 2048
    _, plain = _post(
        f"{url}/tokenize", {"model": MODEL, "prompt": "Hello world", "add_special_tokens": False}
    )
    assert plain["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    _, chat = _post(
        f"{url}/tokenize", {"model": MODEL, "messages": messages, "return_token_strs": True}
    )
    rendered = tokenizer.apply_chat_template(messages)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert len(chat["token_strs"]) == chat["count"]
    status, back = _post(f"{url}/detokenize", {"model": MODEL, "tokens": chat["tokens"]})
    assert status == 200 and back == {"prompt": rendered}
    for route, body, param in (
        ("tokenize", {"model": MODEL, "prompt": "x" * 100_000}, "prompt"),
        ("tokenize", {"model": MODEL, "messages": [{"role": "x", "content": "y"}]},
         "messages[0].role"),
        ("detokenize", {"model": MODEL, "tokens": [10**6]}, "tokens"),
        ("detokenize", {"model": MODEL, "tokens": [1] * 5000}, "tokens"),
        ("tokenize", {"model": "nope", "prompt": "x"}, "model"),
    ):  # fmt: skip
        status, refused = _post(f"{url}/{route}", body)
        assert status in (400, 404), refused
        assert refused["error"]["param"] == param


def test_the_store_charges_the_memory_budget_and_gives_it_back():
    """The store against the server's real budget object: what it keeps is charged, a full
    budget evicts the oldest for a new one, a response larger than the store is not kept, an
    expired one is gone, and clearing gives every byte back."""
    import time

    from plugserve.server.plane.budget import MemoryBudget
    from plugserve.server.protocols.openai.responses_store import ResponseStore

    budget = MemoryBudget(100_000)
    store = ResponseStore(budget, max_entries=100, max_bytes=1 << 20, max_age_s=0)
    body = {"output": "x" * 5000}
    for i in range(10):
        assert store.put(f"r{i}", body, [{"role": "user", "content": "hi"}])
    assert budget.used == store.nbytes <= budget.limit
    assert 0 < len(store) < 10 and store.get("r9") and not store.get("r0")
    other = budget.charge(budget.limit - budget.used, "another request")  # the budget is full
    assert store.put("r10", body, []) and store.get("r10")  # the store made room of its own
    other.release()
    assert not ResponseStore(budget, 10, 1000, 0).put("big", body, [])  # larger than its store
    store.clear()
    assert budget.used == 0 and store.nbytes == 0
    aging = ResponseStore(budget, 10, 1 << 20, max_age_s=0.05)
    assert aging.put("old", body, [])
    time.sleep(0.2)
    assert aging.get("old") is None and budget.used == 0


def test_tokens_govern_the_new_routes_as_generating(folder, tmp_path):
    """With --auth-tokens, /v1/responses (create, retrieve, delete) and /tokenize take an
    ``infer`` token as generating does; none or a wrong one is 401."""
    import urllib.error
    import urllib.request

    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-infer infer\n")
    tokens.chmod(0o600)
    with serving({MODEL: (folder, "NUMPY")}, "--auth-tokens", str(tokens)) as running:
        allowed = client(running, api_key="s3cret-infer")
        made = allowed.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
        assert allowed.responses.retrieve(made.id).id == made.id
        wrong = client(running, api_key="wrong")
        for call in (
            lambda: wrong.responses.create(model=MODEL, input="Hi", max_output_tokens=2),
            lambda: wrong.responses.retrieve(made.id),
            lambda: wrong.responses.delete(made.id),
        ):
            with pytest.raises(openai.AuthenticationError):
                call()
        allowed.responses.delete(made.id)
        for token, status in (("s3cret-infer", 200), (None, 401)):
            request = urllib.request.Request(
                f"{running.http_url}/tokenize",
                json.dumps({"model": MODEL, "prompt": "Hi"}).encode(),
                {"content-type": "application/json"},
            )
            if token:
                request.add_header("authorization", f"Bearer {token}")
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    assert answer.status == status
            except urllib.error.HTTPError as error:
                assert error.code == status


def test_streamed_tool_calls_and_reasoning_reach_the_sdk_as_items():
    """The seam the chat path's tool-call and reasoning parsers feed (responses_output.py):
    chat deltas as vLLM streams them (reasoning, then text, then two calls, each its id and
    name first and its arguments in pieces) made into events by EventStream and read by the
    ``openai`` SDK's own accumulator, which must end with the same items as the whole
    answer's output_items."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from plugserve.server.protocols.openai.responses_output import EventStream, output_items

    def delta(**fields):
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    def call(index, **fields):
        return delta(tool_calls=[{"index": index, **fields}])

    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        delta(reasoning_content="I should "),
        delta(reasoning_content="look it up."),
        delta(content="Checking."),
        call(0, id="call_a", type="function", function={"name": "weather", "arguments": ""}),
        call(0, function={"arguments": '{"city": '}),
        call(0, function={"arguments": '"Paris"}'}),
        call(1, id="call_b", type="function", function={"name": "time", "arguments": "{}"}),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
    ]
    echo = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    events = EventStream("resp_x", 0, MODEL, echo)
    raw = list(events.opening())
    for chunk in chunks:
        raw += events.chunk(chunk)
    raw += events.closing()
    state = ResponseStreamState(
        input_tools=[], text_format=getattr(openai, "omit", openai.NOT_GIVEN)
    )
    for piece in raw:
        data = piece.split(b"data: ", 1)[1]
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(data)))
    final = state._completed_response
    assert final is not None and final.status == "completed"
    kinds = [item.type for item in final.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "I should look it up."
    assert final.output_text == "Checking."
    calls = [(i.call_id, i.name, json.loads(i.arguments)) for i in final.output[2:]]
    assert calls == [("call_a", "weather", {"city": "Paris"}), ("call_b", "time", {})]
    assert final.usage.output_tokens == 9
    whole = output_items(
        "Checking.",
        [
            {"id": "call_a", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "function": {"name": "time", "arguments": "{}"}},
        ],
        "I should look it up.",
    )
    assert [i["type"] for i in whole] == kinds
    assert [(i["call_id"], i["name"]) for i in whole[2:]] == [c[:2] for c in calls]


def test_a_stream_failing_midway_ends_with_response_failed(tmp_path):
    """The status line is out when the request passes --max-request-seconds mid-answer: the
    stream's last event is ``response.failed`` with the error, and nothing is kept."""
    from tiny_decoder import write

    # 16,000 tokens take ~5 s here (4,000 took 1.4 s, and under the 1 s bound on CI's machine)
    slow = write(tmp_path / "slow", context=16384, long_token=8, width=4096)
    with serving({MODEL: (slow, "NUMPY")}, "--max-request-seconds", "1") as running:
        api = client(running, timeout=120)
        events = list(
            api.responses.create(model=MODEL, input="Hi", max_output_tokens=16000, stream=True)
        )
        last = events[-1]
        assert last.type == "response.failed", [e.type for e in events[-3:]]
        assert last.response.status == "failed" and last.response.error.message
        assert [e.sequence_number for e in events] == list(range(len(events)))
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(last.response.id)


def test_input_items_list_a_page_at_a_time_as_openai(api):
    """``client.responses.input_items.list``: the request's input items with ids, newest
    first by default, ``limit``/``order``/``after`` paging with ``has_more``, ``first_id`` and
    ``last_id``; the SDK's auto-pagination walks every page."""
    items = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"role": "user", "content": "And?"},
    ]
    kept = api.responses.create(model=MODEL, input=items, max_output_tokens=2)
    page = api.responses.input_items.list(kept.id)
    assert page.object == "list" and page.has_more is False
    assert [i.type for i in page.data] == [
        "message",
        "function_call_output",
        "function_call",
        "message",
        "message",
    ]
    assert page.data[0].content[0].text == "And?" and page.data[0].role == "user"
    assert page.data[2].call_id == "call_1" and page.data[1].output == "42"
    ids = [i.id for i in page.data]
    assert len(set(ids)) == 5 and (page.first_id, page.last_id) == (ids[0], ids[-1])
    first = api.responses.input_items.list(kept.id, limit=2, order="asc")
    assert [i.id for i in first.data] == ids[::-1][:2] and first.has_more is True
    rest = api.responses.input_items.list(kept.id, limit=2, order="asc", after=first.last_id)
    assert [i.id for i in rest.data] == ids[::-1][2:4] and rest.has_more is True
    walked = [i.id for i in api.responses.input_items.list(kept.id, limit=2)]
    assert walked == ids  # every page, by the SDK's cursor
    only = api.responses.input_items.list(
        api.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id
    )
    assert [(i.role, i.content[0].type, i.content[0].text) for i in only.data] == [
        ("user", "input_text", "Hi")
    ]
    for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "msg_nope"}):
        with pytest.raises(openai.BadRequestError) as error:
            api.responses.input_items.list(kept.id, **bad)
        assert error.value.body["param"] == next(iter(bad))
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list("resp_unknown")


def test_cancel_answers_as_openai_for_a_foreground_response(api):
    """No response runs in the background here (``background: true`` is a 400 at create), so
    cancel answers what OpenAI answers for a foreground response: a 400; an unknown id 404;
    delete still deletes."""
    kept = api.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as error:
        api.responses.cancel(kept.id)
    assert "background" in error.value.message
    with pytest.raises(openai.NotFoundError):
        api.responses.cancel("resp_unknown")
    with pytest.raises(openai.BadRequestError) as error:
        api.responses.create(model=MODEL, input="Hi", background=True)
    assert error.value.body["param"] == "background"
    assert api.responses.retrieve(kept.id).status == kept.status  # not changed by cancel
    api.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.input_items.list(kept.id)


#: what the scripted models write (tests/support/scripted_decoder.py): a Qwen3 thinker's
#: reasoning and one call, a Qwen2.5 caller's text and two calls
THINKS = (
    "<think>\nThe user asks about Paris. I should call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>"
)
CALLS = (
    'I will check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
)
WEATHER_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from scripted_decoder import write

    root = tmp_path_factory.mktemp("scripted")
    entries = {
        "thinker": (write(root / "thinker", "qwen3", THINKS), "NUMPY"),
        "caller": (write(root / "caller", "qwen2_5", CALLS), "NUMPY"),
    }
    with serving(entries) as running:
        yield client(running, timeout=120)


def _items(response) -> list[tuple]:
    """Each output item's kind and what it says (ids left out: each response makes its own)."""
    made = []
    for item in response.output:
        if item.type == "function_call":
            made.append((item.type, item.name, json.loads(item.arguments)))
        else:
            made.append((item.type, "".join(part.text for part in item.content)))
    return made


@pytest.mark.parametrize(
    ("model", "kinds"),
    [("thinker", ["reasoning", "function_call"]), ("caller", ["message", *["function_call"] * 2])],
)
def test_a_streamed_answer_with_reasoning_and_calls_ends_with_the_whole_ones_items(
    scripted, model, kinds
):
    """A real server's stream through the chat path's parsers (reasoning split out, calls
    read: the answer's typed pieces, each face's own events): the ``openai`` SDK's
    accumulated response holds the items the whole response does, its calls' arguments the
    join of their deltas."""
    ask = dict(model=model, input="What is the weather in Paris?", tools=WEATHER_TOOLS)
    whole = scripted.responses.create(**ask, max_output_tokens=300)
    with scripted.responses.stream(**ask, max_output_tokens=300) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [item.type for item in whole.output] == kinds
    assert _items(final) == _items(whole)
    assert ("function_call", "get_weather", {"city": "Paris", "days": 3}) in _items(final)
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    calls = [item.arguments for item in final.output if item.type == "function_call"]
    assert "".join(arguments) == "".join(calls)
    assert final.status == whole.status == "completed"


def test_a_refusal_names_the_responses_field_in_its_message_too(api):
    """A chat check refuses a Responses field: its ``param`` and its message name the
    Responses field. Before, the message said ``'max_completion_tokens'``."""
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(model=MODEL, input="Hi", max_output_tokens=0)
    error = refused.value.body
    assert error["param"] == "max_output_tokens", error
    assert "'max_output_tokens'" in error["message"], error
    assert "max_completion_tokens" not in error["message"], error
