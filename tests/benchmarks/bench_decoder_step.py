"""One decode step of onnxruntime-genai's builder folder of the ~169 M-parameter Llama-style
benchmark model on NUMPY against onnxruntime, in process, the same feeds to both.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_decoder_step.py \\
        [--precision fp32 int4] [--batch 1] [--past 128] [--cache shared|growing] \\
        [--rounds 5] [--seconds 2]

The model is tests/support/llm.py's ``bench-llama`` (hidden 1024, 12 layers, 16 query and 4
key/value heads, MLP 2816, vocabulary 16384, seeded weights), exported by the model builder in
its own venv once and cached. A step is one new token per sequence after ``--past`` cached
tokens: with ``shared`` (the builder's CPU form) the caches are the context's full 4,096
positions, with ``growing`` exactly the past. Cases run interleaved, each a p50 over
``--seconds``, after warm-up runs enough for NUMPY's tuner to settle on this shape; the ratio
is NUMPY's p50 over onnxruntime's per round, and its median. Precision: NUMPY computes in
float32 (int4 weights dequantized to float32 at load); onnxruntime in float32, its int4
MatMulNBits at the builder's accuracy_level 4 (activations rounded to int8). Nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
from harness import interleave, machine, p50_block  # also puts tests/support on sys.path


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cache_shapes(path) -> tuple[int, int, int, int]:
    """(layers, kv heads, head size, context length) from the folder's genai_config.json."""
    model = json.loads((path / "genai_config.json").read_text())["model"]
    decoder = model["decoder"]
    return (
        decoder["num_hidden_layers"],
        decoder["num_key_value_heads"],
        decoder["head_size"],
        model["context_length"],
    )


def feeds(path, batch: int, past: int, shared: bool) -> dict[str, np.ndarray]:
    layers, kv, head, context = cache_shapes(path)
    rng = np.random.default_rng(0)
    capacity = context if shared else past
    made = {
        "input_ids": rng.integers(2, 300, (batch, 1)).astype(np.int64),
        "attention_mask": np.ones((batch, past + 1), np.int64),
    }
    for i in range(layers):
        for kind in ("key", "value"):
            cache = np.zeros((batch, kv, capacity, head), np.float32)
            cache[:, :, :past] = rng.normal(size=(batch, kv, past, head))
            made[f"past_key_values.{i}.{kind}"] = cache
    return made


def compare(model: str, step: dict[str, np.ndarray], core, args) -> tuple:
    """(NUMPY p50 ms, onnxruntime p50 ms, median ratio, each round's ratio)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    request = core.load_network(model, "NUMPY").create_infer_request()
    for _ in range(12):  # NUMPY's tuner times its two GEMM splittings on a new shape
        request.infer(step)
    cases = {
        "ORT": lambda: p50_block(lambda: session.run(None, step), args.seconds, warmup=2),
        "NUMPY": lambda: p50_block(lambda: request.infer(step), args.seconds, warmup=2),
    }
    blocks = interleave(cases, args.rounds, log, alternate=True)
    ratios = [n["p50_ms"] / o["p50_ms"] for n, o in zip(blocks["NUMPY"], blocks["ORT"])]
    ort_ms = statistics.median(b["p50_ms"] for b in blocks["ORT"])
    numpy_ms = statistics.median(b["p50_ms"] for b in blocks["NUMPY"])
    return numpy_ms, ort_ms, statistics.median(ratios), ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "int4"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--cache", choices=["shared", "growing"], default="shared")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    import llm

    from plugserve.server import Core

    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['vector']}")
    print(f"numpy {info['numpy']} ({info['blas']}), onnxruntime {info['onnxruntime']}")
    print("precision: NUMPY float32 (int4 weights dequantized at load); onnxruntime float32, "
          "int4 MatMulNBits at accuracy_level 4 (int8 activations)")  # fmt: skip
    core = Core()
    for precision in args.precision:
        log(f"building or finding the {precision} folder ...")
        try:
            path = llm.export("bench-llama", f"genai-{precision}")
        except llm.Unavailable as error:
            sys.exit(str(error))
        step = feeds(path, args.batch, args.past, args.cache == "shared")
        numpy_ms, ort_ms, ratio, ratios = compare(str(path / "model.onnx"), step, core, args)
        each = ", ".join(f"{r:.2f}" for r in ratios)
        print(
            f"decode step, {precision}, batch {args.batch}, past {args.past}, cache "
            f"{args.cache}: NUMPY {numpy_ms:.1f} ms, onnxruntime {ort_ms:.1f} ms, "
            f"NUMPY / onnxruntime {ratio:.2f}x (rounds: {each})",
            flush=True,
        )


if __name__ == "__main__":
    main()
