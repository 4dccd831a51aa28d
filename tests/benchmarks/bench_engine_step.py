"""The generation engine's cost per token in process, this checkout beside a base commit's.

    python tests/benchmarks/bench_engine_step.py --baseline /path/to/base/venv/bin/python \\
        [--folder FOLDER] [--device ORT] [--new-tokens 384] [--requests 5] [--rounds 10] \\
        [--config KEY=VALUE,...] [--baseline-config KEY=VALUE,...]

    python tests/benchmarks/bench_engine_step.py --device TORCH --baseline-config \\
        ASYNC_SCHEDULING=NO   # pipelined decode steps against synchronous ones

Each round runs one process of each (who goes first alternating), each loading the folder
(default: tests/support/llm.py's tiny-llama exported by onnxruntime-genai's builder, ~0.4 M
parameters: its forward takes tens of microseconds, so what a step costs is mostly the
engine's own Python, which is what a change to the engine changes) and timing
``--requests`` requests through ``Engine.generate`` (greedy, end of sequence ignored): one
stream alone, then 8 at once. Per token: the wall time, the process's CPU time and the engine
loop thread's own (which the machine's other load moves less). Each figure is a median over
the rounds, and the ratios are medians of each round's after / before. Nothing asserts on
time.

A base commit's Python is made as bench_before_after.py's: a virtual environment with
``pip install --no-deps`` of that commit (``git archive``), this venv's site-packages on its
path for the dependencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

import harness  # sets sys.path for the imports below


def measure(folder: str, device: str, new: int, requests: int, extra: str = "") -> dict[str, float]:
    """One process's medians, microseconds per token (run as ``--child``; ``extra``: more
    config keys, ``KEY=VALUE,...``)."""
    from plugserve.server import Core
    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    config = {"MAX_NUM_SEQS": "9", "MAX_MODEL_LEN": str(new + 64)}
    if device == "TORCH":
        config["INFERENCE_NUM_THREADS"] = "1"  # plugins/torch/decoder.py: tiny models
    config.update(dict(item.split("=", 1) for item in extra.split(",") if item))
    net = Core().load_network(folder, device, config)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    def one(i: int) -> None:
        prompt = [*range(100, 131), 100 + i]
        for _event in net.engine.generate(
            GenerationRequest(f"r{i}-{time.time_ns()}", prompt, params)
        ):
            pass

    one(0)  # warm-up
    # the engine's loop thread's own CPU time: its forwards' Python and its sampling,
    # detokenizing and sending, not the consumers' threads
    clock = time.pthread_getcpuclockid(net.engine._thread.ident)
    found: dict[str, list[float]] = {}
    for r in range(requests):
        for streams in (1, 8):
            threads = [threading.Thread(target=one, args=(r * 8 + k,)) for k in range(streams)]
            wall, cpu = time.perf_counter(), time.process_time()
            loop = time.clock_gettime(clock)
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            tokens = streams * new
            for key, value in (
                ("wall", time.perf_counter() - wall),
                ("cpu", time.process_time() - cpu),
                ("engine_cpu", time.clock_gettime(clock) - loop),
            ):
                found.setdefault(f"x{streams}_{key}", []).append(value / tokens * 1e6)
    net.close()
    return {k: statistics.median(v) for k, v in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.before_after_options(parser, device="ORT", new_tokens=384, rounds=10, configs=True)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(
            json.dumps(
                measure(args.folder, args.device, args.new_tokens, args.requests, args.config)
            )
        )
        return 0
    if not args.baseline and args.baseline_config is None:
        parser.error("--baseline PYTHON: a base commit's Python (see the module's docstring)")
    if not args.folder:
        import llm

        args.folder = str(
            llm.hf_folder("tiny-llama")
            if args.device == "TORCH"
            else llm.export("tiny-llama", "genai-fp32")
        )
    child = [__file__, "--child", "--folder", args.folder]
    child += ["--device", args.device, "--new-tokens", str(args.new_tokens)]
    child += ["--requests", str(args.requests)]
    pythons = {"after": sys.executable, "before": args.baseline or sys.executable}
    configs = {"after": args.config, "before": args.config}
    if args.baseline_config is not None:
        configs["before"] = args.baseline_config
    blocks: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
    for r in range(args.rounds):
        for label in ("after", "before") if r % 2 == 0 else ("before", "after"):
            out = subprocess.run(
                [pythons[label], *child, "--config", configs[label]],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            blocks[label].append(json.loads(out.strip().splitlines()[-1]))
        print(f"    round {r + 1}/{args.rounds} done", file=sys.stderr)
    summary: dict[str, object] = {
        "machine": harness.machine(), "folder": args.folder, "config": configs,
    }  # fmt: skip
    for key in blocks["after"][0]:
        after = [b[key] for b in blocks["after"]]
        before = [b[key] for b in blocks["before"]]
        summary[f"{key}_us_per_token"] = {
            "after": round(statistics.median(after), 1),
            "before": round(statistics.median(before), 1),
            "after / before": round(statistics.median(a / b for a, b in zip(after, before)), 3),
        }
    summary["load_average"] = harness.load_average()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
