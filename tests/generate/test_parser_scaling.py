"""Every parser a client can feed through a model's answer is linear in its input.

A model's answer is the client's to shape (a prompt asks for a long call), so a parser whose
work grows with its input squared is a way to hold the GIL: Qwen3-Coder's parameters were two
lazy regular expressions, and a call of many unclosed ``<parameter=`` took 3.2 s at 60 KB and
about a minute at the parsers' bound (MAX_CALL_CHARS). Each tool-call family and each
reasoning splitter here runs shapes built to find such searches, at its bound, whole and
streamed a few characters at a time, and must finish within a generous time and grow at most
3x when its input doubles (this thread's CPU time, the best of a few runs: a noisy 2-core
machine shows that much margin; a quadratic parser grows 4x). A doubling read over the bar is
measured again, both sizes, up to ``ATTEMPTS`` times: on CI's machine a linear splitter once
read 3.2x (0.14 s, then 0.45 s as the best of three), where alone it reads 1.7x; a quadratic
one reads 4x every time.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import pytest
import scripted_decoder

from plugserve.server.apps.generate import reasoning
from plugserve.server.apps.generate.text import chat_template
from plugserve.server.apps.generate.tool_parsers import FAMILIES, MAX_CALL_CHARS, Streamer, parse

#: the most CPU seconds one parse at the bound may take (they take well under 1 s)
BOUND_SECONDS = 10.0
#: a doubled input's time over the input's, at most (linear: 2; quadratic: 4)
GROWTH = 3.0
#: times below this are noise: compared as if they were this long
FLOOR = 0.01
#: how many times a doubling is measured before its growth counts
ATTEMPTS = 3
TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}},
    }
]


def _repeat(head: str, item: str, tail: str) -> Callable[[int], str]:
    """A text of ``size`` characters: ``head``, ``item`` repeated, ``tail``."""

    def make(size: int) -> str:
        count = max(1, (size - len(head) - len(tail)) // len(item))
        return head + item * count + tail

    return make


OBJECTS = '"k": [1, {"b": "x\\"y"}], '
SHAPES: dict[str, list[Callable[[int], str]]] = {
    "hermes": [
        _repeat('<tool_call>{"name": "f", "arguments": {', OBJECTS, '"z": 0}}</tool_call>'),
        _repeat("<tool_call>", "<tool_call>{", "</tool_call>"),
        _repeat("<tool_call>", "</tool_call", ""),
    ],
    "llama3_json": [
        _repeat('{"name": "f", "parameters": {', OBJECTS, '"z": 0}}'),
        _repeat("", '{"name": "f", "parameters": {}}; ', ""),
        _repeat("{", "{", ""),
    ],
    "mistral": [
        _repeat('[TOOL_CALLS][{"name": "f", "arguments": {', OBJECTS, '"z": 0}}]'),
        _repeat("[TOOL_CALLS]", "f[ARGS]{}[TOOL_CALLS]", ""),
        _repeat("[TOOL_CALLS]", "[TOOL_CALLS", ""),
    ],
    "pythonic": [
        _repeat("[f(a=[", "{'b': 1}, ", "])]"),
        _repeat("[", "f(a=1), ", "]"),
        _repeat("[f(a='", "x", "')]"),
    ],
    "qwen3_coder": [
        _repeat("<tool_call><function=f>\n", "<parameter=a>\n1\n</parameter>\n", "</function>"),
        _repeat("<tool_call><function=f>\n", "<parameter=a>\n1\n", "</function></tool_call>"),
        _repeat("<tool_call><function=f>\n", "</function>", "</tool_call>"),
        _repeat("<tool_call><function=f>\n<parameter=a>\n", "</parameter", "</function>"),
    ],
}
REASONING: dict[str, list[Callable[[int], str]]] = {
    "think": [_repeat("<think>", "x</think", "</think>answer"), _repeat("", "<think>", "")],
    "harmony": [
        _repeat("<|channel|>analysis<|message|>", "x<|end", "<|end|>"),
        _repeat("<|channel|>", "<|channel|>", ""),
        _repeat(
            "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{",
            '"a": 1, ',
            "}<|call|>",
        ),
    ],
}


def _cpu(run: Callable[[], object], repeats: int = 3, enough: float = 0.0) -> float:
    """The best of ``repeats`` runs' CPU time on this thread: not the process's (in the whole
    suite other tests' threads run beside it: a linear family read 5.6x a doubling so), and
    with the collector paused (its full passes grow with whatever else the process holds; no
    collection is asked before a run for the same reason: in the whole suite on CI's machine
    each cost more than the parse). Runs stop early once one took under ``enough`` seconds:
    only a time over the bar is measured again (the suite's slowest tests were these repeats:
    ~10 s each, 25 of them)."""
    best = float("inf")
    for _ in range(repeats):
        if best < enough:
            break
        gc.disable()
        try:
            start = time.thread_time()
            run()
            best = min(best, time.thread_time() - start)
        finally:
            gc.enable()
    return best


def _streamed(feed: Callable[[str], object], finish: Callable[[], object], text: str) -> None:
    for at in range(0, len(text), 4):
        feed(text[at : at + 4])
    finish()


def _tool_runs(name: str, text: str) -> dict[str, Callable[[], object]]:
    def whole() -> object:
        return parse(FAMILIES[name](TOOLS), text)

    def streamed() -> None:
        streamer = Streamer(FAMILIES[name](TOOLS))
        _streamed(streamer.feed, streamer.finish, text)

    return {"whole": whole, "streamed": streamed}


def _reasoning_runs(name: str, text: str) -> dict[str, Callable[[], object]]:
    def streamed() -> None:
        splitter = reasoning.FAMILIES[name]().splitter(False)
        _streamed(splitter.feed, splitter.finish, text)

    def whole() -> None:
        splitter = reasoning.FAMILIES[name]().splitter(False)
        splitter.feed(text)
        splitter.finish()

    return {"whole": whole, "streamed": streamed}


def _growth(
    small_run: Callable[[], object], large_run: Callable[[], object]
) -> tuple[float, float]:
    """The small and the large run's CPU seconds, measured again (both, small first) while the
    large one reads over ``GROWTH`` times the small one, at most ``ATTEMPTS`` times: the pair
    that grew least is returned, so one noisy reading is not a finding and a quadratic run,
    4x on every reading, still is."""
    best: tuple[float, float] | None = None
    for _ in range(ATTEMPTS):
        # one run of the small: a slow one only raises the bar (a quadratic run still reads 4x)
        small = _cpu(small_run, repeats=1)
        large = _cpu(large_run, enough=GROWTH * max(small, FLOOR))
        if best is None or large / max(small, FLOOR) < best[1] / max(best[0], FLOOR):
            best = (small, large)
        if large < GROWTH * max(small, FLOOR):
            break
    assert best is not None
    return best


def _check_linear(
    runs_of: Callable[[str], dict[str, Callable[[], object]]], make: Callable[[int], str]
) -> None:
    half, full = make(MAX_CALL_CHARS // 2), make(MAX_CALL_CHARS)
    assert len(full) <= MAX_CALL_CHARS
    for kind in ("whole", "streamed"):
        small, large = _growth(runs_of(half)[kind], runs_of(full)[kind])
        assert large < BOUND_SECONDS, f"{kind}: {large:.2f} s CPU at {len(full)} characters"
        assert large < GROWTH * max(small, FLOOR), (
            f"{kind}: {small:.3f} s at {len(half)} characters, {large:.3f} s at {len(full)}: "
            "the work grows faster than the input"
        )


@pytest.mark.parametrize(
    ("name", "shape"), [(n, i) for n, shapes in SHAPES.items() for i in range(len(shapes))]
)
def test_tool_parser_is_linear(name: str, shape: int) -> None:
    _check_linear(lambda text: _tool_runs(name, text), SHAPES[name][shape])


@pytest.mark.parametrize(
    ("name", "shape"), [(n, i) for n, shapes in REASONING.items() for i in range(len(shapes))]
)
def test_reasoning_parser_is_linear(name: str, shape: int) -> None:
    _check_linear(lambda text: _reasoning_runs(name, text), REASONING[name][shape])


TEMPLATES = ("QWEN", "QWEN3_THINK", "QWEN3_CODER", "LLAMA3", "MISTRAL", "LLAMA4", "GPT_OSS")


@pytest.mark.parametrize("name", TEMPLATES)
def test_chat_template_is_linear_in_messages_and_tools(name: str) -> None:
    """Each family's template (tests/support/scripted_decoder.py, written as the models' own)
    at the request's bounds: 4,096 messages (``protocol.MAX_MESSAGES``) with 128 tools
    (``tools.MAX_TOOLS``), against half of each."""
    template = chat_template.compile_template(getattr(scripted_decoder, name), name)
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "a tool",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    context = {"bos_token": "<s>", "eos_token": "</s>"}

    def run(size: int) -> Callable[[], object]:
        messages = turn * (size // 2) + [{"role": "user", "content": "and?"}]
        tools = [tool] * (size // 32)
        return lambda: chat_template.render(template, messages, True, tools, context, name)

    small, large = _growth(run(2048), run(4096))
    assert large < BOUND_SECONDS, f"{large:.2f} s CPU"
    assert large < GROWTH * max(small, FLOOR), f"{small:.3f} s, then {large:.3f} s"


def test_qwen3_coder_reads_what_it_read() -> None:
    """The scan that replaced the regular expressions reads the same calls and refuses the
    same text (a newline trimmed off each side of a value, whitespace between parameters)."""
    family = FAMILIES["qwen3_coder"](TOOLS)
    call = (
        "<function=f>\n<parameter=a>\n12\n</parameter>\n<parameter= b >x\n\n</parameter>\n"
        "</function>"
    )
    assert [(c.name, c.arguments) for c in family.calls(call)] == [("f", '{"a": 12, "b": "x\\n"}')]
    for broken in (
        "<function=f>\n<parameter=a>\n1\n",  # no </function>
        "<function=f>\ntext<parameter=a>1</parameter>\n</function>",  # text outside
        "<function=f>\n<parameter=a>1\n</function>",  # unclosed parameter
        "<function=</function>",
        "<function=f\ng>\n</function>",
    ):
        assert family.calls(broken) is None, broken
