"""Loading models: paths, bytes, ModelProto, validation errors and external data safety."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from models import mlp, small_cnn
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins.api import InvalidModel, Unsupported
from plugserve.plugins.ir import load_model


def test_load_from_path_bytes_and_proto_agree(tmp_path):
    model = small_cnn()
    path = tmp_path / "cnn.onnx"
    onnx.save(model, path)
    graphs = [
        load_model(path),
        load_model(str(path)),
        load_model(model.SerializeToString()),
        load_model(model),
    ]
    for g in graphs:
        assert [n.name for n in g.nodes] == [n.name for n in graphs[0].nodes]
        assert [i.name for i in g.inputs] == ["x"]
        assert set(g.initializers) == set(graphs[0].initializers)


def test_graph_keeps_types_dynamic_dims_and_topological_order():
    g = load_model(mlp())
    assert g.inputs[0].dtype == np.float32 and g.inputs[0].shape == ("batch", 32)
    seen = {"x", *g.initializers}
    for node in g.nodes:
        assert all(i in seen for i in node.inputs if i)
        seen.update(node.outputs)
        assert node.fused_names == [node.name]
    assert g.spec("m0").shape == ("batch", 64)  # shape inference ran


def test_nodes_out_of_order_are_sorted():
    model = mlp()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(reversed(nodes))
    g = load_model(model.SerializeToString())
    assert g.nodes[0].name == "matmul0" and g.nodes[-1].name == "out"


def test_not_onnx_is_refused(tmp_path):
    with pytest.raises(InvalidModel, match="not an ONNX model"):
        load_model(b"this is not a model at all \x00\xff")
    path = tmp_path / "junk.onnx"
    path.write_bytes(b"\x08\x07garbage")
    with pytest.raises(InvalidModel, match=r"junk\.onnx"):
        load_model(path)
    with pytest.raises(InvalidModel, match="does not exist"):
        load_model(tmp_path / "missing.onnx")
    with pytest.raises(InvalidModel, match=r"path, bytes or onnx\.ModelProto"):
        load_model(42)


def test_truncated_model_is_refused():
    data = small_cnn().SerializeToString()
    with pytest.raises(InvalidModel):
        load_model(data[: len(data) // 2])


def _two_node(a_inputs, b_inputs):
    return helper.make_graph(
        [
            helper.make_node("Relu", a_inputs, ["a"], name="A"),
            helper.make_node("Relu", b_inputs, ["b"], name="B"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )


def test_cycle_is_refused_naming_nodes():
    model = helper.make_model(_two_node(["b"], ["a"]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidModel) as info:
        load_model(model.SerializeToString())
    assert "cycle" in str(info.value) or "A" in str(info.value)


def test_dangling_edge_is_refused_naming_node_and_value():
    model = helper.make_model(
        _two_node(["x"], ["nowhere"]), opset_imports=[helper.make_opsetid("", 17)]
    )
    with pytest.raises(InvalidModel, match="nowhere"):
        load_model(model.SerializeToString())


def test_unknown_op_is_refused_at_load_with_node_named(numpy_plugin):
    graph = helper.make_graph(
        [helper.make_node("Frobnicate", ["x"], ["y"], name="mystery", domain="com.acme")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.acme", 1)]
    )
    with pytest.raises(Unsupported, match=r"mystery.*Frobnicate"):
        numpy_plugin.load_network(model)


def test_unknown_standard_op_fails_validation():
    graph = helper.make_graph(
        [helper.make_node("NotAnOnnxOp", ["x"], ["y"], name="n")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidModel, match="NotAnOnnxOp"):
        load_model(model.SerializeToString())


def _external_model(location: str) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"], name="add")],
        "ext",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        initializer=[weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_external_data_beside_the_model_is_read(tmp_path):
    (tmp_path / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    path = tmp_path / "model.onnx"
    path.write_bytes(_external_model("weights.bin").SerializeToString())
    g = load_model(path)
    assert np.array_equal(g.initializers["w"], np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("location", ["../secret.bin", "../../etc/passwd", "/etc/passwd"])
def test_external_data_outside_the_folder_is_refused(tmp_path, location):
    folder = tmp_path / "models"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 16)
    path = folder / "model.onnx"
    path.write_bytes(_external_model(location).SerializeToString())
    with pytest.raises(InvalidModel, match="outside the model's folder"):
        load_model(path)


def test_external_data_through_a_symlink_out_is_refused(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 16)
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    path = folder / "model.onnx"
    path.write_bytes(_external_model("link.bin").SerializeToString())
    with pytest.raises(InvalidModel, match="outside"):
        load_model(path)


def test_external_data_in_bytes_is_refused():
    with pytest.raises(InvalidModel, match="given as bytes cannot read files"):
        load_model(_external_model("weights.bin").SerializeToString())


@pytest.mark.parametrize("node_name", ["sm", ""])
def test_an_attribute_value_strict_inference_rejects_is_refused_naming_the_node(node_name):
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=9, name=node_name)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    where = f"node {node_name!r}" if node_name else "a node"
    with pytest.raises(InvalidModel, match=rf"{where} \(Softmax\): 'axis' must be in"):
        load_model(model)


def test_strict_inference_failing_inside_an_onnx_function_body_falls_back():
    """ONNX's own MeanVarianceNormalization body fails strict inference (a Constant with an
    attribute reference); the model is valid and must load."""
    graph = helper.make_graph(
        [helper.make_node("MeanVarianceNormalization", ["x"], ["y"], name="mvn")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3, 3, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert [n.op_type for n in load_model(model).nodes] == ["MeanVarianceNormalization"]
