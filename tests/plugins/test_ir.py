"""Loading models: paths, bytes, ModelProto, validation errors and external data safety."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from google.protobuf.unknown_fields import UnknownFieldSet
from models import mlp, small_cnn
from onnx import TensorProto, helper, numpy_helper

from plugserve.plugins import ir, model_copies, reading
from plugserve.plugins.api import InvalidModel, Unsupported
from plugserve.plugins.ir import load_model
from plugserve.plugins.model_copies import serialized


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


def test_tensors_sharing_external_bytes_are_refused(tmp_path):
    """Every tensor's bytes read together are at most its files' bytes: a red team's 500
    initializers each naming one 1 MB range of one file grew the server 2.2 GB."""
    (tmp_path / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    model = _external_model("weights.bin")
    second = model.graph.initializer.add()
    second.CopyFrom(model.graph.initializer[0])
    second.name = "w2"
    model.graph.node.add().CopyFrom(helper.make_node("Add", ["y", "w2"], ["z"], name="add2"))
    model.graph.output[0].name = "z"
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(InvalidModel, match="tensors may not share bytes"):
        load_model(path)


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


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("offset", "-1", "offset '-1' is not a count of bytes"),
        ("offset", "abc", "offset 'abc' is not a count of bytes"),
        ("length", "1e3", "length '1e3' is not a count of bytes"),
        ("length", "-3", "length '-3' is not a count of bytes"),
        ("offset", "9" * 23, "offset '9999"),
        ("offset", "9" * 19, "runs past the end of 'weights.bin'"),
        ("length", "9" * 19, "runs past the end of 'weights.bin'"),
        ("location", "weights.bin\x00x", "holds a NUL byte"),
        ("location", "../weights.bin", "outside the model's folder;"),
    ],
)
def test_bad_external_data_fields_are_refused_naming_them(tmp_path, field, value, said):
    """The fields are a client's where a load sends files: Python's own errors were a 500."""
    (tmp_path / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    model = _external_model("weights.bin")
    entry = next(e for e in model.graph.initializer[0].external_data if e.key == field)
    entry.value = value
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(InvalidModel, match=f"tensor 'w'.*{re.escape(said)}") as refused:
        load_model(path)
    assert str(tmp_path) not in str(refused.value)  # the server's folder is not the client's


def test_a_model_file_is_parsed_within_the_reads_bound(tmp_path, monkeypatch):
    """A file may be a client's (a repository load's file overrides): 2 MB of empty nodes
    parse to ~140 MB, so the file's bytes are parsed as a client's bytes are, first in a
    helper bounded by --max-read-bytes (onnx.load parsed them in the server: 10 MB, +1 GB)."""
    monkeypatch.setattr(reading, "_limits", reading.ReadLimits(max_bytes=16 << 20))
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    empty = b"\x0a\x00" * 1_000_000  # GraphProto.node, of no fields
    size = len(empty)
    length = bytes([(size >> s & 0x7F) | (0x80 if size >> s >> 7 else 0) for s in (0, 7, 14)])
    path = tmp_path / "1" / "model.onnx"
    path.parent.mkdir()
    path.write_bytes(data.SerializeToString() + b"\x3a" + length + empty)  # graph, merged
    with pytest.raises(InvalidModel, match=r"model file '1/model.onnx': parsing its") as refused:
        load_model(path)
    assert str(tmp_path) not in str(refused.value)


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


def _weighted(mend=lambda model, weight: None, ir_version: int = 8) -> onnx.ModelProto:
    """x @ w + b: a [128, 128] weight (large: the checker sees a stand-in of it) and a
    small bias, ``mend`` applied to the model and its weight."""
    weight = numpy_helper.from_array(np.eye(128, dtype=np.float32), "w")
    bias = numpy_helper.from_array(np.arange(128, dtype=np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
            helper.make_node("Add", ["m", "b"], ["y"], name="add"),
        ],
        "weighted",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128])],
        initializer=[weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ir_version
    mend(model, model.graph.initializer[0])
    return model


def _short(model, w):
    w.raw_data = w.raw_data[:100]


def _long(model, w):
    w.raw_data += b"\0\0\0\0"


def _odd(model, w):
    w.raw_data = w.raw_data[:-1]


def _string(model, w):
    w.data_type = TensorProto.STRING


def _undefined(model, w):
    w.data_type = TensorProto.UNDEFINED


def _unknown_type(model, w):
    w.data_type = 99


def _two_fields(model, w):
    w.float_data.append(1.0)


def _negative_dims(model, w):
    w.dims[:] = [-128, -128]


def _empty_with_data(model, w):
    w.dims[:] = [0, 128]


def _twice(model, w):
    model.graph.initializer.add().CopyFrom(w)


def _not_an_input_at_ir3(model, w):
    model.ir_version = 3
    model.graph.input.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [128]))


@pytest.mark.parametrize(
    "mend",
    [
        _string, _undefined, _two_fields, _negative_dims, _empty_with_data,
        _twice, _not_an_input_at_ir3,
    ],
)  # fmt: skip
def test_a_large_weight_the_checker_refuses_is_refused_with_its_words(mend):
    """The checker sees large weights as stand-ins without their data
    (model_copies.checked_form): what it refuses a weight for other than its data's length, it
    still says, word for word."""
    model = _weighted(mend)
    with pytest.raises(onnx.checker.ValidationError) as checker:
        onnx.checker.check_model(model)
    with pytest.raises(InvalidModel) as ours:
        load_model(model)
    assert str(checker.value).strip().splitlines()[0] in str(ours.value)


@pytest.mark.parametrize("mend", [_short, _long, _odd])
def test_a_large_weight_of_the_wrong_length_is_refused_naming_it(mend):
    """Its data's length is what the stand-in leaves out: graph_from_proto reads the data
    whole and refuses it, naming the initializer (onnx's checker, from 1.20 on, refuses a
    short one; a long one it lets through)."""
    with pytest.raises(InvalidModel, match=r"model 'weighted': initializer 'w': "):
        load_model(_weighted(mend))


def test_a_large_weight_of_a_type_onnx_does_not_know_is_refused():
    """The checker lets an unknown type through with raw_data (and so the stand-in keeps the
    tensor itself); shape inference refuses it."""
    with pytest.raises(InvalidModel, match="data type 99"):
        load_model(_weighted(_unknown_type))


def _listed_as_inputs(model, w):
    """IR 3: every initializer is a graph input too."""
    model.ir_version = 3
    for name, shape in (("w", [128, 128]), ("b", [128])):
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))


@pytest.mark.parametrize("mend", [lambda model, w: None, _listed_as_inputs])
def test_large_weights_load_whole_and_unchanged(mend):
    graph = load_model(_weighted(mend))
    np.testing.assert_array_equal(graph.initializers["w"], np.eye(128, dtype=np.float32))
    np.testing.assert_array_equal(graph.initializers["b"], np.arange(128, dtype=np.float32))
    assert [spec.name for spec in graph.inputs] == ["x"]


def test_a_weight_read_from_external_data_stands_in_for_the_checker(tmp_path):
    """The largest models keep their weights beside them; once read in (data_location DEFAULT,
    set explicitly) they are raw_data like any other, and the checker sees them without it."""
    model = _weighted()
    path = tmp_path / "weighted.onnx"
    onnx.save(model, path, save_as_external_data=True, size_threshold=1024, location="w.bin")
    proto, _ = ir.read_model(path)
    weight = proto.graph.initializer[0]
    assert weight.name == "w" and weight.HasField("data_location") and len(weight.raw_data)
    checked = model_copies.checked_form(proto).graph.initializer[0]
    assert checked.name == "w" and not checked.raw_data and list(checked.dims) == [0, 0]
    graph = load_model(path)
    np.testing.assert_array_equal(graph.initializers["w"], np.eye(128, dtype=np.float32))


def test_serialized_in_pieces_parses_to_the_same_model():
    """ir.serialized writes the initializers as graph fragments of their own: a parser merges
    them back, in their order, beside every other field."""
    model = _weighted()
    model.graph.initializer.add().CopyFrom(numpy_helper.from_array(np.ones(3, np.int64), "k"))
    model.producer_name, model.doc_string = "a test", "pieces"
    helper.set_model_props(model, {"key": "value"})
    twice = helper.make_node("Add", ["a", "a"], ["b"])
    opsets = [helper.make_opsetid("", 17)]
    model.functions.append(helper.make_function("local", "Twice", ["a"], ["b"], [twice], opsets))
    data = serialized(model)
    assert data != model.SerializeToString()  # fields in another order: this is the pieces
    parsed = onnx.ModelProto()
    parsed.ParseFromString(data)
    assert parsed == model
    assert [t.name for t in parsed.graph.initializer] == ["w", "b", "k"]
    bare = helper.make_model(small_cnn().graph)  # and a model without initializers
    del bare.graph.initializer[:]
    again = onnx.ModelProto()
    again.ParseFromString(serialized(bare))
    assert again == bare


def test_serialized_keeps_the_fields_this_onnx_does_not_know():
    """A newer exporter's field, unknown here, still reaches the backend (it may know it)."""
    model = _weighted()
    unknown = bytes([99 << 3 & 0x7F | 0x80, 99 >> 4, 5])  # field 99, a varint: 5
    for target in (model, model.graph):
        target.MergeFromString(unknown)
    parsed = onnx.ModelProto()
    parsed.ParseFromString(serialized(model))
    assert parsed.SerializeToString() == model.SerializeToString()
    assert len(UnknownFieldSet(parsed)) == len(UnknownFieldSet(parsed.graph)) == 1


def test_serialized_refuses_a_model_over_protobufs_bound(monkeypatch):
    model = _weighted()
    # a model of 2 GiB is too much to make here
    monkeypatch.setattr(model_copies, "_MAX_MESSAGE", model.ByteSize() - 1)
    with pytest.raises(InvalidModel, match=r"'weighted' cannot be serialized: .* over protobuf"):
        serialized(model)


def test_a_subgraphs_sparse_initializer_is_defined_in_it(numpy_plugin):
    """A sparse initializer's name is its values' (SparseTensorProto has none of its own): an
    If whose branch holds one was an AttributeError, QueryNetwork's INTERNAL."""
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([5.0], np.float32), "s"),
        numpy_helper.from_array(np.array([1], np.int64), "s_indices"),
        [3],
    )
    out = helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])
    branch = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["b"])], "then", [], [out], sparse_initializer=[sparse]
    )
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["b"])], "else", [], [out])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=other)],
        "sparse_branch",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    node = next(n for n in load_model(model).nodes if n.op_type == "If")
    assert ir.subgraph_free_names(node) == ["x"]
    assert "if" in numpy_plugin.query_network(model.SerializeToString())
