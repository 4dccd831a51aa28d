"""The bounds of reading a model (``plugins/reading.py``), in-process: onnx's shape inference in
a helper process bounded in memory and time that never holds this process's GIL, the node
count, and the values plugserve computes itself (dense sparse initializers, folded constants)
within one read's allowance. tests/server/test_attacks_read.py drives the same models at a
real server."""

from __future__ import annotations

import amplifying
import numpy as np
import pytest
from gil import longest_gap
from onnx import TensorProto, helper

from plugserve.plugins import reading
from plugserve.plugins.api import InvalidModel, ResourceExhausted
from plugserve.plugins.ir import load_model


@pytest.fixture
def bounded():
    """The process's limits for one test (restored after)."""
    before = reading.limits()

    def set_to(**changes):
        reading.set_limits(reading.ReadLimits(**{**vars(before), **changes}))

    yield set_to
    reading.set_limits(before)


def test_data_propagation_past_the_bound_is_refused_without_holding_the_gil(bounded):
    bounded(max_bytes=64 << 20)
    model = amplifying.read_concat_doubling(doublings=16).SerializeToString()
    load_model(amplifying.tile())  # the helper started (once per process): not timed

    def read():
        with pytest.raises(InvalidModel, match="--max-read-bytes") as refused:
            load_model(model)
        assert "shape inference needs more than 67,108,864 bytes" in str(refused.value)

    assert longest_gap(read) < 0.2  # onnx in the server: a 3.9 s gap for this model


def test_a_weights_dims_are_multiplied_no_further_than_an_overflow():
    """What the checker is given is chosen by each large weight's size (model_copies): its dims,
    a client's, are multiplied only until the product passes an int64, where the checker
    refuses the tensor. Plainly multiplied, 30,000 dims of 2**62 held the GIL ~2 s."""
    model = amplifying.many_dims().SerializeToString()

    def read():
        with pytest.raises(InvalidModel, match="Tensor dimension product overflow"):
            load_model(model)

    assert longest_gap(read) < 0.5


def test_shapes_past_the_bound_are_refused_before_they_are_read_back(bounded):
    bounded(max_bytes=256 << 20)  # the helper's data fits; 8 MiB of shapes may come back
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak starts again from now
    before = _peak_kb()
    with pytest.raises(InvalidModel, match=r"shape inference's answer is .* --max-read-bytes"):
        load_model(amplifying.read_wide_shapes())
    assert _peak_kb() - before < 32 << 10  # read back, 190 MB here


def _peak_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def test_shape_inference_past_its_time_is_refused(bounded):
    bounded(seconds=0.3, max_bytes=0)  # the time alone: killed after 0.3 s of its 7 s
    model = amplifying.read_concat_doubling(doublings=16)
    with pytest.raises(ResourceExhausted, match="--max-read-seconds"):
        load_model(model)
    assert load_model(amplifying.tile()).nodes  # the helper was replaced


def test_a_real_model_reads_as_before():
    graph = load_model(amplifying.shape_arithmetic())
    assert [n.op_type for n in graph.nodes] == ["Mul", "Concat", "ConstantOfShape"]
    assert graph.spec("shape").shape == (2,)  # typed by onnx's inference, in the helper


def test_nodes_are_counted_with_subgraphs_and_functions(bounded):
    model = amplifying.loop_scan()  # a Loop of two body nodes
    assert reading.count_nodes(model) == 3
    bounded(max_nodes=2)
    with pytest.raises(InvalidModel, match="--max-model-nodes"):
        load_model(model)


def test_sparse_initializers_are_held_dense_within_the_allowance(bounded):
    bounded(max_bytes=8 << 20)
    with pytest.raises(InvalidModel, match=r"sparse initializer 'w0'.*--max-read-bytes"):
        load_model(amplifying.read_sparse(count=1, elements=4 << 20))  # 16 MB dense
    graph = load_model(amplifying.read_sparse(count=1, elements=1 << 20))  # 4 MB
    assert graph.initializers["w0"].shape == (1 << 20,)


