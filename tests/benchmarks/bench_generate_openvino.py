"""plugserve's generation engine on OPENVINO against openvino-genai's ContinuousBatchingPipeline
(issue 37), both in this process, on one OpenVINO IR folder, in the same precision.

The folder: tests/support/llm.py's ``bench-llama`` (~169 M parameters) exported by optimum-intel
(``--folder`` for another). Both sides compile the same IR in openvino's paged-attention form
with the same properties (``--precision``: the device's own choice by default, or f32, bf16,
f16 as INFERENCE_PRECISION_HINT; the key/value cache in the type the CPU plugin picks for it,
on both sides), the same scheduler settings (``max_num_batched_tokens``, ``max_num_seqs``,
the cache for ``max_num_seqs`` sequences of the whole context, no prefix caching, split
prefill), and the same prompts as token ids (seeded random ids), greedily, end of sequence
ignored:

- ``plugserve xN``: N sequences at once through ``Engine.generate`` (one thread each, as N
  clients' streams); output tokens/s = N x new tokens / the time from the first request to
  the last answer;
- ``genai xN``: ``ContinuousBatchingPipeline.generate`` of the same N prompts; tokens/s the
  same way;
- ``plugserve x1`` and ``genai x1``: one prompt; the time to its first token and the mean
  time per token after it (genai: ``add_request`` then ``step`` until done, reading the
  handle after each step);
- with ``--long-prompt 2000``: the N streams decoding, then a 2,000-token prompt sent once
  each has its first token: its time to first token and the streams' gaps between two
  tokens meanwhile (both split the prompt into ``max_num_batched_tokens`` chunks computed
  beside the decoding rows, in the same forward).

Cases run interleaved, alternating order, for ``--rounds`` rounds; each figure is a median, and
the ratios are medians of the rounds' ratios. The issue's aim: plugserve's tokens/s at 8
streams >= 0.8x openvino-genai's. Both sides' greedy tokens are compared (the same graph and
kernels: they agree unless a reduced precision makes near ties fall differently). The CPU,
load average and versions are printed: on a shared machine the numbers move with what else
runs.

    python tests/benchmarks/bench_generate_openvino.py [--rounds 3] [--new-tokens 64]
        [--prompt-tokens 32] [--streams 8] [--precision f32] [--long-prompt 2000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(100, min(vocab, 10000), (count, length)).tolist()


def properties(precision: str) -> dict[str, str]:
    return {"INFERENCE_PRECISION_HINT": precision} if precision else {}


class Plugserve:
    """The IR folder loaded by plugserve's Core on OPENVINO: its engine."""

    def __init__(self, folder: Path, precision: str, seqs: int, batched: int) -> None:
        from plugserve.server import Core

        config = {
            **properties(precision),
            "MAX_NUM_SEQS": str(seqs),
            "MAX_NUM_BATCHED_TOKENS": str(batched),
            "ENABLE_PREFIX_CACHING": "NO",
        }
        self.network = Core().load_network(str(folder), "OPENVINO", config)
        self.engine = self.network.engine
        caches = self.engine.cache.arrays
        self.kv = str(next(iter(caches.values())).dtype)
        self.kv_mib = self.engine.cache.nbytes / (1 << 20)

    def run(self, ids: list[list[int]], new: int) -> dict:
        from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        times: dict[int, list[float]] = {}
        tokens: dict[int, list[int]] = {}

        def one(i: int) -> None:
            request = GenerationRequest(f"bench-{time.monotonic_ns()}-{i}", ids[i], params)
            stamps, out = [], []
            for event in self.engine.generate(request):
                stamps.append(time.perf_counter())
                out.extend(event.token_ids)
            times[i], tokens[i] = stamps, out

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ids))]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return summary(start, times, tokens)

    def long_prompt(self, ids: list[list[int]], long: list[int], new: int) -> dict:
        """``ids`` decoding, then ``long`` sent once each has its first token."""
        from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

        times: dict[str, list[float]] = {}
        started = threading.Barrier(len(ids) + 1)

        def one(name: str, prompt: list[int], tokens: int) -> None:
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            request = GenerationRequest(f"{name}-{time.monotonic_ns()}", prompt, params)
            stamps = times.setdefault(name, [])
            for _event in self.engine.generate(request):
                stamps.append(time.perf_counter())
                if len(stamps) == 1 and name != "long":
                    started.wait()

        threads = [threading.Thread(target=one, args=(str(i), r, new)) for i, r in enumerate(ids)]
        for thread in threads:
            thread.start()
        started.wait()
        sent = time.perf_counter()
        one("long", long, 4)
        for thread in threads:
            thread.join()
        return gaps_while(times, sent)

    def close(self) -> None:
        self.network.close()


