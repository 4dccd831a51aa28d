"""Issue 58 point 3 on KServe's binary tensor extension: a BYTES input of many small elements
is charged what its decoding holds, and decoding it leaves the REST port answering.

A body with a JSON header and a binary part holding millions of length-prefixed elements is
charged 2x its bytes as it arrives; each element became a Python object (bytes or str: 33-80
bytes and an 8-byte slot, twice: a list and the array) and the answer its JSON. Before: a
150 MB body of small elements grew the server 1.7 GB past its charge, REST health p99 2.5 s.
"""

from __future__ import annotations

import http.client
import json
import struct

import onnx
import pytest
from attack import LATENCY_BOUND_S, Probe, p99
from onnx import TensorProto, helper
from serving import RunningServer

from plugserve.server.plane.budget import BINARY_FACTOR, STRING_ELEMENT_BYTES

#: what the server may grow by whatever the attack's size (tests/server/test_attacks_front)
FIXED = 80 << 20


#: the small server's --max-inflight-bytes
SMALL_BUDGET = 256 << 20


def _start(root, *args: str) -> RunningServer:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, [-1])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, [-1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (root / "strings" / "1").mkdir(parents=True)
    onnx.save(model, root / "strings" / "1" / "model.onnx")
    (root / "strings" / "config.json").write_text(json.dumps({"device": "NUMPY"}))
    running = RunningServer("--model-repository", str(root), *args)
    running.start(timeout=300)
    return running


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = _start(tmp_path_factory.mktemp("bytes"))
    try:
        yield running
    finally:
        running.stop()


def _infer(server, count: int, element: bytes, binary_output: bool) -> tuple[int, bytes, int]:
    """``count`` copies of ``element`` as one BYTES input in the binary part."""
    packed = struct.pack("<I", len(element)) + element
    data = packed * count
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "shape": [count],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "echo", "parameters": {"binary_data": binary_output}}],
        }
    ).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=300)
    try:
        connection.request(
            "POST",
            "/v2/models/strings/infer",
            header + data,
            {"Inference-Header-Content-Length": str(len(header))},
        )
        response = connection.getresponse()
        return response.status, response.read(), len(header) + len(data)
    finally:
        connection.close()


@pytest.mark.parametrize("binary_output", [True, False], ids=["binary-answer", "json-answer"])
def test_a_bytes_body_of_many_small_elements_is_charged_and_stalls_nobody(server, binary_output):
    """4M 2-byte elements (--max-string-elements' default; 24 MB), echoed: answered while
    both probes hold, the server's growth within what the request was charged."""
    count = 4_000_000
    with Probe(server) as probe:
        status, answer, size = _infer(server, count, b"ab", binary_output)
    assert status == 200, answer[:300]
    print(probe.summary())
    assert not probe.failures, probe.summary()
    assert p99(probe.rest) <= LATENCY_BOUND_S and p99(probe.grpc) <= LATENCY_BOUND_S, (
        probe.summary()
    )
    charged = BINARY_FACTOR * size + count * STRING_ELEMENT_BYTES
    assert probe.growth <= charged + FIXED, probe.summary()


def test_bytes_elements_over_the_budget_are_refused_before_they_are_decoded(tmp_path):
    """The same body under a budget its elements' charge does not fit: refused at once
    (503 naming --max-inflight-bytes), though its bytes alone would have fit."""
    running = _start(tmp_path, "--max-inflight-bytes", str(SMALL_BUDGET))
    try:
        count = SMALL_BUDGET // STRING_ELEMENT_BYTES + 1
        status, answer, size = _infer(running, count, b"ab", True)
        assert BINARY_FACTOR * size < SMALL_BUDGET // 4
        assert status in (429, 503), answer[:300]
        assert b"--max-inflight-bytes" in answer and b"BYTES elements" in answer, answer[:300]
        status, answer, _ = _infer(running, 1000, b"ab", True)
        assert status == 200, answer[:300]
    finally:
        running.stop()
