"""The server's host cost per streamed token: CPU time of ``plugserve serve`` per token that
OpenAI streaming clients receive, at 1, 8 and 32 streams, this checkout beside a baseline.

    python tests/benchmarks/bench_stream_cost.py [--baseline /path/to/base/venv/bin/python] \\
        [--folder HF_FOLDER] [--device TORCH] [--streams 1,8,32] [--new-tokens 128] [--rounds 3]
        [--config KEY=VALUE,...] [--baseline-config ASYNC_SCHEDULING=NO]

Why: issue 51's GPU targets (8 streams at >= 2x transformers' compiled ``generate``, about
8,700 tok/s on an H200; 32 streams at >= 1.5x, about 26,500 tok/s; 1 stream at <= 1.0 ms a
token) leave the host 115 us, 38 us and under 1 ms per token for everything that is not the
card's work: the engine's step (scheduling, sampling's launches, stop checks, detokenizing),
the HTTP thread's SSE events and the writes. A CUDA graph replays the forward in a few
microseconds of host time, so on a GPU the server is host-bound unless this cost is small.
Here it is measured on the CPU with the TORCH device and tests' tiny-llama safetensors folder
(hidden 64, 2 layers: its forward is a small share), and reported three ways per token:

* ``server_cpu_us``: the server's threads' CPU time (``schedstat``) per streamed token;
* ``engine_us``: the busiest thread's (the engine's loop: its forward is in it) and
  ``others_us``: the rest (the HTTP event loop, gRPC, metrics);
* ``forward_us``: the forward alone, measured in process on the same folder and rows
  (``Engine.decoder``'s forward timed around ``TorchDecoder._run``), so that
  ``server_cpu_us - forward_us`` is the host's share the GPU would not take away.

Clients run in this process (the ``openai`` SDK, a thread a stream), and their CPU is not
counted. Rounds interleave the checkout and the baseline (who goes first alternating); each
figure is the median over rounds. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness  # sets sys.path for the imports below


def _threads(pid: int) -> dict[str, float]:
    """Each thread's CPU seconds, from ``schedstat`` (nanoseconds): ``stat``'s 10 ms ticks
    were 2.4 us a token at 32 streams of 128 tokens, 9.8 at 8 and 78 at 1 (issue 60)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                out[task] = int(f.read().split()[0]) / 1e9
        except OSError:
            continue  # a thread that ended meanwhile
    return out


