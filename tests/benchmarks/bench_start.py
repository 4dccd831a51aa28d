"""A server's start, with this checkout's sources compiled to bytecode and without.

``python tests/benchmarks/bench_start.py [--rounds N]``

An editable install leaves the sources uncompiled, and where PYTHONDONTWRITEBYTECODE is set
(it is on the machines this project's sessions and CI run on) Python never writes the bytecode
it compiles, so every start of the server compiles plugserve's modules again. Each round
starts the server once without bytecode (this checkout's ``__pycache__`` folders removed) and
once with it (``python -m compileall``), alternating which goes first; it reports the median
time from the command to "server ready" (an empty repository, every port free-picked) of
each, and their ratio. It leaves the sources compiled, as ``.ci/run`` does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # sets sys.path for the tests' support modules
from serving import RunningServer

ROOT = Path(__file__).resolve().parents[2]

#: the folders the editable install maps into ``plugserve`` (pyproject.toml's package-dir)
SOURCES = ("plugins", "server", "client", "conformance", "rayserve", "proto")


def _uncompiled() -> None:
    for name in SOURCES:
        for cache in (ROOT / name).rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)


def _compiled() -> None:
    command = [sys.executable, "-m", "compileall", "-q", "-j", "0", *SOURCES]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def _start(repository: str) -> float:
    """Seconds from the command to "server ready"."""
    started = time.monotonic()
    with RunningServer("--model-repository", repository):
        return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    env = os.environ.get("PYTHONDONTWRITEBYTECODE", "")
    machine = harness.machine()
    print(f"{machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, load "
          f"average {harness.load_average()}, PYTHONDONTWRITEBYTECODE={env!r}")  # fmt: skip
    if not env:
        print("note: without PYTHONDONTWRITEBYTECODE the first start writes the bytecode, so "
              "'uncompiled' is compiled from its second round on")  # fmt: skip
    times: dict[str, list[float]] = {"uncompiled": [], "compiled": []}
    with tempfile.TemporaryDirectory() as repository:
        for round_ in range(args.rounds):
            order = ["uncompiled", "compiled"]
            if round_ % 2:
                order.reverse()
            for kind in order:
                _uncompiled() if kind == "uncompiled" else _compiled()
                times[kind].append(_start(repository))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {times[k][-1]:.3f} s" for k in times))
    _compiled()
    medians = {kind: statistics.median(values) for kind, values in times.items()}
    for kind, median in medians.items():
        print(f"{kind}: median {median:.3f} s to ready")
    print(f"ratio uncompiled / compiled: {medians['uncompiled'] / medians['compiled']:.2f}x")


if __name__ == "__main__":
    main()
