"""Importing an exported network trusts nothing its bytes say (``plugins/blob.py``, each
device's ``import_network``): a red team's hand-made blobs, each imported through the Core as the
server does for ImportNetwork.

* a header nested 100,000 arrays deep was a RecursionError (a 500), one of a JSON array an
  AttributeError; both are now INVALID_ARGUMENT "corrupt header";
* a header's saved configuration naming ``CACHE_DIR`` (the server's own setting, which a
  request may not set) was taken into the network's configuration: it is dropped;
* a payload of 5M empty nodes (10 MB) grew the server 4.6 GB on NUMPY and 1.6 GB on ORT: an
  import's payload is parsed and counted as a sent model's is (``reading.parse_model``,
  ``check_nodes``), refused naming the bound with the memory flat.
"""

from __future__ import annotations

import json
import struct

import amplifying
import pytest
from onnx import TensorProto, helper

from plugserve.plugins import blob
from plugserve.plugins.api import InvalidArgument
from plugserve.server import Core

DEVICES = ["NUMPY", "ORT"]


def _exported(core: Core, device: str) -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    network = core.load_network(model.SerializeToString(), device)
    try:
        return network.export()
    finally:
        network.close()


def _split(data: bytes) -> tuple[dict, bytes]:
    start = len(blob.MAGIC) + 4
    length = int.from_bytes(data[len(blob.MAGIC) : start], "little")
    return json.loads(data[start : start + length]), data[start + length :]


def _joined(header: bytes, payload: bytes) -> bytes:
    return blob.MAGIC + struct.pack("<I", len(header)) + header + payload


@pytest.fixture(scope="module")
def core():
    made = Core()
    if "ORT" not in made.available_devices:
        pytest.skip("onnxruntime is not importable here")
    return made


@pytest.mark.parametrize("device", DEVICES)
def test_a_header_that_is_not_an_object_is_corrupt(core, device):
    _, payload = _split(_exported(core, device))
    for header in (b"[" * 100_000 + b"]" * 100_000, b"[]", b"[" + b"0," * (1 << 20) + b"0]"):
        with pytest.raises(InvalidArgument, match="corrupt header"):
            core.import_network(_joined(header, payload), device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_headers_cache_dir_is_not_imported(core, device, tmp_path):
    header, payload = _split(_exported(core, device))
    header["config"]["CACHE_DIR"] = str(tmp_path / "chosen-by-the-blob")
    network = core.import_network(_joined(json.dumps(header).encode(), payload), device)
    try:
        assert str(tmp_path) not in str(network.config.to_strings().get("CACHE_DIR", ""))
    finally:
        network.close()


def _peak_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


@pytest.mark.parametrize("device", DEVICES)
def test_a_payload_of_empty_nodes_is_counted_before_it_is_read(core, device):
    header, payload = _split(_exported(core, device))
    empty = b"\x0a\x00" * 5_000_000  # NodeProtos of no fields, appended to the graph
    graph = (
        b"\x3a" + amplifying.varint(len(empty)) + empty
    )  # ModelProto.graph merges with the one there
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak starts again from now
    before = _peak_kb()
    with pytest.raises(InvalidArgument, match="--max-read-bytes"):
        core.import_network(_joined(json.dumps(header).encode(), payload + graph), device)
    assert _peak_kb() - before < 64 << 10  # 1.6-4.6 GB before