def test_folding_stops_at_the_allowance_and_leaves_the_rest_to_run_time(bounded):
    from plugserve.server import Core

    bounded(max_bytes=40 << 20)  # two 16 MiB values fit, not three
    model = amplifying.read_folded_chains(count=8, elements=4 << 20)
    compiled = Core().load_network(model, "NUMPY")
    try:
        request = compiled.create_infer_request()
        out = request.infer({"x": np.ones(1, np.float32)})
        assert out["c3"][-1] == (4 << 20) - 1  # a Range left to run time still runs
        assert out["c0"].shape == (4 << 20,)
    finally:
        compiled.close()
    with pytest.raises(InvalidModel, match="--max-read-bytes"):  # onnxruntime would fold all
        Core().load_network(model, "ORT")


def test_shape_inference_errors_are_onnxs_as_before():
    bad = helper.make_model(
        helper.make_graph(
            [helper.make_node("Softmax", ["x"], ["y"], axis=9)],
            "bad",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    bad.ir_version = 8
    with pytest.raises(InvalidModel, match="Softmax"):
        load_model(bad)


def _text_weight(count: int):
    """A model whose weight is ``count`` one-byte strings (3 bytes each on the wire)."""
    weight = helper.make_tensor("words", TensorProto.STRING, [count], [b"a"] * count)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["words"], ["out"])],
        "text",
        [],
        [helper.make_tensor_value_info("out", TensorProto.STRING, [count])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_text_weight_is_charged_before_its_strings_are_made(bounded):
    """Each string of a STRING weight becomes a Python object of ~115 bytes in the server, 38x
    its bytes on the wire (a red team's 48 MB model grew the server 1.9 GB): charged to the
    read's allowance (128 bytes a string) before any is made."""
    bounded(max_bytes=64 << 20)
    with pytest.raises(InvalidModel, match="--max-read-bytes") as refused:
        load_model(_text_weight(600_000))  # 77 MB of objects
    assert "text initializer 'words' of 600,000 strings" in str(refused.value)
    graph = load_model(_text_weight(1_000))
    assert graph.initializers["words"].tolist() == ["a"] * 1_000


def test_functions_are_counted_as_their_calls_expand_them(bounded):
    # f0: Relu + Identity (2); fk: two calls of f(k-1) + Identity; the graph's call: 1 more
    sizes = [2]
    for _ in range(5):
        sizes.append(2 * sizes[-1] + 3)
    assert reading.expanded_nodes(amplifying.calling_functions(6), most=10**9) == 1 + sizes[-1]
    assert (
        reading.expanded_nodes(amplifying.calling_functions(60), most=1000) == 1001
    )  # counted, not expanded
    assert load_model(
        amplifying.calling_functions(6)
    ).nodes  # a real model of functions reads as before
    bounded(max_nodes=100)
    with pytest.raises(InvalidModel, match=r"expanded where they are called.*--max-model-nodes"):
        load_model(amplifying.calling_functions(6))
    with pytest.raises(InvalidModel, match="call each other in a circle"):
        load_model(amplifying.calling_functions(3, circle=True))


def test_attribute_values_are_counted_before_they_are_read(bounded):
    bounded(max_bytes=1 << 20)  # 16,384 values of 64 bytes
    model = amplifying.tile()
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("listed", list(range(20_000))))
    with pytest.raises(InvalidModel, match=r"attribute 'listed': 20,000.*--max-read-bytes"):
        load_model(model)


def test_a_text_constant_is_counted_as_its_strings(bounded):
    """A Constant's STRING tensor becomes a Python object a string, as a text weight does:
    its strings count against the read's allowance (twice, 128 bytes each) before any is
    made."""
    bounded(max_bytes=64 << 20)
    weight = _text_weight(600_000)
    words = weight.graph.initializer.pop()
    weight.graph.node.insert(0, helper.make_node("Constant", [], ["words"], value=words))
    with pytest.raises(InvalidModel, match="Constant, attribute 'value': 1,200,000"):
        load_model(weight)
