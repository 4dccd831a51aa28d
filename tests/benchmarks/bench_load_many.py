"""Many networks in one server (issue 22): time to ready, RSS and threads of a repository of
300 copies of an 11.5 MB MLP on ORT, loaded one at a time and with the default
--model-load-threads; and what one more loaded network costs per device against its bare
backend (tests/support/load_cost.py).

``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python tests/benchmarks/bench_load_many.py
[--models 300] [--rounds 2] [--copies 20] [--baseline /path/to/base/python]``

The server cases run interleaved, round after round (``--baseline``: a base commit's server
serially too, its flags permitting); each figure is the median over the rounds. Time to ready
is from starting the process to its ``server ready`` line (the process's own start, about a
second, included); RSS and threads are read from /proc once it is ready and idle. The
repository's model files are hard links of one file: the server reads each as its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # sets sys.path for the imports below
from load_cost import save_mlp
from serving import RunningServer


def repository(root: Path, models: int) -> Path:
    source = save_mlp(root)
    repo = root / "repo"
    for i in range(models):
        folder = repo / f"mlp{i:03d}"
        (folder / "1").mkdir(parents=True)
        os.link(source, folder / "1" / "model.onnx")
        (folder / "config.json").write_text(json.dumps({"device": "ORT"}))
    return repo


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_once(repo: Path, flags: list[str], python: str) -> dict[str, float]:
    server = RunningServer(
        "--model-repository", str(repo), "--http-port", "-1", *flags, python=python
    )
    started = time.perf_counter()
    server.start(timeout=1800)
    ready = time.perf_counter() - started
    try:
        time.sleep(1)  # idle: a load's scratch threads gone
        assert server.process is not None
        pid = server.process.pid
        return {
            "ready_s": ready,
            "rss_mb": rss_mb(pid),
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "hwm_mb": harness.peak_rss_mb(pid),
        }
    finally:
        server.stop()


def per_network(device: str, copies: int, python: str = "") -> dict[str, float] | None:
    done = subprocess.run(
        [python or sys.executable, str(harness.SUPPORT / "load_cost.py"), device, str(copies)],
        capture_output=True,
        text=True,
        cwd=harness.SUPPORT,
    )
    if done.returncode != 0:
        print(f"  {device}: {done.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--copies", type=int, default=20, help="copies per device, per-network")
    parser.add_argument("--baseline", default="", metavar="PYTHON")
    args = parser.parse_args(argv)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in harness.machine().items()), flush=True)
    print(f"load average {harness.load_average()}", flush=True)

    folder = Path(tempfile.mkdtemp(prefix="plugserve-load-many-"))
    repo = repository(folder, args.models)
    cases = {
        "--model-load-threads 1": (["--model-load-threads", "1"], ""),
        "default threads": ([], ""),
    }
    if args.baseline:
        cases["baseline (its default threads)"] = ([], args.baseline)
    results = harness.interleave(
        {name: (lambda f=f, p=p: start_once(repo, f, p)) for name, (f, p) in cases.items()},
        args.rounds,
        print,
    )
    print(f"\n{args.models} ORT networks (11.5 MB MLP each), medians of {args.rounds} rounds:")
    print(f"  {'case':24s} {'ready s':>8s} {'RSS MB':>8s} {'peak MB':>8s} {'threads':>8s}")
    for name, blocks in results.items():
        print(
            f"  {name:24s} {harness.median_of(blocks, 'ready_s'):8.1f} "
            f"{harness.median_of(blocks, 'rss_mb'):8.0f} "
            f"{harness.median_of(blocks, 'hwm_mb'):8.0f} "
            f"{harness.median_of(blocks, 'threads'):8.0f}"
        )
        print(f"    rounds: {[round(b['ready_s'], 1) for b in blocks]} s")

    print(f"\none more loaded network, {args.copies} copies in one process per device:")
    for device in ("ORT", "NUMPY", "OPENVINO"):
        for label, python in (("", ""), ("baseline", args.baseline)):
            cost = per_network(device, args.copies, python) if python or not label else None
            if cost:
                print(
                    f"  {device:8s} {label or 'plugserve':9s} {cost['plugserve']:5.1f} MB, "
                    f"bare backend {cost['bare']:5.1f} MB "
                    f"({cost['plugserve'] / cost['bare']:.2f}x)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