class Genai:
    """openvino-genai's ContinuousBatchingPipeline on the same folder and properties."""

    def __init__(self, folder: Path, precision: str, seqs: int, batched: int, blocks: int) -> None:
        import openvino_genai as og

        self.og = og
        scheduler = og.SchedulerConfig()
        scheduler.max_num_batched_tokens = batched
        scheduler.max_num_seqs = seqs
        scheduler.num_kv_blocks = blocks
        scheduler.enable_prefix_caching = False
        scheduler.dynamic_split_fuse = True
        self.pipe = og.ContinuousBatchingPipeline(
            str(folder), scheduler, "CPU", properties(precision)
        )
        self.next_id = 0

    def config(self, new: int):
        config = self.og.GenerationConfig()
        config.max_new_tokens = new
        config.ignore_eos = True
        config.do_sample = False
        return config

    def run(self, ids: list[list[int]], new: int) -> dict:
        import openvino as ov

        tensors = [ov.Tensor(np.array([row], np.int64)) for row in ids]
        if len(ids) > 1:  # its own loop, as a user of the pipeline calls it
            start = time.perf_counter()
            results = self.pipe.generate(tensors, [self.config(new)] * len(ids))
            end = time.perf_counter()
            tokens = {i: list(r.m_generation_ids[0]) for i, r in enumerate(results)}
            return {
                "tokens_per_s": sum(len(t) for t in tokens.values()) / (end - start),
                "total_s": end - start,
                "tokens": tokens,
            }
        self.next_id += 1
        start = time.perf_counter()
        handle = self.pipe.add_request(self.next_id, tensors[0], self.config(new))
        stamps, out = [], []
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            if handle.can_read():
                for output in handle.read().values():
                    stamps.append(time.perf_counter())
                    out.extend(output.generated_ids)
        return summary(start, {0: stamps}, {0: out})


def genai_long_prompt(genai: Genai, ids: list[list[int]], long: list[int], new: int) -> dict:
    """The same with openvino-genai: ``add_request`` for each, ``step`` until done, each
    handle read after every step."""
    import openvino as ov

    handles = {}
    for i, row in enumerate(ids):
        genai.next_id += 1
        tensor = ov.Tensor(np.array([row], np.int64))
        handles[str(i)] = genai.pipe.add_request(genai.next_id, tensor, genai.config(new))
    times: dict[str, list[float]] = {}
    sent = 0.0
    while genai.pipe.has_non_finished_requests():
        genai.pipe.step()
        now = time.perf_counter()
        for name, handle in handles.items():
            if handle.can_read():
                for _output in handle.read().values():
                    times.setdefault(name, []).append(now)
        if not sent and len(times) == len(ids):
            sent = time.perf_counter()
            genai.next_id += 1
            tensor = ov.Tensor(np.array([long], np.int64))
            handles["long"] = genai.pipe.add_request(genai.next_id, tensor, genai.config(4))
    return gaps_while(times, sent)


def gaps_while(times: dict[str, list[float]], sent: float) -> dict:
    """The long prompt's time to first token, and the streams' gaps between two tokens
    that ended while it was computed."""
    first = times["long"][0]
    gaps = [
        b - a
        for name, stamps in times.items()
        if name != "long"
        for a, b in itertools.pairwise(stamps)
        if sent <= b <= first + 1e-3
    ]
    return {
        "long_ttft_ms": (first - sent) * 1e3,
        "gap_p50_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
        "gap_max_ms": max(gaps) * 1e3 if gaps else float("nan"),
    }


def summary(start: float, times: dict[int, list[float]], tokens: dict[int, list[int]]) -> dict:
    end = max(t[-1] for t in times.values())
    count = sum(len(t) for t in tokens.values())
    per = [(t[-1] - t[0]) / max(1, len(tokens[i]) - 1) for i, t in times.items()]
    return {
        "tokens_per_s": count / (end - start),
        "total_s": end - start,
        "first_ms": (max(t[0] for t in times.values()) - start) * 1e3,
        "per_token_ms": statistics.median(per) * 1e3,
        "tokens": tokens,
    }


