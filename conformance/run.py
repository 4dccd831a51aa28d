"""Running cases on a device and comparing what it returns with the expected outputs.

The runner is a user of the in-process API (``plugserve.server.Core``), above it: nothing in
``server`` imports this package but the ``plugserve`` command (``server/process/cli.py``), which
sits above every package and loads a verb's module when the verb runs.
"""

from __future__ import annotations

import fnmatch
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from plugserve.conformance.cases import Case, load_cases
from plugserve.conformance.report import CaseResult, Report
from plugserve.plugins.numpy.kernels import narrow
from plugserve.server.control.core import Core

__all__ = ["compare", "run_case", "run_conformance"]


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
    on_result: Callable[[CaseResult], None] | None = None,
) -> Report:
    """Run the cases whose name matches a pattern and that use one of ``ops`` (all by default;
    op names match whatever their case, ``"Relu,Add"`` is two) on ``device``; ``on_result``
    is told each case's result as it is known (the command's progress line)."""
    if load is None:
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
        if on_result is not None:
            on_result(results[-1])
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
