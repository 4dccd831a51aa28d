"""Issue 58 point 3 on the OpenAI routes: a body is charged what it costs, not its bytes.

Against a real server (a decoder made in code, tests/support/tiny_decoder.py, on NUMPY) while
a probe (tests/support/attack.py) times REST ``/v2/health/live`` and gRPC ``ServerLive``: a
body of many small JSON objects is refused by its structure before it is built (413), one
within the bounds is parsed in the JSON helper process (the server's RSS does not grow by its
parsed form) and answered, both with health p99 <= 250 ms; too deep a body, too many tools
and too large a tool are 400/413 naming the bound; and a body whose parsed form does not fit
--max-inflight-bytes is a 429 naming the flag, though its bytes would have fit. Before: a
95 MB chat body of small objects held the GIL 2-7 s and grew the server 2.9 GB against
285 MB charged.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest
from attack import Probe
from serving import RunningServer
from tiny_decoder import write as write_model

from plugserve.server.protocols.http import json_bounds

MODEL = "tiny"
#: what the server may grow by whatever the attack's size (tests/server/test_attacks_generate)
FIXED = 80 << 20
#: the small server's --max-inflight-bytes
SMALL_BUDGET = 64 << 20


def _start(root, *args: str) -> RunningServer:
    write_model(root / MODEL / "1", context=4096)
    (root / MODEL / "config.json").write_text(json.dumps({"device": "NUMPY"}))
    running = RunningServer("--model-repository", str(root), *args)
    running.start(timeout=300)
    return running


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = _start(tmp_path_factory.mktemp("bodies"), "--max-logprobs", "-1")
    try:
        status, _ = _post(running, _body(b"", max_tokens=2))  # warm: imports, the template
        assert status == 200
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    running = _start(
        tmp_path_factory.mktemp("bodies-small"), "--max-inflight-bytes", str(SMALL_BUDGET)
    )
    try:
        yield running
    finally:
        running.stop()


def _body(extra: bytes, **fields: Any) -> bytes:
    """A chat body (``fields`` added), with ``extra`` as the raw JSON of an ignored field."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    text = json.dumps(body).encode()
    return text[:-1] + b', "junk": ' + extra + b"}" if extra else text


def _objects(count: int) -> bytes:
    return b"[" + b",".join([b'{"a":1}'] * count) + b"]"


def _post(server, body: bytes, timeout: float = 120, path: str = "chat/completions") -> Any:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        connection.request("POST", "/v1/" + path, body, {"content-type": "application/json"})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    return response.status, json.loads(data) if len(data) < 1 << 20 else data


def test_a_body_of_millions_of_small_objects_is_refused_unbuilt(server):
    body = _body(_objects(3_000_000), max_tokens=2)  # 24 MB, 6M values; parsed ~600 MB
    with Probe(server) as probe:
        status, answer = _post(server, body)
    assert status == 413, answer
    assert "--max-json-values" in answer["error"]["message"], answer
    probe.check(body_bytes=len(body), fixed_bytes=FIXED)


@pytest.mark.slow
def test_the_issues_95_mb_of_small_objects_as_tools_is_refused_unbuilt(server):
    """The issue's own size: 95 MB of small objects, as ``tools`` (12M objects)."""
    tools = b"[" + b",".join([b'{"type":"function"}'] * 4_700_000) + b"]"
    body = _body(b"", max_tokens=2)[:-1] + b', "tools": ' + tools + b"}"
    with Probe(server) as probe:
        status, answer = _post(server, body, timeout=300)
    assert status == 413, answer
    probe.check(body_bytes=len(body), fixed_bytes=FIXED)


def test_a_large_body_within_the_bounds_is_parsed_off_the_server(server):
    """900k values (3.6 MB, ~90 MB parsed): parsed in the helper process, whose answer is
    the checked request alone (the ignored field is not sent back)."""
    body = _body(_objects(450_000), max_tokens=2)
    with Probe(server) as probe:
        for _ in range(3):
            status, answer = _post(server, body)
            assert status == 200, answer
    probe.check(body_bytes=len(body), fixed_bytes=FIXED)
    assert probe.growth < 40 << 20, probe.summary()  # its parsed form would be ~90 MB


