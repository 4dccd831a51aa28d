"""Tool calls and reasoning on the OpenAI API, against a real server, with the official
``openai`` client unchanged (issue 50, items 1-3 and 5).

A random-weight model never calls a tool, so the answers here come from scripted decoders
(tests/support/scripted_decoder.py): each family's real-format chat template and its markers as
tokens, a decoder that writes a fixed transcript in the family's markup. The server picks each
family's parser from the template (``--tool-call-parser auto``); the answers come back as
``message.tool_calls`` (ids, ``finish_reason: tool_calls``, content before the call kept),
streamed as OpenAI streams calls (id, type and name first, then the arguments) with no markup
in the content deltas, and the same calls either way. Forced tool choice (``required``, a named
function) is constrained decoding on a random-weight model (tests/support/tiny_decoder.py), so
its calls are valid whatever the weights say. The history's arguments reach templates as
objects. Reasoning is split into ``reasoning_content``, and a JSON schema binds only after it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
pydantic = pytest.importorskip("pydantic")

from openai_serving import client, serving  # noqa: E402
from scripted_decoder import write  # noqa: E402
from tiny_decoder import write as write_tiny  # noqa: E402

from plugserve.server.apps.generate.text.tokenizer import Tokenizer  # noqa: E402

WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
TIME = {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}

#: entry -> (family, the decoder's answer, content expected, calls expected)
SCRIPTS = {
    "qwen": (
        "qwen2_5",
        'I will check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
        "I will check the weather.",
        [WEATHER, TIME],
    ),
    "coder": (
        "qwen3_coder",
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Let me look.",
        [WEATHER],
    ),
    "llama": (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        [WEATHER],
    ),
    "mistral": (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
        None,
        [WEATHER, TIME],
    ),
    "llama4": (
        "llama4",
        '[get_weather(city="Paris", days=3), get_time(zone="Europe/Paris")]',
        None,
        [WEATHER, TIME],
    ),
    "qwen3": (
        "qwen3",
        "<think>\nThe user asks about Paris. I should call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>",
        None,
        [WEATHER],
    ),
    "oss": (
        "gpt_oss",
        "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 3}',
        None,
        [WEATHER],
    ),
    "oss-final": (
        "gpt_oss",
        "<|channel|>analysis<|message|>Answer in JSON.<|end|><|start|>assistant"
        '<|channel|>final<|message|>{"city":"Paris"}',
        '{"city":"Paris"}',
        [],
    ),
    "r1": (
        "deepseek_r1",
        'The user wants JSON, so I answer with it.</think>{"city":"Paris"}',
        None,
        [],
    ),
    "broken": (
        "qwen2_5",
        'Calling: <tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
        'Calling: <tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',
        [],
    ),
}
AFTER_TOOL = "It is sunny in Paris, 21 C, for the next 3 days."
CALLERS = ["qwen", "coder", "llama", "mistral", "llama4", "qwen3", "oss"]
#: the answers that end in another of the family's stop tokens than its first
ENDS = {"oss": "<|call|>"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    # bounded, so a random-weight model's forced call ends
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["Europe/Paris", "UTC"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    entries = {}
    for name, (family, script, _, _) in SCRIPTS.items():
        entries[name] = (write(root / name, family, script, end=ENDS.get(name)), "NUMPY")
    # an agent's turn: the call, then (the tool's result in the chat) the answer
    entries["agent"] = (
        write(root / "agent", "qwen2_5", SCRIPTS["qwen"][1], after_tool=AFTER_TOOL),
        "NUMPY",
    )
    entries["tiny"] = (write_tiny(root / "tiny", context=2048), "NUMPY")
    # the same folders with their own parser settings (config keys over the server's flags)
    off = {"TOOL_CALL_PARSER": "none", "REASONING_PARSER": "none"}
    entries["qwen3-raw"] = (entries["qwen3"][0], "NUMPY", off)
    entries["qwen-named"] = (entries["qwen"][0], "NUMPY", {"tool_call_parser": "hermes"})
    with serving(entries) as running:
        running.folders = {name: entry[0] for name, entry in entries.items()}
        yield running


@pytest.fixture(scope="module")
def api(server):
    return client(server, timeout=120)


def _calls(message) -> list[dict]:
    return [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
        for c in message.tool_calls or []
    ]


@pytest.mark.parametrize("name", CALLERS)
def test_each_familys_calls_come_back_as_tool_calls(api, name):
    _, _, content, calls = SCRIPTS[name]
    answer = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _calls(choice.message) == calls
    assert choice.message.content == content
    ids = [c.id for c in choice.message.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)
    assert all(c.type == "function" for c in choice.message.tool_calls)


def _streamed(api, **ask) -> tuple[str, str, list[dict], str, list]:
    """A streamed chat reassembled as the SDK's users do: content, reasoning, calls by index,
    the finish reason, and the tool-call deltas as they came."""
    content, reasoning, calls, finish, deltas = [], [], {}, None, []
    for chunk in api.chat.completions.create(stream=True, **ask):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content.append(delta.content)
            extra = getattr(delta, "model_extra", None) or {}
            if extra.get("reasoning_content"):
                reasoning.append(extra["reasoning_content"])
            for call in delta.tool_calls or []:
                deltas.append(call)
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                if call.function and call.function.name:
                    entry["name"] += call.function.name
                if call.function and call.function.arguments:
                    entry["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    made = [
        {"name": c["name"], "arguments": json.loads(c["arguments"])}
        for _, c in sorted(calls.items())
    ]
    return "".join(content), "".join(reasoning), made, finish, deltas


@pytest.mark.parametrize("name", CALLERS)
def test_streamed_calls_are_the_same_calls_and_no_markup_leaks(api, name):
    _, _, content, calls = SCRIPTS[name]
    text, _, made, finish, deltas = _streamed(api, model=name, messages=ASK, tools=TOOLS)
    assert made == calls and finish == "tool_calls"
    assert text == (content or "")
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "<|channel|>"):
        assert marker not in text
    # each call opens with its id, type and name (arguments ""), then its arguments
    heads = [d for d in deltas if d.id]
    assert [d.index for d in heads] == list(range(len(calls)))
    for head in heads:
        assert head.type == "function" and head.function.name and head.function.arguments == ""


#: the families whose calls stream a fragment at a time (pythonic's Python comes whole)
FRAGMENTED = [name for name in CALLERS if name != "llama4"]


@pytest.mark.parametrize("name", FRAGMENTED)
def test_arguments_stream_in_fragments_after_the_name(api, name):
    """Each call's head (id, type, name; arguments "") comes before any of its arguments,
    which come in more than one fragment as the model writes them and join to exactly the
    non-streamed call's ``arguments``; no content delta holds the family's markup."""
    whole = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS)
    expected = [c.function.arguments for c in whole.choices[0].message.tool_calls]
    fragments: dict[int, list[str]] = {}
    content = []
    for chunk in api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            for call in choice.delta.tool_calls or []:
                if call.id:  # the head: before any fragment of its call
                    assert call.index not in fragments
                    assert call.function.name and call.function.arguments == ""
                    fragments[call.index] = []
                elif call.function and call.function.arguments:
                    assert call.index in fragments and not call.function.name
                    fragments[call.index].append(call.function.arguments)
    joined = ["".join(fragments[i]) for i in sorted(fragments)]
    assert joined == expected
    assert all(len(fragments[i]) > 1 for i in fragments)
    for text in content:
        for marker in ("<tool_call>", "<function=", "[TOOL_CALLS]", "<|python_tag|>", "<|"):
            assert marker not in text


def test_the_sdks_stream_helper_reads_the_fragments(api):
    """``client.chat.completions.stream``: its argument delta events, one per fragment, and
    the final completion's calls parsed from them."""
    helper = getattr(api.chat.completions, "stream", None) or api.beta.chat.completions.stream
    deltas = []
    with helper(model="qwen", messages=ASK, tools=TOOLS) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append((event.index, event.arguments_delta))
            elif event.type == "content.delta":
                assert "<tool_call>" not in event.delta
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [
        WEATHER["arguments"],
        TIME["arguments"],
    ]
    for index, call in enumerate(calls):
        mine = [d for i, d in deltas if i == index]
        assert len(mine) > 1 and "".join(mine) == call.function.arguments


