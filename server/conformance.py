"""Run the ONNX backend node test cases of the installed ``onnx`` package on a device.

onnx 1.23 and later build these cases in memory (``onnx.backend.test.loader``); older releases
ship them as files under ``onnx/backend/test/data/node``. Both are read. Cases whose tensors use
element types plugserve does not carry (8-, 4- and 2-bit floats and ints, bfloat16, complex) are
counted as skipped, everything else as passed or failed, with failures grouped by op type.

    python -m plugserve.server.conformance --device NUMPY [-k PATTERN] [--op Conv] [-v]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fnmatch
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

__all__ = ["CaseResult", "Report", "load_cases", "run_conformance"]

_OUT_OF_SCOPE_NAMES = (
    "FLOAT8E4M3FN",
    "FLOAT8E4M3FNUZ",
    "FLOAT8E5M2",
    "FLOAT8E5M2FNUZ",
    "FLOAT8E8M0",
    "INT4",
    "UINT4",
    "INT2",
    "UINT2",
    "FLOAT4E2M1",
    "BFLOAT16",
    "COMPLEX64",
    "COMPLEX128",
)
OUT_OF_SCOPE_TYPES = {
    getattr(TensorProto, n) for n in _OUT_OF_SCOPE_NAMES if hasattr(TensorProto, n)
}
#: Why an op's cases fail, where the reason is a decision rather than missing work.
KNOWN_GAPS = {
    "ImageDecoder": "Decoding JPEG/PNG/WebP needs an image codec library, which plugserve does "
    "not depend on; the op is reported unsupported.",
    "Dropout": "Training-mode Dropout draws a random mask; the expected outputs come from one "
    "particular random generator, so no other runtime can match them. Inference-mode Dropout "
    "passes.",
    "Bernoulli": "Random output: the expected values were drawn from numpy's global random "
    "generator when the case was made; shapes and types match.",
    "RandomUniformLike": "Random output (Bernoulli's function body): see Bernoulli.",
}
_TYPE_ATTRS = ("to", "saturate_to", "output_datatype", "dtype", "stash_type")


@dataclasses.dataclass
class Case:
    name: str
    model: onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float
    atol: float


@dataclasses.dataclass
class CaseResult:
    name: str
    op_types: tuple[str, ...]
    status: str  # passed, failed, skipped
    detail: str = ""


@dataclasses.dataclass
class Report:
    device: str
    results: list[CaseResult]
    seconds: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def total(self) -> int:
        return len(self.results) - self.count("skipped")

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def summary(self) -> str:
        return (
            f"PASS {self.passed} / TOTAL {self.total} (skipped {self.count('skipped')}) "
            f"= {100 * self.fraction:.1f}% on {self.device}"
        )

    def failures_by_op(self) -> dict[str, list[CaseResult]]:
        groups: dict[str, list[CaseResult]] = collections.defaultdict(list)
        for r in self.results:
            if r.status == "failed":
                groups[r.op_types[0] if r.op_types else "?"].append(r)
        return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])))

    def markdown(self) -> str:
        """The report as docs/conformance.md keeps it: the figure, then what fails and why."""
        import platform

        lines = [
            "# Conformance: ONNX backend node tests",
            "",
            "Produced by `plugserve conformance --device "
            f"{self.device} --write-doc docs/conformance.md` (onnx {onnx.__version__}, "
            f"numpy {np.__version__}, Python {platform.python_version()}).",
            "",
            f"**{self.summary()}**",
            "",
            "Skipped cases use element types plugserve does not carry: "
            + ", ".join(n.lower() for n in _OUT_OF_SCOPE_NAMES if hasattr(TensorProto, n))
            + ". Counting them as failures instead gives "
            f"{self.passed} / {len(self.results)} = "
            f"{100 * self.passed / max(1, len(self.results)):.1f}%.",
            "",
            "## Not supported yet",
            "",
            "Each failing case, grouped by the op it tests, with the first line of its error. A "
            "node that NUMPY cannot run is refused at load time and reported unsupported by "
            "QueryNetwork; it never returns wrong numbers silently.",
            "",
        ]
        for op, cases in self.failures_by_op().items():
            lines.append(f"### {op} ({len(cases)})")
            lines.append("")
            if op in KNOWN_GAPS:
                lines.extend([KNOWN_GAPS[op], ""])
            for case in cases:
                detail = case.detail.replace("|", "\\|")[:240]
                lines.append(f"- `{case.name}`: {detail}")
            lines.append("")
        return "\n".join(lines)

    def render(self, verbose: bool = False) -> str:
        lines = [self.summary()]
        for op, cases in self.failures_by_op().items():
            lines.append(f"  {op}: {len(cases)} failed")
            if verbose:
                lines.extend(f"    {c.name}: {c.detail[:300]}" for c in cases)
        return "\n".join(lines)


def load_cases() -> list[Case]:
    """Every node test case of the installed onnx package, in memory or from files."""
    try:
        from onnx.backend.test.loader import load_node_model_tests
    except ImportError:
        load_node_model_tests = None
    cases: list[Case] = []
    if load_node_model_tests is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for tc in load_node_model_tests():
                if tc.model is None:
                    continue
                cases.append(
                    Case(
                        tc.name,
                        tc.model,
                        [([_value(v) for v in i], [_value(v) for v in o]) for i, o in tc.data_sets],
                        tc.rtol,
                        tc.atol,
                    )
                )
        return cases
    return list(_cases_from_files())


def _value(value: Any) -> Any:
    """Test data as arrays, lists and None (some cases give protobufs instead of arrays)."""
    from onnx import numpy_helper

    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, onnx.SequenceProto):
        return numpy_helper.to_list(value)
    if isinstance(value, onnx.OptionalProto):
        return numpy_helper.to_optional(value)
    return value


def _cases_from_files() -> Iterable[Case]:
    from onnx import numpy_helper

    root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "node")
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        model_path = os.path.join(folder, "model.onnx")
        if not os.path.isfile(model_path):
            continue
        model = onnx.load(model_path)
        data_sets = []
        for ds in sorted(d for d in os.listdir(folder) if d.startswith("test_data_set")):
            ds_dir = os.path.join(folder, ds)
            inputs = [
                _read_pb(os.path.join(ds_dir, f"input_{i}.pb"), numpy_helper)
                for i in range(len(model.graph.input))
                if os.path.exists(os.path.join(ds_dir, f"input_{i}.pb"))
            ]
            outputs = [
                _read_pb(os.path.join(ds_dir, f"output_{i}.pb"), numpy_helper)
                for i in range(len(model.graph.output))
            ]
            data_sets.append((inputs, outputs))
        yield Case(name, model, data_sets, 1e-3, 1e-7)


def _read_pb(path: str, numpy_helper: Any) -> Any:
    tensor = onnx.TensorProto()
    with open(path, "rb") as f:
        tensor.ParseFromString(f.read())
    return numpy_helper.to_array(tensor)


def _uses_out_of_scope_types(graph: onnx.GraphProto) -> bool:
    def types(g: onnx.GraphProto) -> Iterable[int]:
        for v in list(g.input) + list(g.output) + list(g.value_info):
            yield from _value_types(v.type)
        for t in g.initializer:
            yield t.data_type
        for node in g.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t.data_type
                if a.type == onnx.AttributeProto.INT and a.name in _TYPE_ATTRS:
                    yield a.i
                if a.HasField("g"):
                    yield from types(a.g)

    return any(t in OUT_OF_SCOPE_TYPES for t in types(graph))


def _value_types(t: onnx.TypeProto) -> Iterable[int]:
    if t.HasField("tensor_type"):
        yield t.tensor_type.elem_type
    elif t.HasField("sequence_type"):
        yield from _value_types(t.sequence_type.elem_type)
    elif t.HasField("optional_type"):
        yield from _value_types(t.optional_type.elem_type)


def compare(expected: Any, actual: Any, rtol: float, atol: float, where: str = "") -> None:
    """Raise AssertionError when ``actual`` differs from ``expected`` (type, shape or values)."""
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            raise AssertionError(
                f"{where}: expected a sequence of {len(expected)}, got {type(actual).__name__}"
            )
        for i, (e, a) in enumerate(zip(expected, actual)):
            compare(e, a, rtol, atol, f"{where}[{i}]")
        return
    if expected is None:
        if actual is not None:
            raise AssertionError(f"{where}: expected no value (empty optional)")
        return
    expected = np.asarray(expected)
    if not isinstance(actual, np.ndarray):
        raise AssertionError(f"{where}: expected an array, got {type(actual).__name__}")
    if expected.dtype != actual.dtype and not (
        expected.dtype.kind in "OUS" and actual.dtype.kind in "OUS"
    ):
        raise AssertionError(f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    if expected.shape != actual.shape:
        raise AssertionError(f"{where}: shape {actual.shape}, expected {expected.shape}")
    if expected.dtype.kind in "fc":
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    elif expected.dtype.kind in "OUS":
        if [str(x) for x in expected.ravel()] != [str(x) for x in actual.ravel()]:
            raise AssertionError(
                f"{where}: strings differ: {actual.ravel()[:5]} vs {expected.ravel()[:5]}"
            )
    else:
        np.testing.assert_array_equal(actual, expected)


def run_case(case: Case, load: Callable[[onnx.ModelProto], Any]) -> CaseResult:
    ops = tuple(dict.fromkeys(n.op_type for n in case.model.graph.node))
    if _uses_out_of_scope_types(case.model.graph):
        return CaseResult(case.name, ops, "skipped", "element type out of scope")
    try:
        network = load(case.model)
        names = [i.name for i in network.inputs]
        outs = [o.name for o in network.outputs]
        for inputs, expected in case.data_sets:
            request = network.create_infer_request()
            feeds = dict(zip(names, inputs))
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                result = request.infer(feeds)
            for name, exp in zip(outs, expected):
                compare(exp, result[name], case.rtol, case.atol, name)
    except Exception as exc:
        text = str(exc).strip().replace("\n", " ")
        return CaseResult(case.name, ops, "failed", f"{type(exc).__name__}: {text}")
    return CaseResult(case.name, ops, "passed")


def run_conformance(
    device: str = "NUMPY",
    patterns: Sequence[str] = (),
    ops: Sequence[str] = (),
    load: Callable[[onnx.ModelProto], Any] | None = None,
) -> Report:
    """Run the cases whose name matches a pattern (all by default) on ``device``."""
    if load is None:
        from plugserve.server.core import Core

        core = Core()

        def load(model: onnx.ModelProto) -> Any:
            return core.load_network(model, device)

    start = time.perf_counter()
    results = []
    for case in load_cases():
        if patterns and not any(
            fnmatch.fnmatch(case.name, p) or re.search(p, case.name) for p in patterns
        ):
            continue
        if ops and not any(n.op_type in ops for n in case.model.graph.node):
            continue
        results.append(run_case(case, load))
    return Report(device, results, time.perf_counter() - start)


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
        "--op", dest="ops", action="append", default=[], help="only cases using this op"
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
    report = run_conformance(args.device, args.patterns, args.ops)
    print(report.render(args.verbose))
    if args.write_doc:
        with open(args.write_doc, "w") as f:
            f.write(report.markdown() + "\n")
    print(f"({report.seconds:.1f} s)")
    return 0 if report.fraction >= args.min_pass else 1


if __name__ == "__main__":
    sys.exit(main())
