"""The generation engine's own host cost per token outside the forward, with nothing else
running: this checkout beside a base commit's.

    python tests/benchmarks/bench_engine_host.py --baseline /path/to/base/venv/bin/python \\
        [--folder HF_FOLDER] [--device TORCH] [--streams 8,32] [--new-tokens 128] [--rounds 5]
        [--sampled]

Why: issue 51's GPU targets leave the host about 115 us a streamed token at 8 streams and 38
at 32, and on a card the forward is one CUDA graph replay (microseconds of host time), so what
the engine's loop spends around it (scheduling, the runner's arrays, sampling, stop checks,
detokenizing, events) is the budget. In a server that share is hard to see: the HTTP thread
and the clients take the GIL between the engine's torch calls and the machine's other load
moves the figures by more than a change to the loop. Here the engine's loop runs in the
measuring thread itself (its own thread closed after loading), ``--streams`` requests of
``--new-tokens`` greedy tokens (``--sampled``: seeded, temperature 0.8, top-k 40, top-p
0.95, the torch sampler's general path) queued at once, each with a sender that only counts its
events: the thread's CPU time per token, the forward's (``TorchDecoder._run`` timed) and the
difference, the engine's host cost outside the forward. bench_stream_cost.py measures the
whole server. Each round runs one process of each (who goes first alternating); figures are
medians over rounds. Nothing asserts on time.

A base commit's Python is made as bench_before_after.py's: a virtual environment with
``pip install --no-deps`` of that commit (``git archive``), this venv's site-packages on its
path for the dependencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time

import harness  # sets sys.path for the imports below


class _Counting:
    """A sender that counts its events; the last request's final event stops the loop."""

    left = 0

    def __init__(self, engine) -> None:
        self.engine = engine
        self.events = 0

    cancelled = False

    def on_cancel(self, callback):
        return lambda: None

    def send(self, event, final: bool = False) -> bool:
        self.events += 1
        if final:
            _Counting.left -= 1
            if _Counting.left == 0:
                self.engine._closing = True  # the loop ends after this step
        return True

    def fail(self, error: BaseException) -> None:
        raise error


def measure(
    folder: str, device: str, counts: list[int], new: int, bursts: int, sampled: bool = False
) -> dict:
    """One process's figures, microseconds per token (run as ``--child``)."""
    from plugserve.server import Core
    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    config = {"MAX_NUM_SEQS": "64", "MAX_MODEL_LEN": "1024", "INFERENCE_NUM_THREADS": "1"}
    # the synchronous step: closing the engine ends its device stream too, and a pipelined
    # step's forward and sampling would run on that stream's thread, not the measured one
    config["ASYNC_SCHEDULING"] = "NO"
    net = Core().load_network(folder, device, config)
    engine = net.engine
    engine.close()  # its thread ends; the loop runs in this thread from now on
    spent = harness.thread_time_of(engine.decoder, "_run")
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    drawn = {"temperature": 0.8, "top_k": 40, "top_p": 0.95} if sampled else {}

    def burst(n: int, tag: str) -> tuple[float, float]:
        _Counting.left = n
        engine._closing = False
        senders = [_Counting(engine) for _ in range(n)]
        for i, sender in enumerate(senders):
            own = dataclasses.replace(params, **drawn, seed=i) if drawn else params
            engine.add(GenerationRequest(f"{tag}-{i}", [*range(300, 428), i], own), sender)
        spent[0] = 0.0
        t0 = time.thread_time()
        engine._loop()
        total = time.thread_time() - t0
        if any(s.events != new for s in senders):
            raise RuntimeError("a request did not get all its tokens")
        return total / (n * new) * 1e6, spent[0] / (n * new) * 1e6

    out = {}
    for n in counts:
        burst(n, f"warm{n}")
        found = [burst(n, f"x{n}-{b}") for b in range(bursts)]
        total = statistics.median(f[0] for f in found)
        forward = statistics.median(f[1] for f in found)
        out[f"x{n}"] = {"engine_us": total, "forward_us": forward, "host_us": total - forward}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.before_after_options(parser, device="TORCH", streams="8,32", new_tokens=128, rounds=5)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--sampled", action="store_true", help="sampled requests, not greedy")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    counts = [int(s) for s in args.streams.split(",")]
    if not args.folder:
        import llm

        args.folder = str(llm.hf_folder("tiny-llama"))
    if args.child:
        found = measure(
            args.folder, args.device, counts, args.new_tokens, args.bursts, args.sampled
        )
        print(json.dumps(found))
        return 0
    child = [__file__, "--child", "--folder", args.folder, "--device", args.device]
    child += ["--streams", args.streams, "--new-tokens", str(args.new_tokens)]
    child += ["--bursts", str(args.bursts)] + (["--sampled"] if args.sampled else [])
    pythons = {"after": sys.executable}
    if args.baseline:
        pythons["before"] = args.baseline
    blocks: dict[str, list[dict]] = {label: [] for label in pythons}
    for r in range(args.rounds):
        for label in list(pythons) if r % 2 == 0 else list(reversed(pythons)):
            out = subprocess.run(
                [pythons[label], *child], capture_output=True, text=True, check=True
            ).stdout
            blocks[label].append(json.loads(out.strip().splitlines()[-1]))
        print(f"    round {r + 1}/{args.rounds} done", file=sys.stderr)
    harness.print_summary(
        blocks, "host_us", folder=args.folder, device=args.device,
        new_tokens=args.new_tokens, sampled=args.sampled,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
