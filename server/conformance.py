"""Run the ONNX backend node test cases of the installed ``onnx`` package on a device.

onnx 1.23 and later build these cases in memory (``onnx.backend.test.loader``); older releases
ship them as files under ``onnx/backend/test/data/node``. Both are read, and so is another
release's wheel (``--data``). Every case counts, passed or failed, whatever its element types;
failures are grouped by op type.

    python -m plugserve.server.conformance --device NUMPY [-k PATTERN] [--op Conv,Relu]
        [--data onnx-1.22.0-....whl] [-v]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fnmatch
import os
import re
import shutil
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx

from plugserve.plugins.numpy.kernels import narrow

__all__ = ["CaseResult", "Report", "load_cases", "run_conformance"]

#: Why an op's cases fail, where the reason is a decision rather than missing work.
KNOWN_GAPS = {
    "ImageDecoder": "Decoding JPEG/PNG/WebP needs Pillow, an optional dependency: "
    "pip install 'plugserve[image]'. Without it the op is reported unsupported.",
    "Bernoulli": "Random output: the expected values were drawn from numpy's global random "
    "generator when the case was made; shapes and types match.",
    "RandomUniformLike": "Random output (Bernoulli's function body): see Bernoulli.",
}


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
    status: str  # passed, failed
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
        return len(self.results)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    def summary(self) -> str:
        return (
            f"PASS {self.passed} / TOTAL {self.total} = {100 * self.fraction:.1f}% on {self.device}"
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
            "Every case the suite builds is counted, whatever its element types (bfloat16, "
            "the float8 family, float4e2m1, int4/uint4, int2/uint2 and complex included): "
            "nothing is skipped.",
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


def load_cases(data: str | None = None) -> list[Case]:
    """Every node test case: of ``data`` (an onnx wheel or a folder, see :func:`node_data_root`)
    when given, else of the installed onnx package, built in memory or read from its files."""
    if data is not None:
        return list(_cases_from_files(node_data_root(data)))
    try:
        from onnx.backend.test.loader import load_node_model_tests
    except ImportError:
        load_node_model_tests = None
    if load_node_model_tests is None:
        root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "node")
        return list(_cases_from_files(root))
    cases: list[Case] = []
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


_NODE_DATA = "onnx/backend/test/data/node/"


def node_data_root(data: str) -> str:
    """The folder of node cases in ``data``: an onnx wheel (``pip download onnx==1.22.0
    --no-deps``), whose cases are unpacked once under ~/.cache/plugserve-tests, or a folder that
    holds them (the case folders themselves, or an unpacked onnx tree above them)."""
    if os.path.isdir(data):
        nested = os.path.join(data, _NODE_DATA)
        return nested if os.path.isdir(nested) else data
    if not zipfile.is_zipfile(data):
        raise FileNotFoundError(f"{data}: neither a folder of node cases nor an onnx wheel")
    stem = os.path.splitext(os.path.basename(data))[0]
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
        "plugserve-tests",
        "onnx-node-data",
        f"{stem}-{os.path.getsize(data)}",
    )
    if not os.path.isdir(cache):
        staging = f"{cache}.tmp{os.getpid()}"
        with zipfile.ZipFile(data) as wheel:
            members = [m for m in wheel.namelist() if m.startswith(_NODE_DATA)]
            if not members:
                raise FileNotFoundError(f"{data}: the wheel holds no {_NODE_DATA} cases")
            for member in members:
                target = os.path.join(staging, member[len(_NODE_DATA) :])
                if member.endswith("/"):
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with wheel.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        try:
            os.rename(staging, cache)
        except OSError:  # another run unpacked it first
            shutil.rmtree(staging, ignore_errors=True)
    return cache


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


def _cases_from_files(root: str) -> Iterable[Case]:
    """Cases as onnx ships them on disk: a folder per case with ``model.onnx`` and
    ``test_data_set_N/{input,output}_K.pb``, each .pb typed by the graph's input or output."""
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        model_path = os.path.join(folder, "model.onnx")
        if not os.path.isfile(model_path):
            continue
        model = onnx.load(model_path)
        data_sets = []
        for ds in sorted(d for d in os.listdir(folder) if d.startswith("test_data_set")):
            ds_dir = os.path.join(folder, ds)
            inputs = _read_pbs(ds_dir, "input", model.graph.input)
            outputs = _read_pbs(ds_dir, "output", model.graph.output)
            data_sets.append((inputs, outputs))
        yield Case(name, model, data_sets, 1e-3, 1e-7)


def _read_pbs(folder: str, kind: str, values: Sequence[onnx.ValueInfoProto]) -> list[Any]:
    count = len([f for f in os.listdir(folder) if f.startswith(f"{kind}_") and f.endswith(".pb")])
    out = []
    for i in range(count):
        with open(os.path.join(folder, f"{kind}_{i}.pb"), "rb") as f:
            raw = f.read()
        kind_of = values[i].type.WhichOneof("value") if i < len(values) else "tensor_type"
        proto: Any = {
            "sequence_type": onnx.SequenceProto,
            "optional_type": onnx.OptionalProto,
        }.get(kind_of, onnx.TensorProto)()
        proto.ParseFromString(raw)
        out.append(_value(proto))
    return out


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
    if expected.dtype.kind not in "fcOUS" and narrow.is_narrow(expected.dtype):
        # compared in their wide type, as onnx's own runner does; bfloat16 within two ulps
        if expected.dtype.name == "bfloat16":
            rtol = max(rtol, 2**-6)
        wide = narrow.wide_dtype(expected.dtype)
        expected, actual = expected.astype(wide), actual.astype(wide)
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
    data: str | None = None,
) -> Report:
    """Run the cases whose name matches a pattern and that use one of ``ops`` (all by default;
    op names match whatever their case, ``"Relu,Add"`` is two) on ``device``."""
    if load is None:
        from plugserve.server.core import Core

        core = Core()

        def load(model: onnx.ModelProto) -> Any:
            return core.load_network(model, device)

    wanted = {o.strip().lower() for spec in ops for o in spec.split(",") if o.strip()}
    start = time.perf_counter()
    results = []
    for case in load_cases(data):
        if patterns and not any(
            fnmatch.fnmatch(case.name, p) or re.search(p, case.name) for p in patterns
        ):
            continue
        if wanted and not wanted & _op_names(case.model.graph):
            continue
        results.append(run_case(case, load))
    return Report(device, results, time.perf_counter() - start)


def _op_names(graph: onnx.GraphProto) -> set[str]:
    """The op types of a graph and of the graphs nested in its nodes, lower case."""
    names = set()
    for node in graph.node:
        names.add(node.op_type.lower())
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                names |= _op_names(sub)
    return names


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
    try:
        report = run_conformance(args.device, args.patterns, args.ops, data=args.data)
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


if __name__ == "__main__":
    sys.exit(main())