def timed(run):
    """``run`` with the process's CPU seconds per output token added (every thread of this
    process: the engine's, openvino's): on a shared machine the wall clock measures the
    neighbours too, the CPU time mostly the work."""

    def call() -> dict:
        before = time.process_time()
        result = run()
        spent = time.process_time() - before
        result["cpu_ms_per_token"] = spent * 1e3 / sum(len(t) for t in result["tokens"].values())
        return result

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, help="an IR folder (default: bench-llama's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--precision", default="", choices=["", "f32", "bf16", "f16"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="also: a prompt of this many tokens sent while the streams decode (its time to "
        "first token, the streams' gaps between tokens meanwhile)",
    )
    args = parser.parse_args()
    folder = args.folder
    if folder is None:
        import llm

        folder = llm.export("bench-llama", "openvino")
    for key, value in harness.machine().items():
        print(f"{key}: {value}")
    import openvino as ov

    try:
        import openvino_genai as og
    except ImportError:
        raise SystemExit(
            "openvino-genai is the anchor: pip install openvino-genai==2026.4.1.0"
        ) from None

    print(f"openvino_genai: {og.__version__}")
    print(f"load average: {harness.load_average()}")
    cpu = ov.Core()
    print(f"openvino CPU: {cpu.get_property('CPU', 'FULL_DEVICE_NAME')}, capabilities "
          f"{cpu.get_property('CPU', 'OPTIMIZATION_CAPABILITIES')}")  # fmt: skip
    seqs = args.streams + (1 if args.long_prompt else 0)  # the long prompt needs a slot too
    ours = Plugserve(folder, args.precision, seqs, args.max_num_batched_tokens)
    blocks = ours.engine.cache.rows * ours.engine.cache.per_slot
    theirs = Genai(folder, args.precision, seqs, args.max_num_batched_tokens, blocks)
    print(
        f"folder: {folder}\nprecision: {args.precision or 'the device default'} -> plugserve "
        f"computes in {ours.network.precision}, key/value cache {ours.kv} "
        f"({ours.kv_mib:.0f} MiB)"
    )
    vocab = ours.engine.decoder.vocab
    many = prompts(args.streams, args.prompt_tokens, vocab)
    one = many[:1]
    new = args.new_tokens
    cases = {
        f"plugserve x{args.streams}": lambda: ours.run(many, new),
        f"genai x{args.streams}": lambda: theirs.run(many, new),
        "plugserve x1": lambda: ours.run(one, new),
        "genai x1": lambda: theirs.run(one, new),
    }
    for name, run in list(cases.items()):
        cases[name] = timed(run)
    if args.long_prompt:
        long = prompts(1, args.long_prompt, vocab)[0]
        cases["plugserve long"] = lambda: ours.long_prompt(many, long, new)
        cases["genai long"] = lambda: genai_long_prompt(theirs, many, long, new)
    for run in cases.values():  # warm up: first compilation of each shape
        run()
    results: dict[str, list[dict]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(cases[name]())
        print(f"round {r + 1}/{args.rounds} done (load {harness.load_average()})", flush=True)
    n = args.streams

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in results[name])

    def ratio(top: str, bottom: str, key: str) -> float:
        return statistics.median(
            a[key] / b[key] for a, b in zip(results[top], results[bottom], strict=True)
        )

    speed = [name for name in names if "tokens_per_s" in results[name][0]]
    agree = []
    for a, b in zip(results[f"plugserve x{n}"], results[f"genai x{n}"], strict=True):
        pairs = [(a["tokens"][i], b["tokens"][i]) for i in range(n)]
        agree.append(sum(x == y for x, y in pairs) / n)
    print(f"\n{'case':<16}{'tokens/s':>10}{'first ms':>10}{'ms/token':>10}{'CPU ms/tok':>12}")
    for name in speed:
        first = med(name, "first_ms") if "first_ms" in results[name][0] else float("nan")
        per = med(name, "per_token_ms") if "per_token_ms" in results[name][0] else float("nan")
        cpu = med(name, "cpu_ms_per_token")
        print(f"{name:<16}{med(name, 'tokens_per_s'):>10.1f}{first:>10.0f}{per:>10.1f}{cpu:>12.1f}")
    print(
        f"\nx{n} tokens/s: plugserve / genai = "
        f"{ratio(f'plugserve x{n}', f'genai x{n}', 'tokens_per_s'):.2f}  (aim >= 0.8)"
    )
    print(
        "x1 time per token: plugserve / genai = "
        f"{ratio('plugserve x1', 'genai x1', 'per_token_ms'):.2f}"
    )
    print(
        f"x{n} CPU time per token: plugserve / genai = "
        f"{ratio(f'plugserve x{n}', f'genai x{n}', 'cpu_ms_per_token'):.2f}"
    )
    if args.long_prompt:
        print(f"\n{args.long_prompt}-token prompt while {n} streams decode:")
        print(f"{'case':<16}{'TTFT ms':>10}{'gap p50':>10}{'gap max':>10}")
        for name in ("plugserve long", "genai long"):
            print(
                f"{name:<16}{med(name, 'long_ttft_ms'):>10.0f}{med(name, 'gap_p50_ms'):>10.0f}"
                f"{med(name, 'gap_max_ms'):>10.0f}"
            )
    print(f"greedy answers identical at x{n}: {statistics.median(agree):.0%} of the streams")
    ours.close()


if __name__ == "__main__":
    main()
