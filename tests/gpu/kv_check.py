"""The ``kv`` part of the prepared GPU check (``gpu_check.py --parts kv``): issue 61's
multi-turn agent workload on the device, the KV host tier on and off at the same slots, in
at most about a minute (less on a card).

- ``kv.multiturn``: one server serves the generation folder (``gen.folder``'s: on a card
  anchors_generate.py's config in the GPU device's default bf16; on the CPU path tests'
  tiny-llama on ``TORCH``) twice, ``on`` (``KV_OFFLOADING_SIZE``) and ``off``, each with 2
  cache slots (``MAX_NUM_SEQS``) for more conversations than that, so that every later turn
  finds its own history gone from the device. The workload is
  tests/benchmarks/bench_multiturn.py's own (:func:`bench_multiturn.workload`, its figures
  :func:`bench_multiturn.compare`): interleaved conversations, each a shared system prompt
  with tools plus its growing history (on a card the agent's turns: question, tool call, a
  JSON tool result, the answer; on the CPU path short questions, tiny-llama's context being
  512), OpenAI streaming completions, greedy. Figures: each round's median TTFT of later
  turns on and off, their ratio, the later turns' median cached tokens, per-turn medians.
  Passes when the tier was used (later turns' cached tokens above the tier-off ones) and, in
  f32 (the CPU path), the answers were the same token for token (on against off, every turn
  of every round). In bf16 (a card) they are a figure (``same``, ``same_turns``): with the
  tier a history's keys and values were computed turn by turn, without it in one prefill,
  and bf16 rounds the two differently (BENCHMARKS.md saw OpenVINO's bf16 flip greedy answers
  so; f32 keeps them the same).
- ``kv.target``: issue 61's bar, the tier cutting the median TTFT of later turns at least
  :data:`TARGET` times, on a card; the CPU path skips it (the CPU devices' bar is measured by
  bench_multiturn.py on bench-llama, BENCHMARKS.md: tiny sizes say nothing about it).

Bounded: the server's start is capped, each round runs only while the part's time is left
(one round at least), every request has a client timeout, the server is stopped (its log
saved as ``server_kv.log``) whatever happens.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

CHECKS = ("kv.multiturn", "kv.target")

#: issue 61: the host tier cuts the median TTFT of later turns at least this many times
TARGET = 3.0


class KvPlan:
    """The workload's sizes: a card's (the 2,048-token folder, bf16) or the CPU path's (tiny)."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        self.slots = 2
        self.conversations = 4 if gpu else 3
        self.turns = 5 if gpu else 3
        self.new_tokens = 24 if gpu else 4
        self.rounds = 2 if gpu else 1
        self.plain = not gpu  # tiny-llama's 512 positions hold no tool results
        self.tool_items = 1
        self.tools, self.repeats = (3, 1) if gpu else (1, 1)
        self.max_model_len = 2048 if gpu else 512
        self.seconds = 90.0 if gpu else 45.0  # the part's bound, the server's start included

    def args(self) -> Any:
        """What :func:`bench_multiturn.workload` reads."""
        return types.SimpleNamespace(
            conversations=self.conversations, turns=self.turns, new_tokens=self.new_tokens,
            plain=self.plain, tool_items=self.tool_items,
        )  # fmt: skip


def _bench() -> Any:
    """tests/benchmarks/bench_multiturn.py (after the run's own paths: tests/benchmarks'
    module names must not shadow tests/support's)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    import bench_multiturn

    return bench_multiturn


def fitted(plan: KvPlan, folder: Path) -> tuple[str, int]:
    """The system prompt, and the plan's turns cut until the longest conversation (its
    turns' text by the folder's tokenizer, ``new_tokens`` + 8 for each answer) fits
    ``max_model_len`` with its answer; the last prompt's tokens."""
    from tokenizers import Tokenizer

    bench = _bench()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    system = bench.system_prompt(plan.tools, plan.repeats)
    while True:
        count = len(tokenizer.encode(system).ids)
        for turn in range(plan.turns):
            text = (
                bench.question(plan.conversations - 1, turn, plan.rounds)
                if plan.plain
                else bench.tool_turn(plan.conversations - 1, turn, plan.rounds, plan.tool_items)
            )
            count += len(tokenizer.encode(text).ids) + (plan.new_tokens + 8) * (turn > 0)
        if count + plan.new_tokens <= plan.max_model_len or plan.turns <= 2:
            return system, count
        plan.turns -= 1


