"""Each family's tool-call parser (server/apps/generate/tool_parsers) and the think splitter
(server/apps/generate/reasoning) on transcripts in the family's exact format, streamed token by
token through a trained tokenizer and the engine's own detokenizer, as a served answer
arrives: the streamed pieces join to the same content and calls as the whole answer parses to,
no marker reaches content, and broken or endless calls come back as text."""

from __future__ import annotations

import json

import pytest

from plugserve.server.apps.generate import reasoning, tool_parsers
from plugserve.server.apps.generate.text.detokenizer import IncrementalDetokenizer
from plugserve.server.apps.generate.text.tokenizer import Tokenizer
from plugserve.server.apps.generate.tool_parsers import ToolCall

pytest.importorskip("tokenizers")

from scripted_decoder import FAMILIES, write

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]

WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": 3}')
TIME = ToolCall("get_time", '{"zone": "Europe/Paris"}')

#: (folder family, parser, answer, content, calls)
CASES = [
    (
        "qwen2_5",
        "hermes",
        'I will check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
        "I will check the weather.",
        [WEATHER, TIME],
    ),
    (
        "qwen3_coder",
        "qwen3_coder",
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Let me look.",
        [WEATHER],
    ),
    (
        "llama3",
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        "",
        [WEATHER],
    ),
    (
        "llama3",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
        "",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
        "Sure.",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        "",
        [WEATHER],
    ),
    (
        "llama4",
        "pythonic",
        '[get_weather(city="Paris", days=3), get_time(zone="Europe/Paris")]',
        "",
        [WEATHER, TIME],
    ),
    (
        "llama4",
        "pythonic",
        '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>',
        "",
        [WEATHER],
    ),
    # not calls: plain answers, and markup that does not read as a call, kept as text
    ("qwen2_5", "hermes", "The weather is fine.\n", "The weather is fine.\n", []),
    (
        "qwen2_5",
        "hermes",
        "Here: <tool_call>{not json}</tool_call> done",
        "Here: <tool_call>{not json}</tool_call> done",
        [],
    ),
    ("llama3", "llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama4", "pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("llama4", "pythonic", "[os.system('x')]", "[os.system('x')]", []),
    ("mistral", "mistral", "No tools needed.", "No tools needed.", []),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tokenizer per family, trained on its template and every answer of the cases."""
    made = {}
    root = tmp_path_factory.mktemp("families")
    for name in {case[0] for case in CASES} | {"qwen3", "deepseek_r1"}:
        answers = [case[2] for case in CASES if case[0] == name] + list(THINKING.values())
        folder = write(root / name, name, answers[0])
        # the tokenizer trained on every answer of the family, so they split as real text does
        from scripted_decoder import tokenizer

        tokenizer(FAMILIES[name], answers).save(str(folder / "tokenizer.json"))
        made[name] = Tokenizer.from_folder(folder)
    return made


def _pieces(tok: Tokenizer, text: str, skip_special: bool) -> list[str]:
    """``text`` as the engine streams it: encoded, then detokenized a token at a time."""
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special)
    pieces = []
    for token in ids:
        detok.add(token)
        pieces.append(detok.take())
    pieces.append(detok.take(final=True))
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{c[2][:24]}")
def test_streamed_token_by_token_the_calls_are_the_whole_answers(folders, case):
    name, parser, answer, content, calls = case
    family = tool_parsers.FAMILIES[parser](TOOLS)
    assert tool_parsers.detect(FAMILIES[name].template) == parser.replace("qwen2_5", "hermes")
    whole_content, whole_calls = tool_parsers.parse(family, answer)
    assert (whole_content, whole_calls) == (content, calls)
    streamer = tool_parsers.Streamer(family)
    events = []
    for piece in _pieces(folders[name], answer, not family.needs_special_tokens):
        events += streamer.feed(piece)
    events += streamer.finish()
    streamed = [v for k, v in events if k == "content"]
    assert "".join(streamed) == content
    assert [v for k, v in events if k == "call"] == calls
    if calls:  # no markup ever reached content
        for marker in (*family.starts, family.end or "\0"):
            if marker not in ("{", "["):
                assert all(marker not in piece for piece in streamed)
    for call in calls:
        json.loads(call.arguments)
    _streamed_as_openai_streams(family, events, calls)
    # and a character at a time: every marker split at every place
    streamer = tool_parsers.Streamer(family)
    events = [e for ch in answer for e in streamer.feed(ch)] + streamer.finish()
    assert "".join(v for k, v in events if k == "content") == content
    assert [v for k, v in events if k == "call"] == calls
    _streamed_as_openai_streams(family, events, calls)


def _streamed_as_openai_streams(family, events, calls):
    """Each call that streams: its name first, then more than one fragment of its arguments,
    which join to exactly its ``arguments``; pythonic's Python comes whole at its close."""
    streamed, now = [], None
    for kind, value in events:
        if kind == "name":
            assert now is None
            now = [value, []]
        elif kind == "args":
            assert now is not None  # never a fragment before its name
            now[1].append(value)
        elif kind == "call":
            if now is not None:
                assert value.name == now[0] and "".join(now[1]) == value.arguments
                streamed.append(len(now[1]))
            now = None
    if family.reader() is None:
        assert streamed == []
    else:
        assert len(streamed) == len(calls) and all(n > 1 for n in streamed)


THINKING = {
    "qwen3": "<think>\nThe user asks about Paris. I should call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    "</tool_call>",
    "deepseek_r1": 'The user wants JSON.\n</think>\n\n{"city": "Paris"}',
}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_reasoning_split_token_by_token_is_the_whole_answers(folders, name):
    template = FAMILIES[name].template
    think = reasoning.family("auto", template)
    assert think is not None
    tok = folders[name]
    prompt = tok.render_chat([{"role": "user", "content": "hi"}], True, None, {})
    opened = think.opened(prompt[-40:])
    assert opened == (name == "deepseek_r1")  # R1's template opens <think> in the prompt
    if name == "qwen3":  # thinking off: the template writes an empty thought, closed
        off = tok.render_chat(
            [{"role": "user", "content": "hi"}], True, None, {"enable_thinking": False}
        )
        assert off.endswith("<think>\n\n</think>\n\n") and not think.opened(off[-40:])
    answer = THINKING[name]
    whole = think.splitter(opened)
    r1, c1 = whole.feed(answer)
    r2, c2 = whole.finish()
    splitter = think.splitter(opened)
    parts = [splitter.feed(p) for p in _pieces(tok, answer, True)] + [splitter.finish()]
    assert "".join(r for r, _ in parts) == r1 + r2
    assert "".join(c for _, c in parts) == c1 + c2
    assert "think>" not in r1 + r2 + c1 + c2
    assert (c1 + c2).startswith("<tool_call>" if name == "qwen3" else '{"city"')
    assert "Paris" in r1 + r2 or name == "deepseek_r1"


def test_an_endless_call_is_given_up_as_text_within_the_bound():
    """Its name and arguments stream as they come; past the bound it is not a call after all
    (``broken``: the API leaves it out of the message) and its text, then the rest of the
    answer, come as content."""
    family = tool_parsers.FAMILIES["hermes"]()
    streamer = tool_parsers.Streamer(family, limit=1000)
    out = streamer.feed("ok <tool_call>")
    for _ in range(300):
        out += streamer.feed('{"name": "f", "arguments": {"x": "' + "a" * 10)
    out += streamer.finish()
    kinds = [k for k, _ in out]
    assert "call" not in kinds and kinds.count("name") == 1 and kinds.count("broken") == 1
    assert kinds.index("name") < kinds.index("args") < kinds.index("broken")
    text = "".join(v for k, v in out if k == "content")
    assert text.startswith("ok <tool_call>{") and len(text) > 3000
    assert not streamer._buf and streamer._region is None


def test_arguments_stream_as_written_and_a_late_name_comes_whole():
    """The arguments' text is the model's own (strings with braces, quotes and escapes,
    nesting), streamed a piece at a time; a call whose name comes after its arguments, or
    whose arguments are a string, is read whole at its close (the name first when known)."""
    family = tool_parsers.FAMILIES["hermes"]()
    text = (
        '<tool_call>{"name": "f", "arguments": {"a": "x}y\\"z{", "b": [1, {"c": "]"}]}}'
        '</tool_call><tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>'
        '<tool_call>{"name": "h", "arguments": "{\\"a\\": 2}"}</tool_call>'
    )
    streamer = tool_parsers.Streamer(family)
    events = [e for ch in text for e in streamer.feed(ch)] + streamer.finish()
    assert [v.name for k, v in events if k == "call"] == ["f", "g", "h"]
    assert [v for k, v in events if k == "name"] == ["f", "h"]  # g's name came too late
    at = events.index(("name", "h"))
    assert [e for e in events[at:] if e[0] == "args"] == [("args", '{"a": 2}')]  # whole
    first = "".join(v for k, v in events[:at] if k == "args")
    assert first == '{"a": "x}y\\"z{", "b": [1, {"c": "]"}]}'
    assert json.loads(first) == {"a": 'x}y"z{', "b": [1, {"c": "]"}]}
    assert tool_parsers.parse(family, text)[1] == [v for k, v in events if k == "call"]


def test_detect_names_each_family_from_its_template():
    assert {n: tool_parsers.detect(f.template) for n, f in FAMILIES.items()} == {
        "qwen2_5": "hermes",
        "qwen3": "hermes",
        "qwen3_coder": "qwen3_coder",
        "llama3": "llama3_json",
        "mistral": "mistral",
        "llama4": "pythonic",
        "deepseek_r1": None,
        "gpt_oss": None,  # its calls come with its channels: the reasoning parser's
    }
    assert reasoning.detect(FAMILIES["qwen2_5"].template) is None
    assert reasoning.detect(FAMILIES["gpt_oss"].template) == "harmony"
    assert reasoning.detect(FAMILIES["deepseek_r1"].template) == "think"
    assert tool_parsers.family("none", FAMILIES["qwen3"].template, TOOLS) is None
    assert tool_parsers.family("mistral", None, TOOLS).name == "mistral"


def test_an_unknown_parser_name_is_refused_at_start():
    from plugserve.server.process.settings import Settings

    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit, match="must be one of auto, none"):
            Settings.from_argv([flag, "bogus"])
    assert Settings.from_argv(["--tool-call-parser", "qwen3_coder"]).tool_call_parser == (
        "qwen3_coder"
    )


HARMONY = (
    "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking now.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 3}<|end|>'
    "<|start|>assistant<|channel|>final<|message|>It is sunny."
)


def _harmony(pieces: list[str], calls: bool) -> tuple[str, str, list[ToolCall]]:
    splitter = reasoning.family("auto", FAMILIES["gpt_oss"].template).splitter(True)
    splitter.parse_calls = calls
    reasoned, content, made = [], [], []
    for piece in [*pieces, None]:
        r, c = splitter.feed(piece) if piece is not None else splitter.finish()
        reasoned.append(r)
        content.append(c)
        made += splitter.take_calls()
    return "".join(reasoned), "".join(content), made


def test_harmony_channels_token_by_token_are_the_whole_answers(tmp_path):
    from scripted_decoder import tokenizer

    folder = write(tmp_path / "oss", "gpt_oss", HARMONY)
    tokenizer(FAMILIES["gpt_oss"], [HARMONY]).save(str(folder / "tokenizer.json"))
    pieces = _pieces(Tokenizer.from_folder(folder), HARMONY, skip_special=False)
    whole = _harmony([HARMONY], True)
    assert whole == (
        "The user wants the weather; call the tool.",
        "Checking now.It is sunny.",
        [WEATHER],
    )
    assert _harmony(pieces, True) == whole
    # calls not parsed (no tools): the call's arguments are content
    assert _harmony(pieces, False)[1] == 'Checking now.{"city": "Paris", "days": 3}It is sunny.'
    # not harmony at all: plain text is content
    assert _harmony(["Just text, no channels."], True) == ("", "Just text, no channels.", [])


def test_a_long_call_streamed_a_character_at_a_time_costs_its_length():
    """The region is searched only where it grew: 200,000 characters a character at a time
    take well under the time a quadratic search would (seconds of copying)."""
    import time

    family = tool_parsers.FAMILIES["hermes"]()
    streamer = tool_parsers.Streamer(family)
    text = '<tool_call>{"name": "f", "arguments": {"x": "' + "a" * 200_000 + '"}}</tool_call>'
    began = time.process_time()
    events = []
    for ch in text:
        events += streamer.feed(ch)
    events += streamer.finish()
    spent = time.process_time() - began
    assert [k for k, _ in events if k != "args"] == ["name", "call"]
    assert "".join(v for k, v in events if k == "args") == events[-1][1].arguments
    assert spent < 20  # ~0.5 s here; a copy of the region per character is ~40 GB


def test_a_models_parser_keys_are_checked_and_kept_from_the_device():
    from plugserve.plugins.api import InvalidArgument
    from plugserve.server.apps.generate.network import _parsers

    config = {"tool_call_parser": "pythonic", "REASONING_PARSER": "none", "NUM_STREAMS": "1"}
    assert _parsers(config) == {"tool_call_parser": "pythonic", "reasoning_parser": "none"}
    assert config == {"NUM_STREAMS": "1"}  # what the device gets
    with pytest.raises(InvalidArgument, match="'bogus' is not a parser"):
        _parsers({"TOOL_CALL_PARSER": "bogus"})


@pytest.mark.parametrize("parser", sorted(set(tool_parsers.FAMILIES) - {"qwen2_5", "qwen3"}))
def test_hostile_regions_come_back_as_text(parser):
    """JSON or Python nested past any parser's depth, and the markers alone: text, never an
    exception (which would fail the request)."""
    family = tool_parsers.FAMILIES[parser](TOOLS)
    opening = next(iter(family.starts))
    for body in ("[" * 100_000, '{"a":' * 50_000, "", "(" * 50_000, "\x00\ud800"):
        text = opening + body + (family.end or "")
        content, calls = tool_parsers.parse(family, text)
        assert calls == [] and content == text


def test_a_harmony_call_nested_past_the_parsers_depth_is_text():
    splitter = reasoning.Harmony().splitter(True)
    splitter.parse_calls = True
    body = "[" * 100_000
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>" + body + "<|call|>"
    assert splitter.feed(text) + splitter.finish() == ("", body, "", "")
    assert splitter.take_calls() == []
