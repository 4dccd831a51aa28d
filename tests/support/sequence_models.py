"""Sequence models built in code: Triton's own sequence examples and stateful ones.

``simple_sequence`` and ``simple_dyna_sequence`` are the graphs of Triton's example models
(server repo, docs/examples/model_repository: OUTPUT = (INPUT + START) * READY, the dyna one
adding END * CORRID), written here node for node so the tests need no download; their
config.pbtxt files say what Triton's say. ``accumulator`` keeps a running sum as an implicit
state (Triton's ``state`` entries), the smallest real stateful model.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from models import adding_body
from onnx import TensorProto, helper

OPSET = 17

SIMPLE_SEQUENCE = """
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

SIMPLE_DYNA_SEQUENCE = """
name: "simple_dyna_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  oldest { max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def _int32(name: str, dtype: int = TensorProto.INT32) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, ["batch", 1])


def _model(nodes, inputs, outputs, name):
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def simple_sequence() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Identity", ["INPUT"], ["_INPUT"]),
        helper.make_node("Add", ["_INPUT", "START"], ["add"]),
        helper.make_node("Mul", ["READY", "add"], ["CAST"]),
        helper.make_node("Cast", ["CAST"], ["OUTPUT"], to=TensorProto.INT32),
    ]
    inputs = [_int32("INPUT"), _int32("START"), _int32("READY")]
    return _model(nodes, inputs, [_int32("OUTPUT")], "simple_sequence")


def simple_dyna_sequence() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Identity", ["INPUT"], ["_INPUT"]),
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),
        helper.make_node("Add", ["_INPUT", "START"], ["add0"]),
        helper.make_node("Mul", ["END", "corrid"], ["mul0"]),
        helper.make_node("Add", ["add0", "mul0"], ["sum0"]),
        helper.make_node("Mul", ["READY", "sum0"], ["CAST"]),
        helper.make_node("Cast", ["CAST"], ["OUTPUT"], to=TensorProto.INT32),
    ]
    inputs = [
        _int32("INPUT"),
        _int32("START"),
        _int32("END"),
        _int32("READY"),
        _int32("CORRID", TensorProto.UINT64),
    ]
    return _model(nodes, inputs, [_int32("OUTPUT")], "simple_dyna_sequence")


def accumulator(batched: bool = True) -> onnx.ModelProto:
    """OUTPUT = INPUT + STATE_IN (float32 [batch, 4]); STATE_OUT = OUTPUT."""
    dims = ["batch", 4] if batched else [4]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)  # noqa: E731
    nodes = [
        helper.make_node("Add", ["INPUT", "STATE_IN"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
    ]
    return _model(
        nodes, [value("INPUT"), value("STATE_IN")], [value("OUTPUT"), value("STATE_OUT")], "acc"
    )


def accumulator_config(
    name: str, strategy: str = "", max_batch_size: int = 8, extra: str = ""
) -> str:
    dims = "[ 4 ]"
    return f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
sequence_batching {{
  {strategy}
  {extra}
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: {dims} }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: {dims} }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: {dims} }} ]
"""


def picker() -> onnx.ModelProto:
    """OUTPUT = the INDEX-th value of the state's row (GatherElements), STATE_OUT = STATE_IN + 1
    (float32 [batch, 4]). An INDEX outside [-4, 3] fails the run: the device checks bounds."""
    state = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 4])  # noqa: E731
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph(
        [
            helper.make_node("GatherElements", ["STATE_IN", "INDEX"], ["OUTPUT"], axis=1),
            helper.make_node("Add", ["STATE_IN", "one"], ["STATE_OUT"]),
        ],
        "picker",
        [
            helper.make_tensor_value_info("INDEX", TensorProto.INT64, ["batch", 1]),
            state("STATE_IN"),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", 1]),
            state("STATE_OUT"),
        ],
        [one],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def oldest_config(name: str, rows: int, input_name: str, output_dims: str) -> str:
    """``oldest``, waiting up to 2 s for ``rows`` sequences' requests to run together; a
    float32 [4] state, one INT64 [1] input, one float32 output."""
    return f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {rows}
sequence_batching {{
  oldest {{ max_candidate_sequences: 16 preferred_batch_size: [ {rows} ]
           max_queue_delay_microseconds: 2000000 }}
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
}}
input [ {{ name: "{input_name}" data_type: TYPE_INT64 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: {output_dims} }} ]
"""


def spinner() -> onnx.ModelProto:
    """OUTPUT = STATE_IN added up M times in a Loop (M: the rows' largest), STATE_OUT =
    STATE_IN + 1 (float32 [batch, 4]): a run that takes as long as a request asks."""
    rows = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 4])  # noqa: E731
    body = adding_body("STATE_IN")
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMax", ["M"], ["trips"], keepdims=0),
            helper.make_node("Mul", ["STATE_IN", "zero"], ["start"]),
            helper.make_node("Loop", ["trips", "", "start"], ["OUTPUT"], body=body),
            helper.make_node("Add", ["STATE_IN", "one"], ["STATE_OUT"]),
        ],
        "spinner",
        [helper.make_tensor_value_info("M", TensorProto.INT64, ["batch", 1]), rows("STATE_IN")],
        [rows("OUTPUT"), rows("STATE_OUT")],
        [
            helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
            helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def big_state(size: int) -> onnx.ModelProto:
    """A state of ``size`` float32 a row (STATE_OUT = STATE_IN + INPUT) and a small answer
    (OUTPUT = its sum): what a sequence holds is its state, not its messages."""
    nodes = [
        helper.make_node("Add", ["STATE_IN", "INPUT"], ["STATE_OUT"]),
        helper.make_node("ReduceSum", ["STATE_OUT", "axes"], ["OUTPUT"], keepdims=1),
    ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        nodes,
        "big_state",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("STATE_IN", TensorProto.FLOAT, ["batch", size]),
        ],
        [
            helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("STATE_OUT", TensorProto.FLOAT, ["batch", size]),
        ],
        [axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def big_state_config(name: str, size: int) -> str:
    return f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 4
sequence_batching {{
  state [ {{
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ {size} ]
  }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
"""


def write_model(root: Path, name: str, model: onnx.ModelProto, config: str) -> Path:
    """A Triton repository entry: ``root/name/config.pbtxt`` and ``root/name/1/model.onnx``."""
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "1" / "model.onnx"))
    (folder / "config.pbtxt").write_text(config)
    return folder


def triton_examples(root: Path) -> Path:
    """Triton's two sequence example models, as its docs' model repository holds them."""
    write_model(root, "simple_sequence", simple_sequence(), SIMPLE_SEQUENCE)
    write_model(root, "simple_dyna_sequence", simple_dyna_sequence(), SIMPLE_DYNA_SEQUENCE)
    return root