@pytest.mark.parametrize("name", ["qwen", "coder", "oss"])
def test_responses_stream_function_call_arguments_in_deltas(api, name):
    """/v1/responses streamed: each function call's ``response.function_call_arguments.delta``
    events (more than one) join to its ``.done`` arguments and to the non-streamed
    response's."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    whole = api.responses.create(model=name, input="Weather?", tools=tools)
    expected = [i.arguments for i in whole.output if i.type == "function_call"]
    deltas: dict[str, list[str]] = {}
    done = []
    for event in api.responses.create(model=name, input="Weather?", tools=tools, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas.setdefault(event.item_id, []).append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            done.append(event.arguments)
            assert "".join(deltas[event.item_id]) == event.arguments
        elif event.type == "response.output_text.delta":
            assert "<tool_call>" not in event.delta and "<|" not in event.delta
    assert done == expected and len(done) == len(SCRIPTS[name][3])
    assert all(len(d) > 1 for d in deltas.values())


def test_parallel_tool_calls_false_keeps_one_call(api):
    answer = api.chat.completions.create(
        model="qwen", messages=ASK, tools=TOOLS, parallel_tool_calls=False
    )
    assert _calls(answer.choices[0].message) == [WEATHER]
    _, _, made, _, _ = _streamed(
        api, model="mistral", messages=ASK, tools=TOOLS, parallel_tool_calls=False
    )
    assert made == [WEATHER]


def test_tool_choice_none_and_no_tools_leave_the_text_as_it_is(api):
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        answer = api.chat.completions.create(model="qwen", messages=ASK, **extra)
        assert answer.choices[0].message.tool_calls is None
        assert answer.choices[0].message.content == SCRIPTS["qwen"][1]
        assert answer.choices[0].finish_reason == "stop"


def test_a_malformed_call_is_text_never_an_error(api):
    answer = api.chat.completions.create(model="broken", messages=ASK, tools=TOOLS)
    assert answer.choices[0].message.content == SCRIPTS["broken"][2]
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"
    # streamed, its name and arguments went out before its end marker cut it short: the
    # stream cannot take them back, but the message's calls and finish reason leave it out
    # and its text comes as content, as the whole answer's does
    content, finish, heads = [], None, []
    for chunk in api.chat.completions.create(
        model="broken", messages=ASK, tools=TOOLS, stream=True
    ):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            heads += [c for c in choice.delta.tool_calls or [] if c.id]
            finish = choice.finish_reason or finish
    assert ("".join(content), finish) == (SCRIPTS["broken"][2], "stop")
    assert [h.function.name for h in heads] == ["get_weather"]


def test_reasoning_is_split_out_streamed_and_not(api):
    answer = api.chat.completions.create(model="qwen3", messages=ASK, tools=TOOLS)
    message = answer.choices[0].message
    thought = "\nThe user asks about Paris. I should call the tool.\n"
    assert message.model_extra["reasoning_content"] == thought
    assert _calls(message) == [WEATHER] and message.content is None
    text, reasoning, made, _, _ = _streamed(api, model="qwen3", messages=ASK, tools=TOOLS)
    assert (text, reasoning, made) == ("", thought, [WEATHER])
    # gpt-oss: the analysis channel is reasoning, the commentary to functions.* a call
    answer = api.chat.completions.create(model="oss", messages=ASK, tools=TOOLS)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "Need the weather tool."
    assert _calls(message) == [WEATHER] and answer.choices[0].finish_reason == "tool_calls"
    text, reasoning, made, _, _ = _streamed(api, model="oss", messages=ASK, tools=TOOLS)
    assert (text, reasoning, made) == ("", "Need the weather tool.", [WEATHER])
    # DeepSeek-R1's template opens <think> in the prompt: the answer starts inside it
    answer = api.chat.completions.create(model="r1", messages=ASK)
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants JSON, so I answer with it."
    assert message.content == '{"city":"Paris"}'


class City(pydantic.BaseModel):
    city: str


def test_a_schema_binds_after_the_reasoning_ends(api):
    """The scripted reasoning is no JSON: a grammar from the first token would forbid it (and
    the answer would not be the script); after </think> it binds, and the SDK's parse reads
    the content."""
    parse = getattr(api.chat.completions, "parse", None) or api.beta.chat.completions.parse
    answer = parse(model="r1", messages=ASK, response_format=City)
    message = answer.choices[0].message
    assert message.parsed == City(city="Paris")
    assert message.model_extra["reasoning_content"].startswith("The user wants JSON")
    assert answer.choices[0].finish_reason == "stop"
    answer = parse(model="oss-final", messages=ASK, response_format=City)  # gpt-oss's final
    assert answer.choices[0].message.parsed == City(city="Paris")
    assert answer.choices[0].message.model_extra["reasoning_content"] == "Answer in JSON."


def test_a_named_tool_choice_forces_a_valid_call(api):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = api.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=200,
    )  # fmt: skip
    message = answer.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 9
    assert answer.choices[0].finish_reason == "stop"  # forced: OpenAI's (and Triton's)
    _, _, made, finish, deltas = _streamed(
        api, model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=200,
    )  # fmt: skip
    assert made == [{"name": "get_weather", "arguments": arguments}]
    assert finish == "stop" and deltas[0].function.name == "get_weather"


def test_required_makes_at_least_one_call_and_one_without_parallel(api):
    for parallel, most in ((True, 16), (False, 1)):
        answer = api.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
            max_tokens=400, parallel_tool_calls=parallel,
        )  # fmt: skip
        calls = answer.choices[0].message.tool_calls
        assert calls and len(calls) <= most, answer
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            assert isinstance(json.loads(call.function.arguments), dict)
        assert answer.choices[0].finish_reason == "stop"  # forced: as OpenAI answers


def test_a_named_tool_choice_not_in_tools_is_a_400(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    assert caught.value.body["param"] == "tool_choice"


HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@pytest.mark.parametrize(
    "name, rendered",
    [
        ("qwen", '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'),
        ("coder", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>"),
        ("llama4", '[get_weather(city="Paris", days=3)]'),
        ("mistral", '"call_id": "call_1"'),
    ],
)
def test_the_history_reaches_templates_with_arguments_as_objects(server, api, name, rendered):
    answer = api.chat.completions.create(
        model=name, messages=HISTORY, tools=TOOLS, extra_body={"return_token_ids": True},
        max_tokens=1,
    )  # fmt: skip
    tokenizer = Tokenizer.from_folder(server.folders[name])
    prompt = tokenizer.decode(answer.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert rendered in prompt
    assert '\\"city\\"' not in prompt  # never encoded twice
    assert "sunny, 21 C" in prompt


def test_ten_thousand_tools_are_a_400_and_the_server_serves_on(api):
    many = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
            },
        }
        for i in range(10_000)
    ]
    for choice in ("required", "auto"):  # refused by their count, before a grammar or prompt
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model="qwen", messages=ASK, tools=many, tool_choice=choice)
        assert caught.value.body["param"] == "tools", caught.value.body
        assert "at most 128" in caught.value.body["message"], caught.value.body
    answer = api.chat.completions.create(model="qwen", messages=ASK, tools=TOOLS)
    assert _calls(answer.choices[0].message) == [WEATHER, TIME]


class Forecast(pydantic.BaseModel):
    """What a forced call must fill: bounded fields and no others, so a random-weight model's
    call ends."""

    model_config = pydantic.ConfigDict(extra="forbid")

    unit: str = pydantic.Field(json_schema_extra={"enum": ["c", "f"]})
    days: int = pydantic.Field(ge=1, le=9)


def test_langchain_bind_tools_stream_and_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")

    def chat(model: str):
        return langchain_openai.ChatOpenAI(
            model=model, base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0,
            timeout=120,
        )  # fmt: skip

    question = "What is the weather in Paris?"
    calls = [(c["name"], c["arguments"]) for c in (WEATHER, TIME)]
    answer = chat("qwen").bind_tools(TOOLS).invoke(question)
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == calls
    chunks = list(chat("mistral").bind_tools(TOOLS).stream(question))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == calls
    # json_schema (its default): the reasoning model thinks, then answers in the schema
    assert chat("r1").with_structured_output(City).invoke(question) == City(city="Paris")
    # function_calling: a tool_choice naming the schema's function, forced by the grammar
    forced = chat("tiny").with_structured_output(Forecast, method="function_calling")
    made = forced.invoke(question)
    assert isinstance(made, Forecast) and made.unit in ("c", "f")


def test_langchain_forced_tool_choice_with_free_strings_closes(server):
    """Issue 62: LangChain's ``bind_tools(..., tool_choice="any")`` (OpenAI's "required") on a
    random-weight decoder. The forced call's arguments are held to the declared properties
    (``grammar.closed_schema``): before, the weak model wrote keys the tool never declared
    until ``max_tokens`` cut the JSON and LangChain got no call. And its free string closes
    within the call's tokens (``grammar.JsonConstraint.close_within``): before, this decoder
    sampled 2,018 tokens of the query without a quote."""
    langchain_openai = pytest.importorskip("langchain_openai")
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web for a query.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "site": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
    chat = langchain_openai.ChatOpenAI(
        model="tiny", base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0,
        timeout=120, seed=7,
    )  # fmt: skip
    answer = chat.bind_tools([search], tool_choice="any").invoke("Find the news about Paris.")
    assert len(answer.tool_calls) >= 1, answer
    for call in answer.tool_calls:
        assert call["name"] == "search"
        assert "query" in call["args"] and set(call["args"]) <= {"query", "site"}, call
        assert all(isinstance(v, str) for v in call["args"].values()), call


def test_a_forced_call_with_free_strings_closes_within_max_tokens(api):
    """A forced call's JSON closes within its tokens (``JsonConstraint.close_within``): on the
    random-weight decoder, whose strings never end by themselves, each budget gives a call that
    parses, holds the required key, and spends at most the budget; a larger budget writes a
    longer string (the closing starts near the budget's end, not at once)."""
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "site": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
    lengths = []
    for budget in (100, 200):
        answer = api.chat.completions.create(
            model="tiny", messages=ASK, tools=[search], tool_choice="required", temperature=0,
            max_tokens=budget,
        )  # fmt: skip
        (call,) = answer.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "search" and "query" in arguments, arguments
        assert set(arguments) <= {"query", "site"}
        assert answer.usage.completion_tokens <= budget
        lengths.append(len(call.function.arguments))
    assert lengths[1] > lengths[0], lengths


def test_instructor_default_mode(server, api):
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(api)  # Mode.TOOLS: tool_choice names the model's function
    made = patched.chat.completions.create(
        model="tiny", messages=ASK, response_model=Forecast, max_retries=0, temperature=0,
        max_tokens=100,
    )  # fmt: skip
    assert isinstance(made, Forecast) and 1 <= made.days <= 9


def test_calls_with_n_logprobs_usage_and_token_ids_streamed(api):
    """Parsing composes with the other options: each of ``n`` choices has its own calls, the
    logprobs and token ids of every token still arrive, usage comes last."""
    answer = api.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, n=2, logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    for choice in answer.choices:
        assert _calls(choice.message) == [WEATHER] and choice.finish_reason == "tool_calls"
        assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    stream = api.chat.completions.create(
        model="qwen3", messages=ASK, tools=TOOLS, n=2, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    tokens, finishes, heads, usage = {0: 0, 1: 0}, {}, {0: [], 1: []}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            tokens[choice.index] += len(choice.model_extra.get("token_ids") or [])
            if choice.logprobs and choice.logprobs.content:
                assert choice.model_extra.get("token_ids")
            for call in choice.delta.tool_calls or []:
                if call.id:
                    heads[choice.index].append(call.function.name)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert heads == {0: ["get_weather"], 1: ["get_weather"]}
    assert usage.completion_tokens == tokens[0] + tokens[1] > 0


def test_reasoning_effort_reaches_the_template(server, api):
    answer = api.chat.completions.create(
        model="r1", messages=ASK, reasoning_effort="high", max_tokens=1,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    tokenizer = Tokenizer.from_folder(server.folders["r1"])
    prompt = tokenizer.decode(answer.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.startswith("<｜begin▁of▁sentence｜>Reasoning: high\n")  # noqa: RUF001
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model="r1", messages=ASK, extra_body={"reasoning_effort": 3})
    assert caught.value.body["param"] == "reasoning_effort"


def test_a_models_own_parser_keys_override_the_servers(api):
    answer = api.chat.completions.create(model="qwen3-raw", messages=ASK, tools=TOOLS)
    message = answer.choices[0].message
    assert message.content == SCRIPTS["qwen3"][1] and message.tool_calls is None
    assert "reasoning_content" not in (message.model_extra or {})
    answer = api.chat.completions.create(model="qwen-named", messages=ASK, tools=TOOLS)
    assert _calls(answer.choices[0].message) == [WEATHER, TIME]


class GetWeather(pydantic.BaseModel):
    city: str
    days: int


def test_the_sdks_parse_reads_strict_function_tools(api):
    """``chat.completions.parse`` with ``pydantic_function_tool`` (strict tools): the calls'
    arguments come back parsed into the tool's model."""
    parse = getattr(api.chat.completions, "parse", None) or api.beta.chat.completions.parse
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    answer = parse(model="coder", messages=ASK, tools=[tool])
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetWeather(city="Paris", days=3)
    streamed = api.chat.completions.stream if hasattr(api.chat.completions, "stream") else None
    if streamed is None:
        streamed = api.beta.chat.completions.stream
    with streamed(model="qwen", messages=ASK, tools=[tool]) as stream:
        final = stream.get_final_completion()
    first = final.choices[0].message.tool_calls[0]
    assert first.function.parsed_arguments == GetWeather(city="Paris", days=3)


def test_an_agents_turn_runs_the_tool_and_answers_with_its_result(api):
    """The openai SDK's tool loop as agents run it: the model calls, the calls run, their
    results go back as tool messages with their ids, and the model answers."""
    results = {"get_weather": "sunny, 21 C", "get_time": "12:00"}
    messages: list = list(ASK)
    for _ in range(3):
        answer = api.chat.completions.create(model="agent", messages=messages, tools=TOOLS)
        message = answer.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            content = results[call.function.name]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    assert message.content == AFTER_TOOL and answer.choices[0].finish_reason == "stop"
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]


def test_the_openai_agents_sdk_runs_a_turn_with_function_tools(server):
    """The OpenAI Agents SDK on the chat completions API (its OpenAIChatCompletionsModel): the
    agent's function tools are called with the model's arguments and the run ends with the
    answer the model gave once it read their results."""
    agents = pytest.importorskip("agents", reason="pip install openai-agents")
    agents.set_tracing_disabled(True)  # nothing exported anywhere
    ran = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city."""
        ran.append(("get_weather", city, days))
        return "sunny, 21 C"

    @agents.function_tool
    def get_time(zone: str) -> str:
        """The time in a zone."""
        ran.append(("get_time", zone))
        return "12:00"

    def agent():  # a client per event loop (run_sync's, then the streamed run's)
        model = agents.OpenAIChatCompletionsModel(
            model="agent",
            openai_client=openai.AsyncOpenAI(
                base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120
            ),
        )
        return agents.Agent(
            name="weather", instructions="Answer about the weather.", model=model,
            tools=[get_weather, get_time],
        )  # fmt: skip

    result = agents.Runner.run_sync(agent(), "What is the weather in Paris?", max_turns=4)
    assert result.final_output == AFTER_TOOL
    assert ran == [("get_weather", "Paris", 3), ("get_time", "Europe/Paris")]

    # streamed: the SDK joins the calls' argument fragments itself
    async def streamed():
        run = agents.Runner.run_streamed(agent(), "What is the weather in Paris?", max_turns=4)
        async for _ in run.stream_events():
            pass
        return run.final_output

    ran.clear()
    assert asyncio.run(streamed()) == AFTER_TOOL
    assert ran == [("get_weather", "Paris", 3), ("get_time", "Europe/Paris")]


def test_pydantic_ai_default_output_type(server):
    """Pydantic AI's default structured output: a ``final_result`` tool the model must call
    (``tool_choice`` ``required``), forced by the grammar on a random-weight model."""
    pytest.importorskip("pydantic_ai", reason="pip install 'pydantic-ai-slim[openai]'")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{server.http_url}/v1", api_key="unused")
    model = OpenAIChatModel("tiny", provider=provider)
    agent = Agent(model, output_type=Forecast, model_settings={"temperature": 0})
    made = agent.run_sync("What is the forecast?").output
    assert isinstance(made, Forecast) and made.unit in ("c", "f") and 1 <= made.days <= 9


FUNCTIONS = """
def get_weather(city: str, days: int) -> str:
    "The weather in a city."
    return "sunny, 21 C"


def get_time(zone: str) -> str:
    "The time in a zone."
    return "12:00"
"""


def test_the_llm_cli_runs_its_tools(server, tmp_path):
    """Simon Willison's ``llm`` CLI with Python functions as tools, on an OpenAI-compatible
    model of its extra-openai-models.yaml: it runs the calls and prints the answer."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("llm", reason="pip install llm")
    found = shutil.which("llm") or str(Path(sys.executable).parent / "llm")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: agent\n  model_name: agent\n  api_base: {server.http_url}/v1\n"
        "  supports_tools: true\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused"}
    done = subprocess.run(
        [found, "-m", "agent", "--functions", FUNCTIONS, "--td", "--no-stream",
         "What is the weather in Paris?"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert AFTER_TOOL in done.stdout
    # --td: the calls it ran, with the model's arguments, shown on stderr
    assert "get_weather({'city': 'Paris', 'days': 3})" in done.stderr
    assert "get_time({'zone': 'Europe/Paris'})" in done.stderr
