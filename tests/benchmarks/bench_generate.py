"""plugserve's generation engine against onnxruntime-genai (issue 37), in one run on one folder.

The folder: tests/support/llm.py's ``bench-llama`` (~169 M parameters) exported by
onnxruntime-genai's model builder in fp32 (``--folder`` for another). plugserve serves it
(``--device``, ORT by default) and is asked over tritonclient's ModelStreamInfer, greedily,
end-of-sequence ignored, the prompts as token ids (the same ids both sides get):

- ``plugserve x8``: 8 concurrent streams (one request each on one gRPC stream); output
  tokens/s = 8 x new tokens / the time from the first request sent to the last answer;
- ``genai x8``: onnxruntime-genai in process (its Generator, in its own virtual environment:
  genai_worker.py) generating the same 8 prompts as one batch; tokens/s the same way;
- ``plugserve x1`` and ``genai x1``: one prompt; the mean time per token after the first
  (plugserve: between the first and the last streamed response).

Cases run interleaved, alternating order, for ``--rounds`` rounds; each figure is a median, and
the ratios are medians of the rounds' ratios. The issue's targets: tokens/s at 8 streams
>= 1.0x genai's batch, single-stream time per token <= 1.3x genai's. The CPU, load average and
versions are printed: on a shared machine the numbers move with what else runs.

With ``--long-prompt 2000``: a 2,000-token prompt sent while the 8 streams decode, its time to
first token and the streams' gaps between two tokens meanwhile (prompts are computed in chunks
of ``max_num_batched_tokens``, 256 on ORT by default, so the streams keep going).

With ``--baseline PYTHON`` (a virtual environment with a base commit installed, as
bench_before_after.py takes), that commit's server serves the same folder beside this
checkout's, and its ``before x8`` and ``before x1`` run interleaved with the others: what a
change to the engine costs a step shows as the ratios ``after / before`` (medians of the
rounds'), and the baseline's own ratios to onnxruntime-genai beside this checkout's.
``--no-genai`` leaves onnxruntime-genai out (a before/after run only).

    python tests/benchmarks/bench_generate.py [--rounds 3] [--new-tokens 64] [--prompt-tokens 32]
        [--long-prompt 2000] [--baseline /path/to/base/venv/bin/python] [--no-genai]
        [--device TORCH --folder SAFETENSORS_FOLDER] [--config KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # sets sys.path for the imports below
import numpy as np

HERE = Path(__file__).resolve().parent


def prompt_ids(batch: int, length: int, vocab: int) -> np.ndarray:
    """genai_worker.py's prompts."""
    rng = np.random.default_rng(0)
    return rng.integers(100, min(vocab, 10000), (batch, length)).astype(np.int32)


