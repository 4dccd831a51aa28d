"""proto/grpc_service.proto and proto/model_config.proto match tritonclient's protocol, field for
field, and messages cross between the two unchanged.

tritonclient's generated modules and ours define the same symbols (``inference.*``) in proto
files of different names. Ours add them to a descriptor pool of their own (``proto/pools.py``),
so both import in one process (tests/server/test_inprocess_clients.py); this test was written
before that and compares the two from their sources: it reads the serialized descriptors out of
both sets of ``*_pb2.py`` files, each into a pool of the test's. The checks that need the real
modules (tritonclient's request builder and result decoder; our generated module's descriptor)
run in subprocesses.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip("tritonclient is not installed", allow_module_level=True)

SERVICE = "inference.GRPCInferenceService"


# ------------------------------------------------------------------ tritonclient's descriptors


def _serialized_file(path: Path) -> bytes:
    """The FileDescriptorProto bytes a generated *_pb2.py hands to AddSerializedFile."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            return node.args[0].value
    raise AssertionError(f"no serialized descriptor in {path}")


@functools.cache
def _triton_pool() -> descriptor_pool.DescriptorPool:
    spec = importlib.util.find_spec("tritonclient")  # the top package only: no pb2 import
    grpc_dir = Path(next(iter(spec.submodule_search_locations))) / "grpc"
    pool = descriptor_pool.DescriptorPool()
    for name in ("model_config_pb2.py", "service_pb2.py"):  # dependency first
        pool.AddSerializedFile(_serialized_file(grpc_dir / name))
    return pool


def _triton_files():
    pool = _triton_pool()
    return [pool.FindFileByName("model_config.proto"), pool.FindFileByName("grpc_service.proto")]


def _triton_class(full_name: str):
    return message_factory.GetMessageClass(_triton_pool().FindMessageTypeByName(full_name))


# ------------------------------------------------------------------ our descriptors

OUR_CONFIG = "plugserve/proto/model_config.proto"
OUR_SERVICE = "plugserve/proto/grpc_service.proto"


def _proto_dir() -> Path:
    spec = importlib.util.find_spec("plugserve.proto")  # the package only: no pb2 import
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _our_pool() -> descriptor_pool.DescriptorPool:
    """Our generated descriptors in a private pool (never the default one tritonclient uses)."""
    pool = descriptor_pool.DescriptorPool()
    for name in ("model_config_pb2.py", "grpc_service_pb2.py"):  # dependency first
        pool.AddSerializedFile(_serialized_file(_proto_dir() / name))
    return pool


def _our_class(full_name: str):
    return message_factory.GetMessageClass(_our_pool().FindMessageTypeByName(full_name))


# ------------------------------------------------------------------ structural comparison


def _types(files) -> tuple[dict, dict]:
    """Every message and enum defined in `files`, nested ones included, by full name."""
    messages, enums = {}, {}

    def visit(desc):
        messages[desc.full_name] = desc
        for enum in desc.enum_types:
            enums[enum.full_name] = enum
        for nested in desc.nested_types:
            visit(nested)

    for file in files:
        for enum in file.enum_types_by_name.values():
            enums[enum.full_name] = enum
        for desc in file.message_types_by_name.values():
            visit(desc)
    return messages, enums


def _message_shape(desc) -> dict:
    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    oneofs = [o.name for o in proto.oneof_decl]
    fields = {
        f.name: {
            "number": f.number,
            "type": descriptor_pb2.FieldDescriptorProto.Type.Name(f.type),
            "label": descriptor_pb2.FieldDescriptorProto.Label.Name(f.label),
            "type_name": f.type_name,
            "oneof": oneofs[f.oneof_index] if f.HasField("oneof_index") else None,
            "proto3_optional": f.proto3_optional,
        }
        for f in proto.field
    }
    return {
        "fields": fields,
        "oneofs": sorted(oneofs),
        "map_entry": proto.options.map_entry,
        "nested_types": sorted(n.name for n in proto.nested_type),
        "nested_enums": sorted(e.name for e in proto.enum_type),
    }


def _enum_shape(desc) -> list[tuple[str, int]]:
    return [(v.name, v.number) for v in desc.values]


def _service_shape(desc) -> dict:
    return {
        m.name: (
            m.input_type.full_name,
            m.output_type.full_name,
            m.client_streaming,
            m.server_streaming,
        )
        for m in desc.methods
    }


