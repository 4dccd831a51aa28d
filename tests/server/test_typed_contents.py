"""KServe's typed ``contents`` (what the KServe SDK, grpcurl and MLServer's clients send):
decoded by numpy from the serialized field instead of value by value through protobuf's Python
API, and charged to the memory budget for the arrays they decode into before they are decoded.

The decoder is checked against protobuf's own reading of the same values; the server is driven
with tritonclient's own ``service_pb2``, as a client of it would.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper
from serving import RunningServer

from plugserve.plugins.ir import np_dtype

grpcclient = pytest.importorskip("tritonclient.grpc", reason="pip install tritonclient[grpc]")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

MB = 1 << 20

#: KServe datatype -> (ONNX element type, the contents field that carries it)
TYPES = {
    "BOOL": (TensorProto.BOOL, "bool_contents"),
    "INT8": (TensorProto.INT8, "int_contents"),
    "INT16": (TensorProto.INT16, "int_contents"),
    "INT32": (TensorProto.INT32, "int_contents"),
    "INT64": (TensorProto.INT64, "int64_contents"),
    "UINT8": (TensorProto.UINT8, "uint_contents"),
    "UINT16": (TensorProto.UINT16, "uint_contents"),
    "UINT32": (TensorProto.UINT32, "uint_contents"),
    "UINT64": (TensorProto.UINT64, "uint64_contents"),
    "FP32": (TensorProto.FLOAT, "fp32_contents"),
    "FP64": (TensorProto.DOUBLE, "fp64_contents"),
}


def _values(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    """``n`` values of ``dtype``: its extremes first, then a spread (every other size small
    integers, one or two bytes a varint)."""
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind == "f":
        v = rng.standard_normal(n).astype(dtype)
        v[: min(n, 4)] = [np.inf, -np.inf, -0.0, np.finfo(dtype).max][: min(n, 4)]
        return v
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if n % 2:
        v = v % dtype.type(min(300, int(info.max)))
    v[: min(n, 3)] = [info.min, info.max, 0][: min(n, 3)]
    return v


@pytest.mark.parametrize("slice_bytes", [None, 7])  # 7: varints straddle every slice's end
def test_the_decoder_reads_what_protobuf_reads(monkeypatch, slice_bytes):
    from plugserve.proto import grpc_service_pb2 as pb
    from plugserve.server.protocols.kserve import contents as kserve_contents
    from plugserve.server.protocols.kserve.codec import CONTENTS, DATATYPES

    monkeypatch.setattr(kserve_contents, "FEW", 2)  # the numpy decode for all but one value
    if slice_bytes:
        monkeypatch.setattr(kserve_contents, "SLICE", slice_bytes)
    rng = np.random.default_rng(7)
    for datatype, field in CONTENTS.items():
        if datatype == "BYTES":
            continue
        dtype = DATATYPES[datatype]
        for n in (0, 1, 2, 3, 50, 1001, 2000 if slice_bytes else 70000):
            contents = pb.InferTensorContents()
            getattr(contents, field).extend(_values(rng, dtype, n).tolist())
            contents.bytes_contents.append(b"other fields are passed over")
            parsed = pb.InferTensorContents.FromString(contents.SerializeToString())
            got = kserve_contents.decode_contents(parsed, field, dtype)
            want = np.array(getattr(parsed, field), dtype=dtype)
            assert got.dtype == want.dtype and got.shape == want.shape, (datatype, n)
            assert np.array_equal(got, want, equal_nan=True), (datatype, n, got[:5], want[:5])


def test_the_decoder_refuses_a_value_that_does_not_fit_as_numpy_does():
    from plugserve.proto import grpc_service_pb2 as pb
    from plugserve.server.protocols.kserve import contents as kserve_contents
    from plugserve.server.protocols.kserve.codec import CONTENTS, DATATYPES

    for datatype, bad in (("INT8", 128), ("INT16", -40000), ("UINT8", 256), ("UINT16", 70000)):
        contents = pb.InferTensorContents()
        getattr(contents, CONTENTS[datatype]).extend([1, bad, 2] * kserve_contents.FEW)
        with pytest.raises(OverflowError, match=str(bad)):
            kserve_contents.decode_contents(contents, CONTENTS[datatype], DATATYPES[datatype])


def _identities(folder: Path) -> Path:
    """A model with one input of each numeric KServe datatype, each returned as it came."""
    inputs, outputs, nodes = [], [], []
    for datatype, (elem, _) in TYPES.items():
        name = datatype.lower()
        inputs.append(helper.make_tensor_value_info(name, elem, ["n"]))
        outputs.append(helper.make_tensor_value_info(f"{name}_out", elem, ["n"]))
        nodes.append(helper.make_node("Identity", [name], [f"{name}_out"]))
    graph = helper.make_graph(nodes, "typed", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "typed" / "1").mkdir(parents=True)
    (folder / "typed" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    text = helper.make_graph(
        [helper.make_node("Identity", ["s"], ["s_out"])],
        "text",
        [helper.make_tensor_value_info("s", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("s_out", TensorProto.STRING, ["n"])],
    )
    model = helper.make_model(text, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (folder / "text" / "1").mkdir(parents=True)
    (folder / "text" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    return folder


def _request(model: str, tensors: dict[str, tuple[str, np.ndarray]]):
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, (datatype, array) in tensors.items():
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        getattr(tensor.contents, TYPES[datatype][1]).extend(array.tolist())
    return request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = _identities(tmp_path_factory.mktemp("typed"))
    with (
        RunningServer(
            "--model-repository", str(repo), "--max-inflight-bytes", str(64 * MB)
        ) as running,
        grpc.insecure_channel(
            running.target,
            options=[
                ("grpc.max_send_message_length", 256 * MB),
                ("grpc.max_receive_message_length", 256 * MB),
            ],
        ) as channel,
    ):
        yield running, service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_every_numeric_type_arrives_as_sent(served):
    """Each datatype's extremes and a spread of values in between, through the server."""
    _, stub = served
    rng = np.random.default_rng(3)
    tensors = {}
    for datatype, (elem, _) in TYPES.items():
        dtype = np.dtype(np_dtype(elem))
        if dtype == np.bool_:
            array = np.array([True, False, True, True, False])
        elif dtype.kind == "f":
            array = np.array([np.finfo(dtype).min, -1.5, -0.0, 3.25, np.finfo(dtype).max], dtype)
        else:
            info = np.iinfo(dtype)
            middle = rng.integers(info.min, info.max, 3, dtype=dtype, endpoint=True)
            array = np.array([info.min, *middle, info.max], dtype)
        tensors[datatype.lower()] = (datatype, array)
    result = grpcclient.InferResult(stub.ModelInfer(_request("typed", tensors), timeout=60))
    for name, (_, array) in tensors.items():
        got = result.as_numpy(f"{name}_out")
        assert got.dtype == array.dtype and np.array_equal(got, array), name


