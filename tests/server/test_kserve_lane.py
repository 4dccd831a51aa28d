"""The KServe fast path (``PlainLane`` in ``kserve/convert.py``) takes only what the general
path takes, gives the same arrays and the same response bytes, and leaves everything else to it.

In a subprocess (written when our KServe modules and tritonclient's could not share one
process; see proto/pools.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_CHECK = """
import numpy as np
from test_wire import COMPOSED_ARRAYS
from plugserve.plugins.api import TensorSpec
from plugserve.proto import grpc_service_pb2 as kpb
from plugserve.server.protocols.kserve.codec import infer_response, plain_lane, request_inputs

class Network:
    inputs = [
        TensorSpec("x", np.dtype(np.float32), (1, 16)),
        TensorSpec("n", np.dtype(np.int64), ("batch", 3)),
        TensorSpec("any", np.dtype(np.uint8), None),
    ]

class Entry:
    name, version, network = "net", 4, Network()
    output_names = ["y", "z"]
    sequences = None

    def __init__(self):
        self.lanes = {}

    def expect(self, name, dtype, shape=None):
        pass

def request(**tensors):
    message = kpb.ModelInferRequest(model_name="net", id="r1")
    for name, (datatype, array) in tensors.items():
        message.inputs.add(name=name, datatype=datatype, shape=array.shape)
        message.raw_input_contents.append(array.tobytes())
    return message

x = np.arange(16, dtype=np.float32).reshape(1, 16)
n = np.arange(6, dtype=np.int64).reshape(2, 3)
a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
entry = Entry()
lane = plain_lane(entry)
assert plain_lane(entry) is lane

# taken: every input, in any order, with outputs named or not
plain = request(n=("INT64", n), any=("UINT8", a), x=("FP32", x))
arrays, outputs = lane.decode(plain)
general = request_inputs(plain, entry)
assert outputs == []
for spec, array in zip(Network.inputs, arrays):
    assert array.dtype == general[spec.name].dtype and np.array_equal(array, general[spec.name])
plain.outputs.add(name="z")
assert lane.decode(plain)[1] == ["z"]

# left to the general path
def refused(change):
    message = request(n=("INT64", n), any=("UINT8", a), x=("FP32", x))
    change(message)
    return lane.decode(message) is None

assert refused(lambda m: m.inputs[2].__setattr__("datatype", "FP64"))
assert refused(lambda m: m.inputs[0].__setattr__("datatype", "BYTES"))
assert refused(lambda m: m.inputs[2].shape.__setitem__(0, 2))  # a fixed dimension
assert refused(lambda m: m.inputs[0].shape.__setitem__(1, 4))  # bytes do not fill it
assert refused(lambda m: m.inputs[0].shape.__setitem__(0, -2))
assert refused(lambda m: m.inputs[0].shape.append(1))  # rank
assert refused(lambda m: m.inputs[1].__setattr__("name", "n"))  # given twice
assert refused(lambda m: m.inputs[1].__setattr__("name", "nope"))
assert refused(lambda m: m.inputs[1].parameters["binary_data_size"].int64_param)
assert refused(lambda m: m.inputs[1].contents.uint_contents.append(1))
assert refused(lambda m: m.raw_input_contents.pop())
assert refused(lambda m: m.inputs.pop())
assert refused(lambda m: m.outputs.add(name="nope"))
assert refused(lambda m: [m.outputs.add(name="y"), m.outputs.add(name="y")])
assert refused(lambda m: m.outputs.add(name="y").parameters["classification"].int64_param)
empty = request(n=("INT64", np.zeros((0, 3), np.int64)), any=("UINT8", a), x=("FP32", x))
assert lane.decode(empty) is None

class Strings(Network):
    inputs = [TensorSpec("s", np.dtype(object), (1,))]

class StringEntry(Entry):
    network = Strings()

assert plain_lane(StringEntry()).inputs == {}

# the same answer, byte for byte
results = [
    {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "z": np.array([True, False])},
    {"y": np.array(["a", "héllo"], dtype=object), "z": np.array(7, dtype=np.int64)},
    {"y": np.zeros((0, 4), np.float16)},
    COMPOSED_ARRAYS,  # big-endian, transposed, empty...
]
for message in (kpb.ModelInferRequest(id="r7"), kpb.ModelInferRequest(id=""), plain):
    for outputs in results:
        for _ in range(2):  # the header made, then the one kept
            composed = b"".join(lane.encode(message, outputs))
            assert composed == b"".join(infer_response(message, entry, outputs)), outputs
classified = kpb.ModelInferRequest()
classified.outputs.add(name="y").parameters["classification"].int64_param = 1
assert lane.encode(classified, results[0]) is None
assert lane.encode(plain, {"y": [1, 2]}) is None
"""


def test_the_plain_lane_matches_the_general_path():
    """The check's output (a failed assert's traceback) is the test's own."""
    here = Path(__file__).parent
    subprocess.run([sys.executable, "-c", _CHECK], cwd=here, timeout=120, check=True)