def _differences(theirs_files, ours_files) -> list[str]:
    """Human-readable differences between two sets of files; empty when they agree."""
    diffs = []
    their_msgs, their_enums = _types(theirs_files)
    our_msgs, our_enums = _types(ours_files)
    for kind, theirs, mine, shape in (
        ("message", their_msgs, our_msgs, _message_shape),
        ("enum", their_enums, our_enums, _enum_shape),
    ):
        for name in sorted(theirs.keys() - mine.keys()):
            diffs.append(f"{kind} {name} missing")
        for name in sorted(mine.keys() - theirs.keys()):
            diffs.append(f"{kind} {name} is extra")
        for name in sorted(theirs.keys() & mine.keys()):
            a, b = shape(theirs[name]), shape(mine[name])
            if a == b:
                continue
            if kind == "message":
                for key in a:
                    if key == "fields":
                        for field in sorted(a["fields"].keys() | b["fields"].keys()):
                            fa, fb = a["fields"].get(field), b["fields"].get(field)
                            if fa != fb:
                                diffs.append(f"{name}.{field}: tritonclient {fa}, ours {fb}")
                    elif a[key] != b[key]:
                        diffs.append(f"{name} {key}: tritonclient {a[key]}, ours {b[key]}")
            else:
                diffs.append(f"enum {name}: tritonclient {a}, ours {b}")
    their_services = {s.full_name: s for f in theirs_files for s in f.services_by_name.values()}
    our_services = {s.full_name: s for f in ours_files for s in f.services_by_name.values()}
    if their_services.keys() != our_services.keys():
        diffs.append(
            f"services: tritonclient {sorted(their_services)}, ours {sorted(our_services)}"
        )
    for name in sorted(their_services.keys() & our_services.keys()):
        a, b = _service_shape(their_services[name]), _service_shape(our_services[name])
        for method in sorted(a.keys() | b.keys()):
            if a.get(method) != b.get(method):
                diffs.append(f"{name}/{method}: tritonclient {a.get(method)}, ours {b.get(method)}")
    return diffs


OUR_FILES = [_our_pool().FindFileByName(OUR_CONFIG), _our_pool().FindFileByName(OUR_SERVICE)]


def test_files_are_package_inference():
    for file in OUR_FILES:
        assert file.package == "inference"
    assert [d.name for d in OUR_FILES[1].dependencies] == [OUR_CONFIG]


def test_same_set_of_messages_and_enums():
    their_msgs, their_enums = _types(_triton_files())
    our_msgs, our_enums = _types(OUR_FILES)
    assert sorted(our_msgs) == sorted(their_msgs)
    assert sorted(our_enums) == sorted(their_enums)


def _triton_message_names() -> list[str]:
    return sorted(_types(_triton_files())[0])


def _triton_enum_names() -> list[str]:
    return sorted(_types(_triton_files())[1])


@pytest.mark.parametrize("name", _triton_message_names())
def test_message_matches(name):
    theirs = _triton_pool().FindMessageTypeByName(name)
    mine = _our_pool().FindMessageTypeByName(name)
    assert _message_shape(mine) == _message_shape(theirs)


@pytest.mark.parametrize("name", _triton_enum_names())
def test_enum_matches(name):
    theirs = _triton_pool().FindEnumTypeByName(name)
    mine = _our_pool().FindEnumTypeByName(name)
    assert _enum_shape(mine) == _enum_shape(theirs)


def test_service_matches():
    theirs = _triton_pool().FindServiceByName(SERVICE)
    mine = OUR_FILES[1].services_by_name["GRPCInferenceService"]
    assert mine.full_name == SERVICE
    assert _service_shape(mine) == _service_shape(theirs)
    assert [m.name for m in mine.methods] == [m.name for m in theirs.methods]


def test_no_differences_at_all():
    assert _differences(_triton_files(), OUR_FILES) == []


def _mutated_files(edit):
    """Our two files rebuilt in a private pool after `edit(grpc_service FileDescriptorProto)`."""
    protos = []
    for file in OUR_FILES:
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        protos.append(proto)
    edit(protos[1])
    pool = descriptor_pool.DescriptorPool()
    return [pool.Add(p) for p in protos]


def _field(file_proto, message, field):
    msg = next(m for m in file_proto.message_type if m.name == message)
    return next(f for f in msg.field if f.name == field)


def test_comparison_catches_a_changed_field_number():
    def renumber(proto):
        _field(proto, "ModelInferRequest", "raw_input_contents").number = 8

    diffs = _differences(_triton_files(), _mutated_files(renumber))
    assert len(diffs) == 1 and "inference.ModelInferRequest.raw_input_contents" in diffs[0]


