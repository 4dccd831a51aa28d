"""LiteLLM, unchanged, against a real server's OpenAI API (issue 50: "LiteLLM (completion with
tools, responses)"): ``litellm.completion`` with tools on the ``openai/`` provider, not streamed
(the parsed ``tool_calls`` come back through LiteLLM's ``ModelResponse``) and streamed (the
chunks reassemble, by LiteLLM's own ``stream_chunk_builder``, into the same calls), an agent's
second turn with LiteLLM's own message sent back as history, and ``litellm.responses`` on
/v1/responses, not streamed and streamed (its events end in ``response.completed`` holding the
same items).

A random-weight model never calls a tool, so the answers come from scripted decoders
(tests/support/scripted_decoder.py): Qwen2.5's real-format template and markers, a decoder that
writes a fixed ``<tool_call>`` transcript; the server's parser (chosen from the template) turns
it into calls.

LiteLLM reaches for the network unless told not to: at import it fetches its model cost map
from GitHub (three tries with back-off, ~10 s offline, then its bundled copy), so
``LITELLM_LOCAL_MODEL_COST_MAP`` is set before the import; tiktoken's encodings come from the
copy LiteLLM bundles (it points ``TIKTOKEN_CACHE_DIR`` there itself). The import (~5 s) is in a
fixture, not at collection, so a run that selects none of these tests does not pay it.
"""

from __future__ import annotations

import json
import os

import pytest
from openai_serving import serving
from scripted_decoder import write

# LiteLLM's own models (pydantic 2.12+) warn about ReadOnly TypedDict items and its usage
# conversion on every import and stream: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pydantic")

CALLS = (
    'I will check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
    '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
)
BEFORE = "I will check the weather."
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
TIME = {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}
AFTER_TOOL = "It is sunny in Paris, 21 C, for the next 3 days."
TEXT = "Paris is sunny today."

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
    "get_time": {
        "type": "object",
        "properties": {"zone": {"type": "string"}},
        "required": ["zone"],
    },
}
#: chat completions' tools (a ``function`` object each)
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
#: the Responses API's tools (flat)
RESPONSE_TOOLS = [
    {"type": "function", "name": name, "parameters": schema} for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def litellm():
    # before the import: LiteLLM reads it while importing (see the module docstring)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return pytest.importorskip("litellm", reason="pip install litellm (the test extra)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("litellm")
    entries = {
        # the calls, then (a tool's result in the chat) the answer
        "caller": (write(root / "caller", "qwen2_5", CALLS, after_tool=AFTER_TOOL), "NUMPY"),
        "writer": (write(root / "writer", "qwen2_5", TEXT), "NUMPY"),
    }
    with serving(entries) as running:
        yield running


@pytest.fixture(scope="module")
def route(server) -> dict:
    """What every LiteLLM call here passes: the ``openai/`` provider's base and key."""
    return {"api_base": f"{server.http_url}/v1", "api_key": "unused", "timeout": 120}


def _calls(tool_calls) -> list[dict]:
    return [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
        for c in tool_calls or []
    ]


def test_completion_with_tools_returns_the_parsed_calls(litellm, route):
    answer = litellm.completion(model="openai/caller", messages=ASK, tools=TOOLS, **route)
    assert isinstance(answer, litellm.ModelResponse)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _calls(choice.message.tool_calls) == [WEATHER, TIME]
    assert choice.message.content == BEFORE
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert answer.usage.completion_tokens > 0


def test_streamed_completion_with_tools_reassembles_into_the_same_calls(litellm, route):
    chunks = list(
        litellm.completion(model="openai/caller", messages=ASK, tools=TOOLS, stream=True, **route)
    )
    assert len(chunks) > 2
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == BEFORE  # no <tool_call> markup leaks into the text deltas
    built = litellm.stream_chunk_builder(chunks, messages=ASK)
    choice = built.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _calls(choice.message.tool_calls) == [WEATHER, TIME]
    assert choice.message.content == BEFORE


def test_an_agents_second_turn_takes_litellms_message_as_history(litellm, route):
    first = litellm.completion(model="openai/caller", messages=ASK, tools=TOOLS, **route)
    message = first.choices[0].message
    history = [*ASK, message.model_dump(exclude_none=True)]
    for call in message.tool_calls:
        history.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    second = litellm.completion(model="openai/caller", messages=history, tools=TOOLS, **route)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == AFTER_TOOL
    assert not second.choices[0].message.tool_calls


def _function_calls(output) -> list[dict]:
    return [
        {"name": item.name, "arguments": json.loads(item.arguments)}
        for item in output
        if item.type == "function_call"
    ]


def test_responses_returns_the_calls_as_function_call_items(litellm, route):
    response = litellm.responses(
        model="openai/caller", input=ASK[0]["content"], tools=RESPONSE_TOOLS, **route
    )
    assert response.status == "completed"
    assert _function_calls(response.output) == [WEATHER, TIME]
    calls = [item for item in response.output if item.type == "function_call"]
    assert all(item.call_id.startswith("call_") for item in calls)
    messages = [item for item in response.output if item.type == "message"]
    assert [part.text for m in messages for part in m.content] == [BEFORE]


def test_a_responses_second_turn_chains_on_previous_response_id(litellm, route):
    """LiteLLM wraps the server's id in its own (the provider and the id, base64) and unwraps it
    when it goes back as ``previous_response_id``: the stored turn and the tools' outputs make
    the chat whose answer is the one after a tool's result."""
    first = litellm.responses(
        model="openai/caller", input=ASK[0]["content"], tools=RESPONSE_TOOLS, **route
    )
    outputs = [
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 21 C"}
        for item in first.output
        if item.type == "function_call"
    ]
    second = litellm.responses(
        model="openai/caller", input=outputs, previous_response_id=first.id,
        tools=RESPONSE_TOOLS, **route,
    )  # fmt: skip
    assert second.status == "completed"
    assert _function_calls(second.output) == []
    assert second.output_text == AFTER_TOOL


def test_responses_text_answer(litellm, route):
    response = litellm.responses(model="openai/writer", input="Weather?", **route)
    assert response.status == "completed"
    texts = [
        part.text for item in response.output if item.type == "message" for part in item.content
    ]
    assert texts == [TEXT]
    assert response.usage.output_tokens > 0


def test_streamed_responses_end_in_completed_with_the_same_items(litellm, route):
    events = list(
        litellm.responses(
            model="openai/caller", input=ASK[0]["content"], tools=RESPONSE_TOOLS, stream=True,
            **route,
        )
    )  # fmt: skip
    kinds = [str(getattr(event.type, "value", event.type)) for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert "response.output_text.delta" in kinds
    text = "".join(e.delta for e, k in zip(events, kinds) if k == "response.output_text.delta")
    assert text == BEFORE
    done = events[-1].response
    assert _function_calls(done.output) == [WEATHER, TIME]
