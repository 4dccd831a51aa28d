"""HETERO cuts where ONNX's shape inference cannot type the value on the cut, and runs models
a device cannot read whole.

- Outputs of ``ai.onnx.ml`` ops (Scaler, Normalizer, LinearRegressor: ONNX infers nothing for
  them), of Loop (typed, not shaped) and strings from a ``com.microsoft`` op handed to
  another device: each piece must still be a valid model, so the cut value gets its runtime
  type and rank.
- A value no rule can type (an If whose branches disagree on the rank) fails the load with
  an error that says which nodes to pin where, and doing so works.
- A value ONNX leaves without a rank though the graph fixes it (a Conv after such an If),
  read only inside another If's branches in a later piece of the same device, crosses with
  the type and rank the device making it computes (a Silero-VAD-like export).
- openvino refuses some models whole (OpConversionFailure on an op inside an If branch):
  HETERO:OPENVINO,NUMPY still runs them, openvino taking the nodes it can convert.

Results are compared with onnxruntime on the whole model.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from models import OUTER_READ_PINS, make_model, outer_read_across_pieces
from onnx import TensorProto, helper
from reference import ort_run

from plugserve.plugins.api import TensorSpec, Unsupported
from plugserve.plugins.ir import load_model

RTOL, ATOL = 1e-3, 1e-4
ML = "ai.onnx.ml"


def sklearn_like() -> onnx.ModelProto:
    """A scaler, a normalizer and a linear regressor as skl2onnx writes them, followed by
    ops openvino runs: ONNX's inference types none of the ML ops' outputs."""
    nodes = [
        helper.make_node(
            "Scaler",
            ["x"],
            ["scaled"],
            domain=ML,
            offset=[0.5] * 4,
            scale=[2.0] * 4,
            name="scaler",
        ),
        helper.make_node("Normalizer", ["scaled"], ["unit"], domain=ML, norm="L2", name="norm"),
        helper.make_node(
            "LinearRegressor",
            ["unit"],
            ["pred"],
            domain=ML,
            coefficients=[1.0, -2.0, 0.5, 3.0, 0.1, 0.2, 0.3, 0.4],
            intercepts=[0.5, -0.5],
            targets=2,
            name="linreg",
        ),
        helper.make_node("Sigmoid", ["pred"], ["prob"], name="sigmoid"),
        helper.make_node("ReduceSum", ["unit"], ["unit_sum"], keepdims=1, name="sum"),
        helper.make_node("Mul", ["prob", "unit_sum"], ["y"], name="mul"),
    ]
    return make_model(
        nodes,
        [("x", TensorProto.FLOAT, ["N", 4])],
        [("y", TensorProto.FLOAT, ["N", 2])],
        opsets=(("", 17), (ML, 3)),
    )


def scripted_loop() -> onnx.ModelProto:
    """A loop as torch.jit.script exports it: a loop-carried accumulator (ONNX types it
    without a shape) and a scan output, read by ops on another device."""
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["acc", "x"], ["acc_next"]),
            helper.make_node("Identity", ["cond"], ["cond_out"]),
            helper.make_node("Identity", ["acc_next"], ["step"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_next", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("step", TensorProto.FLOAT, ["N", 4]),
        ],
    )
    nodes = [
        helper.make_node("Loop", ["n", "", "x"], ["final", "steps"], body=body, name="loop"),
        helper.make_node("Tanh", ["final"], ["a"], name="tanh"),
        helper.make_node("ReduceMax", ["steps"], ["b"], keepdims=0, name="max"),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    return make_model(
        nodes,
        [("x", TensorProto.FLOAT, ["N", 4]), ("n", TensorProto.INT64, [])],
        [("y", TensorProto.FLOAT, ["N", 4]), ("steps", TensorProto.FLOAT, [None, "N", 4])],
    )


def tokenizer_pipeline() -> onnx.ModelProto:
    """skl2onnx's text pipeline start: com.microsoft Tokenizer (strings ONNX cannot type,
    onnxruntime runs) then an ai.onnx string op (which takes [C] or [1, C])."""
    nodes = [
        helper.make_node(
            "Tokenizer",
            ["text"],
            ["tokens"],
            domain="com.microsoft",
            mark=0,
            mincharnum=1,
            pad_value="#",
            separators=[" "],
            name="tokenizer",
        ),
        helper.make_node(
            "StringNormalizer",
            ["tokens"],
            ["lower"],
            case_change_action="LOWER",
            locale="C",
            name="lower",
        ),
        helper.make_node("Shape", ["lower"], ["shape"], name="shape"),
    ]
    return make_model(
        nodes,
        [("text", TensorProto.STRING, [1])],
        [("lower", TensorProto.STRING, [1, None]), ("shape", TensorProto.INT64, [2])],
        opsets=(("", 17), ("com.microsoft", 1)),
    )


def wrap_padded_if() -> onnx.ModelProto:
    """openvino fails to convert a Pad in 'wrap' mode inside an If branch, and with it the
    whole model (OpConversionFailure), though it runs the nodes around it."""
    pads = helper.make_tensor("pads", TensorProto.INT64, [8], [0, 0, 1, 1, 0, 0, 1, 1])
    out = [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3, 6, 7])]
    then = helper.make_graph(
        [helper.make_node("Pad", ["a", "pads"], ["t"], mode="wrap")], "then", [], out
    )
    other = helper.make_graph(
        [helper.make_node("Pad", ["a", "pads"], ["e"], mode="reflect")],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2, 3, 6, 7])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other, name="if"),
        helper.make_node("Sigmoid", ["b"], ["y"], name="sigmoid"),
    ]
    return make_model(
        nodes,
        [("x", TensorProto.FLOAT, [2, 3, 4, 5]), ("c", TensorProto.BOOL, [])],
        [("y", TensorProto.FLOAT, [2, 3, 6, 7])],
        [pads],
        opsets=(("", 19),),
    )


def rank_changing_if() -> onnx.ModelProto:
    """An If whose branches give different ranks: no rule can type its output."""
    then = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 3])],
    )
    other = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["e"], keepdims=0)],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [])],
    )
    nodes = [
        helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other, name="if"),
        helper.make_node("Neg", ["b"], ["y"], name="neg"),
    ]
    return make_model(
        nodes,
        [("x", TensorProto.FLOAT, [2, 3]), ("c", TensorProto.BOOL, [])],
        [("y", TensorProto.FLOAT, [2, 3])],
    )


def _same_as_ort(got: dict[str, np.ndarray], model: onnx.ModelProto, feeds: dict) -> None:
    names = [o.name for o in model.graph.output]
    for name, want in zip(names, ort_run(model, feeds)):
        assert got[name].shape == want.shape, name
        if want.dtype == object:
            assert got[name].tolist() == want.tolist(), name
        else:
            np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


def _load(core, model, device, pins=None):
    config = {"AFFINITY": json.dumps(pins)} if pins else {}
    return core.load_network(model, device, config)


def _x(*shape):
    return np.random.default_rng(3).normal(size=shape).astype(np.float32)


ML_PINS = [
    None,
    # every ML op on NUMPY, everything else on OPENVINO: three cuts, all on untyped values
    {"scaler": "NUMPY", "norm": "NUMPY", "linreg": "NUMPY", "sigmoid": "OPENVINO",
     "mul": "OPENVINO", "sum": "OPENVINO"},
]  # fmt: skip


@pytest.mark.parametrize("pins", ML_PINS, ids=["queried", "pinned"])
@pytest.mark.parametrize("device", ["HETERO:OPENVINO,NUMPY", "HETERO:NUMPY,ORT"])
def test_ml_outputs_cross_devices(core, device, pins):
    model = sklearn_like()
    if pins and "OPENVINO" not in device:
        pins = {k: ("ORT" if v == "OPENVINO" else v) for k, v in pins.items()}
    network = _load(core, model, device, pins)
    try:
        steps = network.get_metric("HETERO_SUBGRAPHS")
        if pins:
            assert len({s["device"] for s in steps}) == 2, steps
        for rows in (5, 1):
            feeds = {"x": _x(rows, 4)}
            _same_as_ort(network.infer(feeds), model, feeds)
    finally:
        network.close()


@pytest.mark.parametrize("other", ["OPENVINO", "ORT"])
def test_loop_outputs_cross_devices(core, other):
    model = scripted_loop()
    pins = {"loop": "NUMPY", "tanh": other, "max": other, "add": "NUMPY"}
    network = _load(core, model, f"HETERO:NUMPY,{other}", pins)
    try:
        assert len(network.get_metric("HETERO_SUBGRAPHS")) >= 3
        for n in (3, 1):
            feeds = {"x": _x(2, 4), "n": np.array(n, np.int64)}
            _same_as_ort(network.infer(feeds), model, feeds)
    finally:
        network.close()


def test_contrib_strings_cross_devices(core):
    model = tokenizer_pipeline()
    network = _load(core, model, "HETERO:ORT,NUMPY", {"tokenizer": "ORT", "lower": "NUMPY"})
    try:
        steps = network.get_metric("HETERO_SUBGRAPHS")
        assert [s["device"] for s in steps][:2] == ["ORT", "NUMPY"], steps
        feeds = {"text": np.array(["Hello ONNX World"], dtype=object)}
        _same_as_ort(network.infer(feeds), model, feeds)
    finally:
        network.close()


def test_an_untypable_cut_says_what_to_pin(core):
    model = rank_changing_if()
    with pytest.raises(Unsupported) as info:
        _load(core, model, "HETERO:NUMPY,ORT", {"if": "NUMPY", "neg": "ORT"})
    message = str(info.value)
    assert "value 'b'" in message and "If node 'if' on NUMPY" in message
    assert "pin node(s) 'neg' to NUMPY" in message
    network = _load(core, model, "HETERO:NUMPY,ORT", {"if": "NUMPY", "neg": "NUMPY"})
    feeds = {"x": _x(2, 3), "c": np.array(True)}
    _same_as_ort(network.infer(feeds), model, feeds)
    network.close()


def test_openvino_refusing_the_whole_model_still_takes_nodes(core):
    model = wrap_padded_if()
    with pytest.raises(
        Unsupported, match=r"cannot convert node\(s\) 'if' \(Pad-19: Unsupported padding mode"
    ):
        core.load_network(model, "OPENVINO")
    assert core.query_network(model, "OPENVINO") == {"relu": "OPENVINO", "sigmoid": "OPENVINO"}
    placed = core.query_network(model, "HETERO:OPENVINO,NUMPY")
    assert placed == {"relu": "OPENVINO", "if": "NUMPY", "sigmoid": "OPENVINO"}
    network = core.load_network(model, "HETERO:OPENVINO,NUMPY")
    try:
        for flag in (True, False):
            feeds = {"x": _x(2, 3, 4, 5), "c": np.array(flag)}
            _same_as_ort(network.infer(feeds), model, feeds)
    finally:
        network.close()
    auto = core.load_network(model, "AUTO")
    feeds = {"x": _x(2, 3, 4, 5), "c": np.array(True)}
    _same_as_ort(auto.infer(feeds), model, feeds)
    auto.close()


def test_a_value_read_inside_if_branches_crosses_pieces(core):
    pytest.importorskip("openvino")
    model = outer_read_across_pieces()
    network = _load(core, model, "HETERO:OPENVINO,NUMPY", OUTER_READ_PINS)
    try:
        steps = network.get_metric("HETERO_SUBGRAPHS")
        assert [s["device"] for s in steps] == ["NUMPY", "OPENVINO", "NUMPY"], steps
        assert "/decoder/Sigmoid" in steps[0]["nodes"] and steps[2]["nodes"] == ["/model/If"]
        x = _x(1, 3, 6)
        for threshold in (-1.0, 10.0):  # /model/If's then branch, then its else branch
            feeds = {"input": x, "threshold": np.array(threshold, np.float32)}
            _same_as_ort(network.infer(feeds), model, feeds)
    finally:
        network.close()


def test_numpy_says_what_it_computes_for_an_unranked_value(numpy_plugin):
    graph = load_model(outer_read_across_pieces())
    name = "/decoder/Sigmoid_output_0"
    spec = graph.spec(name)
    assert spec is None or spec.shape is None  # ONNX's inference cannot tell its rank
    found = numpy_plugin.computed_types(graph, [name])
    assert found == {name: TensorSpec(name, np.dtype(np.float32), (None, None, None))}
