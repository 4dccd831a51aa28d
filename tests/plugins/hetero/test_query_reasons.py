"""``plugserve query`` tells, per node and device, what runs where and why not: in-process
(HETERO's ``refusals``), through a real server (QueryNetwork's ``refusals``) and printed by
the console script."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from models import with_custom_op
from test_hetero_boundaries import sklearn_like, wrap_padded_if

from plugserve.client import Client

PLUGSERVE = shutil.which("plugserve")
PAD_WHY = "openvino cannot convert it: Pad-19: Unsupported padding mode: [wrap]"


def _by_node(refusals) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for node, device, why in refusals:
        found.setdefault(node, {})[device] = why
    return found


def test_hetero_refusals_in_process(core):
    hetero = core.plugin("HETERO")
    found = _by_node(hetero.refusals(wrap_padded_if(), {"DEVICE_PRIORITIES": "OPENVINO,NUMPY"}))
    assert found == {"if": {"OPENVINO": PAD_WHY}}  # relu and sigmoid went to OPENVINO
    found = _by_node(hetero.refusals(with_custom_op(), {"DEVICE_PRIORITIES": "NUMPY,ORT"}))
    assert set(found) == {"scale"}  # no device takes it: both say why
    assert "no kernel for op 'Scale' of domain 'com.example'" in found["scale"]["NUMPY"]
    assert "no kernel for com.example::Scale" in found["scale"]["ORT"]


def test_ml_ops_name_the_op_openvino_lacks(core):
    found = _by_node(
        core.plugin("HETERO").refusals(sklearn_like(), {"DEVICE_PRIORITIES": "OPENVINO,NUMPY"})
    )
    for node, op in (("scaler", "Scaler"), ("norm", "Normalizer"), ("linreg", "LinearRegressor")):
        assert found[node] == {"OPENVINO": f"openvino has no conversion for ai.onnx.ml::{op}"}


def test_pinned_nodes_say_so(core):
    config = {"DEVICE_PRIORITIES": "OPENVINO,NUMPY", "AFFINITY": '{"relu": "NUMPY"}'}
    found = _by_node(core.plugin("HETERO").refusals(wrap_padded_if(), config))
    assert found["relu"] == {"OPENVINO": "pinned to NUMPY by AFFINITY"}


def test_auto_and_multi_say_why_a_device_was_passed_over(core):
    model = wrap_padded_if()
    auto = core.plugin("AUTO").refusals(model, {"DEVICE_PRIORITIES": "OPENVINO,ORT,NUMPY"})
    assert auto == [("if", "OPENVINO", PAD_WHY)]
    assert core.query_network(model, "AUTO:OPENVINO,ORT,NUMPY") == dict.fromkeys(
        ["relu", "if", "sigmoid"], "ORT"
    )
    multi = core.plugin("MULTI").refusals(model, {"DEVICE_PRIORITIES": "NUMPY,OPENVINO"})
    assert multi == [("if", "OPENVINO", PAD_WHY)]
    batch = core.plugin("BATCH").refusals(with_custom_op(), {"DEVICE_PRIORITIES": "ORT"})
    assert [(n, d) for n, d, _ in batch] == [("scale", "ORT")]
    assert "no kernel for com.example::Scale" in batch[0][2]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=120) as c:
        yield c


def test_query_network_carries_the_refusals(client):
    response = client.query(wrap_padded_if(), "HETERO:OPENVINO,NUMPY")
    assert dict(response.supported) == {"relu": "OPENVINO", "if": "NUMPY", "sigmoid": "OPENVINO"}
    assert [(r.node, r.device, r.reason) for r in response.refusals] == [
        ("if", "OPENVINO", PAD_WHY)
    ]
    auto = client.query(wrap_padded_if(), "AUTO:OPENVINO,ORT")
    assert set(auto.supported.values()) == {"ORT"}
    assert [(r.node, r.device, r.reason) for r in auto.refusals] == [("if", "OPENVINO", PAD_WHY)]
    single = client.query(wrap_padded_if(), "OPENVINO")
    assert dict(single.unsupported) == {"if": PAD_WHY} and not single.refusals


def _rows(table: str) -> dict[str, list[str]]:
    rows = [line.split(None, 2) for line in table.splitlines() if line.strip()]
    return {row[0]: row[1:] for row in rows}


@pytest.mark.skipif(PLUGSERVE is None, reason="the plugserve script is not on PATH")
def test_cli_prints_where_each_node_runs_and_why_not(server, tmp_path):
    def query(model, device: str) -> dict[str, list[str]]:
        path = tmp_path / "model.onnx"
        path.write_bytes(model.SerializeToString())
        result = subprocess.run(
            [PLUGSERVE, "query", str(path), "--device", device, "--target", server.target],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return _rows(result.stdout)

    rows = query(wrap_padded_if(), "HETERO:OPENVINO,NUMPY")
    assert rows.pop("NODE") == ["DEVICE", "WHY NOT"]
    assert rows == {
        "relu": ["OPENVINO"],
        "if": ["NUMPY", f"OPENVINO: {PAD_WHY}"],
        "sigmoid": ["OPENVINO"],
    }
    rows = query(wrap_padded_if(), "OPENVINO")
    assert rows["if"] == ["-", PAD_WHY]
    rows = query(with_custom_op(), "HETERO:NUMPY,ORT")
    assert rows["relu"] == ["NUMPY"] and rows["scale"][0] == "-"
    assert "NUMPY: node 'scale': no kernel for op 'Scale'" in rows["scale"][1]
    assert "; ORT: onnxruntime's CPU provider has no kernel" in rows["scale"][1]