def test_comparison_catches_a_changed_type_and_oneof():
    def retype(proto):
        _field(
            proto, "InferParameter", "uint64_param"
        ).type = descriptor_pb2.FieldDescriptorProto.TYPE_INT64
        _field(proto, "ModelStreamInferResponse", "error_message").number = 3

    diffs = _differences(_triton_files(), _mutated_files(retype))
    assert any("InferParameter.uint64_param" in d for d in diffs)
    assert any("ModelStreamInferResponse.error_message" in d for d in diffs)


# ------------------------------------------------------------------ wire round trips


def _fill_infer_request(m):
    m.model_name = "resnet"
    m.model_version = "3"
    m.id = "req-42"
    m.parameters["sequence_id"].int64_param = -7
    m.parameters["sequence_start"].bool_param = True
    m.parameters["priority"].uint64_param = 2**63 + 5
    m.parameters["note"].string_param = "héllo"
    m.parameters["scale"].double_param = 0.25
    x = m.inputs.add(name="x", datatype="FP32", shape=[2, 3])
    x.parameters["shared_memory_offset"].int64_param = 16
    t = m.inputs.add(name="t", datatype="BYTES", shape=[2])
    t.contents.bytes_contents.extend([b"ab", b""])
    i = m.inputs.add(name="i", datatype="INT32", shape=[3])
    i.contents.int_contents.extend([-1, 0, 2**31 - 1])
    out = m.outputs.add(name="y")
    out.parameters["classification"].int64_param = 3
    m.outputs.add(name="z")
    m.raw_input_contents.append(np.arange(6, dtype="<f4").tobytes())
    return m


def _fill_infer_response(m):
    m.model_name = "resnet"
    m.model_version = "3"
    m.id = "req-42"
    m.parameters["sequence_end"].bool_param = True
    y = m.outputs.add(name="y", datatype="FP16", shape=[1, 4])
    y.parameters["binary_data_size"].int64_param = 8
    z = m.outputs.add(name="z", datatype="UINT64", shape=[2])
    z.contents.uint64_contents.extend([0, 2**64 - 1])
    m.raw_output_contents.append(np.ones(4, dtype="<f2").tobytes())
    return m


def _fill_stream_response(m):
    m.error_message = "model 'nope' is not ready"
    _fill_infer_response(m.infer_response)
    return m


def _fill_config_response(m):
    c = m.config
    c.name = "resnet"
    c.platform = "onnxruntime_onnx"
    c.backend = "onnxruntime"
    c.max_batch_size = 8
    c.version_policy.latest.num_versions = 2
    inp = c.input.add(name="x", data_type=11, format=2, dims=[3, -1, -1])  # TYPE_FP32, NCHW
    inp.reshape.shape.extend([1, 3])
    c.output.add(name="y", data_type=13, dims=[1000], label_filename="labels.txt")
    c.dynamic_batching.preferred_batch_size.extend([4, 8])
    c.dynamic_batching.max_queue_delay_microseconds = 100
    c.dynamic_batching.priority_queue_policy[1].max_queue_size = 5
    group = c.instance_group.add(name="g", kind=2, count=2)  # KIND_CPU
    group.rate_limiter.resources.add(name="r", count=1)
    spec = c.optimization.cuda.graph_spec.add(batch_size=4)
    spec.input["x"].dim.extend([3, 224, 224])
    c.optimization.execution_accelerators.cpu_execution_accelerator.add(name="openvino")
    c.parameters["threads"].string_value = "4"
    c.model_warmup.add(name="w", batch_size=1).inputs["x"].random_data = True
    c.model_transaction_policy.decoupled = True
    return m


def _fill_statistics_response(m):
    s = m.model_stats.add(
        name="resnet",
        version="3",
        last_inference=1_700_000_000_000,
        inference_count=10,
        execution_count=4,
    )
    s.inference_stats.success.count = 10
    s.inference_stats.success.ns = 123_456
    s.inference_stats.queue.ns = 7
    s.batch_stats.add(batch_size=4).compute_infer.ns = 99
    s.memory_usage.add(type="CPU", id=0, byte_size=1 << 20)
    s.response_stats["0"].success.count = 1
    return m


def _fill_repository_load(m):
    m.repository_name = ""
    m.model_name = "resnet"
    m.parameters["config"].string_param = '{"max_batch_size": 8}'
    m.parameters["file:1/model.onnx"].bytes_param = b"\x08\x07"
    return m


