"""The precision a network computes in is visible where operators look: the load's log line,
``plugserve list``, the model's metadata and config, and a metric label. OPENVINO follows
openvino's own default (bf16 on CPUs with bf16 arithmetic); ACCURACY keeps f32."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from models import mlp
from prometheus_client.parser import text_string_to_metric_families

from plugserve.client import Client

PLUGSERVE = [sys.executable, "-m", "plugserve.server.process.cli"]


@pytest.fixture(scope="module")
def fastest():
    """What openvino itself computes in here without a hint."""
    ov = pytest.importorskip("openvino", reason="pip install openvino")
    from plugserve.plugins.openvino.config import precision_name

    return precision_name(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _info_series(server) -> dict[tuple[str, str], str]:
    """``{(model, device): precision}`` of every plugserve_model_info series."""
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        text = response.read().decode()
    return {
        (s.labels["model"], s.labels["device"]): s.labels["precision"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "plugserve_model_info" and s.value == 1
    }


def test_precision_shows_in_list_metadata_config_and_metrics(server, fastest):
    model = mlp().SerializeToString()
    loads = {
        "ov_default": ("OPENVINO", {}, fastest),
        "ov_accurate": ("OPENVINO", {"EXECUTION_MODE_HINT": "ACCURACY"}, "f32"),
        "ov_pinned": ("OPENVINO", {"INFERENCE_PRECISION_HINT": "f32"}, "f32"),
        "on_numpy": ("NUMPY", {}, "f32"),
    }
    with Client(server.target, timeout=120) as client:
        try:
            for name, (device, config, _) in loads.items():
                response = client.load(name, model, device, config)
                assert response.network.precision == loads[name][2], name
            listed = {n.name: n.precision for n in client.networks()}
            assert {n: listed[n] for n in loads} == {n: p for n, (_, _, p) in loads.items()}

            cli = subprocess.run(
                [*PLUGSERVE, "list", "--target", server.target],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert cli.returncode == 0, cli.stderr
            lines = {line.split()[0]: line for line in cli.stdout.splitlines() if line}
            for name, (device, _, precision) in loads.items():
                assert f"on {device} ({precision}):" in lines[name], lines[name]

            for name, (device, _, precision) in loads.items():
                base = f"{server.http_url}/v2/models/{name}"
                assert _get(base)["parameters"] == {"device": device, "precision": precision}
                parameters = _get(f"{base}/config")["parameters"]
                assert parameters["precision"] == {"string_value": precision}

            series = _info_series(server)
            for name, (device, _, precision) in loads.items():
                assert series[name, device] == precision
        finally:
            for name in loads:
                client.unload(name)
    # an unloaded network's series is gone with it
    assert not [key for key in _info_series(server) if key[0] in loads]


def test_a_bad_execution_mode_is_refused_naming_the_choices(server):
    import grpc

    with Client(server.target, timeout=120) as client, pytest.raises(grpc.RpcError) as refused:
        client.load("bad_mode", mlp().SerializeToString(), "NUMPY", {"EXECUTION_MODE_HINT": "X"})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PERFORMANCE or ACCURACY" in refused.value.details()
