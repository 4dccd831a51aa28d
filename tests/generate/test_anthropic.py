"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) against a real
server, with the official ``anthropic`` SDK unchanged (issue 62, point 4; point 5's strict
forced arguments on both faces).

Models: a random-weight decoder (tests/support/tiny_decoder.py: one token per byte, never an
end of sequence, so an answer is ``max_tokens`` long and greedy answers repeat) for text,
streams, stop sequences and forced tool calls (constrained decoding makes them valid whatever
the weights say); scripted decoders (tests/support/scripted_decoder.py: a family's real chat
template and markers, a fixed answer) for what a random model never writes: an end of turn,
the model's own tool calls (``auto``), an answer to a tool's result, reasoning.

This SDK's ``messages.create`` takes no ``temperature`` (2.x dropped the sampling fields);
the server reads it, sent as ``extra_body``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest

anthropic = pytest.importorskip("anthropic", reason="pip install anthropic (the test extra)")
openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")

from openai_serving import client, serving  # noqa: E402
from scripted_decoder import write  # noqa: E402
from tiny_decoder import write as write_tiny  # noqa: E402

CALLS = (
    'I will check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
)
THINKS = (
    "<think>\nThe user asks about Paris. I should call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>"
)
HELLO = "Hello there, friend."
AFTER_TOOL = "It is sunny in Paris, 21 C, for the next 3 days."
#: tools as Anthropic declares them; the schemas do not close their objects (point 5: a
#: forced call's grammar does), their strings are bounded so a random model's call ends
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
        },
    },
    {
        "name": "get_time",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"enum": ["Europe/Paris", "UTC"]}},
            "required": ["zone"],
        },
    },
]
DECLARED = {t["name"]: set(t["input_schema"]["properties"]) for t in TOOLS}
REQUIRED = {t["name"]: set(t["input_schema"]["required"]) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    entries = {
        "tiny": (write_tiny(root / "tiny", context=2048), "NUMPY"),
        "hello": (write(root / "hello", "qwen2_5", HELLO), "NUMPY"),
        "caller": (write(root / "caller", "qwen2_5", CALLS, after_tool=AFTER_TOOL), "NUMPY"),
        "thinker": (write(root / "thinker", "qwen3", THINKS), "NUMPY"),
    }
    with serving(entries) as running:
        yield running


def _sdk(server, api_key: str | None = "unused", **kwargs):
    return anthropic.Anthropic(
        base_url=server.http_url, api_key=api_key, max_retries=0, timeout=120, **kwargs
    )


@pytest.fixture(scope="module")
def sdk(server):
    return _sdk(server)


def _events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A streamed message's events as sent: (the ``event:`` line's name, the data)."""
    request = urllib.request.Request(
        server.http_url + "/v1/messages",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = reply.read().decode()
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        value = json.loads(data[len("data: ") :])
        assert value["type"] == name[len("event: ") :]
        events.append((value["type"], value))
    return events


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_answers_a_message_with_text_blocks_and_usage(sdk):
    message = sdk.messages.create(
        model="tiny", max_tokens=8, messages=ASK, system="Answer briefly.",
        metadata={"user_id": "u1"},
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and len(block.text) == 8  # a byte a token
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 0
    # system as text blocks renders as the string does: the same prompt
    again = sdk.messages.create(
        model="tiny", max_tokens=8, messages=ASK,
        system=[{"type": "text", "text": "Answer briefly."}],
    )  # fmt: skip
    assert (
        again.usage.input_tokens + again.usage.cache_read_input_tokens
        == message.usage.input_tokens + message.usage.cache_read_input_tokens
    )
    ended = sdk.messages.create(model="hello", max_tokens=64, messages=ASK)
    assert _text(ended) == HELLO and ended.stop_reason == "end_turn"
    assert ended.usage.output_tokens < 64


def test_an_assistant_prefill_is_continued(server, sdk):
    """A last assistant message is continued, as Anthropic's prefill (the answer holds the
    continuation only): vLLM's ``continue_final_message`` on the chat route, the same text."""
    prefill = [*ASK, {"role": "assistant", "content": "Sure, in Paris it is"}]
    message = sdk.messages.create(model="tiny", max_tokens=8, messages=prefill, extra_body=GREEDY)
    api = client(server, timeout=120)
    continued, new_turn = (
        api.chat.completions.create(
            model="tiny", messages=prefill, max_tokens=8, temperature=0,
            extra_body={"continue_final_message": flag, "add_generation_prompt": not flag},
        )
        for flag in (True, False)
    )  # fmt: skip
    assert _text(message) == continued.choices[0].message.content
    counted = sdk.messages.count_tokens(model="tiny", messages=prefill).input_tokens
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens
    # the same prompt as the continued chat's, not a new turn's (which ends in another header)
    assert counted == continued.usage.prompt_tokens < new_turn.usage.prompt_tokens