class Genai:
    """onnxruntime-genai in its own process, the model loaded once."""

    def __init__(self, python: Path, folder: Path) -> None:
        self.process = subprocess.Popen(
            [str(python), str(HERE / "genai_worker.py"), str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.process.stdout.readline())["ready"]

    def run(self, batch: int, length: int, new: int) -> dict:
        self.process.stdin.write(f"{batch} {length} {new}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def plugserve_run(target: str, model: str, ids: np.ndarray, new: int) -> dict:
    """Every row of ``ids`` as one streamed request at once; timings of their answers."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(target)
    answers: queue.Queue = queue.Queue()
    client.start_stream(
        callback=lambda result, error: answers.put((time.perf_counter(), result, error))
    )
    params = json.dumps({"max_tokens": new, "temperature": 0, "ignore_eos": True}).encode()
    start = time.perf_counter()
    for i, row in enumerate(ids):
        inputs = [
            grpcclient.InferInput("input_ids", [len(row)], "INT32"),
            grpcclient.InferInput("stream", [1], "BOOL"),
            grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
            grpcclient.InferInput("return_num_output_tokens", [1], "BOOL"),
        ]
        inputs[0].set_data_from_numpy(row)
        inputs[1].set_data_from_numpy(np.array([True]))
        inputs[2].set_data_from_numpy(np.array([params], dtype=object))
        inputs[3].set_data_from_numpy(np.array([True]))
        client.async_stream_infer(
            model, inputs, request_id=str(i), enable_empty_final_response=True
        )
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens = 0
    while len(last) < len(ids):
        when, result, error = answers.get(timeout=3600)
        if error is not None:
            raise RuntimeError(error)
        response = result.get_response()
        first.setdefault(response.id, when)
        count = result.as_numpy("num_output_tokens")
        if response.parameters["triton_final_response"].bool_param:
            last[response.id] = when
            tokens += int(count[0]) if count is not None else new
    client.stop_stream()
    client.close()
    end = max(last.values())
    per = [(last[i] - first[i]) / (new - 1) for i in last]
    return {
        "first_s": max(first.values()) - start,
        "total_s": end - start,
        "per_token_ms": statistics.median(per) * 1e3,
        "tokens_per_s": tokens / (end - start),
    }


def long_prompt_run(
    target: str, model: str, streams: np.ndarray, long: np.ndarray, new: int
) -> dict:
    """``streams`` decoding (``new`` tokens each), then ``long`` sent once each has its first
    token: the long prompt's time to first token, and the streams' gaps between two tokens
    while it was computed (split prefill keeps them short)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(target)
    answers: queue.Queue = queue.Queue()
    client.start_stream(
        callback=lambda result, error: answers.put((time.perf_counter(), result, error))
    )

    def send(rid: str, row: np.ndarray, tokens: int) -> None:
        params = json.dumps({"max_tokens": tokens, "temperature": 0, "ignore_eos": True}).encode()
        inputs = [
            grpcclient.InferInput("input_ids", [len(row)], "INT32"),
            grpcclient.InferInput("stream", [1], "BOOL"),
            grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
        ]
        inputs[0].set_data_from_numpy(row.astype(np.int32))
        inputs[1].set_data_from_numpy(np.array([True]))
        inputs[2].set_data_from_numpy(np.array([params], dtype=object))
        client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)

    for i, row in enumerate(streams):
        send(str(i), row, new)
    times: dict[str, list[float]] = {}
    finals: set[str] = set()
    sent_long = first_long = 0.0
    while len(finals) < len(streams) + 1:
        when, result, error = answers.get(timeout=3600)
        if error is not None:
            raise RuntimeError(error)
        response = result.get_response()
        times.setdefault(response.id, []).append(when)
        if response.parameters["triton_final_response"].bool_param:
            finals.add(response.id)
        if response.id == "long" and not first_long:
            first_long = when
        if not sent_long and len(times) == len(streams):
            sent_long = time.perf_counter()
            send("long", long, 4)
    client.stop_stream()
    client.close()
    gaps = [
        b - a
        for rid, stamps in times.items()
        if rid != "long"
        for a, b in itertools.pairwise(stamps)
        if sent_long <= b <= first_long + 1e-3
    ]
    return {
        "long_prompt_ttft_s": first_long - sent_long,
        "streams_gap_p50_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
        "streams_gap_max_ms": max(gaps) * 1e3 if gaps else float("nan"),
        "streams_gaps": len(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--folder", default="", help="a model builder folder (default: bench-llama)"
    )
    parser.add_argument("--device", default="ORT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="also: a prompt of this many tokens sent while the streams decode (its time to "
        "first token, the streams' gaps meanwhile); 0: not run",
    )
    parser.add_argument(
        "--baseline", default="", metavar="PYTHON", help="a base commit's Python, served beside"
    )
    parser.add_argument("--no-genai", action="store_true", help="leave onnxruntime-genai out")
    parser.add_argument(
        "--config", action="append", default=[], help="KEY=VALUE in the model's config"
    )
    args = parser.parse_args(argv)

    import llm
    from serving import RunningServer

    folder = Path(args.folder) if args.folder else llm.export("bench-llama", "genai-fp32")
    genai_python = None if args.no_genai else llm.GENAI.python()
    if (folder / "genai_config.json").is_file():
        vocab = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
    else:  # a safetensors folder (TORCH)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    print(json.dumps({"machine": harness.machine(), "folder": str(folder), "args": vars(args)}))

    root = Path(tempfile.mkdtemp(prefix="plugserve-bench-generate-"))
    (root / "bench").mkdir()
    (root / "bench" / "1").symlink_to(folder, target_is_directory=True)
    context = max(args.prompt_tokens, args.long_prompt) + args.new_tokens + 16
    settings = {
        "device": args.device,
        "config": {
            "MAX_NUM_SEQS": str(args.streams + 1),
            "MAX_MODEL_LEN": str(context),
            **dict(item.split("=", 1) for item in args.config),
        },
    }
    (root / "bench" / "config.json").write_text(json.dumps(settings))
    flags = ["--model-repository", str(root), "--grpc-port", "0", "--http-port", "-1"]
    flags += ["--metrics-port", "-1"]
    server = RunningServer(*flags).start(timeout=600)
    base = RunningServer(*flags, python=args.baseline).start(timeout=600) if args.baseline else None
    genai = Genai(genai_python, folder) if genai_python is not None else None
    ids = prompt_ids(args.streams, args.prompt_tokens, vocab)
    length, new = args.prompt_tokens, args.new_tokens
    many, one = f"x{args.streams}", "x1"
    cases = {}
    if genai is not None:
        cases[f"genai {many}"] = lambda: genai.run(args.streams, length, new)
    cases[f"plugserve {many}"] = lambda: plugserve_run(server.target, "bench", ids, new)
    if base is not None:
        cases[f"before {many}"] = lambda: plugserve_run(base.target, "bench", ids, new)
    if genai is not None:
        cases["genai x1"] = lambda: genai.run(1, length, new)
    cases["plugserve x1"] = lambda: plugserve_run(server.target, "bench", ids[:1], new)
    if base is not None:
        cases["before x1"] = lambda: plugserve_run(base.target, "bench", ids[:1], new)
    try:
        for case in cases.values():  # warm-up
            case()
        results = harness.interleave(cases, args.rounds, lambda m: print(m, file=sys.stderr), True)
        if args.long_prompt:
            long = np.random.default_rng(1).integers(100, min(vocab, 10000), args.long_prompt)
            # the streams go on long enough to decode through the whole prompt's chunks
            split = long_prompt_run(server.target, "bench", ids, long, 4 * args.new_tokens)
    finally:
        if genai is not None:
            genai.close()
        if base is not None:
            base.stop()
        server.stop()
        for path in sorted(root.rglob("*"), reverse=True):
            path.unlink() if path.is_symlink() or path.is_file() else path.rmdir()
        root.rmdir()

    def ratio(key: str, top: str, bottom: str) -> float:
        rounds = zip(results[top], results[bottom])
        return round(statistics.median(t[key] / b[key] for t, b in rounds), 3)

    summary = {
        name: {
            k: round(harness.median_of(blocks, k), 3)
            for k in ("tokens_per_s", "per_token_ms", "first_s")
        }
        for name, blocks in results.items()
    }
    summary["ratios"] = {}
    if genai is not None:
        summary["ratios"] = {
            f"tokens/s at {args.streams} streams, plugserve / genai (target >= 1.0)": ratio(
                "tokens_per_s", f"plugserve {many}", f"genai {many}"
            ),
            "single-stream time per token, plugserve / genai (target <= 1.3)": ratio(
                "per_token_ms", f"plugserve {one}", f"genai {one}"
            ),
        }
        if base is not None:  # the baseline's own standing against the same anchor
            summary["ratios"][f"tokens/s at {args.streams} streams, before / genai"] = ratio(
                "tokens_per_s", f"before {many}", f"genai {many}"
            )
            summary["ratios"]["single-stream time per token, before / genai"] = ratio(
                "per_token_ms", f"before {one}", f"genai {one}"
            )
    if base is not None:
        for key, what in (("tokens_per_s", "tokens/s"), ("per_token_ms", "time per token")):
            for streams in (many, one):
                after, before = results[f"plugserve {streams}"], results[f"before {streams}"]
                summary["ratios"][f"{what} {streams}, after / before"] = ratio(
                    key, f"plugserve {streams}", f"before {streams}"
                )
                summary["ratios"][f"{what} {streams}, each round"] = [
                    round(a[key] / b[key], 3) for a, b in zip(after, before)
                ]
    if args.long_prompt:
        summary[f"a {args.long_prompt}-token prompt while {args.streams} streams decode"] = {
            k: round(v, 3) for k, v in split.items()
        }
    summary["load_average"] = harness.load_average()
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
