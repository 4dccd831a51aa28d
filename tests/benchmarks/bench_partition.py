"""Benchmark of the HETERO subgraph selection on network-like graphs.

Run as ``python tests/benchmarks/bench_partition.py [--repeat N] [SIZE ...]``. The
graphs are layered DAGs with skip connections (residual blocks, two-branch blocks
merged by a concat), mostly on one device with long runs on a second one and a
few scattered unsupported nodes on the fallback device.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from plugserve.plugins.hetero.partition import order_subgraphs, partition

DEVICES = ("GPU", "NPU", "CPU")


def network(n: int, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """A network-like DAG of ``n`` nodes (topological order) and its affinities."""
    rng = random.Random(seed)
    succ: list[list[int]] = [[] for _ in range(n)]

    def edge(u: int, v: int) -> None:
        if u != v and v not in succ[u]:
            succ[u].append(v)

    last = 0
    i = 1
    while i < n:
        kind = rng.random()
        if kind < 0.5 or n - i < 8:  # a plain layer, sometimes with a long skip
            edge(last, i)
            if rng.random() < 0.1 and i > 10:
                edge(rng.randrange(max(0, i - 30), i - 2), i)
            last = i
            i += 1
        elif kind < 0.8:  # residual block: a -> b -> c, add(c, last)
            edge(last, i)
            edge(i, i + 1)
            edge(i + 1, i + 2)
            edge(last, i + 3)
            edge(i + 2, i + 3)
            last = i + 3
            i += 4
        else:  # two branches of 1-3 layers, concatenated
            start = i
            tails = []
            for _ in range(2):
                length = rng.randint(1, 3)
                edge(last, i)
                for k in range(i, i + length - 1):
                    edge(k, k + 1)
                tails.append(i + length - 1)
                i += length
            for t in tails:
                edge(t, i)
            assert i > start
            last = i
            i += 1
    for s in succ:
        s.sort()
    aff = ["GPU"] * n
    # long runs on the second device
    for _ in range(max(1, n // 2000)):
        start = rng.randrange(n)
        for k in range(start, min(n, start + rng.randint(n // 50 + 5, n // 20 + 10))):
            aff[k] = "NPU"
    # a few scattered unsupported nodes, on the fallback device
    for _ in range(max(2, n // 250)):
        aff[rng.randrange(n)] = "CPU"
    return succ, aff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", nargs="*", type=int, default=[100, 1_000, 10_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--literal", action="store_true", help="through_subgraphs=False")
    args = parser.parse_args(argv)
    print(f"{'nodes':>7} {'edges':>7} {'median ms':>10} {'min ms':>8} {'subgraphs':>9}  per device")
    for n in args.sizes:
        succ, aff = network(n, seed=n)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = partition(succ, aff, DEVICES, through_subgraphs=not args.literal)
            times.append(time.perf_counter() - t0)
        order_subgraphs(result, succ)  # raises if the graph of subgraphs is cyclic
        per_device = {d: sum(s.device == d for s in result) for d in DEVICES}
        edges = sum(map(len, succ))
        print(
            f"{n:>7} {edges:>7} {1e3 * statistics.median(times):>10.2f} {1e3 * min(times):>8.2f}"
            f" {len(result):>9}  {per_device}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
