"""onnxruntime-genai's side of bench_generate.py, run in its own virtual environment (the
model builder's, tests/support/llm.py's GENAI): loads a folder once, then for each line
``BATCH PROMPT_TOKENS NEW_TOKENS`` read from stdin generates greedily for that many rows of
seeded prompt ids as one batch (its Generator API, in process) and prints a JSON line: the
time to the first token, the whole time, and the mean time per token after the first.

    VENV/bin/python genai_worker.py FOLDER
"""

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og


def prompts(batch: int, length: int, vocab: int) -> np.ndarray:
    """The same ids bench_generate.py sends plugserve."""
    rng = np.random.default_rng(0)
    return rng.integers(100, min(vocab, 10000), (batch, length)).astype(np.int32)


def run(model, batch: int, length: int, new: int, vocab: int) -> dict:
    params = og.GeneratorParams(model)
    total = length + new
    # min_length: the end-of-sequence token is not chosen before (plugserve's ignore_eos)
    params.set_search_options(batch_size=batch, max_length=total, min_length=total, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompts(batch, length, vocab))
    generator.generate_next_token()
    first = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
    end = time.perf_counter()
    return {
        "first_s": first - start,
        "total_s": end - start,
        "per_token_ms": (end - first) / (new - 1) * 1e3,
        "tokens_per_s": batch * new / (end - start),
        "onnxruntime_genai": og.__version__ if hasattr(og, "__version__") else "?",
    }


def main() -> None:
    folder = sys.argv[1]
    model = og.Model(folder)
    with open(f"{folder}/genai_config.json") as f:
        vocab = json.load(f)["model"]["vocab_size"]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch, length, new = (int(x) for x in line.split())
        print(json.dumps(run(model, batch, length, new, vocab)), flush=True)


if __name__ == "__main__":
    main()