def test_a_stream_sends_anthropics_events_in_their_order(server, sdk):
    events = _events(server, {"model": "tiny", "max_tokens": 8, "messages": ASK})
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"], kinds
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"], kinds
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert (
        start["role"] == "assistant" and start["content"] == [] and start["id"].startswith("msg_")
    )
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta")
    assert all(e["delta"]["type"] == "text_delta" for k, e in events if k == "content_block_delta")
    assert len(text) == 8
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8
    # the SDK's stream helper: text deltas, the final message, its usage
    with sdk.messages.stream(model="tiny", max_tokens=12, messages=ASK) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 12 and "".join(pieces) == _text(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0


def test_stop_sequences_end_the_answer_and_are_named(sdk):
    whole = _text(sdk.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY))
    stop = whole[6:9]
    before = whole[: whole.index(stop)]
    ask = dict(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY)
    stops = [stop, "never-written"]
    message = sdk.messages.create(stop_sequences=stops, **ask)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == before
    with sdk.messages.stream(stop_sequences=stops, **ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == before and final.stop_sequence == stop
    assert final.stop_reason == "stop_sequence"
    # no stop sequence met: the answer runs to max_tokens, nothing cut
    other = sdk.messages.create(stop_sequences=["never-written"], **ask)
    assert _text(other) == whole and other.stop_reason == "max_tokens"


def test_output_config_format_is_constrained_decoding(sdk):
    """The SDK's ``messages.parse`` (``output_config.format``, a JSON schema) on a random model:
    the answer is JSON of the schema, parsed back by the SDK."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        sunny: bool
        unit: Literal["C", "F"]

    parsed = sdk.messages.parse(
        model="tiny", max_tokens=60, messages=ASK, output_format=Verdict, extra_body=GREEDY
    )
    assert isinstance(parsed.parsed_output, Verdict) and parsed.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError, match=r"output_config\.format"):
        sdk.messages.create(
            model="tiny", max_tokens=4, messages=ASK, output_config={"format": {"type": "xml"}}
        )  # type: ignore[typeddict-item]


def _tool_uses(message) -> list:
    uses = [b for b in message.content if b.type == "tool_use"]
    for use in uses:
        assert use.id.startswith("toolu_") and isinstance(use.input, dict)
        assert use.name in DECLARED
        # point 5: only the declared properties, the required ones there
        assert REQUIRED[use.name] <= set(use.input) <= DECLARED[use.name], use.input
    return uses


@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"]
)
def test_a_forced_tool_choice_gives_a_tool_use_block(sdk, choice):
    ask = dict(
        model="tiny", max_tokens=300, messages=ASK, tools=TOOLS, tool_choice=choice,
        extra_body=GREEDY,
    )  # fmt: skip
    message = sdk.messages.create(**ask)
    uses = _tool_uses(message)
    assert uses and message.stop_reason == "tool_use", message
    if choice["type"] == "tool":
        assert [u.name for u in uses] == ["get_weather"]
        assert 1 <= uses[0].input["days"] <= 9
    with sdk.messages.stream(**ask) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [(u.name, u.input) for u in _tool_uses(final)] == [(u.name, u.input) for u in uses]
    assert all(d.delta.type == "input_json_delta" for d in deltas)
    assert final.stop_reason == "tool_use"


def test_forced_arguments_hold_the_declared_keys_only_on_the_openai_face_too(server):
    """Point 5 on chat: ``required`` and a named function decode by the closed schema."""
    api = client(server, timeout=120)
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "parameters": t["input_schema"]},
        }
        for t in TOOLS
    ]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = api.chat.completions.create(
            model="tiny", messages=ASK, tools=tools, tool_choice=choice, temperature=0,
            max_tokens=300,
        )  # fmt: skip
        calls = answer.choices[0].message.tool_calls
        assert calls, answer
        for call in calls:
            arguments = json.loads(call.function.arguments)
            name = call.function.name
            assert REQUIRED[name] <= set(arguments) <= DECLARED[name], arguments


def test_tool_choice_auto_reads_the_models_own_calls(sdk):
    message = sdk.messages.create(model="caller", max_tokens=200, messages=ASK, tools=TOOLS)
    assert message.stop_reason == "tool_use"
    assert message.content[0].type == "text"
    assert message.content[0].text == "I will check the weather."
    uses = _tool_uses(message)
    assert [(u.name, u.input) for u in uses] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_time", {"zone": "Europe/Paris"}),
    ]
    assert len({u.id for u in uses}) == 2
    with sdk.messages.stream(model="caller", max_tokens=200, messages=ASK, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert [(u.name, u.input) for u in _tool_uses(final)] == [(u.name, u.input) for u in uses]
    # tool_choice none: the calls are not read, the text comes as it is
    plain = sdk.messages.create(
        model="caller", max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert [b.type for b in plain.content] == ["text"] and "<tool_call>" in _text(plain)
    assert plain.stop_reason == "end_turn"


def test_a_tool_result_turn_gets_the_answer(sdk):
    first = sdk.messages.create(model="caller", max_tokens=200, messages=ASK, tools=TOOLS)
    uses = _tool_uses(first)
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny, 21 C"} for u in uses]
    results[1]["content"] = [{"type": "text", "text": "14:05"}]
    turn = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": results},
    ]
    answer = sdk.messages.create(model="caller", max_tokens=200, messages=turn, tools=TOOLS)
    assert _text(answer) == AFTER_TOOL and answer.stop_reason == "end_turn"
    assert not _tool_uses(answer)


def test_thinking_comes_as_thinking_blocks(server, sdk):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    ask = dict(model="thinker", max_tokens=2000, messages=ASK, tools=TOOLS, thinking=thinking)
    message = sdk.messages.create(**ask)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert (
        message.content[0].thinking.strip() == "The user asks about Paris. I should call the tool."
    )
    assert message.content[1].input == {"city": "Paris", "days": 3}
    events = _events(server, {**ask, "tools": TOOLS})
    deltas = [e["delta"] for kind, e in events if kind == "content_block_delta"]
    thought = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    assert thought == message.content[0].thinking
    assert "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")
    starts = [e["content_block"]["type"] for kind, e in events if kind == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    # the thinking block sent back with the next turn is accepted (a template reads it)
    back = [*ASK, {"role": "assistant", "content": message.content[:1]}, *ASK]
    assert sdk.messages.create(model="thinker", max_tokens=8, messages=back).content
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        sdk.messages.create(
            model="thinker", max_tokens=8, messages=ASK, thinking={"type": "enabled"}
        )  # type: ignore[typeddict-item]


def test_count_tokens_is_the_messages_input_tokens(server, sdk):
    system = f"Session {uuid.uuid4().hex}: answer briefly."  # a prompt no cache holds
    counted = sdk.messages.count_tokens(model="tiny", messages=ASK, system=system, tools=TOOLS)
    assert counted.input_tokens > 0
    message = sdk.messages.create(
        model="tiny", max_tokens=4, messages=ASK, system=system, tools=TOOLS
    )
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.input_tokens == counted.input_tokens
    # once cached, Anthropic's split: input plus cache reads is the count
    events = _events(
        server,
        {"model": "tiny", "max_tokens": 4, "messages": ASK, "system": system, "tools": TOOLS},
    )
    assert events[0][1]["message"]["usage"]["input_tokens"] == counted.input_tokens
    usage = events[-2][1]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted.input_tokens
    turns = [*ASK, {"role": "assistant", "content": "Sunny."}, *ASK]
    longer = sdk.messages.count_tokens(model="tiny", messages=turns).input_tokens
    assert longer > sdk.messages.count_tokens(model="tiny", messages=ASK).input_tokens


def _refused(call, kind: type, error_type: str) -> str:
    with pytest.raises(kind) as caught:
        call()
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    assert "Traceback" not in body["error"]["message"]
    return body["error"]["message"]


def test_refusals_are_anthropics_errors(server, sdk):
    create = sdk.messages.create
    missing = _refused(
        lambda: create(model="tiny", max_tokens=anthropic.NOT_GIVEN, messages=ASK, timeout=60),
        anthropic.BadRequestError, "invalid_request_error",
    )  # fmt: skip
    assert "max_tokens" in missing
    unknown = _refused(
        lambda: create(model="nope", max_tokens=4, messages=ASK),
        anthropic.NotFoundError, "not_found_error",
    )  # fmt: skip
    assert "nope" in unknown
    # the prompt bound counts the system with the messages: a long system is named (the model's
    # context of 2,048 tokens holds at most 2,048 x its longest token's bytes)
    long = _refused(
        lambda: create(model="tiny", max_tokens=4, messages=ASK, system="a" * 200_000),
        anthropic.BadRequestError, "invalid_request_error",
    )  # fmt: skip
    assert long.startswith("the prompt ('system' and 'messages' together) is at least"), long
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    unasked = {"type": "tool_result", "tool_use_id": "toolu_never", "content": "sunny"}
    called = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    cases = {
        "messages.0.content.0": [{"role": "user", "content": [image]}],
        "role": [{"role": "system", "content": "Hi"}],
        # a result answering no call of the message before it (as Anthropic's API)
        "messages.0.content.0.tool_use_id": [{"role": "user", "content": [unasked]}],
        "messages.2.content.1.tool_use_id": [
            *ASK,
            {"role": "assistant", "content": [called]},
            {"role": "user", "content": [{**unasked, "tool_use_id": "toolu_1"}, unasked]},
        ],
    }
    for needle, messages in cases.items():
        message = _refused(
            lambda m=messages: create(model="tiny", max_tokens=4, messages=m),
            anthropic.BadRequestError, "invalid_request_error",
        )  # fmt: skip
        assert needle in message
    for needle, extra in (
        ("temperature", {"temperature": 1.5}),
        ("stop_sequences", {"stop_sequences": "END"}),
        ("tool_choice", {"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}),
        ("tools.0.type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        ("output_config.effort", {"output_config": {"effort": ["high"]}}),  # (was a 500)
        ("output_config.effort", {"output_config": {"effort": {"a": 1}}}),
        ("metadata.user_id", {"metadata": {"user_id": "u" * 257}}),  # (Anthropic's bound)
    ):
        message = _refused(
            lambda e=extra: create(model="tiny", max_tokens=4, messages=ASK, extra_body=e),
            anthropic.BadRequestError, "invalid_request_error",
        )  # fmt: skip
        assert needle in message, message
    request = urllib.request.Request(
        server.http_url + "/v1/messages", data=b"{not json",
        headers={"content-type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"
    # the server serves on
    assert sdk.messages.create(model="tiny", max_tokens=2, messages=ASK).usage.output_tokens == 2


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic-tokens")
    tokens = root / "tokens"
    tokens.write_text("key-a infer tenant=a\nkey-a2 infer tenant=a\nkey-b infer tenant=b\n")
    tokens.chmod(0o600)
    entries = {"tiny": (write_tiny(root / "tiny", context=2048), "NUMPY")}
    args = ("--auth-tokens", str(tokens), "--max-message-bytes", str(1 << 20))
    with serving(entries, *args) as running:
        yield running


def test_x_api_key_is_a_token_and_tenants_keep_their_caches(guarded):
    """With --auth-tokens, the SDK's api_key (``x-api-key``) or auth_token (``authorization:
    Bearer``) is the token; none or a wrong one is a 401 in Anthropic's body; a tenant's
    prefix cache is its own on this face too; the router's 413 is Anthropic's body too."""
    ask = dict(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "Hi " * 200}])
    first = _sdk(guarded, api_key="key-a").messages.create(**ask)
    assert first.usage.output_tokens == 2 and first.usage.cache_read_input_tokens == 0
    same_tenant = _sdk(guarded, api_key=None, auth_token="key-a2").messages.create(**ask)
    assert same_tenant.usage.cache_read_input_tokens > 0
    other = _sdk(guarded, api_key="key-b").messages.create(**ask)
    assert other.usage.cache_read_input_tokens == 0
    assert other.usage.input_tokens == first.usage.input_tokens
    wrong = _refused(
        lambda: _sdk(guarded, api_key="wrong").messages.create(**ask),
        anthropic.AuthenticationError, "authentication_error",
    )  # fmt: skip
    assert "x-api-key" in wrong
    _refused(
        lambda: _sdk(guarded, api_key="wrong").messages.count_tokens(model="tiny", messages=ASK),
        anthropic.AuthenticationError, "authentication_error",
    )  # fmt: skip
    request = urllib.request.Request(  # no token at all
        guarded.http_url + "/v1/messages",
        data=json.dumps(ask).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 401
    assert json.loads(caught.value.read())["error"]["type"] == "authentication_error"
    # a body over --max-message-bytes is refused before it is read, in Anthropic's body too
    huge = {**ask, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    message = _refused(
        lambda: _sdk(guarded, api_key="key-a").messages.create(**huge),
        anthropic.APIStatusError, "request_too_large",
    )  # fmt: skip
    assert "max-message-bytes" in message


def test_a_stream_failing_midway_ends_with_an_error_event(tmp_path):
    """The status line is out when the request passes --max-request-seconds mid-answer: the
    stream's last event is Anthropic's ``error`` (the SDK raises it), after what was sent."""
    # 16,000 tokens take ~5 s here (4,000 took 1.4 s: close to the 1 s bound on a fast machine)
    slow = write_tiny(tmp_path / "slow", context=16384, long_token=8, width=4096)
    with serving({"slow": (slow, "NUMPY")}, "--max-request-seconds", "1") as running:
        ask = {"model": "slow", "max_tokens": 16000, "messages": ASK}
        events = _events(running, ask)
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "message_start" and "content_block_delta" in kinds
        assert kinds[-1] == "error" and "message_stop" not in kinds, kinds[-3:]
        error = events[-1][1]["error"]
        assert error["type"] != "invalid_request_error" and error["message"]
        with pytest.raises(anthropic.APIStatusError), _sdk(running).messages.stream(**ask) as s:
            for _ in s:
                pass


@pytest.fixture(scope="module")
def torch_server(hf_llama):
    pytest.importorskip("torch", reason="pip install 'plugserve[torch]'")
    with serving({"llama": (hf_llama, "TORCH", {"INFERENCE_NUM_THREADS": "1"})}) as running:
        yield running


def test_a_safetensors_decoder_answers_as_its_chat_route_does(torch_server):
    """tiny-llama's safetensors folder on TORCH: a greedy message is the chat route's greedy
    answer to the same conversation (the same template, tokens and engine), streamed or not,
    its counts the chat's; a forced call on it holds the declared keys only."""
    sdk, api = _sdk(torch_server), client(torch_server, timeout=120)
    chat = api.chat.completions.create(
        model="llama", messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    ask = dict(model="llama", system="Be brief.", messages=ASK, max_tokens=12, extra_body=GREEDY)
    message = sdk.messages.create(**ask)
    assert _text(message) == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert message.usage.output_tokens == chat.usage.completion_tokens
    counted = sdk.messages.count_tokens(model="llama", system="Be brief.", messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens
    used = message.usage
    assert used.input_tokens + used.cache_read_input_tokens == counted.input_tokens
    with sdk.messages.stream(**ask) as stream:
        assert "".join(stream.text_stream) == _text(message)
    forced = sdk.messages.create(
        model="llama", messages=ASK, max_tokens=200, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY,
    )  # fmt: skip
    assert [(u.name, set(u.input)) for u in _tool_uses(forced)] == [("get_time", {"zone"})]