def _keys(text: str) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` as config keys."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def _repository(folder: Path, device: str, extra: dict[str, str] | None = None) -> Path:
    root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    (root / "decoder").mkdir()
    (root / "decoder" / "1").symlink_to(folder.resolve(), target_is_directory=True)
    config = {"MAX_NUM_SEQS": "64", "MAX_MODEL_LEN": "1024", "MAX_NUM_BATCHED_TOKENS": "4096"}
    if device == "TORCH":
        config["INFERENCE_NUM_THREADS"] = "1"  # plugins/torch/decoder.py: tiny models
    config.update(extra or {})
    spec = {"device": device, "config": config}
    (root / "decoder" / "config.json").write_text(json.dumps(spec))
    return root


def stream(url: str, n: int, new: int, seed: int) -> tuple[int, float]:
    """``n`` streaming completions at once; (tokens received by usage, wall seconds)."""
    import numpy as np
    import openai

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(300, 2000, 128).tolist() for _ in range(n)]
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    got = [0] * n
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            chunks = client.completions.create(
                model="decoder", prompt=prompts[i], max_tokens=new, temperature=0.0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in chunks:
                if chunk.usage is not None:
                    got[i] = chunk.usage.completion_tokens
        except Exception as exc:  # reported, the round is void
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} streams failed: {errors[0]}")
    return sum(got), time.perf_counter() - t0


def measure_server(
    python: str,
    folder: Path,
    device: str,
    counts: list[int],
    new: int,
    extra: dict[str, str] | None = None,
) -> dict:
    """One server process of ``python`` (``extra``: more config keys for the model): per
    stream count, CPU per token (process, busiest thread, the rest) and tokens per second."""
    from serving import RunningServer

    root = _repository(folder, device, extra)
    server = RunningServer("--model-repository", str(root), python=python)
    try:
        server.start(timeout=240)
        assert server.process is not None
        pid = server.process.pid
        url = f"{server.http_url}/v1"
        stream(url, 1, 8, seed=1)  # warm-up
        stream(url, max(counts), 8, seed=2)
        out = {}
        for n in counts:
            threads = _threads(pid)
            tokens, wall = stream(url, n, new, seed=n)
            threads_after = _threads(pid)
            deltas = sorted(
                (threads_after[t] - threads.get(t, 0.0) for t in threads_after), reverse=True
            )
            total = sum(deltas)  # (a thread that ended within the window is not counted)
            busiest = deltas[0] if deltas else 0.0
            out[f"x{n}"] = {
                "tok_per_s": tokens / wall,
                "server_cpu_us": total / tokens * 1e6,
                "engine_us": busiest / tokens * 1e6,
                "others_us": (total - busiest) / tokens * 1e6,
            }
        return out
    finally:
        server.stop(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def measure_forward(folder: Path, device: str, counts: list[int], new: int) -> dict:
    """The forward alone per token, in process: ``n`` rows decoding together (the decoder's
    ``_run``; OPENVINO's paged decoder has none: its ``_forward``, the inputs' few arrays and
    the infer request)."""
    from plugserve.server import Core
    from plugserve.server.apps.generate.types import GenerationRequest, SamplingParams

    config = {"MAX_NUM_SEQS": "64", "MAX_MODEL_LEN": "1024", "INFERENCE_NUM_THREADS": "1"}
    net = Core().load_network(str(folder), device, config)
    decoder = net.engine.decoder
    spent = harness.thread_time_of(decoder, "_run" if hasattr(decoder, "_run") else "_forward")
    out = {}
    try:
        for n in counts:
            params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            prompts = [[*range(300, 428), i] for i in range(n)]
            spent[0] = 0.0

            def one(i: int, prompts=prompts, params=params) -> None:
                request = GenerationRequest(
                    f"f{len(prompts)}-{i}-{time.time_ns()}", prompts[i], params
                )
                for _event in net.engine.generate(request):
                    pass

            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            out[f"x{n}"] = spent[0] / (n * new) * 1e6
    finally:
        net.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.before_after_options(
        parser, device="TORCH", streams="1,8,32", new_tokens=128, rounds=3, configs=True
    )
    args = parser.parse_args(argv)
    counts = [int(s) for s in args.streams.split(",")]
    if not args.folder:
        import llm

        args.folder = str(llm.hf_folder("tiny-llama"))
    folder = Path(args.folder)
    pythons = {"after": sys.executable}
    keys = {"after": _keys(args.config), "before": _keys(args.config)}
    if args.baseline or args.baseline_config is not None:
        pythons["before"] = args.baseline or sys.executable
        if args.baseline_config is not None:
            keys["before"] = _keys(args.baseline_config)
    blocks: dict[str, list[dict]] = {label: [] for label in pythons}
    for r in range(args.rounds):
        order = list(pythons) if r % 2 == 0 else list(reversed(pythons))
        for label in order:
            blocks[label].append(
                measure_server(
                    pythons[label], folder, args.device, counts, args.new_tokens, keys[label]
                )
            )
        print(f"    round {r + 1}/{args.rounds} done", file=sys.stderr)
    forward = measure_forward(folder, args.device, counts, args.new_tokens)
    harness.print_summary(
        blocks, "server_cpu_us", folder=str(folder), device=args.device,
        new_tokens=args.new_tokens,
        forward_us_per_token={k: round(v, 1) for k, v in forward.items()},
        config={label: keys[label] for label in pythons},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
