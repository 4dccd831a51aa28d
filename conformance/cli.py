"""Run the ONNX backend node test cases of the installed ``onnx`` package on a device.

onnx 1.23 and later build these cases in memory (``onnx.backend.test.loader``); older releases
ship them as files under ``onnx/backend/test/data/node``. Both are read, and so is another
release's wheel (``--data``). Every case counts, passed or failed, whatever its element types;
failures are grouped by op type.

    plugserve conformance --device NUMPY [-k PATTERN] [--op Conv,Relu]
        [--data onnx-1.22.0-....whl] [-v]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from plugserve.client.progress import progress
from plugserve.conformance.report import CaseResult
from plugserve.conformance.run import run_conformance

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="plugserve conformance", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--device", default="NUMPY")
    parser.add_argument(
        "-k",
        dest="patterns",
        action="append",
        default=[],
        help="only cases whose name matches (glob or regex); repeatable",
    )
    parser.add_argument(
        "--op",
        dest="ops",
        action="append",
        default=[],
        help="only cases using one of these ops (Relu,Add; any case); repeatable",
    )
    parser.add_argument(
        "--data",
        metavar="WHEEL_OR_DIR",
        help="read the cases from an onnx wheel (pip download onnx==1.22.0 --no-deps) or a "
        "folder of case folders instead of the installed onnx",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show each failure")
    parser.add_argument(
        "--min-pass",
        type=float,
        default=0.0,
        help="exit 1 when the pass fraction is below this (e.g. 0.9)",
    )
    parser.add_argument(
        "--write-doc",
        metavar="FILE",
        help="also write the report as Markdown (docs/conformance.md)",
    )
    args = parser.parse_args(argv)
    failed = []
    results = []

    def counted(result: CaseResult) -> None:
        results.append(result)
        if result.status != "passed":
            failed.append(result)

    def count() -> str:
        return f"{len(results)} cases, {len(failed)} failed"

    try:
        # the cases are built and the devices found first (~20 s) before any case runs
        with progress(f"plugserve conformance on {args.device}", count):
            report = run_conformance(
                args.device, args.patterns, args.ops, data=args.data, on_result=counted
            )
    except FileNotFoundError as exc:
        print(f"plugserve conformance: {exc}", file=sys.stderr)
        return 2
    if not report.results:
        print(
            "plugserve conformance: no case matched "
            + " ".join([f"-k {p}" for p in args.patterns] + [f"--op {o}" for o in args.ops]),
            file=sys.stderr,
        )
        return 2
    print(report.render(args.verbose))
    if args.write_doc:
        with open(args.write_doc, "w") as f:
            f.write(report.markdown() + "\n")
    print(f"({report.seconds:.1f} s)")
    return 0 if report.fraction >= args.min_pass else 1
