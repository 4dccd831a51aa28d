"""RegexFullMatch in linear time: RE2 (``google-re2``), as ONNX specifies its patterns.

Python's ``re`` backtracks: ``(a+)+$`` against 40 ``a`` and a ``!`` is 2^40 steps, holding the
GIL. The strings are a client's (a request's), or the whole node is: a model an ``infer`` token
sends to QueryNetwork, whose constants NUMPY folds in the server (and TORCH's query sizes small
load-time values with onnx's reference evaluator, whose RegexFullMatch is Python's ``re``). Each
case runs in a process of its own with a timeout: a regression would otherwise hold the test
run's GIL for good.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: a model of one RegexFullMatch over a string constant that backtracks for ~2^40 steps in re
MODEL = """
import numpy as np
from onnx import TensorProto, helper, numpy_helper

text = numpy_helper.from_array(np.array(["a" * 40 + "!"], dtype=object), "text")
node = helper.make_node("RegexFullMatch", ["text"], ["hit"], pattern="(a+)+$")
cast = helper.make_node("Cast", ["hit"], ["y"], to=TensorProto.FLOAT)
add = helper.make_node("Add", ["y", "x"], ["z"])
graph = helper.make_graph(
    [node, cast, add], "redos",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
    [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
    [text],
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
model.ir_version = 9
"""


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MODEL) + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_backtracking_pattern_is_matched_in_linear_time_when_run():
    out = _run("""
        from plugserve.plugins.numpy import NumpyPlugin
        network = NumpyPlugin().load_network(model.SerializeToString(), {})
        print(network.create_infer_request().infer({"x": np.zeros(1, np.float32)})["z"])
    """)
    assert out.strip() == "[0.]"


@pytest.mark.parametrize("device", ["NUMPY", "TORCH"])
def test_a_query_of_a_backtracking_constant_answers_at_once(device):
    """QueryNetwork, what any infer token may send: answered within the timeout."""
    pytest.importorskip("torch") if device == "TORCH" else None
    out = _run(f"""
        from plugserve.server import Core
        print(sorted(Core().query_network(model.SerializeToString(), {device!r}).values()))
    """)
    assert device in out


def test_a_pattern_re2_refuses_writes_nothing_to_the_log():
    """RE2 logged each pattern it refused to stderr, a client's text with its newlines: a
    query of 20,000 bad patterns wrote 180,000 lines, forged ones among them."""
    code = """
        from plugserve.server import Core
        model.graph.node[0].attribute[0].s = b"(a)\\\\1\\nFORGED"
        print(sorted(Core().query_network(model.SerializeToString(), "NUMPY").items())[:1])
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MODEL) + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FORGED" not in done.stderr, done.stderr[-2000:]