def test_a_value_that_does_not_fit_its_datatype_is_refused(served):
    _, stub = served
    request = service_pb2.ModelInferRequest(model_name="typed")
    for datatype, (_, field) in TYPES.items():
        tensor = request.inputs.add(name=datatype.lower(), datatype=datatype, shape=[1])
        getattr(tensor.contents, field).append(True if datatype == "BOOL" else 1)
    request.inputs[1].contents.int_contents[0] = 200  # INT8
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "int8" in refused.value.details() and "200" in refused.value.details()


def _int64_request(count: int):
    """Zeros in int64_contents: one byte each on the wire, eight once decoded."""
    request = service_pb2.ModelInferRequest(model_name="typed")
    for datatype, (_, field) in TYPES.items():
        n = count if datatype == "INT64" else 1
        tensor = request.inputs.add(name=datatype.lower(), datatype=datatype, shape=[n])
        getattr(tensor.contents, field).extend([0] * n if datatype != "BOOL" else [False])
    return request


def test_typed_contents_are_charged_what_they_decode_into_before_decoding(served):
    """8M zeros in int64_contents take 8 MB on the wire and 64 MB as an array. Charged by the
    message alone (2 x 8 MB) the request was admitted into a 64 MB budget and decoded; now it
    is refused before decoding, naming the flag, and a request that fits is still served."""
    _, stub = served
    big = _int64_request(8 * MB)
    assert big.ByteSize() < 9 * MB
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(big, timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-inflight-bytes" in refused.value.details()
    fits = _int64_request(MB // 2)  # 0.5 MB on the wire, 4 MB decoded: charged 5 MB
    for _ in range(4):  # and each charge is given back
        result = grpcclient.InferResult(stub.ModelInfer(fits, timeout=60))
        out = result.as_numpy("int64_out")
        assert out.shape == (MB // 2,) and not out.any()


def test_strings_are_charged_the_objects_they_decode_into_before_decoding(served):
    """1.2M two-byte strings in bytes_contents take 4.8 MB on the wire and a Python object
    each once decoded (~50 bytes): charged by the message alone (2 x 4.8 MB) they were
    admitted into a 64 MB budget and decoded; now refused first, naming the flag."""
    _, stub = served

    def strings(count: int):
        request = service_pb2.ModelInferRequest(model_name="text")
        tensor = request.inputs.add(name="s", datatype="BYTES", shape=[count])
        tensor.contents.bytes_contents.extend([b"ab"] * count)
        return request

    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(strings(1_200_000), timeout=120)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-inflight-bytes" in refused.value.details()
    result = grpcclient.InferResult(stub.ModelInfer(strings(1000), timeout=60))
    assert result.as_numpy("s_out").tolist() == [b"ab"] * 1000