def _tools(count: int, description: str = "") -> list[dict]:
    function = {"name": "f", "description": description}
    return [{"type": "function", "function": {**function, "name": f"f{i}"}} for i in range(count)]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (_body(b"[" * 100 + b"]" * 100), 400, "--max-json-depth"),
        (_body(b"", tools=_tools(129)), 400, "at most 128"),
        (_body(b"", tools=_tools(1, "x" * 300_000)), 413, "bytes of JSON"),
    ],
    ids=["depth", "tools", "tool-size"],
)
def test_a_body_past_a_structural_bound_is_refused(server, body, status, words):
    got, answer = _post(server, body)
    assert got == status, answer
    assert words in answer["error"]["message"], answer


def test_braces_in_strings_past_the_depth_bound_are_no_structure(server):
    """A small body whose strings hold more ``{`` and ``[`` than --max-json-depth: the quick
    counts (json_bounds.surely_within) overstate it, so it is scanned, and answered."""
    status, answer = _post(server, _body(json.dumps("{[" * 100).encode(), max_tokens=2))
    assert status == 200, answer


@pytest.mark.parametrize(
    ("data", "quick"),
    [
        (b'{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}', True),
        (b"[" * 64 + b"]" * 64, True),
        (b"[" * 65 + b"]" * 65, False),  # too deep: the scan refuses it
        (b'{"s":"' + b"{[" * 40 + b'"}', False),  # in a string: the scan passes it
        (b'{"s":"\\\\",' + b'"t":{' * 30 + b"}" * 30 + b"}", True),
        (b"[" + b",".join([b"1"] * 99) + b"]", True),
        (b"[" + b",".join([b"1"] * 100) + b"]", False),  # 101 values
        (b'["' + b"," * 120 + b'"]', False),  # in a string: the scan passes it
    ],
)
def test_the_quick_counts_pass_only_what_the_scan_passes(data, quick):
    """The inline path skips :func:`body.scan` when the counts say a body is within the
    bounds (a streamed completion's body, as bench_stream_cost sends it): they may fail to
    say so of a body within them, never say so of one the scan refuses."""
    bounds = json_bounds.Bounds(values=100, depth=64)
    values, depth = json_bounds.scan(data)
    assert json_bounds.surely_within(data, bounds) is quick
    if quick:
        assert values <= bounds.values and depth <= bounds.depth


def test_a_body_is_charged_its_parsed_size(small):
    """700k numbers are 1.4 MB of body (charged 4.2 MB as it arrives) and ~90 MB parsed:
    over a 64 MiB budget, refused before they are built; a small chat still answers."""
    body = _body(b"[" + b",".join([b"7"] * 700_000) + b"]", max_tokens=2)
    status, answer = _post(small, body)
    assert status == 429, answer
    assert "--max-inflight-bytes" in answer["error"]["message"], answer
    status, answer = _post(small, _body(b"", max_tokens=2))
    assert status == 200, answer


def test_prompt_logprobs_over_the_vocabulary_are_charged_what_they_hold(server):
    """2,400 prompt tokens with all 262 alternatives each: ~330 MB in the server while the
    answer is made (the engine's entries, the answer's objects and its JSON at once, 536
    bytes an alternative measured), charged 600 an alternative before the engine runs; it
    had been charged 160 (+4.1 GB against 1.24 GB over a whole 150k vocabulary)."""
    prompt = ("abcdefghij" * 240)[:2400]  # one token a byte
    body = json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": -1}
    ).encode()
    charged = 2400 * 263 * 600
    with Probe(server) as probe:
        status, answer = _post(server, body, path="completions")
    assert status == 200, answer[:500]
    print(probe.summary())
    assert probe.growth <= charged + FIXED, probe.summary()
    scored = json.loads(answer)["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == 2400 and len(scored[1]) >= 262
