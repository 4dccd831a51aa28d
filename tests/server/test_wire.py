"""Responses composed as wire bytes are exactly what protobuf itself would serialize."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plugserve.proto import plugserve_pb2 as pb
from plugserve.proto.tensors import from_tensor, to_tensor

COMPOSED_ARRAYS = {
    "image": np.random.default_rng(0).random((1, 3, 5, 7), dtype=np.float32),
    "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
    "transposed": np.arange(12, dtype=np.float64).reshape(3, 4).T,
    "flags": np.array([True, False, True]),
    "half": np.array([1.5, -2.0], dtype=np.float16),
    "scalar": np.array(3, dtype=np.int64),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "words": np.array(["a", "", "héllo"], dtype=object),
}


@pytest.mark.parametrize("names", [list(COMPOSED_ARRAYS), ["empty"], []])
def test_composed_plugserve_response_is_protobufs_own_serialization(names):
    from plugserve.server.protocols.v1.convert import infer_response

    outputs = {name: COMPOSED_ARRAYS[name] for name in names}
    composed = b"".join(infer_response("req-1", "net", 3, outputs))
    expected = pb.InferResponse(id="req-1", network="net", version=3)
    for name, array in outputs.items():
        to_tensor(expected.outputs.add(), name, array)
    assert composed == expected.SerializeToString()
    parsed = pb.InferResponse.FromString(composed)
    for tensor, (name, array) in zip(parsed.outputs, outputs.items()):
        assert tensor.name == name
        assert np.array_equal(from_tensor(tensor), array)


_KSERVE_CHECK = """
import sys
import numpy as np
from test_wire import COMPOSED_ARRAYS
from plugserve.proto import grpc_service_pb2 as kpb
from plugserve.proto.tensors import encode_strings
from plugserve.server.protocols.kserve.codec import datatype_of, infer_response

class Entry:
    name, version = "net", 2

for names in (list(COMPOSED_ARRAYS), ["empty"], []):
    outputs = {name: COMPOSED_ARRAYS[name] for name in names}
    composed = b"".join(infer_response(kpb.ModelInferRequest(id="r7"), Entry(), outputs))
    expected = kpb.ModelInferResponse(model_name="net", model_version="2", id="r7")
    for name, array in outputs.items():
        expected.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        expected.raw_output_contents.append(
            encode_strings(array)
            if array.dtype == object
            else np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        )
    assert composed == expected.SerializeToString(), names
print("same")
"""


def test_composed_kserve_response_is_protobufs_own_serialization():
    """In a subprocess (written when our KServe modules and tritonclient's could not share
    one process; see proto/pools.py)."""
    run = subprocess.run(
        [sys.executable, "-c", _KSERVE_CHECK],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert run.stdout.strip() == "same", run.stdout + run.stderr
