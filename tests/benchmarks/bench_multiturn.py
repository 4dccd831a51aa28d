"""A multi-turn agent workload with the KV host tier on and off (issue 61 item 6): time to first
token per turn and cached tokens, at the same device cache size.

The workload: ``--conversations`` conversations, interleaved turn by turn (one request at a
time: conversation 1's turn 1, conversation 2's turn 1, ..., conversation 1's turn 2, ...),
each a long system prompt with tool definitions that every conversation shares plus its own
growing history. An agent's turn (the default) is the user's question, the assistant's tool
call, the tool's result (deterministic JSON of ``--tool-items`` flights: about 200 tokens at 2)
and the generated answer, all of which stays in the history; ``--plain`` is the earlier
workload, a short question and the answer a turn. The server has ``--slots`` cache slots per
model (``MAX_NUM_SEQS``), fewer than the conversations, so by a conversation's next turn its
slot was taken by another: without the tier the shared system prompt is still found on the
device (another slot holds it) but the conversation's own history is computed again; with the
tier (``KV_OFFLOADING_SIZE``) it is restored from host memory.

One server serves the folder twice, ``on`` (the tier) and ``off``, same settings otherwise
(``--config KEY=VALUE`` adds a key to both); rounds run the whole workload on each, the order
alternating. Requests are OpenAI streaming completions (greedy, ``ignore_eos``,
``--new-tokens`` each); TTFT is the time from sending to the first chunk with text. Printed:
the machine, the folder and the cache's element type, per round each model's median TTFT of
later turns (turn 2 on) and of first turns, median cached tokens, each turn's median TTFT and
cached tokens on and off, the ratio off / on, whether the answers were the same (the streamed
text of each turn, on against off); then the median of the rounds' ratios. Before that, in
process, the crossover: restoring ``k`` blocks (the tier's copy, and the disk tier's read of
the same blocks' files and copy) against computing them (the decoder's ``extend`` over them
after a prefix of 4 blocks), for k = 1, 2, 4, 8, 16 (``--crossover-only``: that alone;
``--no-crossover``: the workload alone).

    python tests/benchmarks/bench_multiturn.py [--folder FOLDER] [--device ORT] \\
        [--conversations 4] [--turns 5] [--slots 2] [--rounds 2] [--new-tokens 24] \\
        [--plain] [--tool-items 2] [--max-model-len 4096] [--config KEY=VALUE] \\
        [--crossover-only | --no-crossover]

The folder defaults to tests/support/llm.py's ``bench-llama`` (~169 M parameters, context 4096)
exported by optimum (``python tests/support/llm.py path bench-llama optimum-onnx`` makes it).
:func:`workload` and :func:`compare` are the GPU check's ``kv`` part too (tests/gpu/kv_check.py).
Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

TOOLS = [
    ("search_flights", "Find flights between two airports on a date", ["origin", "destination"]),
    ("book_hotel", "Reserve a hotel room in a city for some nights", ["city", "nights"]),
    ("get_weather", "The forecast for a city on a given day", ["city", "day"]),
    ("convert_currency", "Convert an amount between two currencies", ["amount", "to"]),
    ("send_email", "Send an email to a recipient with a subject", ["to", "subject"]),
    ("calendar_add", "Add an event to the user's calendar", ["title", "start"]),
]
TOPICS = ["Lisbon", "Kyoto", "Oslo", "Quito", "Nairobi", "Hanoi", "Perth", "Tunis", "Lima"]


def system_prompt(count: int = len(TOOLS), repeats: int = 3) -> str:
    """A travel agent's system prompt with its first ``count`` tools (JSON schemas), shared by
    every conversation (its rules ``repeats`` times: 1,319 tokens of bench-llama's tokenizer
    at the defaults; the GPU check's smaller models take fewer)."""
    tools = "\n".join(
        f'{{"type": "function", "function": {{"name": "{name}", "description": "{text}", '
        f'"parameters": {{"type": "object", "properties": {{'
        + ", ".join(f'"{a}": {{"type": "string", "description": "the {a}"}}' for a in args)
        + f'}}, "required": {args!r}}}}}}}'.replace("'", '"')
        for name, text, args in TOOLS[:count]
    )
    rules = (
        "You are a careful travel agent. Plan trips step by step, call a tool when you need "
        "facts, never invent prices, confirm before booking, and answer briefly. "
    )
    return f"System: {rules * repeats}\nTools:\n{tools}\n{rules}\n"


def question(conversation: int, turn: int, round_: int) -> str:
    """A short follow-up (an agent's turn: the history grows by the answer and this); each
    round's conversations are new ones (a round must not find the last round's in the tier)."""
    city = TOPICS[conversation % len(TOPICS)]
    return (
        f"\nUser: trip {conversation} of group {round_} to {city}, step {turn}: and then?"
        "\nAssistant:"
    )


def tool_turn(conversation: int, turn: int, round_: int, items: int = 2) -> str:
    """An agent's turn: the user's question, the assistant's tool call and the tool's result
    (deterministic JSON of ``items`` flights: about 200 tokens of bench-llama's tokenizer at 2,
    110 at 1),
    then the assistant's answer is generated. The history grows by all of it every turn."""
    city = TOPICS[conversation % len(TOPICS)]
    day = f"2027-{1 + turn % 12:02d}-{10 + conversation % 18:02d}"
    call = json.dumps(
        {"name": "search_flights", "arguments": {"origin": "LHR", "destination": city[:3].upper()}}
    )
    flights = [
        {
            "flight": f"{('BA', 'TP', 'KL', 'LH')[(conversation + i) % 4]}{100 + 37 * i + turn}",
            "departs": f"{day}T{6 + 3 * i:02d}:{(15 * (turn + i)) % 60:02d}",
            "stops": i % 2,
            "price": {"amount": 180 + 45 * i + 7 * turn + conversation, "currency": "EUR"},
            "seats_left": 9 - i,
        }
        for i in range(items)
    ]
    result = json.dumps(
        {"status": "ok", "query": f"{round_}-{conversation}-{turn}", "flights": flights}
    )
    return (
        f"\nUser: trip {conversation} of group {round_} to {city}, step {turn}: find me a flight."
        f"\nAssistant: <tool_call>{call}</tool_call>\nTool: {result}\nAssistant:"
    )


def ttft(api, model: str, prompt: str, new_tokens: int) -> tuple[float, str, int]:
    """Seconds to the first chunk with text, the whole answer, the cached prompt tokens."""
    sent = time.perf_counter()
    first = None
    text, cached = [], 0
    stream = api.completions.create(
        model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.perf_counter() - sent
            text.append(chunk.choices[0].text)
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return (first if first is not None else float("nan")), "".join(text), cached


def workload(
    api, model: str, args: argparse.Namespace, round_: int, system: str | None = None
) -> list[dict]:
    """Every turn of every conversation of round ``round_``, interleaved; one record each.
    ``args``: ``conversations``, ``turns``, ``new_tokens``, ``plain`` (a short question a turn
    instead of :func:`tool_turn`) and ``tool_items``; ``system``: the shared prompt (default
    :func:`system_prompt`). The GPU check's ``kv`` part (tests/gpu/kv_check.py) runs it too."""
    system = system_prompt() if system is None else system
    history = [system for _ in range(args.conversations)]
    records = []
    for turn in range(args.turns):
        for c in range(args.conversations):
            if args.plain:
                history[c] += question(c, turn, round_)
            else:
                history[c] += tool_turn(c, turn, round_, args.tool_items)
            seconds, text, cached = ttft(api, model, history[c], args.new_tokens)
            history[c] += text
            records.append({"turn": turn, "c": c, "ttft": seconds, "text": text, "cached": cached})
    return records


def crossover(folder: Path, device: str) -> None:
    """In process: restoring k blocks from the host tier, and from the disk tier's files (just
    written: the page cache holds them), against computing them after a prefix of 4 blocks."""
    import tempfile

    from plugserve.server import Core
    from plugserve.server.apps.generate.engine.kv_disk_tier import DiskEntry, DiskTier, digest, root
    from plugserve.server.apps.generate.engine.kv_host_tier import HostTier

    network = Core().load_network(str(folder), device, {"MAX_NUM_SEQS": "2"})
    try:
        engine = network.engine
        decoder, cache, size = engine.decoder, engine.cache, engine.table.block_size
        kib = cache.layout.bytes_per_token * size / 1024
        print(
            f"cache: {cache.layout.dtype}, {len(cache.layout.entries)} arrays, "
            f"{kib:.0f} KiB a block"
        )
        tier = HostTier(cache, size, 1 << 40)
        files = tempfile.TemporaryDirectory(prefix="bench-kv-disk-")
        tier.disk = disk = DiskTier(files.name, 1 << 30, b"bench", tier.disk_shape, np.uint8)
        rng = np.random.default_rng(0)
        vocab = decoder.vocab or 1000
        print("blocks  compute_ms  restore_ms  compute/restore  disk_ms  compute/disk")
        for k in (1, 2, 4, 8, 16):
            prefix, count = 4 * size, k * size
            tokens = [int(t) for t in rng.integers(10, vocab - 1, prefix + count)]
            decoder.first(cache, [0], [tokens[:prefix]])
            computed = []
            for _ in range(3):
                start = time.perf_counter()
                decoder.extend(cache, 0, prefix, tokens[prefix:])
                computed.append(time.perf_counter() - start)
            slot = engine.table.slots[0]
            engine.table.truncate(slot, 0)
            engine.table.written(slot, tokens)
            tier.offload(slot)
            blocks = tier.match([*tokens, 1], slot.salt)[4:]
            restored = []
            for _ in range(3):
                start = time.perf_counter()
                tier.restore(1, blocks, 4)
                restored.append(time.perf_counter() - start)
            previous, parent = root(disk.identity, slot.salt), None
            for block in tier.match([*tokens, 1], slot.salt):  # the same blocks, as files
                previous = digest(previous, block.tokens)
                disk.offer(
                    DiskEntry(previous, block.key, parent, block.salt, block.tokens), block.data
                )
                parent = block.key
            disk.flush()
            read = []
            for _ in range(3):
                start = time.perf_counter()
                staging = disk.stage([*tokens, 1], slot.salt, lambda: None)
                assert staging is not None
                staging.done.wait()  # the reader's read and check, then the copy into the slot
                got = tier.restore_disk(1, staging, 4)
                staging.release()
                read.append(time.perf_counter() - start)
                assert got == k, got
            engine.table.truncate(slot, 0)
            c, r = statistics.median(computed) * 1e3, statistics.median(restored) * 1e3
            d = statistics.median(read) * 1e3
            print(f"{k:6d}  {c:10.2f}  {r:10.3f}  {c / r:15.0f}x  {d:7.3f}  {c / d:11.0f}x")
        disk.close()
        files.cleanup()
    finally:
        network.close()


def compare(runs: dict[str, list[dict]]) -> dict:
    """One round's figures from its ``on`` and ``off`` records: each model's median TTFT (ms)
    of later turns (turn 2 on) and of first turns, its later turns' median cached tokens, each
    turn's medians, the ratio off / on of later turns, how many turns' answers were the same
    (``same_turns``) and whether all were."""
    figures: dict = {}
    for model, records in runs.items():
        later = [x for x in records if x["turn"] > 0]
        figures[model] = {
            "later_ms": round(statistics.median(x["ttft"] for x in later) * 1e3, 1),
            "first_ms": round(
                statistics.median(x["ttft"] for x in records if x["turn"] == 0) * 1e3, 1
            ),
            "later_cached": statistics.median(x["cached"] for x in later),
            "turns": [
                (
                    round(statistics.median(x["ttft"] for x in records if x["turn"] == t) * 1e3, 1),
                    statistics.median(x["cached"] for x in records if x["turn"] == t),
                )
                for t in sorted({x["turn"] for x in records})
            ],
        }
    figures["ratio"] = round(figures["off"]["later_ms"] / figures["on"]["later_ms"], 2)
    pairs = list(zip(runs["on"], runs["off"], strict=True))
    figures["same_turns"] = sum(a["text"] == b["text"] for a, b in pairs)
    figures["same"] = figures["same_turns"] == len(pairs)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path)
    parser.add_argument("--device", default="ORT")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--offload-gib", type=float, default=1.0)
    parser.add_argument(
        "--max-model-len", type=int, help="MAX_MODEL_LEN (default 4096; --plain: 2048)"
    )
    parser.add_argument(
        "--plain", action="store_true", help="the old workload: a short question a turn, no tools"
    )
    parser.add_argument("--tool-items", type=int, default=2, help="flights in a tool's result")
    parser.add_argument("--config", action="append", default=[], help="KEY=VALUE for both models")
    parser.add_argument(
        "--crossover-only", action="store_true", help="the in-process crossover, no server"
    )
    parser.add_argument("--no-crossover", action="store_true", help="the served workload only")
    args = parser.parse_args()
    import harness  # sets sys.path for the imports below (here: the GPU check imports this)
    import llm
    from openai_serving import client, serving

    folder = args.folder or llm.export("bench-llama", "optimum-onnx")
    for key, value in harness.machine().items():
        print(f"{key}: {value}")
    print(f"folder: {folder} on {args.device}; load average {harness.load_average()}")
    if not args.no_crossover:
        crossover(folder, args.device)
    if args.crossover_only:
        return
    length = args.max_model_len or (2048 if args.plain else 4096)
    common = {"MAX_NUM_SEQS": str(args.slots), "MAX_MODEL_LEN": str(length)}
    common.update(item.split("=", 1) for item in args.config)
    models = {
        "on": (folder, args.device, {**common, "KV_OFFLOADING_SIZE": str(args.offload_gib)}),
        "off": (folder, args.device, common),
    }
    print(
        f"workload: {'plain' if args.plain else f'agent, {args.tool_items} flights a tool result'}"
    )
    ratios, same = [], True
    with serving(models) as server:
        api = client(server)
        for r in range(args.rounds):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            runs = {model: workload(api, model, args, r) for model in order}
            figures = compare(runs)
            for model in order:
                mine = figures[model]
                print(
                    f"round {r + 1} {model:3s}: later turns TTFT median {mine['later_ms']:8.1f}"
                    f" ms, first turns {mine['first_ms']:8.1f} ms, later turns' cached tokens "
                    f"median {mine['later_cached']:.0f}"
                )  # fmt: skip
            for turn in range(args.turns):
                cells = [
                    f"{m} {figures[m]['turns'][turn][0]:7.1f} ms, cached "
                    f"{figures[m]['turns'][turn][1]:5.0f}"
                    for m in ("on", "off")
                ]
                print(f"round {r + 1} turn {turn + 1}: " + "; ".join(cells))
            same = same and figures["same"]
            ratios.append(figures["ratio"])
            print(
                f"round {r + 1}: off / on = {ratios[-1]:.2f}x; answers the same: "
                f"{figures['same']}; load average {harness.load_average()}"
            )
    print(
        f"median of the rounds' ratios (later turns' TTFT, off / on): "
        f"{statistics.median(ratios):.2f}x; answers the same in every round: {same}; "
        f"load average {harness.load_average()}"
    )


if __name__ == "__main__":
    main()
