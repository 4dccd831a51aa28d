"""What a streamed answer costs each OpenAI-side face per token, in the process: chat's chunks
(the anchor), the Responses API's events, Anthropic's events.

``python tests/benchmarks/bench_face_events.py [--tokens 200] [--runs 200] [--rounds 3]
[--baseline-root DIR]``

Each case drives the face's own body (``stream_reply``'s pulled chunks; ``responses.py``'s
``_streamed``, Anthropic's ``answer.events_of``) over ``--tokens`` one-token engine events, one
event a wake-up, no engine and no socket: the adapter's work alone (issue 60.2: the faces used
to parse chat's chunks back; they read the answer's typed pieces now). Medians over ``--runs``
requests a case. ``--baseline-root DIR``: a tree whose ``DIR/plugserve`` is the base commit's
code (``git archive BASE | tar -x -C DIR/plugserve``), run as a child with ``PYTHONPATH=DIR``
in rounds interleaved with this checkout's (who goes first alternating); a base before
``Started`` is driven through its faces' chat-bytes seam.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import types
from typing import Any


class _Stream:
    """An engine stream's stand-in: its events, one a wake-up."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    async def batches(self) -> Any:
        for event in self.events:
            yield [(event, event.finish_reason is not None)]

    def cancel(self, error: Any = None) -> None:
        pass


def _cases(tokens: int) -> dict[str, Any]:
    """Each face's body over a fresh answer: a callable making the async iterator of bytes."""
    from plugserve.server.apps.generate.types import GenerationEvent
    from plugserve.server.protocols.openai import answer as A
    from plugserve.server.protocols.openai import responses as responses_routes
    from plugserve.server.protocols.openai.anthropic import routes as messages_routes
    from plugserve.server.protocols.openai.anthropic.answer import EventStream as Messages
    from plugserve.server.protocols.openai.anthropic.request import messages_request
    from plugserve.server.protocols.openai.responses_input import responses_request
    from plugserve.server.protocols.openai.responses_output import EventStream as Responses

    def events() -> list[Any]:
        made = [
            GenerationEvent(0, [i], f" tok{i}", completion_tokens=i + 1, prompt_tokens=12)
            for i in range(tokens - 1)
        ]
        last = GenerationEvent(
            0, [tokens], " end", finish_reason="length", prompt_tokens=12, completion_tokens=tokens
        )
        return [*made, last]

    network = types.SimpleNamespace(tokenizer=None, context=4096, vocab_size=4096, max_n=1)
    network.parsers = {}
    model = A.ServedModel(types.SimpleNamespace(name="m", network=network))
    asked = responses_request({"model": "m", "input": "hi", "stream": True})
    routes = responses_routes.ResponsesRoutes(types.SimpleNamespace(), None)
    chat, _conversation = routes._chat_ask(asked, [])
    message = {"role": "user", "content": "hi"}
    messages = messages_request(
        {"model": "m", "max_tokens": tokens, "stream": True, "messages": [message]}
    )
    typed = hasattr(A, "Started")

    def answer(ask: Any) -> Any:
        return A.Answer(model, ask, "chat", "chatcmpl-x", [[1] * 12], False, None)

    def chat_case() -> Any:
        return A.stream_reply(answer(chat), [_Stream(events())]).chunks

    def responses_case() -> Any:
        face = Responses("resp_x", 0, "m", asked.echo)
        if typed:
            started = A.Started(answer(chat), [_Stream(events())])
            return routes._streamed(face, started, None, [], "")
        return routes._streamed(face, chat_case(), None, [], "")

    def messages_case() -> Any:
        face = Messages("msg_x", "m", [], 12)
        if typed:
            started = A.Started(answer(messages.chat), [_Stream(events())])
            if hasattr(A, "events_of"):  # (the faces' one loop over the pieces)
                return A.events_of(face, started)
            return messages_routes._streamed(face, started)
        reply = A.stream_reply(answer(messages.chat), [_Stream(events())])
        return messages_routes._streamed(face, reply.chunks)

    return {"chat": chat_case, "responses": responses_case, "messages": messages_case}


async def _time(make: Any) -> float:
    start = time.perf_counter()
    async for _piece in make():
        pass
    return time.perf_counter() - start


async def _measure(tokens: int, runs: int) -> dict[str, float]:
    """Each case's median microseconds a token (the cases interleaved run by run)."""
    cases = _cases(tokens)
    for make in cases.values():
        for _ in range(20):
            await _time(make)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, make in cases.items():
            times[name].append(await _time(make))
    return {name: statistics.median(t) / tokens * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-root", default=None)
    parser.add_argument("--once", action="store_true", help="one measurement as JSON (a child)")
    args = parser.parse_args()
    if args.once:
        print(json.dumps(asyncio.run(_measure(args.tokens, args.runs))))
        return
    sides = {"after": os.environ.get("PYTHONPATH", "")}
    if args.baseline_root:
        sides = {"before": args.baseline_root, **sides}
    found: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            env = {**os.environ, "PYTHONPATH": sides[side]}
            command = [sys.executable, __file__, "--once", f"--tokens={args.tokens}"]
            out = subprocess.run(
                [*command, f"--runs={args.runs}"], env=env, check=True, capture_output=True
            )
            found[side].append(json.loads(out.stdout))
    print(f"{args.tokens} tokens a stream, {args.runs} streams a case, {args.rounds} rounds")
    print("us a token (median of the rounds' medians); face / chat in the same run")
    for side, rounds in found.items():
        for case in ("chat", "responses", "messages"):
            value = statistics.median(r[case] for r in rounds)
            ratio = statistics.median(r[case] / r["chat"] for r in rounds)
            print(f"  {side:6} {case:9} {value:6.2f} us  {ratio:.2f} x chat")
    if "before" in found:
        for case in ("responses", "messages"):
            pairs = zip(found["after"], found["before"], strict=True)
            ratio = statistics.median(a[case] / b[case] for a, b in pairs)
            print(f"  {case}: after / before {ratio:.2f}")


if __name__ == "__main__":
    main()