def check_multiturn(folder: Path, device: str, plan: KvPlan, out: Path, g: Any) -> dict:
    """``kv.multiturn``'s figures (see the module's docstring); raises ``g.Failed`` with them
    when the answers differ or the tier was not used."""
    import openai

    bench = _bench()
    t0 = time.monotonic()
    system, longest = fitted(plan, folder)
    common = {"MAX_NUM_SEQS": str(plan.slots), "MAX_MODEL_LEN": str(plan.max_model_len)}
    if device == "TORCH":
        common["INFERENCE_NUM_THREADS"] = "1"
    root = Path(tempfile.mkdtemp(prefix="gpu-check-kv-"))
    for name, extra in (("on", {"KV_OFFLOADING_SIZE": "1"}), ("off", {})):
        (root / name).mkdir()
        (root / name / "1").symlink_to(folder.resolve(), target_is_directory=True)
        settings = {"device": device, "config": {**common, **extra}}
        (root / name / "config.json").write_text(json.dumps(settings))
    figures: dict[str, Any] = {
        "device": device, "config": common, "offload_gib": 1, "workload": (
            "plain questions" if plan.plain else f"agent turns ({plan.tool_items} flight a result)"
        ), "conversations": plan.conversations, "turns": plan.turns, "slots": plan.slots,
        "new_tokens": plan.new_tokens, "last_prompt_tokens": longest, "rounds": [],
    }  # fmt: skip
    log = out / "server_kv.log"
    server = None
    try:
        server = g.start_server(root, min(240.0, plan.seconds * 3), log)
        figures["server_ready_s"] = round(time.monotonic() - t0, 1)
        api = openai.OpenAI(
            base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
        )
        for r in range(plan.rounds):
            spent = time.monotonic() - t0
            if r and spent * (r + 1) / r > plan.seconds:  # another round would pass the bound
                figures["rounds_cut"] = f"{r} of {plan.rounds} rounds in {spent:.0f} s"
                break
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            runs = {m: bench.workload(api, m, plan.args(), r, system) for m in order}
            figures["rounds"].append(bench.compare(runs))
            print(f"   kv round {r + 1}: {figures['rounds'][-1]}", flush=True)
    finally:
        if server is not None:
            g.stop_server(server, log)
        shutil.rmtree(root, ignore_errors=True)
    rounds = figures["rounds"]
    figures["ratio"] = round(statistics.median(x["ratio"] for x in rounds), 2)
    for model in ("on", "off"):
        figures[f"{model}_later_ms"] = statistics.median(x[model]["later_ms"] for x in rounds)
        figures[f"{model}_cached"] = statistics.median(x[model]["later_cached"] for x in rounds)
    figures["same"] = all(x["same"] for x in rounds)
    figures["same_turns"] = (
        f"{sum(x['same_turns'] for x in rounds)} of {len(rounds) * plan.turns * plan.conversations}"
    )
    if not figures["same"] and not plan.gpu:
        raise g.Failed("the answers with the tier on differ from those with it off", figures)
    if not figures["same"]:  # bf16: a history computed turn by turn rounds unlike one recomputed
        figures["note"] = "answers differ in bf16 (BENCHMARKS.md: OpenVINO's bf16 does so too)"
    if figures["on_cached"] <= figures["off_cached"]:
        raise g.Failed("the tier restored nothing (later turns' cached tokens)", figures)
    return figures


def target(found: dict | None, gpu: bool, g: Any) -> dict:
    """``kv.target``: the median ratio of later turns' TTFT, off / on, against :data:`TARGET`."""
    if not gpu:
        raise g.Skip("CPU path: the CPU devices' bar is bench_multiturn.py's on bench-llama")
    if not found:
        raise g.Failed("no figure: kv.multiturn did not pass")
    figures = {"ratio": found["ratio"], "target": TARGET}
    if found["ratio"] < TARGET:
        raise g.Failed(f"off / on {found['ratio']}x, under {TARGET}x", figures)
    return figures


def run(results: Any, gpu: bool, work: Path, g: Any) -> None:
    """The part's checks, into ``results`` (gpu_check.Results; ``g``: the gpu_check module
    running: its folder, server, Skip and Failed)."""
    plan = KvPlan(gpu)
    device = "GPU" if gpu else "TORCH"
    folder = g.make_folder(gpu, work)  # gen.folder's (made again only when the part runs alone)
    found = results.run(
        "kv.multiturn", lambda: check_multiturn(folder, device, plan, results.out, g),
        need_s=plan.seconds,
    )  # fmt: skip
    results.run("kv.target", lambda: target(found, gpu, g))
