"""A request's grammar cannot crash the server or hold its workers (a red team's findings
against main at bb5bde3, each sent by an ``infer`` client with the official ``openai`` client).

* A JSON schema of 1,000 objects chained by ``$ref`` (94 KB), in ``response_format`` or a forced
  tool's parameters, or a Lark grammar of 3,000 chained rules (40 KB): llguidance's reading
  recursed past its thread's stack and the server died of SIGSEGV. Now the grammar is read and
  validated in a helper process first (``server/apps/generate/text/grammar_check.py``): a 400
  naming the field, and the server serves on.
* A GBNF grammar of 26,000 rules: llguidance's pure-Python converter is quadratic in a chain
  of rules (131 s of a worker, every chat waiting). Now more than 1,000 rules is a 400 at once.
* A forced tool whose parameters nest 20 levels, each listing ``required: ["a", "a", "a"]``
  (1.6 KB): the tokens kept to close its JSON were counted once per listing, 3^20 visits,
  hours of both of the adapter's worker threads. Now each name counts once: answered at once.

After each, a plain guided request is answered on the same server.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="pip install openai (the test extra)")
pytest.importorskip("llguidance", reason="guided decoding needs llguidance")

from openai_serving import client, serving  # noqa: E402

MODEL = "tiny"
ASK = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_decoder import write

    folder = write(tmp_path_factory.mktemp("hostile-grammars") / "tiny", context=512)
    with serving({MODEL: (folder, "NUMPY")}) as running:
        yield running


@pytest.fixture(scope="module")
def llama(hf_llama):
    """tiny-llama's safetensors folder on TORCH (a real vocabulary) and its client."""
    pytest.importorskip("torch", reason="tiny-llama runs on TORCH")
    with serving({"llama": (hf_llama, "TORCH", {"INFERENCE_NUM_THREADS": "1"})}) as running:
        yield running, client(running, timeout=60)


@pytest.fixture(scope="module")
def api(server):
    return client(server, timeout=60)


def ref_chain(count: int = 1_000) -> dict:
    defs = {
        f"o{i}": {
            "type": "object",
            "properties": {"x": {"$ref": f"#/$defs/o{i + 1}"}},
            "required": ["x"],
        }
        for i in range(count)
    }
    defs[f"o{count}"] = {"type": "integer"}
    return {"$ref": "#/$defs/o0", "$defs": defs}


def lark_chain(count: int = 3_000) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(count)) + f'r{count}: "a"\n'


def gbnf_chain(count: int) -> str:
    rules = "".join(f"r{i} ::= r{i + 1}\n" for i in range(count))
    return f'root ::= r0\n{rules}r{count} ::= "a"\n'


def repeated_required(depth: int = 20) -> dict:
    node: dict = {"type": "string", "maxLength": 4}
    for _ in range(depth):
        node = {"type": "object", "properties": {"a": node}, "required": ["a", "a", "a"]}
    return node


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _still_serves(server, api) -> None:
    assert server.process.poll() is None, "the server died"
    answer = api.completions.create(
        model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert answer.choices[0].text in ("yes", "no")


def _refused(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param, refused.value.body
    return refused.value.body["message"]


DEEP = {
    "response_format": (
        lambda api: api.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4,
            response_format={
                "type": "json_schema", "json_schema": {"name": "deep", "schema": ref_chain()},
            },
        ),
        "response_format",
    ),
    "forced_tool": (
        lambda api: api.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, tools=_tool(ref_chain()),
            tool_choice={"type": "function", "function": {"name": "f"}},
        ),
        "tool_choice",
    ),
    "lark": (
        lambda api: api.completions.create(
            model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_grammar": lark_chain()}
        ),
        "guided_grammar",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(DEEP))
def test_a_deeply_nested_grammar_is_a_400_not_a_crash(server, api, name):
    call, param = DEEP[name]
    message = _refused(lambda: call(api), param)
    assert "nested too deeply" in message, message
    _still_serves(server, api)


def test_a_gbnf_grammar_of_too_many_rules_is_refused_before_it_is_converted(server, api):
    message = _refused(
        lambda: api.completions.create(
            model=MODEL, prompt="x", max_tokens=4,
            extra_body={"guided_grammar": gbnf_chain(12_000)},
        ),
        "guided_grammar",
    )  # fmt: skip
    assert "at most 1,000" in message, message
    # a grammar within the bound and not too deep is converted and honoured
    answer = api.completions.create(
        model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_grammar": gbnf_chain(20)}
    )
    assert answer.choices[0].text == "a"
    _still_serves(server, api)


def test_a_required_name_listed_again_costs_nothing_more(server, api):
    from plugserve.server.apps.generate.text.grammar import closing_reserve

    schema = repeated_required()
    listed_once = json.loads(json.dumps(schema).replace('["a", "a", "a"]', '["a"]'))
    assert closing_reserve(json.dumps(schema)) == closing_reserve(json.dumps(listed_once))
    for _ in range(2):  # both of the adapter's workers, as the attack had them
        answer = api.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=96, temperature=0, tools=_tool(schema),
            tool_choice={"type": "function", "function": {"name": "f"}},
        )  # fmt: skip
        (call,) = answer.choices[0].message.tool_calls
        assert call.function.name == "f"
    _still_serves(server, api)


@pytest.mark.parametrize(
    ("field", "grammar"),
    [
        ("guided_regex", "(a{1000}){1000}"),
        ("guided_regex", "((a{100}){100}){100}"),
        ("response_format", {"type": "string", "pattern": "^(a{1000}){1000}$"}),
    ],
)
def test_counted_repetitions_cost_a_bounded_time(llama, field, grammar):
    """A red team's 15-byte regex: llguidance's first mask of ``(a{1000}){1000}`` over a
    vocabulary of runs of a letter (tiny-llama's; the byte-level test model has none) took
    1.3 s and 260 MB, inside a step of the engine that every sequence of the model waits on
    (with n 16: 6.8 s). Now llguidance's lexer work is bounded (``INITIAL_LEXER_FUEL``: the
    grammar fails once past it, and the sequence stops) and the first mask is made while the
    request is prepared, on its worker: the whole request costs the server well under the
    one mask before."""
    from attack import cpu_seconds

    server, api = llama
    if field == "response_format":
        schema = {"name": "s", "schema": grammar}
        extra = {"response_format": {"type": "json_schema", "json_schema": schema}}
    else:
        extra = {field: grammar}
    before = cpu_seconds(server.process.pid)
    try:
        api.completions.create(model="llama", prompt="go", max_tokens=8, extra_body=extra)
    except openai.BadRequestError as refused:  # a grammar past the bound may be refused
        assert "cannot be used" in str(refused), refused
    used = cpu_seconds(server.process.pid) - before
    print(f"{used:.2f} s CPU")
    assert used < 0.4, f"{used:.2f} s of CPU"  # 0.85-1.1 s before, 0.04-0.1 s now
    answer = api.completions.create(
        model="llama", prompt="go", max_tokens=4, extra_body={"guided_regex": "[0-9]{4}"}
    )
    assert answer.choices[0].text.isdigit()