ROUND_TRIPS = {
    "inference.ModelInferRequest": _fill_infer_request,
    "inference.ModelInferResponse": _fill_infer_response,
    "inference.ModelStreamInferResponse": _fill_stream_response,
    "inference.ModelConfigResponse": _fill_config_response,
    "inference.ModelStatisticsResponse": _fill_statistics_response,
    "inference.RepositoryModelLoadRequest": _fill_repository_load,
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_round_trip_both_ways(name):
    fill = ROUND_TRIPS[name]
    theirs_cls, ours_cls = _triton_class(name), _our_class(name)
    theirs = fill(theirs_cls())
    # tritonclient -> ours
    parsed = ours_cls.FromString(theirs.SerializeToString())
    assert parsed == fill(ours_cls())
    # ours -> tritonclient
    back = theirs_cls.FromString(parsed.SerializeToString())
    assert back == theirs
    assert back.SerializeToString(deterministic=True) == theirs.SerializeToString(
        deterministic=True
    )


CLIENT_SCRIPT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import _utils, service_pb2

x = grpcclient.InferInput("x", [2, 3], "FP32")
x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
t = grpcclient.InferInput("t", [2], "BYTES")
t.set_data_from_numpy(np.array([b"hi", b"there"], dtype=np.object_))
outputs = [grpcclient.InferRequestedOutput("y", class_count=2),
           grpcclient.InferRequestedOutput("z")]
request = _utils._get_inference_request(
    model_name="m", inputs=[x, t], model_version="1", request_id="r1", outputs=outputs,
    sequence_id=7, sequence_start=True, sequence_end=False, priority=3, timeout=1000,
    parameters={"custom": "v"})

response = service_pb2.ModelInferResponse.FromString(sys.stdin.buffer.read())
result = grpcclient.InferResult(response)
print(json.dumps({
    "request": request.SerializeToString().hex(),
    "y": result.as_numpy("y").tolist(),
    "s": [v.decode() for v in result.as_numpy("s").tolist()],
    "id": result.get_response().id,
}))
"""


def test_real_tritonclient_builds_requests_we_parse_and_reads_our_responses():
    """tritonclient's own request builder and result decoder, run in a subprocess."""
    response = _our_class("inference.ModelInferResponse")(
        model_name="m", model_version="1", id="r1"
    )
    response.outputs.add(name="y", datatype="INT64", shape=[2, 2])
    response.raw_output_contents.append(np.array([[1, -2], [3, 4]], dtype="<i8").tobytes())
    response.outputs.add(name="s", datatype="BYTES", shape=[2])
    strings = b"".join(len(s).to_bytes(4, "little") + s for s in (b"ab", b"xyz"))
    response.raw_output_contents.append(strings)
    done = subprocess.run(
        [sys.executable, "-c", CLIENT_SCRIPT],
        input=response.SerializeToString(),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    report = json.loads(done.stdout)
    assert report["y"] == [[1, -2], [3, 4]]
    assert report["s"] == ["ab", "xyz"]
    assert report["id"] == "r1"

    wire = bytes.fromhex(report["request"])
    request = _our_class("inference.ModelInferRequest").FromString(wire)
    assert (request.model_name, request.model_version, request.id) == ("m", "1", "r1")
    assert [(i.name, i.datatype, list(i.shape)) for i in request.inputs] == [
        ("x", "FP32", [2, 3]),
        ("t", "BYTES", [2]),
    ]
    assert request.raw_input_contents[0] == np.arange(6, dtype="<f4").tobytes()
    assert request.raw_input_contents[1] == b"\x02\x00\x00\x00hi\x05\x00\x00\x00there"
    assert [o.name for o in request.outputs] == ["y", "z"]
    assert request.outputs[0].parameters["classification"].int64_param == 2
    params = request.parameters
    assert params["sequence_id"].int64_param == 7
    assert params["sequence_start"].bool_param is True
    assert params["sequence_end"].WhichOneof("parameter_choice") == "bool_param"
    assert params["priority"].uint64_param == 3
    assert params["timeout"].int64_param == 1000
    assert params["custom"].string_param == "v"
    # and back: tritonclient's class reads our re-serialization as the original
    triton_cls = _triton_class("inference.ModelInferRequest")
    assert triton_cls.FromString(request.SerializeToString()) == triton_cls.FromString(wire)


OUR_MODULES_SCRIPT = r"""
import sys
from google.protobuf import descriptor_pb2
from plugserve.proto import grpc_service_pb2, model_config_pb2

for module in (model_config_pb2, grpc_service_pb2):
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    print(proto.SerializeToString(deterministic=True).hex())
"""


def test_private_pool_holds_what_our_generated_modules_register():
    """The descriptors read from the *_pb2.py sources are the ones the modules import."""
    done = subprocess.run(
        [sys.executable, "-c", OUR_MODULES_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    expected = []
    for file in OUR_FILES:
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        expected.append(proto.SerializeToString(deterministic=True).hex())
    assert done.stdout.split() == expected
