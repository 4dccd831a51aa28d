"""TORCH's attention with a boolean mask against the additive one it now makes once a step,
at bench-llama's shapes (16 query and 4 key/value heads of 64, 12 layers), in process.

    python tests/benchmarks/bench_attention_mask.py [--rounds 5] [--seconds 1] [--dtype float32]

Cases: a prompt chunk of 330 tokens (a later turn's new text on bench_multiturn.py's agent
workload) after 640 and 1,640 cached positions, and decoding steps (8 rows over 256 and 2,048
keys, one row over 1,024). Each case is one ``scaled_dot_product_attention`` call as
``plugins/torch/decoder_model.py``'s ``_AttentionPlan.attend`` makes it, timed as a p50 over
``--seconds`` and scaled by 12 (a step's layers); both masks interleaved each round, the ratio
additive / boolean the median of the rounds'. Answers are checked equal first. Nothing here
asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from harness import interleave, machine, p50_block, ratio_of


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for key, value in machine().items():
        print(f"{key}: {value}")
    print(f"torch: {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    generator = torch.Generator().manual_seed(0)

    def tensors(batch: int, queries: int, keys: int) -> tuple:
        def draw(*shape: int):
            return torch.randn(*shape, generator=generator).to(dtype)

        return draw(batch, 16, queries, 64), draw(batch, 4, keys, 64), draw(batch, 4, keys, 64)

    shapes = {}
    for start in (640, 1640):
        q, k, v = tensors(1, 330, start + 330)
        positions = torch.arange(start, start + 330)[:, None]
        shapes[f"chunk of 330 after {start}"] = (q, k, v, torch.arange(start + 330) <= positions)
    for batch, width in ((8, 256), (8, 2048), (1, 1024)):
        q, k, v = tensors(batch, 1, width)
        positions = torch.randint(width // 2, width, (batch,), generator=generator)
        allowed = torch.arange(width)[None, :] <= positions[:, None]
        shapes[f"decode {batch} rows over {width}"] = (q, k, v, allowed[:, None, :])
    for name, (q, k, v, allowed) in shapes.items():
        # [1, 1, queries, keys] for a chunk, [rows, 1, 1, keys] decoding: as the plan's
        boolean = allowed[None, None] if allowed.dim() == 2 else allowed[:, None]
        additive = torch.zeros(boolean.shape, dtype=dtype).masked_fill_(~boolean, float("-inf"))

        def attend(mask, q=q, k=k, v=v):
            return sdpa(q, k, v, attn_mask=mask, enable_gqa=True)

        assert torch.equal(attend(boolean), attend(additive)), name
        blocks = interleave(
            {
                label: lambda mask=mask: p50_block(lambda: attend(mask), args.seconds, 3)
                for label, mask in (("boolean", boolean), ("additive", additive))
            },
            args.rounds,
            log,
            alternate=True,
        )
        ratio, ratios = ratio_of(blocks, "additive", "boolean")
        each = {
            case: statistics.median(b["p50_ms"] for b in rounds) * 12
            for case, rounds in blocks.items()
        }
        print(
            f"{name}: boolean {each['boolean']:.1f} ms, additive {each['additive']:.1f} ms a "
            f"step of 12 layers; additive / boolean {ratio}x (rounds {ratios})"
        )


if __name__ == "__main__":
    main()
